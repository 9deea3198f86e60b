"""Tensor parallelism then FSDP2 on a 2-D mesh (dp shard 2 x tp 2, world size 4, CPU/gloo): the run applies
the plan's styles before fully_shard, the tp ranks of a data-parallel group train on one micro-batch, FSDP2's
collectives run over the shard group with the bytes predicted from the local (tp-split) parameters, DTensor's
collectives over the tp group are counted per kind as the styles imply, and a DCP checkpoint restores."""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from shard_planner.cli.main import main as cli_main
from shard_planner.plan.comm import GroupCollectiveBytes
from shard_planner.errors import RunError
from shard_planner.execute import launch_plans
from shard_planner.execute.comm_count import FunctionalCollectiveCounter
from shard_planner.execute.stepper import Stepper
from shard_planner.model.hf import HfOptions
from shard_planner.model.modelfile import ModelFile, load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit, save_plan
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.trace.structure import model_fingerprint
from tests.execute.test_run import reference_losses
from tests.paths import EXAMPLES
from tests.models import exec_llama_tp as llama

MODEL = "tests/models/exec_llama_tp.py"
F32 = 4
BSH_BYTES = llama.TRAINING["micro_batch"] * llama.SEQ * llama.DIM * F32  # one (b, s, h) activation, whole
BS_BYTES = llama.TRAINING["micro_batch"] * llama.SEQ * F32  # one (b, s) statistic of the loss


def tp_plan(model=MODEL, styles=None, units=None, seq_len=None, **tp) -> Plan:
    built = load_model_file(model, HfOptions(seq_len=seq_len) if seq_len else None).build()
    units = units or (Unit(("",), True), Unit(("layers.0",)), Unit(("layers.1",)))
    return Plan(ModelRef(model, model_fingerprint(built), seq_len=seq_len), Cluster(4, 8, "cpu-gloo", 2**30),
                Mesh(shard=2, tp=2), Training(llama.TRAINING["micro_batch"], param_dtype="float32"), tuple(units),
                Prefetch(1, 1), tensor_parallel=TensorParallel(styles or llama.styles(), **tp))


def _by(m, source):
    return {(c.group, c.collective): c for c in m.comm_by_group if c.source == source}


@pytest.mark.multiprocess
def test_tp_then_fsdp_2x2_counts_restores_and_matches_a_single_process(tmp_path):
    plan = tp_plan()
    m = launch_plans([plan], steps=2, warmup=1, device="cpu", timeout_s=240,
                     checkpoint_dir=str(tmp_path / "ckpt")).measurements[0]
    assert (m.world_size, m.mesh_shard, m.mesh_replicate, m.mesh_tp) == (4, 2, 1, 2)
    assert m.samples_per_step == 2 * llama.TRAINING["micro_batch"]  # the dp ranks' micro-batches only
    # the tp ranks of a data-parallel group drew one micro-batch: the same losses, bit for bit; the groups differ
    assert m.data_ranks == (0, 0, 1, 1)
    assert m.rank_losses[0] == m.rank_losses[1] and m.rank_losses[2] == m.rank_losses[3]
    assert m.rank_losses[0] != m.rank_losses[2] and all(math.isfinite(v) for v in m.losses)
    # the same global batches in one process without any parallelism (float32: sums in another order)
    assert m.losses == pytest.approx(reference_losses(plan, 2, len(m.losses)), rel=1e-4)
    assert all(r.peak_bytes > 0 for r in m.memory) and m.step_time_median_s > 0
    # FSDP2: over the shard group only, the bytes predicted from the parameters as tp splits them
    fsdp = _by(m, "fsdp")
    assert {group for group, _ in fsdp} == {"shard"}
    assert m.comm_matches, m.comm_comparison()
    local_numel = sum(p.numel() for p in llama.build_model().parameters()) - _tp_split_away()
    assert fsdp["shard", "reduce_scatter"].bytes == local_numel * F32  # one gradient reduce-scatter of each
    # tensor parallelism, per step over the tp group (2 blocks, sequence and loss parallel): forward, per block
    # 2 all-gathers (attention, feed-forward inputs) + 2 reduce-scatters (wo, w2 outputs), the embedding's
    # reduce-scatter, the head's all-gather; backward the same reversed; 3 loss all-reduces of (b, s) (max,
    # sum of exponentials, the target logits), one all-reduce per norm weight's gradient (5 norms of DIM)
    tp = _by(m, "tp")
    assert set(tp) == {("tp", "all_gather"), ("tp", "reduce_scatter"), ("tp", "all_reduce")}
    assert (tp["tp", "all_gather"].calls, tp["tp", "all_gather"].bytes) == (10, 10 * BSH_BYTES)
    assert (tp["tp", "reduce_scatter"].calls, tp["tp", "reduce_scatter"].bytes) == (10, 10 * BSH_BYTES)
    assert (tp["tp", "all_reduce"].calls, tp["tp", "all_reduce"].bytes) == (8, 3 * BS_BYTES + 5 * llama.DIM * F32)
    assert m.comm_same_every_step
    # DCP across the 2-D mesh (_StridedShard x Shard parameters): every tensor and the next losses back
    assert m.checkpoint is not None and m.checkpoint.ok, m.checkpoint
    assert m.checkpoint.restores[0].tensors_checked > 0


