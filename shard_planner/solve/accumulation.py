"""Gradient accumulation to a global batch: which (micro-batch, micro-steps, policies) the planner searches.

``plan --global-batch N`` (samples) or ``--global-batch-tokens N`` (tokens: samples x the model's
sequence length) fixes the samples per optimizer step over the cluster. A plan reaches it as

    micro_batch x accumulation_steps x data-parallel ranks = N

where every GPU is a data-parallel rank (FSDP shards and HSDP replicates over all of them). The planner
tries every micro-batch that divides N / ranks (smallest first, stopping at the first one nothing fits,
since a larger micro-batch only needs more memory), each with its accumulation steps, and at each the
gradient-sync and keep-gathered policies (:data:`POLICIES`, cost/accumulation.py prices them), jointly
with the units, prefetch and mesh it searches anyway; the fastest plan that fits wins. An N that no
plan can reach (not a multiple of the ranks, or of micro-batch x ranks when ``--batch-size`` fixes the
micro-batch; tokens: not a whole number of samples) is refused with one line naming the nearest global
batches that work: the planner never changes the batch it was asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shard_planner.errors import UserError
from shard_planner.plan import GRADIENT_SYNCS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accumulation:
    """Micro-steps per optimizer step and what happens between them (plan.Training's fields)."""

    steps: int = 1
    gradient_sync: str = GRADIENT_SYNCS[0]
    keep_params_gathered: bool = False

    @property
    def label(self) -> str:
        sync = "sync every micro-step" if self.gradient_sync == GRADIENT_SYNCS[0] else "sync on the last"
        kept = ", parameters kept gathered" if self.keep_params_gathered else ""
        return f"{self.steps} micro-steps ({sync}{kept})"

    def training_fields(self) -> dict:
        return {"accumulation_steps": self.steps, "gradient_sync": self.gradient_sync,
                "keep_params_gathered": self.keep_params_gathered}


NO_ACCUMULATION = Accumulation()
# (gradient_sync, keep_params_gathered) tried with two or more micro-steps: the leanest first.
POLICIES = tuple((sync, keep) for sync in GRADIENT_SYNCS for keep in (False, True))


@dataclass(frozen=True)
class GlobalBatch:
    """What the user asked for: ``samples`` per optimizer step over the cluster; ``tokens``: as given
    in tokens (None when given in samples), for messages."""

    samples: int
    tokens: int | None = None


def resolve_global_batch(samples: int | None, tokens: int | None, tokens_per_sample: int | None,
                         model: str) -> GlobalBatch | None:
    """The global batch in samples from ``--global-batch`` or ``--global-batch-tokens`` (which needs
    the model's sequence length); None when neither is given."""
    if tokens is None:
        return GlobalBatch(samples) if samples is not None else None
    if not tokens_per_sample:
        raise UserError(f"--global-batch-tokens needs a model with tokens per sample (a sequence length); "
                        f"{model} has none: give --global-batch in samples")
    if tokens % tokens_per_sample:
        below = tokens // tokens_per_sample * tokens_per_sample
        raise UserError(f"--global-batch-tokens {tokens} is not a whole number of {tokens_per_sample}-token samples: "
                        f"nearest {_pair(below, below + tokens_per_sample, 'tokens')}")
    return GlobalBatch(tokens // tokens_per_sample, tokens)


def split_global_batch(batch: GlobalBatch, ranks: int, micro_batch: int | None,
                       tokens_per_sample: int | None) -> list[tuple[int, int]]:
    """Every (micro-batch, accumulation steps) with micro-batch x steps x ``ranks`` = the global batch,
    smallest micro-batch first (only ``micro_batch`` when the user fixed it), or one clear error."""
    unit = ranks * (micro_batch or 1)
    if batch.samples % unit:
        below = batch.samples // unit * unit
        what = f"{ranks} data-parallel ranks" + (f" x micro-batch {micro_batch}" if micro_batch else "")
        per = tokens_per_sample if batch.tokens is not None else 1
        asked = f"--global-batch-tokens {batch.tokens}" if batch.tokens is not None else f"--global-batch {batch.samples}"
        raise UserError(f"{asked} is not a multiple of {what} ({unit} samples"
                        f"{f' = {unit * per} tokens' if per > 1 else ''}): nearest "
                        f"{_pair(below * per, (below + unit) * per, 'tokens' if per > 1 else 'samples')}")
    per_rank = batch.samples // ranks
    if micro_batch:
        return [(micro_batch, per_rank // micro_batch)]
    return [(mb, per_rank // mb) for mb in range(1, per_rank + 1) if per_rank % mb == 0]


def accumulation_options(steps: int) -> list[Accumulation]:
    """The policies worth trying at ``steps`` micro-steps (none between micro-steps at one)."""
    if steps == 1:
        return [NO_ACCUMULATION]
    return [Accumulation(steps, sync, keep) for sync, keep in POLICIES]


def _pair(below: int, above: int, what: str) -> str:
    return f"{above} {what}" if below <= 0 else f"{below} or {above} {what}"
