"""The losses over the output layer (shard_planner/model/loss.py): chunked (torchtune's) and fused (Liger's)
compute the model file's own loss and gradients, the tracer and the cost model account for their memory, and
a CPU run (2 gloo ranks) measures what the plan predicts; bad requests are refused in one line."""

import pytest
import torch

from shard_planner.cli.main import main as cli_main
from shard_planner.errors import ModelFileError
from shard_planner.execute import run_plans
from shard_planner.model.hf import HfOptions, model_options
from shard_planner.model.loss import fused_chunk_rows, output_loss, shifted_labels
from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import load_plan
from tests.paths import EXAMPLES

LLAMA = str(EXAMPLES / "llama.py")


def _loss_and_grads(loss: str, batch: int = 2):
    mf = load_model_file(LLAMA, HfOptions(loss=loss))
    torch.manual_seed(0)
    model = mf.build()
    torch.manual_seed(1)
    inputs, targets = mf.batch(batch)
    value = mf.loss(mf.forward(model, inputs, targets), targets)
    value.backward()
    return value.item(), {n: p.grad for n, p in model.named_parameters()}


def test_chunked_and_fused_compute_the_model_files_loss_and_gradients():
    ref, ref_grads = _loss_and_grads("model")
    for loss in ("chunked", "fused"):
        value, grads = _loss_and_grads(loss)
        assert value == pytest.approx(ref, rel=1e-6), loss
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=f"{loss}: {name}")


def test_ignored_targets_are_skipped_as_cross_entropy_skips_them():
    torch.manual_seed(0)
    h, w = torch.randn(2, 12, 16), torch.randn(40, 16)
    t = torch.randint(0, 40, (2, 12))
    t[0, :5] = -100
    ref = torch.nn.functional.cross_entropy((h @ w.t()).flatten(0, 1), t.flatten(), ignore_index=-100)
    from shard_planner.model.loss import fused_linear_cross_entropy

    assert fused_linear_cross_entropy(h, w, None, t).item() == pytest.approx(ref.item(), rel=1e-5)
    chunks = [c @ w.t() for c in h.chunk(8, dim=1)]
    assert output_loss("chunked", chunks, t).item() == pytest.approx(ref.item(), rel=1e-5)


def test_liger_chunk_of_tokens():
    """liger_kernel/ops/fused_linear_cross_entropy.py: next_power_of_2(ceil(BT / ceil(V / H)))."""
    assert fused_chunk_rows(8192, 128256, 4096) == 256  # Llama 3 8B, 8,192 tokens: 32 chunks of 256
    assert fused_chunk_rows(512, 512, 64) == 64
    assert fused_chunk_rows(100, 1000, 10) == 1


def test_transformers_labels_become_shifted_targets():
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shifted_labels(labels).tolist() == [[6, 7, 8, -100]]


def test_the_trace_counts_the_fused_weight_gradient_once():
    """The fused forward's weight gradient is saved and becomes the parameter's gradient: the trace records
    it as forward_grad_bytes (of saved_bytes_self), not as a gradient made in backward."""
    from shard_planner.trace import trace_model

    trace = trace_model(load_model_file(LLAMA, HfOptions(loss="fused")), dtype="float32")
    head = trace.module("output")
    weight_bytes = sum(head.param_bytes_by_dtype.values())
    assert head.forward_grad_bytes.at(4) == weight_bytes
    assert head.saved_bytes_self.at(4) > weight_bytes  # the hidden states' gradient too
    plain = trace_model(load_model_file(LLAMA), dtype="float32")
    assert plain.module("output").forward_grad_bytes.at(4) == 0


