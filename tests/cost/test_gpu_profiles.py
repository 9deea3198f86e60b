"""The GPU profiles added for the cards people fine-tune on (issue 36 item 15): RTX 4090, RTX 3090, RTX A6000,
A10G, L40S, V100 SXM2 32GB, B200. Each loads, cites a source for every number, is internally consistent
(its peak rate follows from its SMs, tensor rate per SM and clock; no fp8 on cards without it; a PCIe-only card's
ring never beats its PCIe link) and plans a small model. A V100 refuses a bfloat16 plan in one line
(shard_planner/hardware/profile.py [Note: A compute dtype the device lacks]). docs/profiles.md lists every shipped profile."""

import re

import pytest

from shard_planner.cost.kernels import kernel_constants
from shard_planner.errors import ProfileError
from shard_planner.hardware.profile import PROFILES_DIR, load_profile
from shard_planner.solve import PlanRequest, plan_model

GIB = 2**30
# name: (marketed memory in GB = GiB as the datasheets mean it, boost clock in GHz from the vendor's table, and
# whether the card has NVLink between all GPUs of its node). The clocks are the ones each profile's comments cite.
CARDS = {
    "rtx-4090": (24, 2.52, False),   # Ada whitepaper v2.01, Appendix A
    "rtx-3090": (24, 1.695, False),  # GA102 whitepaper v2.0, Appendix A
    "rtx-a6000": (48, 1.80, False),  # GA102 whitepaper v2.0, Appendix C
    "a10g": (24, 1.71, False),       # no vendor datasheet: its rate is derived from this clock (an arithmetic check)
    "l40s": (48, 2.52, False),       # L40S datasheet (its 362 TFLOP/s implies ~2.49 GHz: within the tolerance)
    "v100-32gb": (32, 1.53, True),   # V100 datasheet (SXM2), DGX-1 NVLink2
    "b200": (180, None, True),       # no per-clock figure published: tensor_flop_per_clk_per_sm is an estimate
}
NO_FP8 = ("rtx-3090", "rtx-a6000", "a10g", "v100-32gb")  # Volta and Ampere have no FP8 tensor cores
PCIE4_LINE_BYTES_PER_S = 32e9  # PCIe Gen4 x16, one direction
NUMBER_LINE = re.compile(r"\s*[a-z_0-9]+\s*=\s*[0-9.e+-]+\s*(#.*)?$")


@pytest.mark.parametrize("name", CARDS)
def test_profile_loads_and_every_number_cites_its_source(name):
    p = load_profile(name)
    assert p.name == name and p.device == "cuda" and p.compute_model == "flops"
    assert 0 < p.compute_efficiency <= 1 and 0 < p.usable_fraction <= 1
    assert p.reserved_bytes > 0 and p.per_process_group_bytes > 0
    assert p.per_op_overhead_s < p.per_unit_overhead_s and p.per_param_tensor_optimizer_overhead_s > 0
    for line in (PROFILES_DIR / f"{name}.toml").read_text().splitlines():
        if NUMBER_LINE.match(line):
            assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, f"{name}: no source for: {line}"


@pytest.mark.parametrize("name", CARDS)
def test_memory_is_what_nvidia_smi_shows_of_the_marketed_size(name):
    marketed_gib, _, _ = CARDS[name]
    p = load_profile(name)
    assert 0.93 * marketed_gib * GIB < p.memory_bytes <= marketed_gib * GIB
    assert p.memory_bytes % 2**20 == 0  # nvidia-smi's MiB


@pytest.mark.parametrize("name", CARDS)
def test_peak_rates_are_dense_and_consistent(name):
    _, clock_ghz, _ = CARDS[name]
    p = load_profile(name)
    rates = p.peak_flops_per_s
    half = rates.get("bfloat16", rates["float16"])
    assert rates["float16"] == half  # FP16 and BF16 tensor cores run at one rate on every card here
    assert rates["float32"] < half  # non-tensor FP32 below the 16-bit tensor rate
    kc = kernel_constants(p, "float16")
    if clock_ghz is not None:  # SMs x tensor FLOP per clock x boost clock = the datasheet's dense rate
        assert kc.sm_count * kc.tensor_flop_per_clk_per_sm * clock_ghz * 1e9 == pytest.approx(half, rel=0.015)
    if name in NO_FP8:
        assert not any(d.startswith("float8") for d in rates)
    else:  # Ada and Blackwell: FP8 at twice the 16-bit rate (FP32 accumulate), dense; the L40S datasheet's own
        # figures differ by 1.2% (BF16 362.05 dense but 733 sparse, FP8 733 dense)
        assert rates["float8_e4m3fn"] == pytest.approx(2 * half, rel=0.015)


