"""The incremental peak of one-unit-per-item covers (solve/item_peaks.py) equals the linear model's
:func:`evaluate` for every one-item change of random covers, over traces, meshes, prefetch depths and
options; and the item greedy hint built on it."""

import random

import pytest

from shard_planner.plan import Mesh, Prefetch, Training
from shard_planner.hardware.profile import load_profile
from shard_planner.solve.cpsat import _singles, item_greedy_cover
from shard_planner.solve.item_peaks import ItemCoverPeaks
from shard_planner.solve.choice import GlobalChoice
from shard_planner.solve.linear import build_linear_model, evaluate
from shard_planner.solve.space import build_space
from tests.models import cost_synth, solve_traces

TRACES = {
    "stack1": lambda: solve_traces.stack_trace(1),
    "stack6": lambda: solve_traces.stack_trace(6),
    "synth8": lambda: cost_synth.synthetic_trace(layers=8, hidden=1024, seq=512, vocab=4096),
}


def _models():
    profile = load_profile("h100-80gb")
    for name, make in TRACES.items():
        trace = make()
        for shard, gpn in ((8, 8), (16, 8)):
            space = build_space(trace, shard_group=shard, gpus_per_node=gpn, max_group_size=1)
            for prefetch in (Prefetch(0, 1), Prefetch(1, 1), Prefetch(2, 2)):
                choice = GlobalChoice(2, prefetch, Mesh(shard))
                yield f"{name}-{shard}-{prefetch.forward}{prefetch.backward}", build_linear_model(
                    trace, space, choice, Training(2, "adamw", "bfloat16"), profile)


MODELS = dict(_models())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_one_item_change_has_evaluates_peak(name):
    lm = MODELS[name]
    singles, rng = _singles(lm), random.Random(5)
    for _ in range(4):
        cover = [rng.choice(singles[i]) for i in range(lm.space.n)]
        peaks = ItemCoverPeaks(lm, cover)
        for i in range(lm.space.n):
            for k in singles[i]:
                trial = cover[:i] + [k] + cover[i + 1:]
                assert peaks.with_item(i, k) == evaluate(lm, trial).peak_mib, (i, k)
        i = rng.randrange(lm.space.n)  # after a change, the same holds
        cover[i] = rng.choice(singles[i])
        peaks.set(i, cover[i])
        for k in singles[(i + 1) % lm.space.n]:
            j = (i + 1) % lm.space.n
            assert peaks.with_item(j, k) == evaluate(lm, cover[:j] + [k] + cover[j + 1:]).peak_mib


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_item_greedy_hint_fits_and_no_faster_single_option_would(name):
    lm = MODELS[name]
    singles = _singles(lm)
    lo = evaluate(lm, [min(singles[i], key=lambda k: lm.coeffs[k].stack_mib + lm.coeffs[k].bwd_mib)
                       for i in range(lm.space.n)]).peak_mib
    for budget in (lo, lo + 64, lo * 2):
        cover = item_greedy_cover(lm, budget)
        if cover is None:
            continue
        assert evaluate(lm, cover).peak_mib <= budget
        # the last item can take no faster option than its own and still fit (greedy's final step)
        i = lm.space.n - 1
        for k in singles[i]:
            if lm.coeffs[k].time_us < lm.coeffs[cover[i]].time_us:
                assert evaluate(lm, list(cover[:i]) + [k]).peak_mib > budget