def test_bad_requests_are_refused_in_one_line(tmp_path):
    with pytest.raises(ModelFileError, match="unknown --loss 'sum'"):
        HfOptions(loss="sum")
    model = tmp_path / "m.py"
    model.write_text((EXAMPLES / "llama.py").read_text().replace('"lr": 1e-3 if', '"loss": "huge", "lr": 1e-3 if'))
    with pytest.raises(ModelFileError, match=r"TRAINING\['loss'\] must be one of model, chunked, fused"):
        load_model_file(str(model))
    vit = load_model_file(str(EXAMPLES / "vit.py"), HfOptions(loss="chunked"))
    with pytest.raises(ModelFileError, match="need one output layer"):
        vit.build()
    scaled = tmp_path / "scaled.py"
    scaled.write_text((EXAMPLES / "llama.py").read_text().replace("return self.output(h)  # (B, T, vocab)",
                                                                  "return self.output(h) * 1.0"))
    mf = load_model_file(str(scaled), HfOptions(loss="fused"))
    inputs, targets = mf.batch(1)
    model = mf.build()
    with pytest.raises(ModelFileError, match="does not return what its output layer returns"):
        mf.loss(mf.forward(model, inputs, targets), targets)


def test_a_training_loss_is_the_default_and_the_plan_records_it(tmp_path):
    model = tmp_path / "m.py"
    model.write_text((EXAMPLES / "llama.py").read_text().replace('"lr": 1e-3 if', '"loss": "chunked", "lr": 1e-3 if'))
    assert load_model_file(str(model)).loss_name == "chunked"
    assert load_model_file(str(model), HfOptions(loss="model")).loss_name == "model"
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(model), "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo", "-o", str(out),
                     "--no-report"]) == 0
    plan = load_plan(out)
    assert plan.model.loss == "chunked" and model_options(plan.model).loss == "chunked"
    plain = tmp_path / "plain.json"
    assert cli_main(["plan", str(model), "--loss", "model", "--gpus", "2", "--mem", "2GB", "--profile",
                     "cpu-gloo", "-o", str(plain), "--no-report"]) == 0
    assert "loss" not in load_plan(plain).to_dict()["model"]  # the model file's own: as plans before the field


def test_tensor_parallel_degrees_are_refused_with_the_reason(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", LLAMA, "--loss", "fused", "--gpus", "8", "--mem", "4GB", "-o", str(out),
                     "--no-report"]) == 0
    assert load_plan(out).mesh.tp == 1
    assert "TP 2: --loss fused is not combined with tensor parallelism yet" in capsys.readouterr().out


def _per_block(plan):
    """``plan`` with each of the tiny Llama's two blocks its own unit, predicted again."""
    from dataclasses import replace

    from shard_planner.cost import estimate
    from shard_planner.hardware.profile import load_priced_profile
    from shard_planner.plan import Unit
    from shard_planner.trace import trace_for_plan

    root = plan.units[-1]
    plan = replace(plan, units=(Unit(("layers.0",), True), Unit(("layers.1",), True), root), predicted=None)
    mf = load_model_file(plan.model.path, model_options(plan.model))
    return replace(plan, predicted=estimate(trace_for_plan(mf, plan), plan, load_priced_profile("cpu-gloo")).prediction())


def test_cpu_runs_measure_what_the_plans_predict(tmp_path):
    """2 gloo ranks: the three losses train to the same losses, and the measured peak is the predicted one,
    within 0.5% with each block its own unit. The planner's one-unit plan of the tiny model is exact for model
    and chunked; for fused it is 2.5% high (docs/model-files.md: the whole backward is one block there)."""
    planned = {}
    for loss in ("model", "chunked", "fused"):
        out = tmp_path / f"{loss}.json"
        assert cli_main(["plan", LLAMA, "--loss", loss, "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo",
                         "-o", str(out), "--no-report"]) == 0
        planned[loss] = load_plan(out)
    plans = {**{(k, "one unit"): p for k, p in planned.items()}, **{(k, "per block"): _per_block(p)
                                                                     for k, p in planned.items()}}
    runs = dict(zip(plans, run_plans(list(plans.values()), world_size=2, steps=2, warmup=1, device="cpu",
                                     timeout_s=600)))
    peaks = {k: p.predicted.peak_bytes for k, p in plans.items()}
    assert peaks["fused", "per block"] < peaks["chunked", "per block"] < peaks["model", "per block"]
    for key, plan in plans.items():
        tolerance = 0.03 if key == ("fused", "one unit") else 0.005
        assert abs(peaks[key] / runs[key].peak_bytes - 1) <= tolerance, (key, peaks[key], runs[key].peak_bytes)
        assert runs[key].losses == pytest.approx(runs["model", key[1]].losses, rel=1e-4)


