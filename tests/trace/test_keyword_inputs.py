"""Tier 1: the model-file contract's keyword inputs (``make_batch`` returning a dict, or (dict, targets)),
the default loss on model outputs that carry ``.loss`` / ``.logits`` (as transformers' ModelOutputs do),
and a transformers config without transformers installed."""

import json
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from shard_planner.errors import ModelFileError
from shard_planner.model.modelfile import default_loss_fn, load_model_file
from shard_planner.trace import trace_model

VOCAB, SEQ, DIM = 32, 8, 16

# A model whose forward takes keyword-only inputs and returns an output object with .logits and,
# when labels are given, .loss (the shape of a transformers ModelOutput, without transformers).
KEYWORD_MODEL = f"""
import torch, torch.nn as nn, torch.nn.functional as F
from dataclasses import dataclass

@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding({VOCAB}, {DIM})
        self.body = nn.Sequential(nn.Linear({DIM}, {DIM}), nn.GELU())
        self.head = nn.Linear({DIM}, {VOCAB})

    def forward(self, *, input_ids, mask, labels=None):
        logits = self.head(self.body(self.embed(input_ids)) * mask.unsqueeze(-1))
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return Output(logits, loss)

def build_model():
    return Net()
"""
ONLY_DICT = KEYWORD_MODEL + f"""
def make_batch(batch_size):
    ids = torch.randint(0, {VOCAB}, (batch_size, {SEQ}))
    return {{"input_ids": ids, "mask": torch.ones(batch_size, {SEQ}), "labels": ids}}
"""
DICT_AND_TARGETS = KEYWORD_MODEL + f"""
def make_batch(batch_size):
    ids = torch.randint(0, {VOCAB}, (batch_size, {SEQ}))
    return {{"input_ids": ids, "mask": torch.ones(batch_size, {SEQ})}}, ids
"""


def write(tmp_path, name, text):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("text", [ONLY_DICT, DICT_AND_TARGETS], ids=["dict", "dict+targets"])
def test_keyword_inputs_trace_and_loss(tmp_path, text):
    mf = load_model_file(write(tmp_path, "kw", text))
    inputs, targets = mf.batch(3)
    assert isinstance(inputs, dict) and set(inputs) >= {"input_ids", "mask"}
    assert (targets is None) == ("labels" in inputs)
    model = mf.build()
    out = mf.forward(model, inputs)  # model(**inputs)
    loss = mf.loss(out, targets)
    ids = inputs["input_ids"]
    assert torch.allclose(loss, F.cross_entropy(out.logits.flatten(0, 1).float(), ids.flatten()))
    trace = trace_model(mf, dtype="float32")
    assert trace.param_count == sum(p.numel() for p in model.parameters())
    assert {"embed", "body", "head"} <= {m.fqn for m in trace.modules if m.calls == 1}
    # the batch's inputs are counted by storage: ids (int64) + mask (fp32); the labels / targets are the
    # ids tensor itself, counted once
    per_sample = SEQ * 8 + SEQ * 4
    assert trace.batch_input_bytes.at(2) - trace.batch_input_bytes.at(1) == per_sample
    # the head's logits are what the loss reads: saved and seen by the trace in either form
    assert trace.module("head").output_bytes.at(1) == SEQ * VOCAB * 4


def test_positional_batch_still_a_tuple(tmp_path):
    text = KEYWORD_MODEL.replace("def forward(self, *, input_ids, mask, labels=None)",
                                 "def forward(self, input_ids, mask, labels=None)") + f"""
def make_batch(batch_size):
    ids = torch.randint(0, {VOCAB}, (batch_size, {SEQ}))
    return (ids, torch.ones(batch_size, {SEQ})), ids
"""
    mf = load_model_file(write(tmp_path, "pos", text))
    inputs, targets = mf.batch(2)
    assert isinstance(inputs, tuple) and len(inputs) == 2
    assert mf.loss(mf.forward(mf.build(), inputs), targets).dim() == 0


@dataclass
class _Output:  # the attributes of a transformers ModelOutput the default loss reads
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_default_loss_of_model_outputs():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, :2] = -100  # ignored, as transformers' padding labels
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert torch.allclose(default_loss_fn(_Output(logits), targets), expected)
    assert torch.allclose(default_loss_fn(logits, targets), expected)  # a plain tensor, as before
    own = torch.tensor(1.25)
    assert default_loss_fn(_Output(logits, own), targets) is own  # the model's own loss wins
    assert default_loss_fn(_Output(logits, own), None) is own
    with pytest.raises(ValueError, match="no targets"):
        default_loss_fn(_Output(logits), None)


def test_dict_without_labels_or_targets_is_one_line(tmp_path):
    text = KEYWORD_MODEL + f"""
def make_batch(batch_size):
    return {{"input_ids": torch.randint(0, {VOCAB}, (batch_size, {SEQ})), "mask": torch.ones(batch_size, {SEQ})}}
"""
    path = write(tmp_path, "nolabels", text)
    with pytest.raises(ModelFileError) as info:
        trace_model(path)
    assert str(info.value).startswith(path) and "\n" not in str(info.value)
    assert "computed no loss" in str(info.value)


def test_config_without_transformers_says_how_to_install(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    for given in (str(config), str(tmp_path)):
        with pytest.raises(ModelFileError) as info:
            load_model_file(given)
        assert "\n" not in str(info.value)
        assert "pip install 'shard-planner[hf]'" in str(info.value)


def test_hf_options_only_for_configs(tmp_path):
    from shard_planner.model.hf import HfOptions

    path = write(tmp_path, "kw", ONLY_DICT)
    with pytest.raises(ModelFileError, match="transformers config"):
        load_model_file(path, HfOptions(seq_len=16))
