"""Exports: FSDP2 code that runs and shards exactly like apply_plan; Accelerate YAML, torchtitan TOML and
DeepSpeed JSON that parse, hold the expected keys, and say what they cannot express."""

import json
from dataclasses import replace


import pytest

from tests.models.report_fixtures import make_plan, make_trace
from shard_planner.cli.main import main
from shard_planner.errors import PlanError, UserError
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit, save_plan
from shard_planner.report.export import TARGETS, export_plan, model_info_for_plan, model_info_from_trace
from shard_planner.report.export.common import split_number, uniform_reshard
from shard_planner.report.export.deepspeed import derive_zero3
from shard_planner.trace.structure import model_fingerprint

GPT2 = "examples/gpt2.py"


# Plans name their model file relative to the repository root (examples/...), as the CLI is run.
pytestmark = pytest.mark.usefixtures("in_repository_root")


def gpt2_plan(units, prefetch=Prefetch(2, 2), world=8, **training) -> Plan:
    fp = model_fingerprint(load_model_file(GPT2).build())
    return Plan(ModelRef(GPT2, fp, 64), Cluster(world, 8, "h100-80gb", 16 * 2**30), Mesh(world),
                Training(micro_batch=2, **training), tuple(units), prefetch)


def parse_yaml(text: str) -> dict:
    """The Accelerate config as Accelerate reads it (PyYAML's safe_load, accelerate/commands/config/config_args.py)."""
    import yaml

    return yaml.safe_load(text)


# ---- fsdp2 ----

@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_fsdp2_export_shards_like_apply_plan(fake_world):
    """Grouped units, an int reshard (2 of 8), no reshard, checkpointing, a nested unit, prefetch depth 2,
    CPU offload, bf16 mixed precision."""
    import torch

    from shard_planner.execute.apply import apply_plan, describe_sharding

    plan = gpt2_plan([
        Unit(("",), reshard_after_forward=False),
        Unit(("blocks.0", "blocks.1"), reshard_after_forward=2, activation_checkpoint=True),
        Unit(("blocks.2",), reshard_after_forward=False),
        Unit(("blocks.3",), activation_checkpoint=True),
        Unit(("blocks.3.mlp",)),
    ], cpu_offload=True)
    mf = load_model_file(GPT2)
    reference = describe_sharding(apply_plan(mf.build(), plan, fake_world))

    source = export_plan(plan, "fsdp2").text
    assert "shard_planner" not in source.split('"""', 2)[2], "the exported code must not import shard-planner"
    namespace: dict = {}
    exec(compile(source, "apply_sharding.py", "exec"), namespace)
    model = namespace["apply_sharding"](mf.build(), fake_world)
    exported = describe_sharding(model)

    strip = lambda units: [(u.modules, u.reshard_after_forward, u.forward_prefetch, u.backward_prefetch) for u in units]
    assert strip(exported) == strip(reference)
    assert len(exported) == len(plan.units)
    checkpointed = {fqn for fqn, m in model.named_modules() if "forward" in vars(m)}
    assert checkpointed == {"blocks.0", "blocks.1", "blocks.3"}
    group = model.blocks[2]._get_fsdp_state()._fsdp_param_groups[0]
    assert type(group.offload_policy).__name__ == "CPUOffloadPolicy" and group.mp_policy.param_dtype == torch.bfloat16
    # It runs: one forward and backward under the fake process group.
    inputs, targets = mf.batch(2)
    mf.loss(model(*inputs), targets).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fsdp2_export_folds_runs_and_compiles():
    plan = make_plan(32, group=2, checkpoint_every=2)
    source = export_plan(plan, "fsdp2").text
    compile(source, "x.py", "exec")
    assert '*[([f"blocks.{i}", f"blocks.{i + 1}"], True, i // 2 % 2 == 0) for i in range(0, 32, 2)],' in source
    # 94: the 89 lines of a folded 32-block plan, and the allocator's setting's paragraph in the docstring
    assert len(source.splitlines()) < 94, "a 32-block plan must stay short"
    # The folded comprehension expands to exactly the plan's units.
    ns: dict = {}
    units_src = source[source.index("UNITS = ["):source.index("FORWARD_PREFETCH")]
    exec(units_src, ns)
    assert [(tuple(m), r, ac) for m, r, ac in ns["UNITS"]] == [
        (u.modules, u.reshard_after_forward, u.activation_checkpoint) for u in plan.units]


