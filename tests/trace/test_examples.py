"""The example model files in examples/ follow the model-file contract and train at their tiny size.

Each file is loaded from its path (as the tool loads it); sizes are read from SHARD_PLANNER_SIZE when
build_model()/make_batch() are called, so tests set the variable with monkeypatch before calling.
"""

import importlib.util
import math
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.paths import EXAMPLES as EXAMPLES_DIR

EXAMPLES = ["gpt2", "llama", "vit", "encdec", "unet"]
SIZES = {
    "gpt2": ["tiny", "small", "medium", "large", "xl"],
    "llama": ["tiny", "1b", "8b", "70b", "405b"],
    "vit": ["tiny", "base", "large"],
    "encdec": ["tiny", "base"],
    "unet": ["tiny", "base"],
}


def load(name: str):
    path = EXAMPLES_DIR / f"{name}.py"
    module_name = f"_shard_planner_example_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def as_tuple(inputs):
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", EXAMPLES)
def test_contract_attributes(name):
    mod = load(name)
    assert callable(mod.build_model) and callable(mod.make_batch) and callable(mod.loss_fn)
    assert mod.__doc__ and "SHARD_PLANNER_SIZE" in mod.__doc__
    training = mod.TRAINING
    assert set(training) <= {"micro_batch", "seq_len", "optimizer", "lr"}
    assert isinstance(training["micro_batch"], int) and training["micro_batch"] > 0
    assert training["optimizer"] in ("adamw", "adam", "sgd")
    assert isinstance(training["lr"], float) and training["lr"] > 0
    if name in ("gpt2", "llama", "encdec"):
        inputs, targets = mod.make_batch(1)
        assert training["seq_len"] == targets.shape[-1]
    else:
        assert "seq_len" not in training


