"""Export a plan as the torchtitan job-config settings it reads for FSDP, checkpointing and batch (TOML).

Keys (torchtitan/config/job_config.py): ``[parallelism] data_parallel_shard_degree``,
``data_parallel_replicate_degree`` (> 1 with a shard degree > 1 is HSDP), ``fsdp_reshard_after_forward``
("default" | "always" | "never"); ``[activation_checkpoint] mode`` ("none" | "full" | "selective") with
``selective_ac_option`` (an integer k checkpoints every k-th block: torchtitan counts blocks from 1 and
checkpoints block i when i % k == 0) or ``"op"`` (per-op selective: attention outputs and every other mm
kept, for a plan whose blocks are selective; exactly a plan's ``ac_save_ops = ["alternate_matmul",
"attention_fwd"]``); ``[training] local_batch_size`` (per GPU), ``global_batch_size``
(with gradient accumulation: torchtitan runs global / (local x data-parallel degree) micro-steps per
optimizer step), ``seq_len``,
``mixed_precision_param`` / ``mixed_precision_reduce``, ``enable_cpu_offload``.

torchtitan decides the units itself in its ``parallelize`` functions (one per transformer block, plus
the embeddings and output) and sets no explicit prefetch: what the plan decides beyond that is listed
as comments with the nearest setting.
"""

from __future__ import annotations

from shard_planner import __version__
from shard_planner.checkpointing import DEFAULT_SAVE_OPS, SELECTIVE, TORCHTITAN_OP_SAVE_OPS
from shard_planner.plan import Plan
from shard_planner.report.export.accumulation import policy_notes
from shard_planner.report.export.common import (
    Export, block_units, comment_block, emit_toml, grouped_note, prefetch_notes, uniform_reshard,
)


def _ac_settings(flags: list[bool]) -> tuple[dict, list[str]]:
    """torchtitan's activation_checkpoint table for a per-block checkpoint pattern, and notes."""
    n, count = len(flags), sum(flags)
    if count == 0:
        return {"mode": "none"}, []
    if count == n:
        return {"mode": "full"}, []
    for k in range(2, n + 1):
        if flags == [(i + 1) % k == 0 for i in range(n)]:
            return {"mode": "selective", "selective_ac_option": str(k)}, []
    # Nearest: every k-th block with k the largest that checkpoints at least as many blocks as the plan.
    k = max(2, n // count)
    note = (f"the plan checkpoints {count} of {n} blocks, not every k-th: torchtitan checkpoints every k-th "
            f"block; using k = {k} ({n // k} blocks), at least as many as the plan")
    return {"mode": "selective", "selective_ac_option": str(k)}, [note]


def _op_sac_settings(blocks) -> tuple[dict, list[str]]:
    """torchtitan's per-op selective checkpointing (``selective_ac_option = "op"``) for blocks of which
    some are selective (shard_planner/checkpointing.py [Note: torchtitan's op-level policy]), and notes."""
    modes = [u.activation_checkpoint for u in blocks]
    save_sets = {tuple(u.ac_save_ops) for u in blocks if u.activation_checkpoint == SELECTIVE}
    notes = []
    if DEFAULT_SAVE_OPS in save_sets:
        notes.append("torchtitan's \"op\" policy saves mm and SDPA outputs but recomputes every second mm of a "
                     "block: a little less memory and a little more recompute than the plan's (which saves every "
                     "matmul and attention output)")
    if any(m != SELECTIVE for m in modes):
        notes.append(f"the plan checkpoints {sum(m == SELECTIVE for m in modes)} of {len(modes)} blocks "
                     "selectively and the others fully or not at all; torchtitan applies one mode to every "
                     "block: using \"op\" on all")
    other = sorted(save_sets - {DEFAULT_SAVE_OPS, TORCHTITAN_OP_SAVE_OPS})
    if other:
        notes.append(f"the plan saves op classes {', '.join(map(str, other[0]))}; torchtitan's op list is fixed "
                     "(matmuls and attention)")
    return {"mode": "selective", "selective_ac_option": "op"}, notes


def export_torchtitan(plan: Plan) -> Export:
    notes: list[str] = []
    reshard, reshard_notes = uniform_reshard(plan)
    notes += reshard_notes
    units = plan.inner_units
    blocks = block_units(plan)
    if any(u.activation_checkpoint == SELECTIVE for u in blocks):
        ac, ac_notes = _op_sac_settings(blocks)
    else:
        ac, ac_notes = _ac_settings([u.activation_checkpoint for u in blocks])
    notes += ac_notes
    others = [u.name for u in units if u.activation_checkpoint and u not in blocks]
    if others:
        notes.append(f"checkpointed unit(s) outside the repeated blocks ({', '.join(others)}): torchtitan "
                     "checkpoints blocks only; not checkpointed here")
    notes += grouped_note(plan)
    notes += prefetch_notes(plan, where="torchtitan")
    notes.append("units: torchtitan wraps one unit per transformer block plus embeddings and output in its "
                 "parallelize function; the plan's "
                 f"{len(units)} units apply where they coincide (the fsdp2 export applies them exactly)")
    if plan.root.reshard_after_forward:
        notes.append("the plan reshards the root after forward; torchtitan does not (FSDP2's root default)")
    t = plan.training
    training = {"local_batch_size": t.micro_batch}
    if t.accumulation_steps > 1:  # torchtitan derives the steps: global / (local x data-parallel degree)
        training["global_batch_size"] = plan.global_batch_samples
        notes += policy_notes(plan, "torchtitan", syncs_every_step=True)
    if plan.model.seq_len:
        training["seq_len"] = plan.model.seq_len
    training.update(mixed_precision_param=t.param_dtype, mixed_precision_reduce=t.reduce_dtype,
                    enable_cpu_offload=t.cpu_offload)
    if t.reduce_dtype != "float32":
        notes.append(f"torchtitan only accepts mixed_precision_reduce = float32; the plan reduces in {t.reduce_dtype}")
    tables = {
        "parallelism": {
            "data_parallel_shard_degree": plan.mesh.shard,
            "data_parallel_replicate_degree": plan.mesh.replicate,
            "fsdp_reshard_after_forward": "always" if reshard else "never",
        },
        "activation_checkpoint": ac,
        "training": training,
    }
    comments = {
        "parallelism.fsdp_reshard_after_forward": "always/never: every block; \"default\" would let torchtitan choose",
        "training.local_batch_size": f"per GPU; global batch = {t.micro_batch} x {plan.mesh.world_size} ranks"
                                     + (f" x {t.accumulation_steps} accumulation steps" if t.accumulation_steps > 1 else ""),
    }
    header = [
        f"torchtitan settings for {plan.model.path} on {plan.cluster.gpus} GPUs, generated by shard-planner "
        f"{__version__} (model fingerprint {plan.model.fingerprint}).",
        "Merge these tables into your job config (or pass them as --section.key=value).",
        "",
        "Where the plan cannot be expressed exactly (the nearest setting is used below):",
        *[f"- {n}" for n in notes],
    ]
    text = "\n".join(comment_block(header) + emit_toml(tables, comments)) + "\n"
    return Export("torchtitan", text, ".toml", tuple(notes))
