"""A small MLP whose ModelTrace can be written by hand (tier-1 and real-run tests of the cost model).

    Net: blocks.{0..L-1} = Block(fc: Linear(d, d, bias=False), GELU), head: Linear(d, d, bias=False)
    loss: (out.float() * target).mean()

Built in fp32 and run under FSDP2's MixedPrecisionPolicy(param_dtype=bf16) in the real-run tests.
:func:`analytic_trace` gives the tracer's numbers for it, derived by hand below (per micro-batch B,
X = B * d * e bytes for one activation in the compute dtype of element size e):

- the root's MixedPrecisionPolicy casts the fp32 input to the compute dtype: X, blocks.0's input
  (in fp32 there is no cast and blocks.0 saves the batch tensor itself);
- each block saves its Linear input (X: the previous block's output, saved first here) and GELU's input
  (the Linear's output, X): saved 2X; input X, output X; forward peak rise 2X (the Linear output and
  the GELU output live together); backward rise X (the GELU input gradient next to the output
  gradient, then the input gradient next to it);
- the head saves its input (X) and outputs X;
- the loss: ``out.float()`` (2X at e=2; no copy at e=4) saved by the product; its forward+backward
  peak rise (measured with the storage tracker, and explained): at e=2 the fp32 copy (2X) and its
  fp32 gradient (2X) = 4X; at e=4 the gradient of out (X) plus two scalars. (``F.mse_loss`` is
  avoided: on CPU its scalar result keeps a storage of the input's size alive until the loss tensor
  dies, which would make the example test the loss kernel rather than FSDP2.)
"""

import os

import torch
import torch.nn as nn

D = int(os.environ.get("COST_MLP_D", "128"))
LAYERS = int(os.environ.get("COST_MLP_LAYERS", "4"))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))  # (B, d)


class Net(nn.Module):
    def __init__(self, d: int = D, layers: int = LAYERS):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, d, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int):
    return torch.randn(batch_size, D), torch.randn(batch_size, D)


def loss_fn(output, targets):
    return (output.float() * targets).mean()


TRAINING = {"micro_batch": 64, "optimizer": "adamw", "lr": 1e-3}


def analytic_trace(d: int = D, layers: int = LAYERS, compute_dtype: str = "bfloat16"):
    """The ModelTrace of :class:`Net` written by hand (see the module docstring for the derivation)."""
    from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace

    e = 2 if compute_dtype in ("bfloat16", "float16") else 4
    x = Affine(0.0, float(d * e))  # one (B, d) activation, per sample
    zero = Affine()
    lin_flops = Affine(0.0, 2.0 * d * d)

    def mod(fqn, type_name, parent, children, params=0, calls=1, inp=x, out=x, saved=zero,
            fwd_rise=zero, bwd_rise=zero, fwd_flops=zero, bwd_flops=zero):
        return ModuleTrace(
            fqn=fqn, type_name=type_name, parent=parent, children=tuple(children),
            structural_hash=type_name, param_count=params,
            param_bytes_by_dtype={"float32": 4 * params} if params else {}, buffer_bytes=0, calls=calls,
            input_bytes=inp, output_bytes=out, saved_bytes_self=saved, fwd_flops_self=fwd_flops,
            bwd_flops_self=bwd_flops, fwd_peak_rise_bytes=fwd_rise, bwd_peak_rise_bytes=bwd_rise,
        )

    blocks = [f"blocks.{i}" for i in range(layers)]
    modules = [
        mod("", "Net", None, ["blocks", "head"], inp=Affine(0.0, 4.0 * d), out=x,
            fwd_rise=x.scaled(2 * layers + 2), bwd_rise=x.scaled(2)),
        mod("blocks", "ModuleList", "", blocks, calls=0, inp=zero, out=zero),
    ]
    order = [""]
    for i, b in enumerate(blocks):
        # In fp32 there is no cast: blocks.0's input is the batch tensor itself, already counted in
        # batch_input_bytes, so saving it adds nothing.
        first_saved = zero if (i == 0 and e == 4) else x
        modules += [
            mod(b, "Block", "blocks", [f"{b}.fc", f"{b}.act"], fwd_rise=x.scaled(2), bwd_rise=x),
            mod(f"{b}.fc", "Linear", b, [], params=d * d, saved=first_saved, fwd_rise=x, bwd_rise=x,
                fwd_flops=lin_flops, bwd_flops=lin_flops.scaled(2)),
            mod(f"{b}.act", "GELU", b, [], saved=x, fwd_rise=x, bwd_rise=x),
        ]
        order += [b, f"{b}.fc", f"{b}.act"]
    modules.append(mod("head", "Linear", "", [], params=d * d, saved=x, fwd_rise=x, bwd_rise=x,
                       fwd_flops=lin_flops, bwd_flops=lin_flops.scaled(2)))
    order.append("head")
    backward = [""] + [m for m in reversed(order) if m]
    return ModelTrace(
        model_path=__file__, model_class="Net", compute_dtype=compute_dtype, batch_sizes=(1, 2),
        tokens_per_sample=None, modules=tuple(modules), forward_order=tuple(order),
        backward_order=tuple(backward),
        batch_input_bytes=Affine(0.0, 8.0 * d),  # x and target, fp32
        loss_saved_bytes=Affine(0.0, 4.0 * d if e == 2 else 0.0),  # out.float() (fp32), a copy only at e=2
        loss_peak_rise_bytes=Affine(4.0, 4.0 * d * 2) if e == 2 else Affine(8.0, 4.0 * d),
        loss_flops=Affine(0.0, 3.0 * d),
        fingerprint="cost_mlp",
    )
