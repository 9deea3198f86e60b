"""Measure every module's forward and backward time on the real device (``shard-planner calibrate --model``).

``measure_module_timings(model_path, micro_batch=B, dtype="bfloat16", world_size=2) -> ModuleTimings``
builds the model from its model file on the device, casts its floating parameters to ``dtype`` (as
FSDP2 mixed precision computes; the tracer does the same), and runs real training steps (forward,
``loss_fn``, backward; no FSDP, no optimizer) at micro-batches B and 2B. Hooks on every module time,
nested:

- forward: forward pre-hook -> forward hook (all calls of the module in the step summed);
- backward: full backward pre-hook (the gradient of its output is ready) -> full backward hook (the
  gradients of its inputs are), paired per call;
- the root's backward: its full backward pre-hook -> the end of ``loss.backward()`` (the root's input, a
  batch, needs no gradient, so its backward hook cannot mark the end);
- the loss: the root's forward hook -> the loss is computed, and ``loss.backward()`` -> the root's
  backward pre-hook.

So any block the cost tables form (a unit's module subtree, a maximal root-owned subtree, a container's
own operations = the container minus its children; shard_planner/cost/tables.py) can be priced.
Each module's own time (its interval less its children's) is the median over ``repeats`` timed steps
after ``warmup`` steps, subtree times are sums of those medians (``summarise_steps`` says why), per
micro-batch; then a line through the micro-batches (``Affine``).

Modules whose backward the hooks cannot time: when none of a module's positional tensor inputs needs a
gradient (an embedding of token ids, a patch embedding of pixels), torch calls its full backward hook
right after its pre-hook, before its own gradient kernels run (torch/utils/hooks.py,
BackwardHook.setup_output_hook). Their backward is *derived* from the parent: the parent's backward
minus its timed children's and minus what the untimed children's own timed descendants take is split
between the parent's own operations and the untimed children in proportion to their own forward times
(a gather's backward is a scatter of the same size). A module whose outputs need no gradient (rotary
tables computed from buffers) has no backward: 0.

The hooks cost time themselves (a Python call each, and the full backward hooks put an identity autograd
node around every module's inputs and outputs): 20-35 ms of a 30-60 ms step of gpt2/llama tiny on one
CPU thread (fastest steps with and without hooks). So every step with hooks is paired with one without,
and the model's forward and backward are scaled to the time without hooks (``hook_scale``; every
module's own time by the same factor, so subtree sums stay consistent; a small module, which carries
more of the hooks' cost than its share, keeps a little of it). The factors are in the file's notes.

CPU: wall clock (``time.perf_counter``; the ops run synchronously), measured in ``world_size`` spawned
processes at the same time, each with ``torch.set_num_threads(OMP_NUM_THREADS or cores // world_size)``
as the executor's ranks run (shard_planner/execute/launch.py), so memory-bandwidth contention is as in a
real run; the median over ranks is kept. GPU: CUDA events recorded in the hooks, one process,
synchronised after each step.

Limit: the whole model, its activations and gradients at micro-batch 2B must fit on one device; a model
that does not raises one UserError line (plan with FLOPs instead: the profile without timings).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

import torch

from shard_planner.cost.host_share import threads_per_rank, usable_cores
from shard_planner.errors import UserError, first_line
from shard_planner.execute.calibrate import fit_line
from shard_planner.execute.worker import _device_name, build_on_device, make_step_batch
from shard_planner.fileio import write_atomic
from shard_planner.model.modelfile import load_model_file, map_inputs
from shard_planner.hardware.timings import ModuleTime, ModuleTimings
from shard_planner.trace.structure import model_fingerprint
from shard_planner.trace.types import Affine
from shard_planner.units import DTYPE_NAMES

logger = logging.getLogger(__name__)

LOSS = "<loss>"  # key of the loss's times in a rank's samples


@dataclass(frozen=True)
class _Options:
    model_path: str
    micro_batches: tuple[int, ...]
    dtype: str
    device: str  # "cpu" or "cuda"
    world_size: int
    warmup: int
    repeats: int


class _Clock:
    """Marks in time: perf_counter on CPU, recorded CUDA events on GPU (read after a synchronize)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class _Hooks:
    """Forward and backward intervals of every module in one step (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, clock: _Clock):
        self.clock = clock
        self.handles = []
        self.children = {fqn: tuple(f"{fqn}.{n}" if fqn else n for n, _ in m.named_children())
                         for fqn, m in model.named_modules()}
        for fqn, m in model.named_modules():
            self.handles += [
                m.register_forward_pre_hook(self._fwd_pre(fqn)),
                m.register_forward_hook(self._fwd_post(fqn)),
                m.register_full_backward_pre_hook(self._bwd_pre(fqn)),
                m.register_full_backward_hook(self._bwd_post(fqn)),
            ]
        self.reset()

    def reset(self) -> None:
        self.fwd: dict[str, list] = {}  # fqn -> [(start, end)]
        self.bwd: dict[str, list] = {}
        self.fwd_open: dict[str, list] = {}
        self.bwd_open: dict[str, list] = {}
        self.bwd_first: dict[str, object] = {}  # the first backward pre-hook of each module
        self.input_grad: dict[str, bool] = {}  # some positional tensor input needs a gradient (any call)
        self.output_grad: dict[str, bool] = {}  # some output needs a gradient (any call)

    def _fwd_pre(self, fqn):
        def hook(module, args):
            self.input_grad[fqn] = self.input_grad.get(fqn, False) or any(t.requires_grad for t in _tensors(args))
            self.fwd_open.setdefault(fqn, []).append(self.clock.mark())
        return hook

    def _fwd_post(self, fqn):
        def hook(module, args, output):
            self.output_grad[fqn] = self.output_grad.get(fqn, False) or any(t.requires_grad for t in _tensors(output))
            self.fwd.setdefault(fqn, []).append((self.fwd_open[fqn].pop(), self.clock.mark()))
        return hook

    def _bwd_pre(self, fqn):
        def hook(module, grad_output):
            mark = self.clock.mark()
            self.bwd_open.setdefault(fqn, []).append(mark)
            self.bwd_first.setdefault(fqn, mark)
        return hook

    def _bwd_post(self, fqn):
        def hook(module, grad_input, grad_output):
            opened = self.bwd_open.get(fqn)
            if opened:
                self.bwd.setdefault(fqn, []).append((opened.pop(), self.clock.mark()))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _one_step(model, model_file, hooks: _Hooks, clock: _Clock, batch: int, step: int, device,
              dtype: torch.dtype) -> dict[str, tuple]:
    """One forward + loss + backward; fqn -> (fwd_s, bwd_s or None when the hooks cannot time it)."""
    inputs, targets = make_step_batch(model_file, batch, step, 0, device)
    # as FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does at the root
    inputs = map_inputs(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)
    hooks.reset()
    for p in model.parameters():
        p.grad = None
    output = model_file.forward(model, inputs, targets)  # the root's hooks time it
    loss = model_file.loss(output, targets)
    loss_end = clock.mark()
    bwd_start = clock.mark()
    loss.backward()
    bwd_end = clock.mark()
    if clock.cuda:
        torch.cuda.synchronize(device)
    sec = clock.seconds
    out: dict[str, tuple] = {}
    for fqn, intervals in hooks.fwd.items():
        fwd = sum(sec(a, b) for a, b in intervals)
        if not hooks.output_grad.get(fqn):
            bwd = 0.0  # no autograd node depends on it: no backward
        elif fqn == "":
            bwd = sec(hooks.bwd_first[""], bwd_end) if "" in hooks.bwd_first else None
        elif hooks.input_grad.get(fqn) and fqn in hooks.bwd:
            bwd = sum(sec(a, b) for a, b in hooks.bwd[fqn])
        else:
            bwd = None  # derived later (module docstring)
        out[fqn] = (fwd, bwd)
    root_fwd_end = hooks.fwd[""][-1][1]
    root_bwd_start = hooks.bwd_first.get("", bwd_end)
    out[LOSS] = (sec(root_fwd_end, loss_end), sec(bwd_start, root_bwd_start))
    return out


def _plain_step(model, model_file, clock: _Clock, batch: int, step: int, device, dtype) -> tuple[float, float]:
    """The same step without hooks: (model forward s, ``loss.backward()`` s)."""
    inputs, targets = make_step_batch(model_file, batch, step, 0, device)
    inputs = map_inputs(inputs, lambda t: t.to(dtype) if t.is_floating_point() else t)
    for p in model.parameters():
        p.grad = None
    a = clock.mark()
    output = model_file.forward(model, inputs, targets)
    b = clock.mark()
    loss = model_file.loss(output, targets)
    c = clock.mark()
    loss.backward()
    d = clock.mark()
    if clock.cuda:
        torch.cuda.synchronize(device)
    return clock.seconds(a, b), clock.seconds(c, d)


def _nearest(children: dict[str, tuple[str, ...]], timed, fqn: str) -> list[str]:
    """The modules in ``timed`` directly below ``fqn``, looking through the others (never called)."""
    found, stack = [], list(reversed(children.get(fqn, ())))
    while stack:
        c = stack.pop()
        if c in timed:
            found.append(c)
        else:
            stack.extend(reversed(children.get(c, ())))
    return found


def derive_backward(children: dict[str, tuple[str, ...]], fwd: dict[str, float],
                    bwd: dict[str, float | None]) -> dict[str, float]:
    """Fill in the backward of modules the hooks cannot time (None in ``bwd``), top-down from the root:
    the parent's unexplained backward split by own forward time (module docstring). Modules absent from
    ``fwd`` (never called) are looked through."""
    out = dict(bwd)

    def own_fwd(fqn: str) -> float:
        return max(0.0, fwd[fqn] - sum(fwd[c] for c in _nearest(children, fwd, fqn)))

    def timed_below(fqn: str) -> float:
        """Backward of ``fqn``'s nearest descendants whose backward is known (hooks), recursively."""
        return sum(out[c] if out[c] is not None else timed_below(c) for c in _nearest(children, fwd, fqn))

    order = [""] if "" in fwd else []
    i = 0
    while i < len(order):
        parent = order[i]
        i += 1
        kids = _nearest(children, fwd, parent)
        order.extend(kids)
        untimed = [c for c in kids if out[c] is None]
        if not untimed:
            continue
        if out[parent] is None:  # the root is always timed; this is only a guard
            out[parent] = timed_below(parent)
        known = sum(out[c] for c in kids if out[c] is not None) + sum(timed_below(c) for c in untimed)
        rest = max(0.0, out[parent] - known)
        weights = {c: own_fwd(c) for c in untimed}
        total_w = sum(weights.values()) + own_fwd(parent)
        for c in untimed:
            share = rest * weights[c] / total_w if total_w > 0 else rest / (len(untimed) + 1)
            out[c] = timed_below(c) + share
    return {k: (v if v is not None else 0.0) for k, v in out.items()}


