"""A hand-written ModelTrace of a Llama/GPT-style decoder with any number of layers (no model behind
it): the cost model's benchmark and scale tests use it to exercise 80-layer plans without tracing.

Per layer (hidden h, sequence s, heads a, per sample, 16-bit activations), after Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1): saved activations
s·h·34 bytes with flash attention (the 5·a·s²·b term disappears); parameters 12·h² (attention 4h²,
MLP 8h²); forward FLOPs 24·s·h² + 4·s²·h (Kaplan et al. 2020: 2 FLOPs per parameter per token, plus
attention scores and values), backward twice the forward.
"""

from dataclasses import replace

from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace, TPCollective


def synthetic_trace(layers: int = 80, hidden: int = 8192, seq: int = 4096, vocab: int = 128256,
                    compute_dtype: str = "bfloat16", tp: int = 1) -> ModelTrace:
    """``tp`` > 1: one rank's numbers under torchtitan's sequence-parallel TP plan (:func:`tp_rank`)."""
    trace = _full_trace(layers, hidden, seq, vocab, compute_dtype)
    return trace if tp == 1 else tp_rank(trace, tp, seq * hidden * (2 if compute_dtype != "float32" else 4))


def tp_rank(trace: ModelTrace, tp: int, act_bytes: int) -> ModelTrace:
    """One rank's trace under sequence-parallel TP of degree ``tp``: attention and MLP parameters and
    FLOPs split by ``tp``, embedding and head split on the vocabulary; per attention or MLP module one
    all-gather of its (s, h) input and one reduce-scatter of its output in forward, the transposes in
    backward (Korthikanti et al. 2022, Fig. 5); its saved activations the gathered input whole, the rest
    split (torch's colwise projection saves the all-gathered input)."""
    act = Affine(0.0, float(act_bytes))
    pair = (TPCollective("all_gather", "fwd", act), TPCollective("reduce_scatter", "fwd", act),
            TPCollective("all_gather", "bwd", act), TPCollective("reduce_scatter", "bwd", act))

    def split(m: ModuleTrace) -> ModuleTrace:
        if m.type_name in ("Attention", "MLP"):
            return replace(m, param_count=m.param_count // tp,
                           param_bytes_by_dtype={k: v // tp for k, v in m.param_bytes_by_dtype.items()},
                           saved_bytes_self=act.scaled(2) + (m.saved_bytes_self + act.scaled(-2)).scaled(1 / tp),
                           fwd_flops_self=m.fwd_flops_self.scaled(1 / tp), bwd_flops_self=m.bwd_flops_self.scaled(1 / tp),
                           tp_collectives=pair)
        if m.type_name in ("Embedding", "Linear"):
            return replace(m, param_count=m.param_count // tp,
                           param_bytes_by_dtype={k: v // tp for k, v in m.param_bytes_by_dtype.items()},
                           fwd_flops_self=m.fwd_flops_self.scaled(1 / tp), bwd_flops_self=m.bwd_flops_self.scaled(1 / tp),
                           tp_collectives=(TPCollective("reduce_scatter" if m.type_name == "Embedding" else "all_gather",
                                                        "fwd", act),))
        return m

    return replace(trace, modules=tuple(split(m) for m in trace.modules), tp_size=tp,
                   fingerprint=f"{trace.fingerprint}-tp{tp}")


def _full_trace(layers: int, hidden: int, seq: int, vocab: int, compute_dtype: str) -> ModelTrace:
    h, s = hidden, seq
    e = 2 if compute_dtype != "float32" else 4
    act = Affine(0.0, float(s * h * e))  # one (s, h) activation per sample
    zero = Affine()

    def mod(fqn, type_name, parent, children, params=0, calls=1, inp=act, out=act, saved=zero,
            fwd_rise=zero, bwd_rise=zero, fwd_flops=zero):
        return ModuleTrace(
            fqn=fqn, type_name=type_name, parent=parent, children=tuple(children), structural_hash=type_name,
            param_count=params, param_bytes_by_dtype={"float32": 4 * params} if params else {},
            buffer_bytes=0, calls=calls, input_bytes=inp, output_bytes=out, saved_bytes_self=saved,
            fwd_flops_self=fwd_flops, bwd_flops_self=fwd_flops.scaled(2),
            fwd_peak_rise_bytes=fwd_rise, bwd_peak_rise_bytes=bwd_rise,
        )

    names = [f"layers.{i}" for i in range(layers)]
    logits = Affine(0.0, float(s * vocab * e))
    modules = [
        mod("", "Decoder", None, ["embed", "layers", "norm", "head"], inp=Affine(0.0, 8.0 * s), out=logits),
        mod("embed", "Embedding", "", [], params=vocab * h, inp=Affine(0.0, 8.0 * s), fwd_rise=act),
        mod("layers", "ModuleList", "", names, calls=0, inp=zero, out=zero),
    ]
    order = ["", "embed"]
    for n in names:
        attn_flops = Affine(0.0, 8.0 * s * h * h + 4.0 * s * s * h)
        mlp_flops = Affine(0.0, 16.0 * s * h * h)
        modules += [
            mod(n, "Block", "layers", [f"{n}.attn", f"{n}.mlp"], fwd_rise=act.scaled(36), bwd_rise=act.scaled(8)),
            mod(f"{n}.attn", "Attention", n, [], params=4 * h * h, saved=act.scaled(11), fwd_rise=act.scaled(13),
                bwd_rise=act.scaled(6), fwd_flops=attn_flops),
            mod(f"{n}.mlp", "MLP", n, [], params=8 * h * h, saved=act.scaled(23), fwd_rise=act.scaled(25),
                bwd_rise=act.scaled(8), fwd_flops=mlp_flops),
        ]
        order += [n, f"{n}.attn", f"{n}.mlp"]
    modules += [
        mod("norm", "RMSNorm", "", [], params=h, saved=act, fwd_rise=act, bwd_rise=act),
        mod("head", "Linear", "", [], params=vocab * h, saved=act, out=logits, fwd_rise=logits, bwd_rise=act,
            fwd_flops=Affine(0.0, 2.0 * s * h * vocab)),
    ]
    order += ["norm", "head"]
    return ModelTrace(
        model_path="synthetic", model_class="Decoder", compute_dtype=compute_dtype, batch_sizes=(1, 2),
        tokens_per_sample=s, modules=tuple(modules), forward_order=tuple(order),
        backward_order=tuple([""] + [m for m in reversed(order) if m]),
        batch_input_bytes=Affine(0.0, 16.0 * s),  # int64 tokens and targets
        loss_saved_bytes=Affine(0.0, float(s * vocab * 4)),  # fp32 logits
        loss_peak_rise_bytes=Affine(0.0, float(2 * s * vocab * 4)),  # fp32 logits and their gradient
        loss_flops=Affine(0.0, float(4 * s * vocab)),
        fingerprint=f"synthetic-{layers}-{hidden}-{seq}",
    )
