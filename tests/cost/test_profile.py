"""Hardware profiles: every shipped profile loads, is sane and cites a source for every number;
bad names and files give one clear ProfileError; calibrate's fit and its TOML round-trip."""

import re

import pytest

from shard_planner.errors import ProfileError
from shard_planner.hardware.profile import PROFILES_DIR, load_profile

SHIPPED = ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "l4", "mi300x", "cpu-gloo")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_and_is_sane(name):
    p = load_profile(name)
    assert p.name == name
    assert p.device in ("cuda", "cpu")
    assert p.memory_bytes > 2**30 and 0 < p.usable_fraction <= 1
    assert p.flops_per_s("bfloat16") > 0 and p.flops_per_s("float32") > 0
    assert 0 < p.compute_efficiency <= 1
    ic = p.interconnect
    assert ic.gpus_per_node >= 1
    assert ic.intra_node_busbw_bytes_per_s >= ic.inter_node_busbw_bytes_per_s > 0
    if p.device == "cuda":
        assert ic.gpus_per_node == 8
        assert p.reserved_bytes > 0 and p.per_process_group_bytes > 0


@pytest.mark.parametrize("name", SHIPPED)
def test_every_number_cites_its_source(name):
    for line in (PROFILES_DIR / f"{name}.toml").read_text().splitlines():
        if re.match(r"\s*[a-z_0-9]+\s*=\s*[0-9.e+-]+\s*(#.*)?$", line):
            assert "#" in line and len(line.split("#", 1)[1].strip()) > 5, f"{name}: no source for: {line}"


def test_gpu_figures_match_the_reference():
    """REFERENCE.md: datasheet HBM bandwidth and bf16 peak, nccl-tests busbw."""
    h100, h200, a100 = load_profile("h100-80gb"), load_profile("h200"), load_profile("a100-40gb")
    assert h100.peak_flops_per_s["bfloat16"] == 989e12 and h100.memory_bandwidth_bytes_per_s == 3.35e12
    assert h200.memory_bandwidth_bytes_per_s == 4.8e12 and h200.memory_bytes > h100.memory_bytes
    assert a100.peak_flops_per_s["bfloat16"] == 312e12 and a100.memory_bandwidth_bytes_per_s == 1.555e12
    assert h100.interconnect.intra_node_busbw_bytes_per_s == 3.7e11


def test_profile_by_path(tmp_path):
    text = (PROFILES_DIR / "h100-80gb.toml").read_text().replace('name = "h100-80gb"', 'name = "mine"')
    path = tmp_path / "mine.toml"
    path.write_text(text)
    assert load_profile(str(path)).name == "mine"


def test_unknown_profile_names_the_choices():
    with pytest.raises(ProfileError, match="h100-80gb") as exc:
        load_profile("h900")
    assert "\n" not in str(exc.value)


