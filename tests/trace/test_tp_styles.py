"""derive_tensor_parallel and check_divisible (shard_planner/trace/tp_styles.py): the exact styles derived for
examples/llama.py and tiny transformers models, the models refused, the divisibility errors, and the proof:
the derived plan applied with torch's parallelize_module under the fake process group runs a forward and
backward with every parameter split as the style says."""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shard_planner.model import hf
from shard_planner.errors import UserError
from shard_planner.model.modelfile import load_model_file
from shard_planner.parallel.tensor_parallel import Style
from shard_planner.trace.tp_styles import check_divisible, derive_tensor_parallel

from tests.paths import EXAMPLES


def example(name: str):
    mf = load_model_file(str(EXAMPLES / name))
    inputs, targets = mf.batch(2)
    return mf, mf.build(), inputs, targets


def llama_module():
    spec = importlib.util.spec_from_file_location("_tp_styles_llama", EXAMPLES / "llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_styles(n_layers: int, sequence_parallel: bool) -> dict[str, str]:
    """torchtitan's Llama plan over examples/llama.py's names, in forward order."""
    styles = {"tok_embeddings": "embedding"}
    for i in range(n_layers):
        p = f"layers.{i}"
        if sequence_parallel:
            styles |= {f"{p}.attention_norm": "norm", f"{p}.attention": "gather_input"}
        styles |= {f"{p}.attention.{w}": "colwise" for w in ("wq", "wk", "wv")} | {f"{p}.attention.wo": "rowwise"}
        if sequence_parallel:
            styles |= {f"{p}.ffn_norm": "norm", f"{p}.feed_forward": "gather_input"}
        styles |= {f"{p}.feed_forward.w1": "colwise", f"{p}.feed_forward.w3": "colwise",
                   f"{p}.feed_forward.w2": "rowwise"}
    return styles | ({"norm": "norm"} if sequence_parallel else {}) | {"output": "head"}


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_llama_example_styles(sequence_parallel):
    _, model, inputs, _ = example("llama.py")
    tp = derive_tensor_parallel(model, inputs, sequence_parallel=sequence_parallel)
    assert list(tp.styles.items()) == list(llama_styles(2, sequence_parallel).items())
    assert (tp.sequence_parallel, tp.loss_parallel) == (sequence_parallel, True)


def test_llama_example_on_meta_device():
    mf = load_model_file(str(EXAMPLES / "llama.py"))
    with torch.device("meta"):
        model = mf.build()
    inputs, _ = mf.batch(2)
    assert derive_tensor_parallel(model, inputs).styles == llama_styles(2, True)


def hf_model(kind: str, **extra):
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, **extra)
    config = getattr(transformers, f"{kind}Config")(**sizes)
    return getattr(transformers, f"{kind}ForCausalLM")._from_config(config)


def skip_without_embedding_style(plan: dict) -> None:
    """The transformers floor the extras admit (5.15) plans no split of the embedding (its models' ``tp_plan``
    has no ``model.embed_tokens``), so neither the embedding nor the head is styled there and sequence
    parallelism is refused (this module's tests ran only on the newest transformers before tests/trace/ held
    them)."""
    if not any(k.endswith("embed_tokens") for k in plan):
        import transformers

        pytest.skip(f"transformers {transformers.__version__}'s tp_plan splits no embedding (no embed_tokens entry)")


def hf_batch():
    ids = torch.randint(0, 128, (2, 16))
    return {"input_ids": ids, "labels": ids.clone()}


def hf_styles(n_layers: int) -> dict[str, str]:
    styles = {"model.embed_tokens": "embedding"}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        styles |= {f"{p}.self_attn.{w}": "colwise" for w in ("q_proj", "k_proj", "v_proj")}
        styles |= {f"{p}.self_attn.o_proj": "rowwise", f"{p}.mlp.gate_proj": "colwise", f"{p}.mlp.up_proj": "colwise",
                   f"{p}.mlp.down_proj": "rowwise"}
    return styles | {"lm_head": "head"}