def test_fsdp2_export_usage_builds_the_plans_optimizer():
    plan = make_plan(2)
    source = export_plan(replace(plan, training=replace(plan.training, optimizer="sgd_momentum")), "fsdp2").text
    assert "torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)" in source


def test_fsdp2_export_irregular_units_stay_literal():
    plan = make_plan(5, checkpoint_every=0)
    plan = Plan(**{**plan.__dict__, "units": plan.units[:3] + (Unit(("blocks.1",), reshard_after_forward=False),)
                   + plan.units[4:]})
    source = export_plan(plan, "fsdp2").text
    ns: dict = {}
    exec(source[source.index("UNITS = ["):source.index("FORWARD_PREFETCH")], ns)
    assert [(tuple(m), r, ac) for m, r, ac in ns["UNITS"]] == [
        (u.modules, u.reshard_after_forward, u.activation_checkpoint) for u in plan.units]


def test_split_number():
    assert split_number("enc.layers.3.attn") == ("enc.layers.", 3, ".attn")
    assert split_number("blocks.12") == ("blocks.", 12, "")
    assert split_number("3") == ("", 3, "")
    assert split_number("lm_head") is None


# ---- accelerate ----

def test_accelerate_yaml_parses_with_expected_keys():
    plan = gpt2_plan([Unit(("",), False), *[Unit((f"blocks.{i}",), activation_checkpoint=True) for i in range(4)]],
                     prefetch=Prefetch(0, 1))
    export = export_plan(plan, "accelerate")
    config = parse_yaml(export.text)
    fsdp = config["fsdp_config"]
    assert config["distributed_type"] == "FSDP" and config["num_processes"] == 8
    assert config["mixed_precision"] == "bf16"
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert fsdp["fsdp_offload_params"] is False
    # Only the mixed-precision reduce dtype is worth a note for this plan.
    assert len(export.notes) == 1 and "reduces gradients in float32" in export.notes[0]


def test_accelerate_notes_what_it_cannot_express():
    plan = gpt2_plan([
        Unit(("",), False),
        Unit(("blocks.0", "blocks.1"), activation_checkpoint=True),
        Unit(("blocks.2",), reshard_after_forward=4),
        Unit(("blocks.3",), reshard_after_forward=False),
        Unit(("lm_head",)),  # a Linear: every Linear inside the blocks would be wrapped too
    ], prefetch=Prefetch(2, 2), reduce_dtype="bfloat16", cpu_offload=True)
    export = export_plan(plan, "accelerate")
    text = " ".join(export.notes)
    for expected in ("group several modules", "reshard to 4 ranks", "keeps 1 unit(s) gathered",
                     "checkpoints 1 of 3 wrapped units", "forward prefetch of 2", "backward prefetch of 2",
                     "lm_head (Linear)"):
        assert expected in text, expected
    config = parse_yaml(export.text)
    assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    assert config["fsdp_config"]["fsdp_reshard_after_forward"] is True  # nearest: least memory
    assert config["fsdp_config"]["fsdp_activation_checkpointing"] is True
    assert config["fsdp_config"]["fsdp_offload_params"] is True
    assert all(line.startswith("#") or len(line) <= 100 for line in export.text.splitlines())


