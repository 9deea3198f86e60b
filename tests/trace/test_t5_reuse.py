"""T5's blocks as twins (issue 13: T5-3B traced in 21 s): blocks 1..N-2 of each stack reuse block 1's
numbers although they take ``position_bias`` (made by block 0, needs a gradient) and return it, number
their attention by ``layer_idx`` inside a ``layer`` list of their own, and (decoder) take the encoder's
output; the trace equals a full trace module by module. See [Note: shared input gradients]."""

from dataclasses import fields

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the optional extra: pip install 'shard-planner[hf]')")

from shard_planner.model.hf import HfOptions  # noqa: E402
from shard_planner.model.modelfile import load_model_file  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402
from shard_planner.trace.twins import attribute_signatures  # noqa: E402
from shard_planner.trace.types import ModelTrace  # noqa: E402

LAYERS = 5


@pytest.fixture(scope="module")
def t5_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5")
    config = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=LAYERS, num_heads=4,
                                   architectures=["T5ForConditionalGeneration"])
    config.save_pretrained(folder)
    return str(folder / "config.json")


def test_block_numbers_inside_a_sublayer_list_are_positions(t5_config):
    """``encoder.block.2.layer.0.SelfAttention.layer_idx == 2`` numbers the ``block`` stack, not the
    block's own ``layer`` list (index 0): blocks 1 and 2 have the same attribute signature, block 0 not
    (it alone has the relative attention bias)."""
    model = load_model_file(t5_config).build()
    sigs = attribute_signatures(model)
    for stack in ("encoder", "decoder"):
        assert sigs[f"{stack}.block.1"] == sigs[f"{stack}.block.2"] == sigs[f"{stack}.block.{LAYERS - 1}"]
        assert sigs[f"{stack}.block.0"] != sigs[f"{stack}.block.1"]


def test_t5_blocks_are_reused_and_equal_a_full_trace(t5_config):
    mf = load_model_file(t5_config, HfOptions(seq_len=32))
    fast, full = trace_model(mf), trace_model(mf, reuse=False)
    block = {stack: sum(1 for m in full.modules if m.fqn == f"{stack}.block.2" or m.fqn.startswith(f"{stack}.block.2."))
             for stack in ("encoder", "decoder")}
    # blocks 2..N-2 of both stacks whole (block 1 is the template; block N-1, first in backward to reach
    # position_bias and the encoder's output, is traced for real)
    assert fast.reused_modules >= (LAYERS - 3) * (block["encoder"] + block["decoder"])
    assert full.reused_modules == 0
    assert fast.modules == full.modules
    for f in fields(ModelTrace):
        if f.name not in ("trace_seconds", "reused_modules"):
            assert getattr(fast, f.name) == getattr(full, f.name), f.name


def test_input_gradients_are_not_held_to_the_end_of_the_backward(t5_config):
    """Every block after block 0 takes position_bias, whose gradient is complete only after block 0's
    backward: the tracer's end-of-backward hook must not keep a block's input gradients alive until then
    (``register_multi_grad_hook(mode="all")`` did), so each sublayer's layer norm has the same backward
    peak in every block after block 0, the last (first in backward) included."""
    trace = trace_model(load_model_file(t5_config, HfOptions(seq_len=32)), reuse=False)
    for stack, sublayers in (("encoder", 2), ("decoder", 3)):
        for j in range(sublayers):
            peaks = {trace.module(f"{stack}.block.{i}.layer.{j}.layer_norm").bwd_peak_rise_bytes
                     for i in range(1, LAYERS)}
            assert len(peaks) == 1, (stack, j, peaks)
