"""A ``build_model()`` that casts its model (``.to(torch.bfloat16)``, ``.half()``, ``.bfloat16()``, a
transformers ``dtype=``) traces (it failed with "_apply(): Couldn't swap Embedding.weight": [Note: Casting a
fake model] in shard_planner/trace/build.py), records its parameters in the dtype they were built in, and
agrees with a real step."""

import pytest

from shard_planner.trace import trace_model
from shard_planner.trace.realrun import compare_with_real_run
from tests.paths import EXAMPLES

CAST_EXAMPLE = f'''
import importlib.util
import torch

_spec = importlib.util.spec_from_file_location("_cast_llama_example", {str(EXAMPLES / "llama.py")!r})
_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_llama)
make_batch, loss_fn, TRAINING = _llama.make_batch, _llama.loss_fn, _llama.TRAINING


def build_model():
    return _llama.build_model().{{cast}}
'''

HF_DTYPE = '''
import torch
import transformers

CONFIG = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  use_cache=False)


def build_model():
    return transformers.LlamaForCausalLM._from_config(CONFIG, dtype=torch.bfloat16)


def make_batch(batch_size):
    ids = torch.randint(0, 256, (batch_size, 16))
    return {"input_ids": ids, "labels": ids}, None
'''


def write_cast_example(tmp_path, cast: str) -> str:
    path = tmp_path / "cast_llama.py"
    path.write_text(CAST_EXAMPLE.format(cast=cast))
    return str(path)


@pytest.mark.parametrize("cast, dtype", [("to(torch.bfloat16)", "bfloat16"), ("half()", "float16"),
                                         ("bfloat16()", "bfloat16")])
def test_a_cast_example_traces_in_its_built_dtype(cast, dtype, tmp_path):
    path = write_cast_example(tmp_path, cast)
    trace = trace_model(path)
    assert {dt for m in trace.modules for dt in m.param_bytes_by_dtype} == {dtype}
    assert trace.module("tok_embeddings").param_bytes == 512 * 64 * 2  # vocab x dim, 2 bytes each
    if dtype == "bfloat16":
        assert compare_with_real_run(path, trace, batch_size=2) == ()


def test_a_transformers_model_built_with_a_dtype_traces(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    path = tmp_path / "hf_bf16.py"
    path.write_text(HF_DTYPE)
    trace = trace_model(str(path))
    assert {dt for m in trace.modules for dt in m.param_bytes_by_dtype} == {"bfloat16"}
    assert compare_with_real_run(str(path), trace, batch_size=2) == ()
