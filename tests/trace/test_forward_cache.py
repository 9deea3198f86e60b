"""[Note: A forward that builds a cache] (shard_planner/trace/cache.py): found in a forward's output
generically, recorded in the trace (JSON round-trip; traces written before the field load with none), and
probed without a trace before a checkpointed plan runs."""

import json
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch

from shard_planner.plan.checkpointing import USE_CACHE_FIX, checkpointing_refusal
from shard_planner.model.modelfile import load_model_file
from shard_planner.trace import trace_model
from shard_planner.trace.cache import output_cache, probe_forward_cache
from shard_planner.trace.types import ModelTrace
from tests.paths import EXAMPLES


class DynamicCache:  # named like transformers' caches: found by its class name
    pass


def test_output_cache_finds_a_cache_however_the_output_holds_it():
    logits = torch.zeros(2, 3)
    assert output_cache(logits) is None and output_cache(None) is None
    assert output_cache(OrderedDict(loss=logits, logits=logits)) is None
    assert output_cache({"logits": logits, "past_key_values": None}) is None  # None: no cache
    assert output_cache({"logits": logits, "past_key_values": ()}) is None  # empty: no cache
    assert output_cache({"logits": logits, "cache": DynamicCache()}) == "output field 'cache': DynamicCache"
    assert output_cache({"logits": logits, "past_key_values": ((logits, logits),)}) == (
        "output field 'past_key_values': tuple")
    assert output_cache((logits, {"layer_cache": [logits]})) == "output field 'layer_cache': list"
    assert output_cache((logits, DynamicCache())) == "a DynamicCache"


def test_the_refusal_names_the_fix():
    assert checkpointing_refusal("m.py", None) is None
    refusal = checkpointing_refusal("m.py", "output field 'cache': DynamicCache")
    assert refusal.startswith("m.py: ") and USE_CACHE_FIX in refusal and "use_cache=False" in refusal


def test_the_trace_records_it_and_json_round_trips(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_SIZE", "tiny")
    trace = trace_model(str(EXAMPLES / "llama.py"))
    assert trace.forward_cache is None  # logits only
    cached = replace(trace, forward_cache="output field 'cache': DynamicCache")
    assert ModelTrace.from_json(cached.to_json()) == cached
    old = json.loads(trace.to_json())
    del old["forward_cache"]  # a trace file written before the field
    assert ModelTrace.from_dict(old).forward_cache is None


def test_the_probe_answers_as_the_trace(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from shard_planner.model.hf import HfOptions

    for use_cache in (True, False):
        folder = tmp_path / str(use_cache)
        transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2, use_cache=use_cache,
                                architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
        mf = load_model_file(str(folder), HfOptions(seq_len=8))
        assert probe_forward_cache(mf) == trace_model(mf).forward_cache
        assert (probe_forward_cache(mf) is not None) == use_cache
