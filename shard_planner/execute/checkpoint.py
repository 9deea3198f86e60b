"""Distributed checkpoints of a run: save, restore into a model built afresh, and compare.

``shard-planner run`` (``--checkpoint``, on by default) saves one after the measured steps with
torch.distributed.checkpoint (DCP): the sharded model and optimizer state from
``torch.distributed.checkpoint.state_dict.get_state_dict`` and the training progress, in one DCP state
dict ``{"model": ..., "optim": ..., "progress": {...}}``. Loading goes back through ``set_state_dict``, so
a world of another size reads the same folder (DCP reshards DTensors on load).

[Note: what makes the next steps reproducible]
The batches are a function of (step, data-parallel rank) (stepper.make_step_batch reseeds from them), the
model has no other randomness the tool controls, and the optimizer's hyper-parameters come from the plan. So
the progress is the next step's index, the number of data-parallel batches per step (the saving world's
data-parallel size: its world size without tensor parallelism) and the micro-batch. With tensor parallelism
the parameters are DTensors over the 2-D (shard, tp) mesh (_StridedShard x Shard for a colwise weight):
``get_state_dict`` / ``set_state_dict`` and DCP handle them as any DTensor, and the digests below gather each
whole, so the same checks apply (tests/execute/test_tensor_parallel_run.py). A world of the same size replays the same batches; a world of another size
M replays the same *global* batch: the N batches of a step concatenated on dim 0 and cut into M equal
parts (:func:`regrouped_batch`), which gives the same mean loss and gradient for a loss that is a mean
over the samples of a model without cross-sample operators (the example models), up to the order of
floating-point sums (see :func:`loss_tolerance`).

[Note: what a fine-tune's checkpoint holds]
Where some parameters are frozen (a LoRA or QLoRA base, ``--freeze``), the checkpoint holds what training
changes and nothing else: the trainable parameters and their optimizer state
(``StateDictOptions(ignore_frozen_params=True)``, torch/distributed/checkpoint/state_dict.py, which drops
every parameter with ``requires_grad`` False from the model's state dict; the optimizer holds states for
trainable parameters only: stepper.make_optimizer). The frozen ones are what ``build_model()`` makes (in real
use the pretrained base the user loads), and a restore builds them the same way (seeded) before it loads the
rest, non-strictly, then checks that the only keys it did not load are frozen parameters. So a LoRA adapter's
checkpoint is megabytes where the base is gigabytes, and an NF4 base (which DCP and the digests' byte view
cannot handle: NF4Tensor implements no ``view(dtype)``) is never written. The digests below cover what was
saved.

[Note: checking that every tensor came back]
Beside DCP's files the saving world's rank 0 writes ``shard-planner-checkpoint.json``: the progress, the
next steps' losses of the run that saved it (it goes on training after saving) and a SHA-256 digest of
every entry of the state dict — each tensor whole (a DTensor's ``full_tensor()``, gathered one at a
time), so that the digests do not depend on how the tensor is sharded, and every other entry by its
``repr``. A restored state is equal, bit for bit, when every digest matches. Garbage written into a shard
file is caught there even when DCP reads it without complaint.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from shard_planner.errors import first_line
from shard_planner.execute.checkpoint_dir import CheckpointError
from shard_planner.execute.memtrack import StorageTracker

logger = logging.getLogger(__name__)

# ---- save and load ----
def frozen_names(model) -> list[str]:
    """The model's frozen parameters (``requires_grad`` False), by name."""
    return [name for name, p in model.named_parameters() if not p.requires_grad]


def frozen_numel(model) -> int:
    """Elements of the model's frozen parameters (whole, also when sharded): what a checkpoint leaves out."""
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def _options(model) -> StateDictOptions:
    """What the state dicts hold: without the frozen parameters where there are some ([Note: what a
    fine-tune's checkpoint holds]; loaded non-strictly then, and checked), else everything, strictly."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _slowest_s(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def save_checkpoint(model, optimizer, progress: dict, directory: str, device: torch.device) -> tuple[float, int]:
    """Save ``model``, ``optimizer`` and ``progress`` to ``directory`` (every rank); returns (seconds of the
    slowest rank, this rank's rise of memory while saving: the storage tracker's peak of new storages on
    CPU, max_memory_allocated above the level at entry on a GPU)."""
    cuda = device.type == "cuda"
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    tracker = None if cuda else StorageTracker(device_type="cpu")  # counts only what saving allocates
    start = time.perf_counter()
    with tracker if tracker is not None else contextlib.nullcontext():
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
        dcp.save({"model": model_sd, "optim": optim_sd, "progress": dict(progress)}, checkpoint_id=directory)
        del model_sd, optim_sd
    if cuda:
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - before
    else:
        extra = tracker.peak_bytes
    seconds = time.perf_counter() - start
    dist.barrier()
    return _slowest_s(seconds, device), int(extra)


def _root_cause(exc: BaseException) -> str:
    """One line for a failed DCP load: DCP wraps every rank's exception in a CheckpointException."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return f"{type(inner).__name__}: {first_line(inner)}"
    return f"{type(exc).__name__}: {first_line(exc)}"


