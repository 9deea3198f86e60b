"""The search space walks through a container with a single child (BERT's ``encoder`` holding the
``encoder.layer`` list, CLIP's ``encoder.layers``): the blocks become items, not the whole encoder."""

from shard_planner.solve import plan_model
from shard_planner.solve.request import PlanRequest
from shard_planner.solve.space import build_space, find_items
from shard_planner.trace.types import Affine, ModelTrace
from tests.models.solve_traces import GIB, MIB, _mod, profile

N_LAYERS = 4
BLOCK_PARAMS = 32 * MIB


def bert_like_trace(wrap: int = 1) -> ModelTrace:
    """root -> embeddings, encoder -> layer (a ModuleList, never called) -> layer.0..3, pooler; with
    ``wrap`` > 1 the encoder is nested that deep in single-child wrappers (bert.encoder...)."""
    inp = 2 * MIB
    layers = [f"enc.layer.{i}" for i in range(N_LAYERS)]
    mods = [_mod("", "Model", None, ["embeddings", "enc", "pooler"], "root")]
    mods.append(_mod("embeddings", "Embeddings", "", [], "emb", 8 * MIB, out=inp, fwd_rise=inp))
    # the single-child chain: enc -> enc.wrap -> ... -> the list
    chain = ["enc"] + [f"enc{'.w' * k}" for k in range(1, wrap)]
    lst = chain[-1] + ".layer"
    layers = [f"{lst}.{i}" for i in range(N_LAYERS)]
    for i, fqn in enumerate(chain):
        kid = chain[i + 1] if i + 1 < len(chain) else lst
        mods.append(_mod(fqn, "Encoder", "" if i == 0 else chain[i - 1], [kid], f"enc{i}", inp=inp, out=inp))
    mods.append(_mod(lst, "ModuleList", chain[-1], layers, "list", calls=0))
    for name in layers:
        mods.append(_mod(name, "Layer", lst, [], "block", BLOCK_PARAMS, saved=16 * MIB, inp=inp, out=inp,
                         fwd_rise=16 * MIB + inp, bwd_rise=2 * inp, flops=1e12))
    mods.append(_mod("pooler", "Pooler", "", [], "pool", MIB, inp=inp, out=inp, fwd_rise=inp, flops=1e6))
    order = ["", "embeddings", *chain, *layers, "pooler"]
    return ModelTrace(
        model_path="bert_like", model_class="Model", compute_dtype="bfloat16", batch_sizes=(1, 2),
        tokens_per_sample=128, modules=tuple(mods), forward_order=tuple(order),
        backward_order=tuple(reversed(order)), batch_input_bytes=Affine(0, 1024.0),
        loss_saved_bytes=Affine(), loss_peak_rise_bytes=Affine(0, inp), loss_flops=Affine(0, 1e6),
        fingerprint="bert_like",
    )


def test_the_blocks_under_a_single_child_container_are_items():
    trace = bert_like_trace()
    items = [it.fqn for it in find_items(trace)]
    assert items == ["embeddings", *(f"enc.layer.{i}" for i in range(N_LAYERS)), "pooler"]
    space = build_space(trace, shard_group=8, gpus_per_node=8)
    singles = {space.items[c.start].fqn for c in space.candidates if c.stop == c.start + 1}
    assert {f"enc.layer.{i}" for i in range(N_LAYERS)} <= singles
    assert "enc" not in singles


def test_a_chain_of_single_child_wrappers_is_walked_through():
    trace = bert_like_trace(wrap=3)
    items = [it.fqn for it in find_items(trace)]
    assert items[1:-1] == [f"enc.w.w.layer.{i}" for i in range(N_LAYERS)]


def test_a_tight_budget_gets_per_layer_units():
    """The planner can now choose units inside the encoder (before, ``enc`` was one item: one unit for
    all the layers, or the root's)."""
    trace = bert_like_trace()
    result = plan_model(trace, PlanRequest(gpus=8, mem_budget_bytes=2 * GIB, profile=profile(), micro_batch=1))
    inner = {m for u in result.plan.inner_units for m in u.modules}
    assert "enc" not in inner
    assert any(m.startswith("enc.layer.") for m in inner), result.plan.units