def test_accelerate_hsdp_and_mixed_precision_words_parse():
    plan = make_plan(4, checkpoint_every=0)
    plan = Plan(**{**plan.__dict__, "mesh": Mesh(shard=4, replicate=2),
                   "training": Training(micro_batch=2, param_dtype="float32", reduce_dtype="float32")})
    config = parse_yaml(export_plan(plan, "accelerate", model_info_from_trace(make_trace(4))).text)
    assert config["mixed_precision"] == "no"  # quoted in the file: a plain `no` is a YAML boolean
    assert config["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                            "parallelism_config_dp_shard_size": 4}


def test_model_info_from_model_file_matches_trace():
    plan = gpt2_plan([Unit(("",), False), *[Unit((f"blocks.{i}",)) for i in range(4)]])
    info = model_info_for_plan(plan)
    model = load_model_file(GPT2).build()
    assert sum(m.param_count for m in info.modules) == sum(p.numel() for p in model.parameters())
    counts = info.unit_param_counts(plan)
    assert counts[1:] == [sum(p.numel() for p in model.blocks[i].parameters()) for i in range(4)]
    bad = Plan(**{**plan.__dict__, "model": ModelRef(GPT2, "0000000000000000", 64)})
    with pytest.raises(PlanError, match="fingerprint"):
        model_info_for_plan(bad)


# ---- torchtitan ----

def torchtitan_settings(text: str) -> dict:
    """The plan's settings in a torchtitan export (a Python module; it imports torchtitan only when its
    config function runs): PARALLELISM, TRAINING, ACTIVATION_CHECKPOINT, OPTIMIZER."""
    namespace: dict = {}
    exec(compile(text, "shard_planner_torchtitan.py", "exec"), namespace)
    return {k: namespace[k] for k in ("PARALLELISM", "TRAINING", "ACTIVATION_CHECKPOINT", "OPTIMIZER")}


def test_torchtitan_module_holds_the_plans_settings():
    plan = make_plan(8, checkpoint_every=0)
    plan = replace(plan, training=replace(plan.training, lr=3e-4))
    export = export_plan(plan, "torchtitan")
    assert export.suffix == ".py" and "--module shard_planner_torchtitan --config shard_planner_plan" in export.text
    cfg = torchtitan_settings(export.text)
    assert cfg["PARALLELISM"] == {"data_parallel_shard_degree": 8, "data_parallel_replicate_degree": 1,
                                  "fsdp_reshard_after_forward": "always"}
    assert cfg["ACTIVATION_CHECKPOINT"] == "none"
    assert cfg["TRAINING"]["local_batch_size"] == 8 and cfg["TRAINING"]["seq_len"] == 1024
    assert "global_batch_size" not in cfg["TRAINING"]  # torchtitan's default: local x data-parallel degree
    assert cfg["TRAINING"]["mixed_precision_param"] == "bfloat16"
    assert cfg["OPTIMIZER"] == ("AdamW", {"lr": 3e-4})
    assert any("forward prefetch of 2" in n for n in export.notes)


@pytest.mark.parametrize("flags, expected, noted", [
    ([True] * 8, "full", False),
    ([False] * 8, "none", False),
    # torchtitan 0.3 has no every-k-th-block option (0.2's selective_ac_option = k is gone), and a pattern
    # it cannot say falls back to full checkpointing of every block: never less memory-safe than the plan
    ([False, True] * 4, "full", True),
    ([False, False, True] * 3, "full", True),
    ([True, False] * 4, "full", True),
    ([True, True, True, False, False, False, False, False], "full", True),
    ([True] * 26 + [False] * 6, "full", True),  # the 26 of 32: not every 2nd block (16 of 32)
])
def test_torchtitan_checkpoint_pattern(flags, expected, noted):
    base = make_plan(len(flags), checkpoint_every=0)
    units = [u if not u.modules[0].startswith("blocks.") else
             Unit(u.modules, u.reshard_after_forward, flags[int(u.modules[0].split(".")[1])]) for u in base.units]
    export = export_plan(Plan(**{**base.__dict__, "units": tuple(units)}), "torchtitan")
    assert torchtitan_settings(export.text)["ACTIVATION_CHECKPOINT"] == expected
    assert any("no every-k-th-block option" in n and "full checkpointing of every block" in n
               for n in export.notes) == noted


def test_torchtitan_module_compiles_for_any_model_path():
    plan = make_plan(4)
    for path in ['a"""b\\N{x}.py', "line\nbreak\u2028.py", "😀.py"]:
        text = export_plan(replace(plan, model=replace(plan.model, path=path)), "torchtitan").text
        assert torchtitan_settings(text)["PARALLELISM"]["data_parallel_shard_degree"] == 8


def test_uniform_reshard_picks_least_memory():
    plan = make_plan(4)
    assert uniform_reshard(plan)[0] is True and uniform_reshard(plan)[1]  # lm_head keeps its params: noted
    all_false = Plan(**{**plan.__dict__, "units": tuple(
        Unit(u.modules, False, u.activation_checkpoint) for u in plan.units)})
    assert uniform_reshard(all_false) == (False, [])


# ---- deepspeed ----

def test_deepspeed_json_derived_from_plan():
    trace = make_trace(6, block_params=1000)
    plan = make_plan(6, checkpoint_every=0)  # root(no reshard), wte 40M, 6 blocks x 1000, lm_head(no reshard, 0)
    plan = Plan(**{**plan.__dict__, "prefetch": Prefetch(forward=2, backward=1)})
    info = model_info_from_trace(trace)
    config = json.loads(export_plan(plan, "deepspeed", info).text)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold",
                "reduce_bucket_size"):
        assert isinstance(zero[key], int) and key in " ".join(config["_comment"])
    p = [40_000_000] + [1000] * 6 + [0]  # inner units in forward order
    assert zero["stage3_prefetch_bucket_size"] == 2000  # the 2 units after the running one (wte never follows)
    kept = 0 + 2048  # lm_head keeps its (no) params; the root owns ln_f (2048) and does not reshard
    assert zero["stage3_max_live_parameters"] == kept + 40_000_000 + 2000
    # ln_f (2048, the root's) is larger than a block's tensors (unknown sizes from this trace: at least 1
    # element), so it cannot stay whole without blocks staying whole too: nothing persists
    assert zero["stage3_param_persistence_threshold"] == 0
    assert zero["reduce_bucket_size"] == max(p)
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["gradient_clipping"] == 0.0
    assert config["bf16"] == {"enabled": True} and config["train_batch_size"] == 64
    assert config["optimizer"]["type"] == "AdamW"