@pytest.mark.parametrize("kind", ["Llama", "Qwen2", "Mistral"])
def test_transformers_plan_styles(kind):
    model = hf_model(kind)
    plan = hf.tp_plan(model)
    assert plan["model.layers.*.self_attn.k_proj"] == "colwise" and plan["lm_head"] == "colwise_gather_output"
    skip_without_embedding_style(plan)
    tp = derive_tensor_parallel(model, hf_batch(), sequence_parallel=False, hf_tp_plan=plan)
    assert list(tp.styles.items()) == list(hf_styles(2).items())


def test_transformers_refusals():
    model = hf_model("Llama")
    with pytest.raises(UserError, match="sequence length off its embedding"):
        derive_tensor_parallel(model, hf_batch(), hf_tp_plan=hf.tp_plan(model))
    with pytest.raises(UserError, match="transformers model, split by its own plan only"):
        derive_tensor_parallel(model, hf_batch(), sequence_parallel=False)
    with pytest.raises(UserError, match="'model.layers.\\*.mlp.experts' names no module"):
        derive_tensor_parallel(model, hf_batch(), sequence_parallel=False,
                               hf_tp_plan=hf.tp_plan(model) | {"model.layers.*.mlp.experts": "colwise"})
    with pytest.raises(UserError, match="'packed_colwise', which has no equivalent"):
        derive_tensor_parallel(model, hf_batch(), sequence_parallel=False,
                               hf_tp_plan=hf.tp_plan(model) | {"model.layers.*.mlp.up_proj": "packed_colwise"})
    assert hf.tp_plan(nn.Linear(2, 2)) is None


@pytest.mark.parametrize("name, message", [
    ("unet.py", "UNet has no token embedding"),
    ("vit.py", "VisionTransformer has no token embedding"),
    ("shape.py", "lm_head.weight is wte.weight \\(tied embeddings\\)"),
    ("gpt2.py", "lm_head.weight is wte.weight \\(tied embeddings\\)"),
])
def test_models_without_tp_structure_are_refused(name, message):
    _, model, inputs, _ = example(name)
    with pytest.raises(UserError, match=message):
        derive_tensor_parallel(model, inputs)


def test_fused_qkv_is_refused(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_SHAPE", '{"n_layers": 1, "d_model": 64, "d_ffn": 128, "n_heads": 4, '
                                              '"vocab": 64, "seq_len": 8, "tied_embeddings": false}')
    _, model, inputs, _ = example("shape.py")
    with pytest.raises(UserError, match="blocks.0.attn.wqkv projects q, k and v in one Linear"):
        derive_tensor_parallel(model, inputs)


def test_sequence_parallel_refuses_parameters_that_are_not_norms(monkeypatch):
    """shape.py's learned position table runs on the hidden states between the embedding and the head."""
    from shard_planner.trace.tp_styles import _with_sequence_parallel, trace_calls

    monkeypatch.setenv("SHARD_PLANNER_SHAPE", '{"n_layers": 1, "d_model": 64, "d_ffn": 128, "n_heads": 4, '
                                              '"vocab": 64, "seq_len": 8, "tied_embeddings": false}')
    _, model, inputs, _ = example("shape.py")
    styles = {"wte": "embedding", "blocks.0.attn.out_proj": "rowwise", "blocks.0.ffn.up": "colwise",
              "blocks.0.ffn.down": "rowwise", "lm_head": "head"}
    with pytest.raises(UserError, match="wpe \\(Embedding\\) holds parameters .* not a norm"):
        _with_sequence_parallel(model, trace_calls(model, inputs), styles)
    del styles["wte"]
    with pytest.raises(UserError, match="styles no \\(called\\) embedding and head"):
        _with_sequence_parallel(model, trace_calls(model, inputs), styles)


class TinyAttention(nn.Module):
    def __init__(self, names, dim=32, heads=4):
        super().__init__()
        self.names, self.head_dim = names, dim // heads
        for name in names:
            setattr(self, name, nn.Linear(dim, dim, bias=False))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (getattr(self, n)(x).view(B, T, -1, self.head_dim).transpose(1, 2) for n in self.names[:3])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return getattr(self, self.names[3])(y.transpose(1, 2).reshape(B, T, -1))