def load_checkpoint(model, optimizer, directory: str, device: torch.device) -> tuple[dict, float]:
    """Load ``directory`` into ``model`` and ``optimizer`` (built afresh, sharded by the plan; any world
    size); returns (the saved progress, seconds of the slowest rank). CheckpointError on a folder DCP
    cannot read."""
    dist.barrier()
    start = time.perf_counter()
    options = _options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd, "progress": {"step": -1, "data_ranks": -1, "micro_batch": -1}}
    try:
        dcp.load(state, checkpoint_id=directory)
    except (Exception, CheckpointException) as exc:  # many kinds on a truncated or corrupted file: one line for all
        raise CheckpointError(f"{directory}: the checkpoint cannot be read: is a file of it truncated or corrupted? "
                              f"({_root_cause(exc)})") from exc
    loaded = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                            options=options)
    missing = set(loaded.missing_keys) - set(frozen_names(model)) if loaded is not None else set()
    if missing or (loaded is not None and loaded.unexpected_keys):
        raise CheckpointError(f"{directory}: the checkpoint does not match the model: missing "
                              f"{sorted(missing)[:3]}, unexpected {sorted(loaded.unexpected_keys)[:3]}")
    seconds = time.perf_counter() - start
    dist.barrier()
    return state["progress"], _slowest_s(seconds, device)


# ---- digests ----
def _leaves(prefix: str, obj, out: list) -> None:
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _leaves(f"{prefix}.{k}" if prefix else str(k), obj[k], out)
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            _leaves(f"{prefix}.{i}", v, out)
    else:
        out.append((prefix, obj))


def state_digests(model, optimizer) -> dict[str, str]:
    """SHA-256 of every entry of the model's and optimizer's state dict, tensors whole (a collective: every
    rank calls it; rank 0 returns the digests, the others {})."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    leaves: list = []
    _leaves("", {"model": model_sd, "optim": optim_sd}, leaves)
    rank0 = dist.get_rank() == 0
    digests = {}
    for key, value in leaves:
        if isinstance(value, DTensor):
            value = value.full_tensor()  # an all-gather: every rank, in the same order
        if not rank0:
            continue
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            digests[key] = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()
        else:
            digests[key] = hashlib.sha256(repr(value).encode()).hexdigest()
    return digests


def differing_entries(saved: dict[str, str], restored: dict[str, str]) -> tuple[str, ...]:
    """Keys whose digests differ, or that one side lacks."""
    return tuple(sorted(k for k in set(saved) | set(restored) if saved.get(k) != restored.get(k)))


# ---- the next steps ----
def regrouped_batch(batches: list, world_size: int, rank: int):
    """This rank's part of a global batch saved as ``len(batches)`` per-rank batches (inputs, targets), cut
    into ``world_size`` equal parts on dim 0. See [Note: what makes the next steps reproducible]."""
    def cut(tensors: list[torch.Tensor]) -> torch.Tensor:
        whole = torch.cat(tensors, dim=0)
        if whole.shape[0] % world_size:
            raise CheckpointError(f"the saved global batch of {whole.shape[0]} samples cannot be cut into "
                                  f"{world_size} equal parts: restore at a world size that divides it")
        return whole.chunk(world_size, dim=0)[rank]

    first_inputs = batches[0][0]
    if isinstance(first_inputs, dict):
        inputs = {name: cut([b[0][name] for b in batches]) for name in first_inputs}
    else:
        inputs = tuple(cut([b[0][i] for b in batches]) for i in range(len(first_inputs)))
    targets = cut([b[1] for b in batches]) if batches[0][1] is not None else None
    return inputs, targets


def loss_tolerance(saved_world_size: int, world_size: int, device: torch.device) -> tuple[float, str]:
    """(relative tolerance, why) for the restored run's losses against the uninterrupted run's."""
    if world_size != saved_world_size:
        # Measured on CPU/gloo (exec_net, AdamW lr 1e-2, 2 steps): 2 -> 1 and 2 -> 4 differ by < 1e-6.
        return 1e-5, (f"another world size ({saved_world_size} -> {world_size}) sums the same gradients in "
                      "another order (reduce-scatter over another group, the global batch cut differently): "
                      "float32 rounding")
    if device.type == "cuda":
        return 1e-5, ("CUDA kernels are not bitwise reproducible between two runs of the same step "
                      "(atomic adds in some backward kernels)")
    return 0.0, "same world size on CPU: the same operations on the same values, bit for bit"