def test_deepspeed_hpz_for_int_reshard():
    trace = make_trace(4, block_params=1000)
    plan = make_plan(4, checkpoint_every=0)
    units = tuple(u if u.is_root else Unit(u.modules, 4, False) for u in plan.units)
    zero, how = derive_zero3(Plan(**{**plan.__dict__, "units": units}), model_info_from_trace(trace))
    assert zero["zero_hpz_partition_size"] == 4 and zero["stage3_max_reuse_distance"] == 0


# ---- CLI ----

def test_export_cli_writes_and_notes(tmp_path, capsys):
    plan = gpt2_plan([Unit(("",), False), Unit(("blocks.0", "blocks.1")), Unit(("blocks.2",)), Unit(("blocks.3",))])
    save_plan(plan, tmp_path / "plan.json")
    for target in TARGETS:
        out = tmp_path / f"out-{target}"
        assert main(["export", str(tmp_path / "plan.json"), "--to", target, "-o", str(out)]) == 0
        assert out.read_text()
    captured = capsys.readouterr()
    assert "cannot be expressed exactly" in captured.err and "group several modules" in captured.err
    json.loads((tmp_path / "out-deepspeed").read_text())
    torchtitan_settings((tmp_path / "out-torchtitan").read_text())
    parse_yaml((tmp_path / "out-accelerate").read_text())
    compile((tmp_path / "out-fsdp2").read_text(), "x.py", "exec")
    assert main(["export", str(tmp_path / "plan.json"), "--to", "fsdp2"]) == 0
    assert "def apply_sharding(model" in capsys.readouterr().out