def exclusive_times(children: dict[str, tuple[str, ...]], total: dict[str, float]) -> dict[str, float]:
    """Each module's time less its nearest timed descendants' (its own operations), in one step."""
    return {k: v - sum(total[c] for c in _nearest(children, total, k)) for k, v in total.items()}


def inclusive_times(children: dict[str, tuple[str, ...]], own: dict[str, float]) -> dict[str, float]:
    """Subtree times from own times (negative own times, clock jitter, count as 0)."""
    out: dict[str, float] = {}

    def total(k: str) -> float:
        if k not in out:
            out[k] = max(0.0, own[k]) + sum(total(c) for c in _nearest(children, own, k))
        return out[k]

    for k in own:
        total(k)
    return out


def summarise_steps(children: dict[str, tuple[str, ...]], samples: list[dict[str, tuple]],
                    scale: tuple[float, float] = (1.0, 1.0)) -> dict[str, tuple]:
    """fqn -> (fwd_s, bwd_s, bwd source) from per-step samples (fqn -> (fwd_s, bwd_s or None)).

    The median is taken of each module's *own* time per step, and subtree times are sums of those
    medians: on a shared machine a preemption lands in one module's interval of one step, so the median
    drops it, and a container is never priced more than its children plus its own operations (a median
    of each subtree separately would charge every container the preemptions of all its children).
    ``scale``: forward and backward factors that take the hooks' own cost off (``hook_scale``)."""
    own_fwd, own_bwd = [], []
    for s in samples:
        fwd = {k: v[0] for k, v in s.items() if k != LOSS}
        bwd = derive_backward(children, fwd, {k: v[1] for k, v in s.items() if k != LOSS})
        own_fwd.append(exclusive_times(children, fwd))
        own_bwd.append(exclusive_times(children, bwd))
    keys = own_fwd[0].keys()
    fwd = inclusive_times(children, {k: statistics.median(o[k] for o in own_fwd) * scale[0] for k in keys})
    bwd = inclusive_times(children, {k: statistics.median(o[k] for o in own_bwd) * scale[1] for k in keys})
    out = {k: (fwd[k], bwd[k], "hooks" if samples[0][k][1] is not None else "derived") for k in keys}
    out[LOSS] = (statistics.median(s[LOSS][0] for s in samples), statistics.median(s[LOSS][1] for s in samples),
                 "hooks")
    return out


