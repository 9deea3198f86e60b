"""Paths the tests share: the repository, its example model files, the tests' own model files."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
MODELS = REPO / "tests" / "models"
