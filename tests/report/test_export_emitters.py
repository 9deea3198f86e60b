"""The YAML emitter round-trips every scalar it writes through the parser Accelerate uses (PyYAML's
``safe_load``): property-style, over nasty strings (line breaks, quotes, colons, '#', YAML 1.1 words, control and
non-BMP characters) and floats YAML 1.1 would read as strings (``1e+20``)."""

import math
import random

import pytest

from shard_planner.report.export.common import comment_block, emit_yaml, yaml_scalar

yaml = pytest.importorskip("yaml", reason="PyYAML: pip install -e '.[tests]'")

NASTY_STRINGS = [
    "", " ", "a\nb", "a\r\nb", "trailing\n", "x: y", "#c", "a #b", "it's", 'q"q', "back\\slash", "\\N{BULLET}",
    '"""', "'''", "😀 ünï 中文", "yes", "No", "ON", "off", "y", "null", "Null", "~", "true", "FALSE", "1e+20",
    "0x10", "012", "1_000", ".inf", ".nan", "- x", "[a]", "{a: 1}", "*a", "&a", "!a", "%a", "@a", "`a", "? a",
    "\x85\u2028\u2029", "\x7f\x00\t\x1b", "\ufeffbom", "a,b", "C:\\Users\\new\\file.py", "/models/llama.py",
]
FLOATS = [0.0, -0.0, 1e20, 1e-5, 3e-4, 0.1, 1.5e300, 5e-324, 2.0, -7.25, math.inf, -math.inf]
INTS = [0, 1, -3, 525_336_576, 2**63 - 1]


def _random_strings(count: int, seed: int = 26) -> list[str]:
    """Strings drawn from the characters that break emitters: YAML/TOML indicators, line breaks, quotes,
    control characters, and BMP and non-BMP letters (no lone surrogates: they cannot be UTF-8 encoded)."""
    rng = random.Random(seed)
    alphabet = list("aZ09 _-.,:#'\"\\\n\r\t{}[]&*!|>%@`?~=+") + ["\x00", "\x1f", "\x7f", "\x85", "\xa0", "\u2028",
                                                             "é", "中", "\ufffd", "😀", "\U0010ffff"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(count)]


VALUES = [*NASTY_STRINGS, *_random_strings(300), *FLOATS, *INTS, True, False]


def test_every_scalar_round_trips():
    for value in VALUES:
        text = "k: " + yaml_scalar(value)
        back = yaml.safe_load(text)["k"]
        assert back == value and type(back) is type(value), (value, text, back)
        if isinstance(value, float) and value == 0:
            assert math.copysign(1, back) == math.copysign(1, value), text


def test_nan_round_trips():
    assert math.isnan(yaml.safe_load("k: " + yaml_scalar(math.nan))["k"])


def test_yaml_floats_are_floats_in_yaml_1_1():
    """PyYAML (YAML 1.1) reads `1e+20` as a string: the emitter writes `1.0e+20`."""
    assert yaml.safe_load("k: 1e+20")["k"] == "1e+20"  # why the emitter must not write repr(1e20)
    assert yaml_scalar(1e20) == "1.0e+20" and yaml_scalar(1e-5) == "1.0e-05"


def test_nested_mappings_round_trip():
    strings = _random_strings(40, seed=7)
    mapping = {"top": 1, "nested": {s or "empty": s for s in strings}, "deeper": {"a": {"b": 1e20, "c": "x\ny"}}}
    assert yaml.safe_load("\n".join(emit_yaml(mapping))) == mapping


def test_comments_stay_comments():
    """Header comments hold model paths and module names: no character of them ends the comment early."""
    lines = comment_block(["path " + s for s in NASTY_STRINGS + _random_strings(40, seed=3)])
    assert yaml.safe_load("\n".join(lines) + "\nk: 1") == {"k": 1}
    compile("\n".join(lines), "comments.py", "exec")
