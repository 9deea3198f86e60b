"""The trace cache (shard_planner/trace/trace_cache.py): a hit returns what was stored without computing it
again, and anything a trace depends on — the model file, a module it imports, the environment, the planner's
own sources, the parts the caller names — is another key or a miss, never a stale entry."""

from __future__ import annotations

import logging
import os
import pickle
import sys

import pytest

from shard_planner.trace import trace_cache
from shard_planner.trace.trace_cache import CACHE_ENV, CacheKey, cached, prune


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


class Counter:
    """A compute function that counts its calls and returns its argument."""

    def __init__(self, value="traced"):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def _model(tmp_path, text="SIZE = 1\n"):
    path = tmp_path / "model.py"
    path.write_text(text)
    return str(path)


def test_a_hit_returns_the_stored_value_without_computing(cache, tmp_path):
    model, compute = _model(tmp_path), Counter({"trace": [1, 2, 3]})
    key = CacheKey("trace", model, (None, "bfloat16", 2))
    assert cached(key, compute) == {"trace": [1, 2, 3]} and compute.calls == 1
    assert cached(key, compute) == {"trace": [1, 2, 3]} and compute.calls == 1
    assert len(list(cache.glob("*.pickle"))) == 1


@pytest.mark.parametrize("change", ["model file", "environment", "parts", "kind", "working directory"])
def test_what_a_trace_depends_on_is_another_key(cache, tmp_path, monkeypatch, change):
    model, compute = _model(tmp_path), Counter()
    key = CacheKey("trace", model, (None, "bfloat16", 2))
    cached(key, compute)
    if change == "model file":
        _model(tmp_path, "SIZE = 2\n")
    elif change == "environment":
        monkeypatch.setenv("SHARD_PLANNER_SIZE", "8b")  # examples/llama.py reads it
    elif change == "parts":
        key = CacheKey("trace", model, (None, "bfloat16", 4))
    elif change == "kind":
        key = CacheKey("styles", model, (None, "bfloat16", 2))
    else:
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
    cached(key, compute)
    assert compute.calls == 2


def test_a_changed_planner_source_is_another_key(tmp_path, monkeypatch):
    package = tmp_path / "shard_planner"
    package.mkdir()
    (package / "tracer.py").write_text("A = 1\n")
    monkeypatch.setattr(trace_cache, "_PACKAGE", package)
    before = trace_cache._planner_digest.__wrapped__()
    (package / "tracer.py").write_text("A = 2\n")
    assert trace_cache._planner_digest.__wrapped__() != before


def test_a_changed_module_the_model_imports_is_a_miss(cache, tmp_path, monkeypatch):
    sibling = tmp_path / "blocks_for_cache_test.py"
    sibling.write_text("WIDTH = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, compute = _model(tmp_path), Counter()
    key = CacheKey("trace", model, ())

    def traced():  # the model file imports its sibling while it is traced
        import blocks_for_cache_test  # noqa: F401

        return compute()

    try:
        cached(key, traced)
        cached(key, traced)
        assert compute.calls == 1
        sibling.write_text("WIDTH = 2\n")
        cached(key, traced)
        assert compute.calls == 2
    finally:
        sys.modules.pop("blocks_for_cache_test", None)


def test_torchs_own_variable_does_not_change_the_key(cache, tmp_path, monkeypatch):
    """dynamo sets TORCHINDUCTOR_CACHE_DIR on its first import, in the middle of a command: a helper that traced
    before computing a key must compute the one a helper that did not computes."""
    key = CacheKey("trace", _model(tmp_path), ())
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = key.digest()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")
    assert key.digest() == before


def test_the_styles_order_does_not_change_the_key(tmp_path):
    model = _model(tmp_path)
    one = CacheKey("trace", model, ({"b": "colwise", "a": "rowwise"},))
    other = CacheKey("trace", model, ({"a": "rowwise", "b": "colwise"},))
    assert one.digest() == other.digest()
    assert one.digest() != CacheKey("trace", model, ({"a": "colwise", "b": "rowwise"},)).digest()


def test_a_hit_logs_what_the_trace_logged(cache, tmp_path, caplog):
    warn = logging.getLogger("shard_planner.trace.tracer")

    def traced():
        warn.warning("not reusing identical blocks' traces for layers.0")
        return 7

    key = CacheKey("trace", _model(tmp_path), ())
    with caplog.at_level(logging.WARNING, logger="shard_planner"):
        assert cached(key, traced) == 7
        assert cached(key, Counter()) == 7
    said = [r.getMessage() for r in caplog.records if r.name == "shard_planner.trace.tracer"]
    assert said == ["not reusing identical blocks' traces for layers.0"] * 2


def test_an_unreadable_entry_is_a_miss_and_is_deleted(cache, tmp_path):
    model, compute = _model(tmp_path), Counter()
    key = CacheKey("trace", model, ())
    cached(key, compute)
    (entry,) = cache.glob("*.pickle")
    entry.write_bytes(b"\x80\x05truncated")
    assert cached(key, compute) == "traced" and compute.calls == 2
    assert pickle.loads(entry.read_bytes())[0] == trace_cache.FORMAT  # written again, whole


@pytest.mark.parametrize("value", ["off", "0", ""])
def test_off_computes_every_time_and_writes_nothing(tmp_path, monkeypatch, value):
    monkeypatch.setenv(CACHE_ENV, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    compute, key = Counter(), CacheKey("trace", _model(tmp_path), ())
    cached(key, compute)
    cached(key, compute)
    assert compute.calls == 2 and not (tmp_path / "xdg").exists()


def test_the_default_folder_is_under_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert trace_cache.cache_dir() == tmp_path / "xdg" / "shard-planner" / "traces"


def test_a_model_that_is_not_a_file_is_not_cached(cache):
    compute = Counter()
    cached(CacheKey("trace", "some_package.model", ()), compute)
    cached(CacheKey("trace", "some_package.model", ()), compute)
    assert compute.calls == 2 and not cache.exists()


def test_prune_deletes_the_least_recently_used_first(tmp_path):
    for i, name in enumerate(["old", "mid", "new"]):
        path = tmp_path / f"{name}.pickle"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
    prune(tmp_path, max_bytes=250)
    assert sorted(p.stem for p in tmp_path.glob("*.pickle")) == ["mid", "new"]
