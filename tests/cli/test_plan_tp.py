"""`shard-planner plan` and the tensor-parallel degree (cli/plan_degrees.py, trace/tp_degrees.py, solve/layout_search.py):
searched by default on a GPU profile, each degree an outcome in the plan file and a summary line; fixed by
--tp; degree 1 on a CPU profile; bad degrees one line."""

import json

import pytest

from shard_planner.cli.main import main
from shard_planner.plan import load_plan
from tests.paths import EXAMPLES

LLAMA = str(EXAMPLES / "llama.py")  # tiny: 4 heads, 2 key/value heads


def _plan(tmp_path, *args):
    out = tmp_path / "plan.json"
    rc = main(["plan", LLAMA, "--gpus", "8", "-o", str(out), "--no-report", "--time-limit", "0.5", *args])
    return rc, out


def test_every_degree_is_screened_on_a_gpu_profile(tmp_path, capsys):
    rc, out = _plan(tmp_path, "--mem", "4GB")
    assert rc == 0
    plan = load_plan(out)
    by_degree = {o.split.tp: o for o in plan.layouts}
    assert sorted(by_degree) == [1, 2, 4, 8] and plan.mesh.tp in by_degree
    assert by_degree[plan.mesh.tp].judged == "solved" and (plan.tensor_parallel is None) == (plan.mesh.tp == 1)
    for t in (4, 8):  # 2 key/value heads split no further than 2 ways
        assert by_degree[t].judged == "refused" and f"tensor parallelism of degree {t}" in by_degree[t].refused
    assert by_degree[2].judged in ("solved", "screened") and by_degree[2].step_time_s > 0
    text = capsys.readouterr().out
    assert "layouts searched (the fastest plan of each):" in text and "TP 4: tensor parallelism of degree 4" in text
    assert "tensor-parallel degrees: 2 screened (" in text  # 1 and 2: 4 and 8 refused before a trace
    assert "layouts" in json.loads(out.read_text())


def test_tp_fixes_the_degree(tmp_path):
    rc, out = _plan(tmp_path, "--mem", "1GB", "--profile", "cpu-gloo", "--tp", "2", "--no-sequence-parallel")
    plan = load_plan(out)
    assert rc == 0 and plan.mesh.tp == 2 and plan.mesh.dp_size == 4 and plan.layouts == ()
    assert plan.tensor_parallel is not None and not plan.tensor_parallel.sequence_parallel
    assert plan.tensor_parallel.loss_parallel


def test_a_cpu_profile_plans_degree_1(tmp_path):
    rc, out = _plan(tmp_path, "--mem", "1GB", "--profile", "cpu-gloo")
    plan = load_plan(out)
    assert rc == 0 and plan.mesh.tp == 1 and plan.layouts == ()


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "--tp 3 must divide the GPUs per node (8) and --gpus (8)"),
    (["--tp", "4"], "tensor parallelism of degree 4: layers.0.attention.wk"),
])
def test_a_degree_that_cannot_be_planned_is_one_line(tmp_path, capsys, args, message):
    rc, out = _plan(tmp_path, "--mem", "4GB", *args)
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err and not out.exists()


def test_a_transformers_config_is_split_by_its_own_plan(tmp_path):
    """tp_degrees.degree_styles on a transformers Llama built without memory, as the tracer builds it: its own
    plan, without sequence or loss parallelism ([Note: Which degrees are searched]); a degree its 2 key/value
    heads do not divide is refused."""
    pytest.importorskip("transformers", reason="needs the transformers extra")
    from shard_planner.model.hf import HfOptions
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.trace.tp_degrees import degree_styles

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 128, "use_cache": False, "tie_word_embeddings": False}))
    found = degree_styles(load_model_file(str(tmp_path), HfOptions(seq_len=64)), [1, 2, 4], sequence_parallel=True,
                          loss_parallel=True, seq_len=64)
    tp = found.styles[2]
    assert list(found.styles) == [2] and not tp.sequence_parallel and not tp.loss_parallel
    assert tp.styles_by_fqn["model.layers.0.self_attn.q_proj"].style.value == "colwise"
    assert [o.split.tp for o in found.refused] == [4] and "degree 4" in found.refused[0].refused