def hook_scale(plain: list[tuple[float, float]], hooked: list[dict[str, tuple]]) -> tuple[float, float]:
    """Forward and backward factors (at most 1) that take the hooks' own cost off: the model's time
    without hooks / with hooks, medians over steps run alternately with and without. Forward: the
    model's call; backward: ``loss.backward()`` less the loss's own backward, which no hook touches."""
    fwd_plain = statistics.median(p[0] for p in plain)
    bwd_plain = statistics.median(p[1] for p in plain) - statistics.median(s[LOSS][1] for s in hooked)
    fwd_hooked = statistics.median(s[""][0] for s in hooked)
    bwd_hooked = statistics.median(s[""][1] for s in hooked)
    return (min(1.0, fwd_plain / fwd_hooked) if fwd_hooked > 0 else 1.0,
            min(1.0, max(0.0, bwd_plain) / bwd_hooked) if bwd_hooked > 0 else 1.0)


def _threads(world_size: int) -> int:
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return threads_per_rank(world_size, usable_cores())


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to the compute dtype, as FSDP2 mixed precision computes (and the tracer casts)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _measure(opts: _Options, rank: int) -> dict:
    """This process's measurement: {"batches": {B: {fqn: [fwd_s, bwd_s, bwd source]}}, "fingerprint", ...}."""
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(_threads(opts.world_size))
    model_file = load_model_file(opts.model_path)
    model = build_on_device(model_file, device)
    fingerprint = model_fingerprint(model)
    dtype = getattr(torch, opts.dtype)
    _cast(model, dtype)
    model.train()
    # torch warns once per module whose inputs need no gradient; derive_backward handles those
    warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
    clock = _Clock(device)
    batches: dict[int, dict[str, list[float]]] = {}
    overhead: dict[int, tuple[float, float]] = {}  # hook_scale per micro-batch
    step = 0
    for b in opts.micro_batches:
        samples: list[dict[str, tuple]] = []
        plain: list[tuple[float, float]] = []
        for i in range(opts.warmup + opts.repeats):  # alternately without and with hooks: the same load
            p = _plain_step(model, model_file, clock, b, step, device, dtype)
            hooks = _Hooks(model, clock)
            s = _one_step(model, model_file, hooks, clock, b, step, device, dtype)
            hooks.remove()
            step += 1
            if i >= opts.warmup:
                samples.append(s)
                plain.append(p)
        overhead[b] = hook_scale(plain, samples)
        batches[b] = {k: list(v) for k, v in summarise_steps(hooks.children, samples, overhead[b]).items()}
    return {"batches": {str(b): v for b, v in batches.items()}, "fingerprint": fingerprint,
            "hook_scale": {str(b): v for b, v in overhead.items()},
            "threads": torch.get_num_threads() if device.type == "cpu" else 1,
            "device_name": _device_name(device)}


