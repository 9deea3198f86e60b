"""Fixtures the test stages share.

- Every test runs with the example models at their default (tiny) size: SHARD_PLANNER_SIZE and
  SHARD_PLANNER_SEQ from the caller's environment are removed; and without the trace cache.
- ``gloo`` / ``h100``: the shipped cpu-gloo and h100-80gb hardware profiles.
- ``synth``: the synthetic 8-layer transformer trace of tests/models/cost_synth.py (hidden 1024, seq 512).
- ``fake_world``: a fake process group in this process (torch.testing's FakeStore: FSDP2 runs its hooks,
  collectives are no-ops) and its 1-D CPU device mesh; world size 2, or the value given by indirect
  parametrisation (``@pytest.mark.parametrize("fake_world", [8], indirect=True)``).
- ``in_repository_root``: the working directory is the repository (for tests of relative paths).
"""

from __future__ import annotations

import pytest

from shard_planner.hardware.profile import load_profile
from tests.paths import REPO


@pytest.fixture(autouse=True)
def _default_example_size(monkeypatch):
    monkeypatch.delenv("SHARD_PLANNER_SIZE", raising=False)
    monkeypatch.delenv("SHARD_PLANNER_SEQ", raising=False)
    # no trace cache (shard_planner/trace/trace_cache.py): a test that patches the tracer traces for real, and
    # nothing is written under the user's ~/.cache; tests of the cache set their own folder
    monkeypatch.setenv("SHARD_PLANNER_TRACE_CACHE", "off")


@pytest.fixture(scope="session")
def gloo():
    return load_profile("cpu-gloo")


@pytest.fixture(scope="session")
def h100():
    return load_profile("h100-80gb")


@pytest.fixture(scope="session")
def synth():
    from tests.models import cost_synth

    return cost_synth.synthetic_trace(layers=8, hidden=1024, seq=512, vocab=4096)


@pytest.fixture
def fake_world(request):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = getattr(request, "param", 2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def in_repository_root(monkeypatch):
    monkeypatch.chdir(REPO)