def test_export_cli_bad_input(tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing.json"), "--to", "fsdp2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shard-planner: error:") and "no such plan file" in err and len(err.splitlines()) == 1
    with pytest.raises(UserError, match="cannot export"):
        export_plan(make_plan(2), "megatron")


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_fsdp2_export_keeps_0d_parameters_out_of_sharding(fake_world):
    """A model with 0-d parameters (CLIP's logit_scale): the exported apply_sharding passes them as
    ignored_params, as apply_plan does, so fully_shard does not fail and they stay plain tensors."""
    import warnings

    from torch.distributed.tensor import DTensor

    from shard_planner.execute.apply import apply_plan, describe_sharding
    from tests.execute.test_run import make_plan as exec_plan

    model_path = "tests/models/exec_scalar.py"
    plan = exec_plan([Unit(("",), True), *(Unit((f"blocks.{i}",), True) for i in range(4))], 8, model=model_path)
    mf = load_model_file(model_path)
    reference = describe_sharding(apply_plan(mf.build(), plan, fake_world))
    namespace: dict = {}
    exec(compile(export_plan(plan, "fsdp2").text, "apply_sharding.py", "exec"), namespace)
    model = namespace["apply_sharding"](mf.build(), fake_world)
    assert [(u.modules, u.reshard_after_forward) for u in describe_sharding(model)] == \
        [(u.modules, u.reshard_after_forward) for u in reference]
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) != (p.dim() == 0), name
    inputs, targets = mf.batch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mf.loss(model(*inputs), targets).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("path", ["C:\\new\\N{x}\\models\\llama.py", 'a"""b.py', "a'''b.py", "line\nbreak.py",
                                  "ünï 😀.py", "back\\", "surrogate-\udcff.py", "#{$model_path}.py"])
def test_fsdp2_export_compiles_for_any_model_path(path):
    """The model path is written as a Python literal (MODEL_PATH), never into the docstring, so any path
    gives a file that compiles and names the path exactly."""
    plan = make_plan(4)
    plan = replace(plan, model=replace(plan.model, path=path))
    namespace: dict = {}
    exec(compile(export_plan(plan, "fsdp2").text, "apply_sharding.py", "exec"), namespace)
    assert namespace["MODEL_PATH"] == path


def test_fsdp2_export_module_names_that_need_quoting():
    """Module names holding quotes, braces or backslashes (a ModuleDict key can) stay literal and exact."""
    plan = make_plan(4)
    odd = ['blocks.0.{x}', 'blocks.1."q"', "blocks.2.\\N", "blocks.3.'s"]
    units = (plan.units[0], *(Unit((name,)) for name in odd))
    source = export_plan(replace(plan, units=units), "fsdp2").text
    ns: dict = {}
    exec(source[source.index("UNITS = ["):source.index("FORWARD_PREFETCH")], ns)
    assert [m for names, _, _ in ns["UNITS"] for m in names] == ["", *odd]


