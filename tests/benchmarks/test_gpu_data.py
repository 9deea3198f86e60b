"""The H200 measurements of benchmarks/data/h200_2026-12-04 as gpu_kernels.py and gpu_shapes.py read them:
the h200 profile's measured [kernels] constants are what the kernel sweep implies through the closed forms
of `calibrate` (so a change to the kernel model or the profile that breaks that shows here), and every
measured run has its plan and shape."""

import json

import gpu_kernels  # noqa: E402
import pytest

from shard_planner.plan.measurement import load_measurement
from shard_planner.plan import load_plan
from shard_planner.hardware.profile import load_profile
from tests.paths import REPO

DATA = REPO / "benchmarks" / "data" / "h200_2026-12-04"


@pytest.mark.parametrize("sweep", ["kernels_warm.json", "kernels.json"])
def test_h200_profile_holds_the_constants_its_kernel_sweeps_imply(sweep):
    samples = json.loads((DATA / sweep).read_text())["samples"]
    implied = gpu_kernels.implied_constants(samples, "h200")
    table = load_profile("h200").kernels
    tolerance = 0.01 if sweep == "kernels_warm.json" else 0.04  # the profile cites the warm sweep; the first within 4%
    for name, value in implied.items():
        assert table[name] == pytest.approx(value, rel=tolerance), (name, table[name], value)


def test_every_sample_is_priced_and_the_sweep_covers_every_class():
    samples = json.loads((DATA / "kernels_warm.json").read_text())["samples"]
    rows = gpu_kernels.price(samples, "h200")
    assert {r["cls"] for r in rows} >= {"matmul kk", "matmul kn", "matmul mn", "attention fwd", "attention bwd",
                                         "elementwise", "reduction", "copy", "loss", "optimizer", "launch"}
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)


def test_every_measured_shape_run_has_its_plan_and_shape():
    measurements = sorted((DATA / "shapes").glob("*-measurement.json"))
    assert len(measurements) == 14
    for path in measurements:
        stem = path.name[: -len("-measurement.json")]
        m = load_measurement(path)
        plan = load_plan(DATA / "shapes" / f"{stem}-plan.json")
        shape = json.loads((DATA / "shapes" / f"{stem}-shape.json").read_text())
        assert m.device == "cuda" and m.device_name == "NVIDIA H200" and m.world_size == 1
        assert m.micro_batch == plan.training.micro_batch and shape["shape"]["n_layers"] + 1 == len(plan.units)
        assert bool(plan.units[1].activation_checkpoint) == stem.endswith("-ac")