class TinyDecoder(nn.Module):
    def __init__(self, attention_names, mlp_names=("a", "b"), dim=32):
        super().__init__()
        self.emb = nn.Embedding(64, dim)
        self.ln = nn.LayerNorm(dim)
        self.attn = TinyAttention(attention_names, dim)
        self.mlp = nn.Module()
        self.mlp.add_module(mlp_names[0], nn.Linear(dim, 4 * dim))
        self.mlp.add_module(mlp_names[1], nn.Linear(4 * dim, dim))
        self.mlp.forward = lambda x: getattr(self.mlp, mlp_names[1])(F.gelu(getattr(self.mlp, mlp_names[0])(x)))
        self.out = nn.Linear(dim, 64, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.attn(self.ln(h))
        return self.out(h + self.mlp(h))


def test_roles_come_from_structure_and_names_only_cross_check():
    tokens = (torch.randint(0, 64, (2, 8)),)
    tp = derive_tensor_parallel(TinyDecoder(("x1", "x2", "x3", "x4")), tokens, sequence_parallel=False)
    assert tp.styles == {"emb": "embedding", "attn.x1": "colwise", "attn.x2": "colwise", "attn.x3": "colwise",
                         "attn.x4": "rowwise", "mlp.a": "colwise", "mlp.b": "rowwise", "out": "head"}
    with pytest.raises(UserError, match="attn.q is an attention output projection by structure"):
        derive_tensor_parallel(TinyDecoder(("wq", "wk", "wv", "q")), tokens, sequence_parallel=False)
    with pytest.raises(UserError, match="mlp.up_proj is a down projection by structure"):
        derive_tensor_parallel(TinyDecoder(("wq", "wk", "wv", "wo"), ("w1", "up_proj")), tokens,
                               sequence_parallel=False)


def test_check_divisible():
    _, model, inputs, _ = example("llama.py")  # 4 heads, 2 kv heads of 16, ffn 192, vocab 512
    tp = derive_tensor_parallel(model, inputs)
    check_divisible(model, tp, 2, seq_len=64)
    with pytest.raises(UserError, match="degree 4: layers.0.attention.wk holds attention heads of head_dim 16: "
                                        "heads 2, which 4 does not divide"):
        check_divisible(model, tp, 4)
    with pytest.raises(UserError, match="the sequence length 63 does not divide by 2"):
        check_divisible(model, tp, 2, seq_len=63)
    llama = llama_module()
    odd_vocab = llama.Transformer(64, 1, 4, 4, 192, 510)
    with pytest.raises(UserError, match="degree 4: tok_embeddings splits its vocabulary 510"):
        check_divisible(odd_vocab, derive_tensor_parallel(odd_vocab, inputs), 4)
    odd_ffn = llama.Transformer(64, 1, 4, 4, 190, 512)
    with pytest.raises(UserError, match="degree 4: layers.0.feed_forward.w1 splits its output features 190"):
        check_divisible(odd_ffn, derive_tensor_parallel(odd_ffn, inputs), 4)
    with pytest.raises(UserError, match="the degree must be positive"):
        check_divisible(model, tp, 0)


@pytest.fixture
def fake_world():
    """A fake process group of 4 ranks (collectives are no-ops), always destroyed after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def split_shape(full: torch.Size, style: Style | None, param: str, degree: int) -> tuple[int, ...]:
    """A parameter's local shape under its module's style ([Note: The tensor-parallel styles])."""
    shape = list(full)
    if style in (Style.COLWISE, Style.HEAD, Style.EMBEDDING):  # (out, in) or (vocab, dim): dim 0; colwise bias too
        shape[0] //= degree
    elif style is Style.ROWWISE and param == "weight":  # bias replicated
        shape[1] //= degree
    return tuple(shape)


def run_split(model, tp, mesh_shape, run_step) -> None:
    """parallelize_module with the derived plan, one forward + backward, every local shape as the style says."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from shard_planner.execute.tensor_parallel import torch_tp_plan

    full = {name: p.shape for name, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("shard", "tp"))
    parallelize_module(model, mesh["tp"], torch_tp_plan(tp))
    run_step(model)
    styles = tp.styles_by_fqn
    for name, p in model.named_parameters():
        fqn, _, param = name.rpartition(".")
        style = styles[fqn].style if fqn in styles else None
        local = p.to_local() if isinstance(p, DTensor) else p
        assert tuple(local.shape) == split_shape(full[name], style, param, mesh_shape[1]), name
        assert p.grad is not None, name
    assert isinstance(model.get_submodule(tp.head_fqn).weight, DTensor)


def lm_step(loss_parallel: bool, inputs: tuple, targets):
    """A language model's step: cross-entropy of its logits, under loss_parallel() where the head keeps them split."""
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    def step(model):
        with loss_parallel_context() if loss_parallel else nullcontext():
            logits = model(*inputs)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    return step


@pytest.mark.parametrize("sequence_parallel, loss_parallel", [(True, True), (False, False), (True, False)])
def test_llama_example_runs_split(fake_world, sequence_parallel, loss_parallel):
    _, model, inputs, targets = example("llama.py")
    tp = derive_tensor_parallel(model, inputs, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    check_divisible(model, tp, 2, seq_len=inputs[0].shape[1])
    run_split(model, tp, (2, 2), lm_step(loss_parallel, inputs, targets))


def test_llama_runs_split_four_ways(fake_world):
    model = llama_module().Transformer(64, 2, 4, 4, 192, 512)  # 4 kv heads: tp 4 divides them
    tokens = torch.randint(0, 512, (2, 16))
    tp = derive_tensor_parallel(model, (tokens,))
    check_divisible(model, tp, 4, seq_len=16)
    run_split(model, tp, (1, 4), lm_step(True, (tokens,), tokens))


@pytest.mark.parametrize("kind", ["Llama", "Qwen2"])
def test_transformers_plan_runs_split(fake_world, kind):
    from torch.distributed.tensor.parallel import loss_parallel

    model = hf_model(kind)
    batch = hf_batch()
    tp = derive_tensor_parallel(model, batch, sequence_parallel=False, hf_tp_plan=hf.tp_plan(model))
    check_divisible(model, tp, 2)

    def step(m):
        with loss_parallel():  # the model's own loss over the vocabulary shards
            m(**batch).loss.backward()

    run_split(model, tp, (2, 2), step)


def test_transformers_fail_under_sequence_parallelism(fake_world):
    """Why derive_tensor_parallel refuses sequence parallelism for a transformers plan: the decoder computes
    position ids from the embedding output's (local) length, and attention fails on the rotary tables.
    If transformers stops doing so, this fails: lift the refusal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from shard_planner.execute.tensor_parallel import torch_tp_plan
    from shard_planner.parallel.tensor_parallel import TensorParallel
    from shard_planner.trace.tp_styles import _hf_styles, _with_sequence_parallel, trace_calls

    model, batch = hf_model("Llama"), hf_batch()
    skip_without_embedding_style(hf.tp_plan(model))
    styles = _with_sequence_parallel(model, trace_calls(model, batch), _hf_styles(model, hf.tp_plan(model)))
    assert styles["model.layers.0.self_attn"] == "gather_input:hidden_states" and styles["model.norm"] == "norm"
    tp = TensorParallel(styles=styles, sequence_parallel=True, loss_parallel=False)
    parallelize_module(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))["tp"],
                       torch_tp_plan(tp))
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        model(**batch)


def test_a_transformers_plan_on_tied_embeddings_is_refused(tmp_path):
    """Gemma ties its output layer to the embedding: its transformers plan styles both, which would split the one
    weight twice (the trace's logits then covered half the vocabulary); refused as the structure's path refuses."""
    pytest.importorskip("transformers")
    import json

    from shard_planner.model.hf import HfOptions
    from shard_planner.trace.tp_degrees import degree_styles

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="gemma", architectures=["GemmaForCausalLM"], vocab_size=256,
                                      hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, use_cache=False)))
    found = degree_styles(load_model_file(str(config), HfOptions(seq_len=16)), [2], sequence_parallel=False,
                          loss_parallel=False)
    assert not found.styles
    assert [o.refused for o in found.refused] == [
        "tensor parallelism: lm_head.weight is model.embed_tokens.weight (tied embeddings); each style would "
        "distribute it on its own, untying them; untie them or plan without tp"]