def test_deepspeed_persistence_keeps_only_root_tensors_below_every_unit_tensor():
    """DeepSpeed keeps whole every TENSOR of at most stage3_param_persistence_threshold elements: the
    threshold lies below the smallest tensor the plan's units own (GPT-2's blocks: LayerNorm weights of
    n_embd), and covers the root's smaller tensors only; 0 when the root reshards."""
    import torch

    plan = gpt2_plan([Unit(("",), False), *[Unit((f"blocks.{i}",)) for i in range(4)]])
    model = load_model_file(GPT2).build()
    info = model_info_for_plan(plan)
    zero, how = derive_zero3(plan, info)
    block_tensors = [p.numel() for i in range(4) for p in model.blocks[i].parameters()]
    threshold = zero["stage3_param_persistence_threshold"]
    assert threshold < min(block_tensors)
    root_tensors = [p.numel() for n, p in model.named_parameters() if not n.startswith("blocks.")]
    assert threshold == max([n for n in root_tensors if n < min(block_tensors)], default=0)
    assert any("persistence" in line and "smaller than every tensor" in line or "0: no tensor" in line for line in how)
    resharding_root = replace(plan, units=(Unit(("",), True), *plan.units[1:]))
    assert derive_zero3(resharding_root, info)[0]["stage3_param_persistence_threshold"] == 0
    # a root-owned tensor smaller than every block tensor is the threshold
    tiny = torch.nn.Module()
    tiny.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
    tiny.scale = torch.nn.Parameter(torch.ones(3))
    tiny.head = torch.nn.Linear(8, 100)
    from shard_planner.report.export import model_info_from_model

    tiny_plan = replace(plan, units=(Unit(("",), False), Unit(("blocks.0",)), Unit(("blocks.1",))))
    assert derive_zero3(tiny_plan, model_info_from_model(tiny))[0]["stage3_param_persistence_threshold"] == 3


@pytest.mark.parametrize("optimizer, cls, extra", [
    ("adamw", "AdamW", {"betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01}),
    ("adam", "Adam", {"betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0}),
    ("sgd_momentum", "SGD", {"momentum": 0.9}),
])
def test_deepspeed_optimizer_is_the_plans(optimizer, cls, extra):
    """The plan's optimizer and lr, with torch's defaults written out (DeepSpeed's own Adam would default
    weight_decay to 0.0); SGD is allowed under ZeRO explicitly."""
    plan = make_plan(4, checkpoint_every=0)
    plan = replace(plan, training=replace(plan.training, optimizer=optimizer, lr=3e-4))
    config = json.loads(export_plan(plan, "deepspeed", model_info_from_trace(make_trace(4))).text)
    assert config["optimizer"] == {"type": cls, "params": {"lr": 3e-4, **extra}}
    assert config.get("zero_allow_untested_optimizer", False) == (cls == "SGD")


def test_accelerate_says_what_it_reduces_in_and_how_to_run_the_plan():
    """Accelerate's config cannot hold a reduce dtype: the note says Accelerate reduces in bf16, that the
    plan was priced for fp32, and gives the plugin call; sync_module_states accompanies cpu_ram_efficient
    loading (accelerate launch refuses one without the other); the header names the plan's optimizer."""
    plan = gpt2_plan([Unit(("",), False), *[Unit((f"blocks.{i}",)) for i in range(4)]], lr=3e-4)
    export = export_plan(plan, "accelerate")
    note = next(n for n in export.notes if "reduce" in n)
    assert "Accelerate reduce-scatters them in bfloat16" in note and "priced for float32" in note
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in note
    fsdp = parse_yaml(export.text)["fsdp_config"]
    assert fsdp["fsdp_cpu_ram_efficient_loading"] is True and fsdp["fsdp_sync_module_states"] is True
    assert "torch.optim.AdamW(model.parameters(), lr=0.0003)" in export.text
    same = gpt2_plan(list(plan.units), reduce_dtype="bfloat16")
    assert not any("reduce" in n for n in export_plan(same, "accelerate").notes)


def test_every_export_carries_the_plans_lr():
    plan = gpt2_plan([Unit(("",), False), *[Unit((f"blocks.{i}",)) for i in range(4)]], lr=3e-4)
    exports = {t: export_plan(plan, t) for t in TARGETS}
    assert "torch.optim.AdamW(model.parameters(), lr=0.0003)" in exports["fsdp2"].text
    assert "torch.optim.AdamW(model.parameters(), lr=0.0003)" in exports["accelerate"].text
    assert json.loads(exports["deepspeed"].text)["optimizer"]["params"]["lr"] == 3e-4
    assert torchtitan_settings(exports["torchtitan"].text)["OPTIMIZER"] == ("AdamW", {"lr": 3e-4})