def _tp_split_away() -> int:
    """Elements of the whole model that a tp rank does not hold: half of every split weight (norms whole)."""
    model = llama.build_model()
    split = [fqn for fqn, style in llama.styles().items() if style in ("colwise", "rowwise", "embedding", "head")]
    return sum(model.get_submodule(fqn).weight.numel() // 2 for fqn in split)


HF_CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, use_cache=False, dtype="float32")


def hf_styles(layers: int = 2) -> dict[str, str]:
    """transformers' LlamaForCausalLM without sequence parallelism: its decoder layer derives the positions
    from the embedding output's sequence length, which sequence parallelism halves (see the test)."""
    out = {"model.embed_tokens": "embedding", "lm_head": "head"}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj": "colwise", p + "self_attn.k_proj": "colwise", p + "self_attn.v_proj": "colwise",
                p + "self_attn.o_proj": "rowwise", p + "mlp.gate_proj": "colwise", p + "mlp.up_proj": "colwise",
                p + "mlp.down_proj": "rowwise"}
    return out


@pytest.mark.multiprocess
def test_transformers_llama_2x2_without_sequence_parallelism(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_CONFIG))
    plan = tp_plan(str(config), hf_styles(), seq_len=16, sequence_parallel=False,
                   units=(Unit(("",), True), Unit(("model.layers.0",)), Unit(("model.layers.1",))))
    m = launch_plans([plan], steps=1, warmup=1, device="cpu", timeout_s=240).measurements[0]
    assert m.rank_losses[0] == m.rank_losses[1] and all(math.isfinite(v) for v in m.losses)
    assert m.comm_matches, m.comm_comparison()
    bsh = 2 * 16 * 64 * F32
    # forward: the embedding's and each rowwise output's all-reduce (1 + 2 x 2); backward: each colwise
    # projection's input gradient (5 a block) and the head's; the loss's 3 all-reduces of (b, s)
    tp = _by(m, "tp")
    assert set(tp) == {("tp", "all_reduce")}
    assert (tp["tp", "all_reduce"].calls, tp["tp", "all_reduce"].bytes) == (19, 16 * bsh + 3 * 2 * 16 * F32)


@pytest.mark.multiprocess
def test_cli_runs_a_2x2_plan_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    save_plan(tp_plan(), path)
    assert cli_main(["run", str(path), "--steps", "1", "--warmup", "1", "--device", "cpu", "--no-checkpoint"]) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks" in out and "tensor parallelism per step" in out and "reduce-scatter over tp" in out
    # predicted from the runner's trace of one tp rank, beside the measured (cost tp_collectives_per_step)
    assert "measured calls and bytes equal the predicted ones exactly" in out, out
    assert (tmp_path / "measurement.json").is_file()


# ---- one process, fake process group ----
def test_functional_collectives_are_counted_per_group_with_their_bytes(fake_world):
    counter = FunctionalCollectiveCounter(fake_world)
    with counter:
        x = torch.ones(4, 3)
        outs = [funcol.all_gather_single(x, 0, fake_world),  # the whole output: 2 x 48 bytes
                funcol.reduce_scatter_single(x, "sum", 0, fake_world),  # the whole input: 48 bytes
                funcol.all_reduce(x, "sum", fake_world)]
        dist.all_reduce(x)  # not a functional collective: FSDP2's kind, CommCounter's
    for out in outs:
        funcol.wait_tensor(out)
    assert counter.take() == (GroupCollectiveBytes("tp", "world", "all_gather", 2, 1, 96),
                              GroupCollectiveBytes("tp", "world", "all_reduce", 2, 1, 48),
                              GroupCollectiveBytes("tp", "world", "reduce_scatter", 2, 1, 48))
    assert counter.take() == ()