def test_malformed_profile(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ndevice = "cuda"\n[interconnect]\ngpus_per_node = 8\n')
    with pytest.raises(ProfileError, match="malformed"):
        load_profile(str(bad))
    bad.write_text("name = \n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(str(bad))


def test_missing_dtype_is_a_profile_error():
    with pytest.raises(ProfileError, match="float64"):
        load_profile("h100-80gb").flops_per_s("float64")


def test_ring_fit_recovers_alpha_and_busbw():
    from shard_planner.execute.calibrate import fit_ring

    for p in (2, 4, 8):
        alpha, busbw = 2e-5, 3e9
        samples = [(b, alpha * (p - 1) + (p - 1) / p * b / busbw) for b in (2**16, 2**20, 2**24)]
        fit = fit_ring(samples, p)
        assert fit.latency_s == pytest.approx(alpha, rel=1e-6)
        assert fit.busbw_bytes_per_s == pytest.approx(busbw, rel=1e-6)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_have_framework_overheads(name):
    p = load_profile(name)
    # per op: microseconds (GPU launch ~5 us, CPU dispatcher + autograd tens of us); per FSDP unit more
    assert 1e-7 < p.per_op_overhead_s < 1e-3
    assert p.per_op_overhead_s < p.per_unit_overhead_s < 0.1
    assert 0 < p.per_param_tensor_optimizer_overhead_s < 0.01


def test_profile_without_overheads_loads_with_zero(tmp_path):
    text = "\n".join(line for line in (PROFILES_DIR / "h100-80gb.toml").read_text().splitlines()
                     if "overhead_s" not in line)
    path = tmp_path / "old.toml"
    path.write_text(text)
    p = load_profile(str(path))
    assert p.per_op_overhead_s == p.per_unit_overhead_s == p.per_param_tensor_optimizer_overhead_s == 0.0


def test_overheads_from_samples_subtract_the_units_collectives():
    from shard_planner.execute.calibrate import OVERHEAD_LAYERS, OVERHEAD_UNITS, OVERHEAD_WIDTH, overheads_from

    p, alpha, busbw, per_unit, base = 2, 1e-4, 1e9, 3e-3, 0.02
    unit_bytes = OVERHEAD_LAYERS // OVERHEAD_UNITS[-1] * (OVERHEAD_WIDTH + 1) * OVERHEAD_WIDTH * 4
    comm = 3 * (alpha * (p - 1) + (p - 1) / p * unit_bytes / busbw)
    samples = {"unit_samples": tuple((u, base + u * (per_unit + comm)) for u in OVERHEAD_UNITS),
               "optimizer_samples": ((32, 32 * 2e-4),)}
    over = overheads_from(samples, (1e-5, 200, 2e-3), alpha, busbw, p)
    assert over.per_unit_s == pytest.approx(per_unit, rel=1e-9)
    assert over.unit_comm_s == pytest.approx(comm, rel=1e-12)
    assert over.per_tensor_s == pytest.approx(2e-4) and over.per_op_s == 1e-5
    assert over.per_plain_tensor_s is None  # samples without the plain tensors' step: not measured
    samples["optimizer_plain_samples"] = ((32, 32 * 2e-5),)
    assert overheads_from(samples, (1e-5, 200, 2e-3), alpha, busbw, p).per_plain_tensor_s == pytest.approx(2e-5)
    samples["unit_samples"] = tuple((u, base) for u in OVERHEAD_UNITS)  # flat: no overhead, clamped at 0
    assert overheads_from(samples, (1e-5, 200, 2e-3), alpha, busbw, p).per_unit_s == 0.0


def test_per_op_overhead_measurement_counts_ops():
    import torch

    from shard_planner.execute.calibrate import measure_per_op_overhead_s

    per_op, ops, step_s = measure_per_op_overhead_s(torch.device("cpu"), repeats=3)
    assert ops > 100 and per_op > 0 and per_op * ops == pytest.approx(step_s)


@pytest.mark.multiprocess
def test_calibrate_cli_writes_a_loadable_profile(tmp_path, capsys):
    from shard_planner.cli.main import main

    out = tmp_path / "local.toml"
    assert main(["calibrate", "--world-size", "2", "--device", "cpu", "-o", str(out)]) == 0
    p = load_profile(str(out))
    assert p.name == "local" and p.device == "cpu"
    assert p.flops_per_s("bfloat16") > 1e8 and p.memory_bandwidth_bytes_per_s > 1e8
    assert p.interconnect.intra_node_busbw_bytes_per_s > 1e6
    assert p.per_op_overhead_s > 0 and p.per_param_tensor_optimizer_overhead_s > 0
    assert p.per_unit_overhead_s >= 0  # clamped at 0 when the collectives explain the whole slope
    assert "wrote" in capsys.readouterr().out
    for line in out.read_text().splitlines():
        if re.match(r"[a-z_0-9]+\s*=\s*[0-9.e+-]+", line):
            assert "#" in line


def test_calibrate_cli_rejects_bad_arguments(capsys):
    from shard_planner.cli.main import main

    assert main(["calibrate", "--world-size", "1"]) != 0
    assert main(["calibrate", "-o", "profile.json"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("shard-planner: error:") for line in err)


def test_tensor_budget_keeps_the_margin_inside_mem():
    """--mem is device memory: the planner's search fills usable_fraction of it (of the device at most); on a
    GPU profile that is the allocator simulation's margin (cost/fits.py [Note: The margin on a GPU])."""
    p = load_profile("h100-80gb")
    gib = 2**30
    assert p.tensor_budget_bytes(40 * gib) == int(40 * gib * 0.947)
    assert p.tensor_budget_bytes(10**15) == p.usable_bytes  # capped by the device's memory
    assert p.usable_reason(40 * gib) == "--mem 40.00 GiB less the 5.3% margin of the allocator simulation"
    assert load_profile("cpu-gloo").usable_reason(2 * gib) == ("--mem 2.00 GiB less 20% kept free for the OS and "
                                                               "the ranks' processes")


def test_a_plain_tensors_optimizer_overhead_falls_back_to_a_sharded_ones(h100):
    from dataclasses import replace

    assert h100.plain_tensor_optimizer_overhead_s is None
    assert h100.plain_tensor_optimizer_s == h100.per_param_tensor_optimizer_overhead_s
    assert replace(h100, plain_tensor_optimizer_overhead_s=3e-6).plain_tensor_optimizer_s == 3e-6
    gloo = load_profile("cpu-gloo")  # measured: about a tenth of a DTensor's on CPU (cost/engines/single.py)
    assert gloo.plain_tensor_optimizer_s < gloo.per_param_tensor_optimizer_overhead_s / 5
    with pytest.raises(ProfileError, match="plain_tensor_optimizer_overhead_s"):
        replace(h100, plain_tensor_optimizer_overhead_s=-1.0)