@pytest.mark.parametrize("name", CARDS)
def test_interconnect_is_honest(name):
    _, _, nvlink = CARDS[name]
    ic = load_profile(name).interconnect
    assert ic.gpus_per_node == 8
    assert ic.intra_node_busbw_bytes_per_s >= ic.inter_node_busbw_bytes_per_s > 0  # a ring across nodes crosses both
    if not nvlink:  # a PCIe-only ring cannot beat one direction of the card's PCIe link, nor its latency NVLink's
        assert ic.intra_node_busbw_bytes_per_s < PCIE4_LINE_BYTES_PER_S
        assert ic.intra_node_latency_s > load_profile("a100-80gb").interconnect.intra_node_latency_s
    assert load_profile(name).host_to_device_bytes_per_s <= 64e9  # PCIe Gen5 x16 at most


def test_v100_has_no_bfloat16_and_refuses_it_in_one_line():
    v100 = load_profile("v100-32gb")
    assert "bfloat16" not in v100.peak_flops_per_s and v100.flops_per_s("float16") > 0
    with pytest.raises(ProfileError) as exc:
        v100.flops_per_s("bfloat16")
    text = str(exc.value)
    assert "\n" not in text and "--dtype fp16 or fp32" in text and "v100-32gb" in text


@pytest.mark.parametrize("name", CARDS)
def test_plans_a_small_model(name, synth):
    """The synthetic 8-layer transformer (hidden 1024) on 2 GPUs of each card, at a quarter of the card's memory:
    a plan that fits, priced by the profile."""
    p = load_profile(name)
    dtype = "bfloat16" if "bfloat16" in p.peak_flops_per_s else "float16"
    budget = p.memory_bytes // 4
    result = plan_model(synth, PlanRequest(gpus=2, mem_budget_bytes=budget, profile=p, param_dtype=dtype,
                                           frontier_points=2, time_limit_s=5.0))
    plan = result.plan
    assert plan.predicted.peak_bytes <= budget and plan.predicted.step_time_s > 0
    assert plan.training.param_dtype == dtype


def test_faster_card_plans_a_faster_step(synth):
    """The same plan request prices a B200 step below an RTX 3090's (2.25 PFLOP/s and NVLink against 71 TFLOP/s
    over PCIe): the profiles are read, not a default."""
    def step_s(name):
        req = PlanRequest(gpus=2, mem_budget_bytes=20 * GIB, profile=load_profile(name), micro_batch=4,
                          frontier_points=2, time_limit_s=5.0)
        return plan_model(synth, req).plan.predicted.step_time_s

    assert step_s("b200") < step_s("rtx-4090") < step_s("rtx-3090")


def test_plan_command_refuses_bfloat16_on_a_v100_before_tracing(tmp_path, capsys, in_repository_root):
    from shard_planner.cli.main import main

    out = tmp_path / "plan.json"
    code = main(["plan", "examples/llama.py", "--profile", "v100-32gb", "--gpus", "2", "--mem", "32GB", "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and not out.exists()
    assert len(err) == 1 and "no bfloat16 compute rate" in err[0] and "--dtype fp16" in err[0]


def test_docs_list_every_shipped_profile():
    """docs/profiles.md's table names every file in profiles/ (a profile added without a line there fails)."""
    from tests.paths import REPO

    text = (REPO / "docs" / "profiles.md").read_text()
    missing = [p.stem for p in PROFILES_DIR.glob("*.toml") if f"`{p.stem}`" not in text]
    assert not missing, f"docs/profiles.md does not list: {', '.join(missing)}"