@pytest.mark.parametrize("name", EXAMPLES)
def test_forward_backward_tiny_cpu(name):
    mod = load(name)
    torch.manual_seed(0)
    model = mod.build_model()
    assert 50_000 <= n_params(model) <= 5_000_000  # small enough to train on CPU
    inputs, targets = mod.make_batch(2)
    inputs = as_tuple(inputs)
    assert inputs[0].shape[0] == 2 and targets.shape[0] == 2
    loss = mod.loss_fn(model(*inputs), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: no gradient for {pname}"
            assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_adamw_reduces_loss_on_fixed_batch(name):
    mod = load(name)
    torch.manual_seed(0)
    model = mod.build_model()
    inputs, targets = mod.make_batch(4)
    inputs = as_tuple(inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=mod.TRAINING["lr"])
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = mod.loss_fn(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], f"{name}: loss did not fall: {losses}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_meta_device(name):
    mod = load(name)
    with torch.device("meta"):
        model = mod.build_model()
        inputs, targets = mod.make_batch(2)
        inputs = as_tuple(inputs)
        loss = mod.loss_fn(model(*inputs), targets)
        loss.backward()
    assert all(p.is_meta for p in model.parameters())
    assert loss.is_meta and loss.dim() == 0
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", EXAMPLES)
def test_fake_tensor_mode(name):
    mod = load(name)
    with FakeTensorMode() as mode:
        model = mod.build_model()
        inputs, targets = mod.make_batch(2)
        inputs = as_tuple(inputs)
        out = model(*inputs)
        loss = mod.loss_fn(out, targets)
        loss.backward()
    assert loss.dim() == 0
    assert all(mode.is_our_fake(p) for p in model.parameters())  # not real storage
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_size_builds_on_meta(name, monkeypatch):
    mod = load(name)
    counts = []
    for size in SIZES[name]:
        monkeypatch.setenv("SHARD_PLANNER_SIZE", size)
        with torch.device("meta"):
            counts.append(n_params(mod.build_model()))
    assert counts == sorted(counts) and len(set(counts)) == len(counts)  # sizes grow
    monkeypatch.setenv("SHARD_PLANNER_SIZE", "no-such-size")
    with pytest.raises(ValueError, match="SHARD_PLANNER_SIZE"):
        mod.build_model()


# Published parameter counts (untied output for Llama; tied lm_head for GPT-2; timm ViT; U-Net paper).
KNOWN_PARAMS = [
    ("llama", "8b", 8_030_261_248),  # Llama 3 8B
    ("llama", "70b", 70_553_706_496),  # Llama 3 70B
    ("llama", "405b", 405_853_388_800),  # Llama 3.1 405B
    ("llama", "2-13b", 13_015_864_320),  # Llama 2 13B
    ("llama", "2-70b", 68_976_648_192),  # Llama 2 70B
    ("gpt2", "small", 124_439_808),  # GPT-2 124M (HF count, incl. position embedding)
    ("gpt2", "xl", 1_557_611_200),  # GPT-2 XL
    ("vit", "base", 86_567_656),  # ViT-B/16, 1000 classes
    ("vit", "large", 304_326_632),  # ViT-L/16, 1000 classes
]


@pytest.mark.parametrize("name,size,expected", KNOWN_PARAMS)
def test_known_param_counts(name, size, expected, monkeypatch):
    mod = load(name)
    monkeypatch.setenv("SHARD_PLANNER_SIZE", size)
    with torch.device("meta"):
        model = mod.build_model()
    assert n_params(model) == expected


def test_llama_70b_fake_forward_backward_is_quick(monkeypatch):
    """A 70B-shaped Llama traces forward+backward under FakeTensorMode (short sequence, batch 1)."""
    mod = load("llama")
    monkeypatch.setenv("SHARD_PLANNER_SIZE", "70b")
    monkeypatch.setenv("SHARD_PLANNER_SEQ", "16")
    with FakeTensorMode():
        model = mod.build_model()
        inputs, targets = mod.make_batch(1)
        out = model(inputs)
        mod.loss_fn(out, targets).backward()
    assert out.shape == (1, 16, 128256)


def test_seq_override(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_SEQ", "32")
    for name in ("gpt2", "llama", "encdec"):
        mod = load(name)
        assert mod.TRAINING["seq_len"] == 32
        inputs, targets = mod.make_batch(3)
        assert as_tuple(inputs)[-1].shape == (3, 32) and targets.shape == (3, 32)
    monkeypatch.setenv("SHARD_PLANNER_SEQ", "65")  # beyond the tiny GPT-2 context of 64
    with pytest.raises(ValueError, match="SHARD_PLANNER_SEQ"):
        load("gpt2").make_batch(1)


def test_weight_tying():
    gpt = load("gpt2").build_model()
    assert gpt.lm_head.weight is gpt.wte.weight
    encdec = load("encdec").build_model()
    assert encdec.lm_head.weight is encdec.shared.weight
    llama = load("llama").build_model()
    assert llama.output.weight is not llama.tok_embeddings.weight


def test_stable_module_names():
    """FSDP units are chosen by fully-qualified name: the names the planner will see."""
    names = {n: {m for m, _ in load(n).build_model().named_modules()} for n in EXAMPLES}
    assert {"wte", "wpe", "blocks.0", "blocks.3.attn", "blocks.3.mlp", "ln_f", "lm_head"} <= names["gpt2"]
    assert {"tok_embeddings", "layers.0", "layers.1.attention", "layers.1.feed_forward.w3", "norm", "output"} <= names[
        "llama"
    ]
    assert {"patch_embed.proj", "blocks.0", "blocks.3", "norm", "head"} <= names["vit"]
    assert {"shared", "encoder.layers.1", "decoder.layers.1.cross_attn", "encoder.norm", "lm_head"} <= names["encdec"]
    assert {"inc", "downs.0", "downs.1", "bottleneck", "ups.0", "ups.2", "outc"} <= names["unet"]


def test_unet_stages_differ_in_size():
    model = load("unet").build_model()
    sizes = [n_params(m) for m in [model.inc, *model.downs, model.bottleneck, *model.ups, model.outc]]
    assert max(sizes) > 50 * min(sizes)
    out = model(load("unet").make_batch(1)[0])
    assert out.shape == (1, 4, 32, 32)
