"""Tracing without importing torch._dynamo ([Note: torch._dynamo during a trace], trace/dynamo_deferred.py).

Each check runs in a fresh interpreter: the test process may have imported torch._dynamo already, and
then the deferral rightly does nothing."""

import json
import subprocess
import sys

import pytest

from tests.paths import EXAMPLES, MODELS, REPO

TRACE_TWICE = r"""
import json, sys, torch
from shard_planner.trace import trace_model

def content(trace):
    d = json.loads(trace.to_json())
    d.pop("trace_seconds")
    return d

assert "torch._dynamo" not in sys.modules
first = trace_model(sys.argv[1])
deferred = not any(m == "torch._dynamo" or m.startswith("torch._dynamo.") for m in sys.modules)
import torch._dynamo  # the real package, after the trace
from torch._subclasses.fake_tensor import FakeTensorMode
raw = FakeTensorMode.__torch_dispatch__.__wrapped__
cache_dropped = not hasattr(raw, "__dynamo_disable")
second = trace_model(sys.argv[1])  # traced with the real torch._dynamo
print(json.dumps({"deferred": deferred, "real": hasattr(torch._dynamo, "convert_frame"),
                  "cache_dropped": cache_dropped,
                  "wrapped_by_real": getattr(raw, "__dynamo_disable", raw) is not raw,
                  "same": content(first) == content(second)}))
"""

NEEDS_REAL = r"""
import json, sys, torch
from shard_planner.trace.dynamo_deferred import dynamo_deferred

with dynamo_deferred():
    stub = sys.modules["torch._dynamo"]
    has_convert_frame = hasattr(torch._dynamo, "convert_frame")  # more than the deferral offers
    real = sys.modules["torch._dynamo"]
print(json.dumps({"imported": has_convert_frame and real is not stub, "kept": sys.modules["torch._dynamo"] is real,
                  "attribute": torch._dynamo is real}))
"""


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model,deferred", [
    (EXAMPLES / "llama.py", True),
    (MODELS / "trace_twins.py", False),  # a tensor made at import: FakeTensorMode imports torch._dynamo.source
], ids=["llama", "real-tensor-at-import"])
def test_a_trace_imports_the_compiler_only_if_needed_and_equals_one_with_it(model, deferred):
    got = _run(TRACE_TWICE, str(model))
    assert got == {"deferred": deferred, "real": True, "cache_dropped": True, "wrapped_by_real": True, "same": True}


def test_a_trace_that_needs_the_compiler_gets_the_real_package():
    assert _run(NEEDS_REAL) == {"imported": True, "kept": True, "attribute": True}


STYLES_TWICE = r"""
import json, sys, torch
from shard_planner.model.modelfile import load_model_file
from shard_planner.trace.tp_degrees import degree_styles

def styles():
    found = degree_styles(load_model_file(sys.argv[1]), [1, 2, 4], sequence_parallel=True, loss_parallel=True)
    return repr(sorted((t, sorted(tp.styles.items())) for t, tp in found.styles.items())), repr(found.refused)

assert "torch._dynamo" not in sys.modules
first = styles()
deferred = not any(m == "torch._dynamo" or m.startswith("torch._dynamo.") for m in sys.modules)
import torch._dynamo  # the real package, after the derivation
second = styles()
print(json.dumps({"deferred": deferred, "same": first == second, "styles": "colwise" in first[0]}))
"""


def test_deriving_the_tensor_parallel_styles_defers_the_compiler_too():
    """tp_degrees.degree_styles runs one forward as a trace does (its batch made under the FakeTensorMode), so
    it imports no torch._dynamo either (the helper that derives the styles: cli/plan_degrees.py), and finds the
    same styles as with the real package."""
    assert _run(STYLES_TWICE, str(EXAMPLES / "llama.py")) == {"deferred": True, "same": True, "styles": True}