def _rank_main(rank: int, opts: _Options, out_dir: str) -> None:
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        result = _measure(opts, rank)
    except UserError as exc:
        result = {"error": str(exc)}
    except (torch.OutOfMemoryError, MemoryError) as exc:
        first = first_line(exc, empty=type(exc).__name__)
        result = {"error": f"{opts.model_path}: out of memory measuring module timings at micro-batch "
                           f"{max(opts.micro_batches)} ({first}); module timings need the whole model on one "
                           "device: try a smaller --micro-batch, or plan from FLOPs (no timings)"}
    except Exception as exc:  # a model that fails on the real device: one line, the traceback in the log
        logger.debug("%s", traceback.format_exc())
        result = {"error": f"{opts.model_path}: measuring module timings failed: {type(exc).__name__}: "
                           f"{first_line(exc, empty='')}"}
    write_atomic(path, json.dumps(result))  # the parent reads it: whole or not at all


def _fit(points: list[tuple[int, float]]) -> Affine:
    if len(points) == 1:
        return Affine(per_sample=points[0][1] / points[0][0])  # one size: proportional
    fixed, slope = fit_line([float(b) for b, _ in points], [v for _, v in points])
    return Affine(fixed, slope)


def measure_module_timings(model_path: str, *, micro_batch: int | None = None, dtype: str = "bfloat16",
                           world_size: int = 2, device: str = "auto", warmup: int = 2,
                           repeats: int = 7) -> ModuleTimings:
    """Per-module forward/backward seconds of ``model_path`` on this machine (module docstring), at
    micro-batches ``micro_batch`` and twice that (default: the model file's TRAINING micro_batch, else 1)."""
    import torch.multiprocessing as mp

    dtype = DTYPE_NAMES.get(str(dtype).lower(), dtype)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise UserError(f"--dtype {dtype}: choose one of bf16, fp16, fp32")
    if world_size < 1:
        raise UserError(f"--world-size must be at least 1, got {world_size}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    mf = load_model_file(model_path)  # a broken model file fails here, in this process, with one line
    b = micro_batch or int(mf.training.get("micro_batch", 1))
    if b < 1:
        raise UserError(f"--micro-batch must be at least 1, got {b}")
    procs = world_size if device == "cpu" else 1  # GPU: one device per rank, no sharing: one process
    opts = _Options(model_path, (b, 2 * b), dtype, device, world_size, warmup, repeats)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(opts, out_dir), nprocs=procs, join=True, start_method="spawn")
        results = []
        for r in range(procs):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                results.append(json.load(f))
    for r in results:
        if "error" in r:
            raise UserError(r["error"])
    keys = results[0]["batches"][str(b)].keys()
    fitted = {}
    for k in keys:
        fwd_pts, bwd_pts = [], []
        for mb in opts.micro_batches:
            rows = [r["batches"][str(mb)][k] for r in results]
            fwd_pts.append((mb, statistics.median(row[0] for row in rows)))
            bwd_pts.append((mb, statistics.median(row[1] for row in rows)))
        src = results[0]["batches"][str(b)][k][2]
        fitted[k] = (_fit(fwd_pts), _fit(bwd_pts), src)
    loss = fitted.pop(LOSS)
    modules = {k: ModuleTime(f, bw, src) for k, (f, bw, src) in fitted.items()}
    return ModuleTimings(
        model_path=model_path, fingerprint=results[0]["fingerprint"], param_dtype=dtype, device=device,
        device_name=results[0]["device_name"], threads_per_rank=results[0]["threads"], world_size=world_size,
        micro_batches=opts.micro_batches, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        torch_version=torch.__version__, modules=modules, loss_fwd_s=loss[0], loss_bwd_s=loss[1],
        repeats=repeats,
        notes={"hook_scale": "; ".join(
            f"micro-batch {b}: forward x{statistics.median(r['hook_scale'][str(b)][0] for r in results):.3f}, "
            f"backward x{statistics.median(r['hook_scale'][str(b)][1] for r in results):.3f}"
            for b in opts.micro_batches) + " (time without hooks / with hooks; applied to every module's own time)"},
    )
