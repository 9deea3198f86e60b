"""The CUDA caching allocator's mode a plan runs with: ``expandable_segments`` on or off.

PyTorch reads its allocator settings from the environment when CUDA starts: ``PYTORCH_ALLOC_CONF``, and with
lower priority ``PYTORCH_CUDA_ALLOC_CONF`` (torch 2.13, c10/core/AllocatorConfig.h: "The primary environment
variable for configuration is `PYTORCH_ALLOC_CONF`. For backward compatibility, `PYTORCH_CUDA_ALLOC_CONF`
is also supported with lower priority"), a list of ``key:value`` pairs such as
``expandable_segments:True,max_split_size_mb:512``. This module is the one place that reads or writes it:

    planned_expandable(os.environ)      # what `plan` records in cluster.expandable_segments
    rank_environment(plan, os.environ)  # what `run` adds to its ranks' environment, and a warning or None
    effective_conf(os.environ)          # what a rank runs with, for measurement.json
    launch_env(expandable_segments)     # 'PYTORCH_ALLOC_CONF=expandable_segments:True', for the exports

[Note: The allocator mode a plan runs with]
  The memory a plan needs on a GPU depends on the allocator's mode (cost/fits.py): with expandable
  segments each stream's pool grows one segment by pages and a retry unmaps the free pages; without, every
  request of 10 MiB or more takes a ``cudaMalloc`` segment of its own, which fragments more
  (cost/allocator.py). torchtitan launches every run with ``PYTORCH_ALLOC_CONF="expandable_segments:True"``
  (pytorch/torchtitan run_train.sh), and so do we:
  - ``plan`` plans for the mode of the environment it runs in when the user set one, else for expandable
    segments, and records it (``cluster.expandable_segments``; plans written before the field read True);
  - ``run`` gives its ranks ``PYTORCH_ALLOC_CONF=expandable_segments:True`` for such a plan unless the user
    set either variable, which then wins (with a warning when it disagrees with the plan); for a plan made
    for the default mode it sets nothing;
  - ``estimate`` judges the plan in the mode it records; every run's measurement.json records the setting
    its ranks ran with (``allocator_conf``);
  - every export (report/export/) states the setting the plan was judged with as an environment assignment
    for the launch (:func:`launch_env`), both modes spelled out: ``expandable_segments:False`` is the
    default, written so that a setting inherited from elsewhere does not change the mode unnoticed.
  The other settings (``max_split_size_mb``, ``roundup_power2_divisions``, ...) are not simulated
  (cost/allocator.py [Note: What is not modelled]): a conf that sets them is run as given, and the
  prediction assumes their defaults.
"""

from __future__ import annotations

from collections.abc import Mapping

CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # highest priority first
EXPANDABLE_CONF = "expandable_segments:True"


def effective_conf(environ: Mapping[str, str]) -> str | None:
    """The allocator settings a CUDA process started with ``environ`` reads (None: none set)."""
    for var in CONF_VARS:
        value = environ.get(var)
        if value:
            return value
    return None


def expandable_in(conf: str | None) -> bool:
    """Whether the settings ``conf`` turn expandable segments on (None, or no such key: off)."""
    for pair in (conf or "").split(","):
        key, _, value = pair.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip() == "True"
    return False


def planned_expandable(environ: Mapping[str, str]) -> bool:
    """The mode ``plan`` plans for: the user's setting when one is set, else expandable segments."""
    conf = effective_conf(environ)
    return True if conf is None else expandable_in(conf)


def mode_name(expandable_segments: bool) -> str:
    """The mode in words, as the allocator's setting reads."""
    return EXPANDABLE_CONF if expandable_segments else "expandable_segments:False (the default)"


def launch_env(expandable_segments: bool) -> str:
    """The environment assignment a launch of a plan made for ``expandable_segments`` needs:
    'PYTORCH_ALLOC_CONF=expandable_segments:True' (or ':False')."""
    return f"{CONF_VARS[0]}=expandable_segments:{expandable_segments}"


def rank_environment(expandable_segments: bool, environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """What ``run`` adds to its ranks' environment for a plan made for ``expandable_segments``, and a
    warning when the user's own setting (which wins) disagrees with the plan."""
    conf = effective_conf(environ)
    if conf is None:
        return ({CONF_VARS[0]: EXPANDABLE_CONF} if expandable_segments else {}), None
    if expandable_in(conf) == expandable_segments:
        return {}, None
    return {}, (f"the plan was made for {mode_name(expandable_segments)}, but this environment sets the CUDA "
                f"allocator to {conf!r}: running with it, so its memory may differ from the prediction "
                f"(unset it, or re-plan with it set)")