def test_a_transformers_causal_lm_trains_with_them_as_with_its_own_loss(tmp_path):
    """A tiny transformers Llama config: its labels become the targets shifted as ForCausalLMLoss shifts them,
    so the three losses agree; a 2-rank run measures the predicted peak. A classifier is refused."""
    pytest.importorskip("transformers", reason="needs the hf extra (pip install 'shard-planner[hf]')")
    from tests.hf.zoo import ZOO, write_arch

    path = write_arch(next(a for a in ZOO if a.name == "llama"), tmp_path / "llama")
    values = {}
    for loss in ("model", "chunked", "fused"):
        mf = load_model_file(path, HfOptions(loss=loss))
        torch.manual_seed(0)
        model = mf.build()
        torch.manual_seed(1)
        inputs, targets = mf.batch(2)
        values[loss] = mf.loss(mf.forward(model, inputs, targets), targets).item()
    assert values["chunked"] == pytest.approx(values["model"], rel=1e-5)
    assert values["fused"] == pytest.approx(values["model"], rel=1e-5)
    out = tmp_path / "fused.json"
    assert cli_main(["plan", path, "--loss", "fused", "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo",
                     "-o", str(out), "--no-report"]) == 0
    plan = load_plan(out)
    measured = run_plans([plan], world_size=2, steps=1, warmup=1, device="cpu", timeout_s=600)[0].peak_bytes
    assert abs(plan.predicted.peak_bytes / measured - 1) <= 0.03
    with pytest.raises(ModelFileError, match="applies to a causal language model"):
        load_model_file(path, HfOptions(loss="chunked", task="sequence-classification"))


def test_every_export_and_the_report_say_the_loss(tmp_path):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", LLAMA, "--loss", "chunked", "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo",
                     "-o", str(out), "--report-dir", str(tmp_path / "report")]) == 0
    assert "CEWithChunkedOutputLoss" in (tmp_path / "report" / "report.md").read_text()
    for target in ("fsdp2", "torchtitan", "accelerate", "deepspeed"):
        written = tmp_path / f"export-{target}"
        assert cli_main(["export", str(out), "--to", target, "-o", str(written)]) == 0
        text = "".join(p.read_text() for p in ([written] if written.is_file() else written.rglob("*")) if p.is_file())
        assert "CEWithChunkedOutputLoss" in text and "h.chunk(8, dim=1)" in text, target


def test_a_trace_json_takes_no_model_options(tmp_path, capsys):
    """A trace.json is the model as traced (its loss included): --loss and the transformers options are refused
    in one line, not silently ignored."""
    trace = tmp_path / "trace.json"
    assert cli_main(["trace", LLAMA, "--loss", "fused", "-o", str(trace)]) == 0
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(trace), "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo", "-o", str(out),
                     "--no-report"]) == 0
    assert load_plan(out).model.loss == "fused"  # the trace's
    for extra in (["--loss", "chunked"], ["--lora", "8"]):
        code = cli_main(["plan", str(trace), *extra, "--gpus", "2", "--mem", "2GB", "--profile", "cpu-gloo", "-o",
                         str(tmp_path / "other.json"), "--no-report"])
        assert code == 2 and "is a trace.json, the model as it was traced" in capsys.readouterr().err
        assert not (tmp_path / "other.json").exists()