class _VocabSplit(nn.Module):
    """Logits split on the vocabulary, as the head hands them on under loss parallelism."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh, self.w = mesh, nn.Parameter(torch.ones(4))

    def forward(self, x):
        return DTensor.from_local(x * self.w, self.mesh, (Shard(-1),), run_check=False)  # (B, V / tp)


@pytest.mark.parametrize("loss, error", [
    (lambda out, t: nn.functional.cross_entropy(out, t), None),
    (lambda out, t: out.float().pow(2).mean(), "not a cross-entropy"),
])
def test_loss_parallel_takes_a_cross_entropy_and_refuses_another_loss(fake_world, loss, error):
    model = _VocabSplit(fake_world)
    mf = ModelFile("m.py", lambda: model, lambda b: ((torch.randn(b, 4),), torch.zeros(b, dtype=torch.long)), loss)
    step = Stepper(mf, model, torch.optim.SGD(model.parameters(), lr=0.1), Training(2), 0, torch.device("cpu"),
                   loss_parallel=True)
    if error is None:
        assert torch.isfinite(step(0))
    else:
        with pytest.raises(RunError, match=f"{error}.*set tensor_parallel.loss_parallel false"):
            step(0)


@pytest.mark.multiprocess
def test_transformers_llama_with_lora_on_every_linear_2x2(tmp_path):
    """A tiny transformers Llama fine-tuned with LoRA on every Linear, planned at TP 2 (trace/tp_adapters.py: the
    colwise layers' lora_B split with them, the rowwise layers' lora_A) and run on dp 2 x tp 2: both tp ranks
    of a group get the same loss, the peak is the predicted one and FSDP2's and DTensor's collectives are the
    predicted ones, call for call (each rowwise adapter's (b, s, r) all-reduce forward, each colwise adapter's
    input-gradient all-reduce backward among them)."""
    from tests.hf.finetune import need_finetune_extra

    need_finetune_extra()
    from shard_planner.plan import load_plan

    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_CONFIG))
    path = tmp_path / "plan.json"
    assert cli_main(["plan", str(config), "--seq-len", "16", "--lora", "8", "--lora-targets", "all-linear",
                     "--dtype", "fp32", "--gpus", "4", "--mem", "1GB", "--profile", "cpu-gloo", "--tp", "2",
                     "--no-report", "-o", str(path)]) == 0
    plan = load_plan(path)
    styles = {f: s.style.value for f, s in plan.tensor_parallel.styles_by_fqn.items()}
    assert styles["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default"] == "colwise"
    assert styles["base_model.model.model.layers.0.mlp.down_proj.lora_A.default"] == "rowwise"
    m = launch_plans([plan], steps=1, warmup=1, device="cpu", timeout_s=240).measurements[0]
    assert m.rank_losses[0] == m.rank_losses[1] and all(math.isfinite(v) for v in m.losses)
    assert m.comm_matches, m.comm_comparison()
    assert m.comm_tp_matches, m.comm_tp_comparison()
    (name, predicted, measured, error), = [row for row in m.comparison() if row[0] == "peak_bytes"]
    assert abs(error) <= 3.0, (predicted, measured)


@pytest.mark.multiprocess
def test_the_example_lora_model_file_2x2(tmp_path, monkeypatch):
    """examples/llama_lora.py (LoRA layers laid out as peft's on wq and wv) planned at TP 2 from its structure,
    without sequence parallelism, and run on dp 2 x tp 2: the predicted peak and collectives."""
    from shard_planner.plan import load_plan

    monkeypatch.setenv("SHARD_PLANNER_FINETUNE", "lora")
    path = tmp_path / "plan.json"
    assert cli_main(["plan", str(EXAMPLES / "llama_lora.py"), "--gpus", "4", "--mem", "1GB", "--profile", "cpu-gloo",
                     "--tp", "2", "--no-report", "-o", str(path)]) == 0
    plan = load_plan(path)
    assert not plan.tensor_parallel.sequence_parallel
    m = launch_plans([plan], steps=1, warmup=1, device="cpu", timeout_s=240).measurements[0]
    assert m.rank_losses[0] == m.rank_losses[1]
    assert m.comm_matches and m.comm_tp_matches, (m.comm_comparison(), m.comm_tp_comparison())
    (name, predicted, measured, error), = [row for row in m.comparison() if row[0] == "peak_bytes"]
    assert abs(error) <= 3.0, (predicted, measured)


QWEN3_CONFIG = dict(HF_CONFIG, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16)


@pytest.mark.multiprocess
def test_transformers_qwen3_with_per_head_norms_2x2(tmp_path):
    """A tiny Qwen3, whose transformers plan styles its per-head q_norm / k_norm replicated_with_grad_allreduce
    (parallel/tensor_parallel.py grad_all_reduce): planned at TP 2 and run on dp 2 x tp 2, its losses those of one
    process without any parallelism (so the norms' gradients are summed over the heads of both tp ranks), its
    peak and every collective as predicted (one all-reduce of each norm's weight gradient a step among them)."""
    pytest.importorskip("transformers")
    from shard_planner.plan import load_plan

    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_CONFIG))
    path = tmp_path / "plan.json"
    assert cli_main(["plan", str(config), "--seq-len", "16", "--dtype", "fp32", "--gpus", "4", "--mem", "1GB",
                     "--profile", "cpu-gloo", "--tp", "2", "--no-report", "-o", str(path)]) == 0
    plan = load_plan(path)
    norms = {f: s.style.value for f, s in plan.tensor_parallel.styles_by_fqn.items() if f.endswith("_norm")}
    assert norms == {f"model.layers.{i}.self_attn.{n}": "grad_all_reduce" for i in range(2) for n in ("q_norm", "k_norm")}
    m = launch_plans([plan], steps=4, warmup=0, device="cpu", timeout_s=240).measurements[0]
    assert m.losses == pytest.approx(reference_losses(plan, 2, len(m.losses)), rel=1e-5)
    assert m.comm_matches and m.comm_tp_matches, (m.comm_comparison(), m.comm_tp_comparison())
    (name, predicted, measured, error), = [row for row in m.comparison() if row[0] == "peak_bytes"]
    assert abs(error) <= 3.0, (predicted, measured)
