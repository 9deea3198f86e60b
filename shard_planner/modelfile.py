"""Load a user's model file and check it against the contract.

The contract (README, "The model file"): a Python file, or an importable ``package.module``, that
defines

- ``build_model()`` -> ``torch.nn.Module``, loading no weights; it is called under the meta device or
  FakeTensorMode by the tracer, and on the real device by the executor;
- ``make_batch(batch_size)`` -> ``(inputs, targets)`` of synthetic data; ``inputs`` is a tensor or a
  tuple of tensors passed positionally to the model;
- optionally ``loss_fn(output, targets)`` -> scalar loss (default: cross-entropy over the last dim);
- optionally ``TRAINING``: a dict of defaults (``micro_batch``, ``seq_len``, ``optimizer``, ``lr``).

Every violation raises :class:`ModelFileError` naming the file and the problem in one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shard_planner.errors import ModelFileError
from shard_planner.errors import first_line as _first_line
from shard_planner.plan import OPTIMIZERS

logger = logging.getLogger(__name__)

TRAINING_KEYS = {"micro_batch": int, "seq_len": int, "optimizer": str, "lr": float}


@dataclass(frozen=True)
class TrainingDefaults:
    """What a command uses where the user gives no value: the model file's TRAINING, else these (also for
    a trace.json, which carries no TRAINING)."""

    micro_batch: int = 1
    optimizer: str = "adamw"


def default_loss_fn(output, targets):
    """Cross-entropy over the last dimension, computed in fp32 (as language-model trainers do)."""
    import torch.nn.functional as F

    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file: its functions and defaults, checked against the contract."""

    path: str  # as given by the user: a file path or package.module
    build_model: Callable[[], Any]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]
    training: dict = field(default_factory=dict)

    @property
    def defaults(self) -> TrainingDefaults:
        """The TRAINING micro-batch and optimizer, with :class:`TrainingDefaults` where it names none."""
        return TrainingDefaults(**{k: self.training[k] for k in ("micro_batch", "optimizer") if k in self.training})

    def build(self):
        """Call ``build_model()`` and check that it returns an nn.Module."""
        import torch.nn as nn

        model = self._call("build_model()", self.build_model)
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{self.path}: build_model() returned {type(model).__name__}, expected a torch.nn.Module"
            )
        return model

    def batch(self, batch_size: int) -> tuple[tuple, Any]:
        """Call ``make_batch(batch_size)``; return ``(inputs as a tuple, targets)``."""
        import torch

        result = self._call(f"make_batch({batch_size})", self.make_batch, batch_size)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise ModelFileError(
                f"{self.path}: make_batch({batch_size}) returned {type(result).__name__}, "
                "expected a pair (inputs, targets)"
            )
        inputs, targets = result
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelFileError(
                f"{self.path}: make_batch({batch_size}) inputs must be a tensor or a tuple of tensors"
            )
        if not isinstance(targets, torch.Tensor):
            raise ModelFileError(f"{self.path}: make_batch({batch_size}) targets must be a tensor")
        if inputs[0].shape[0] != batch_size:
            raise ModelFileError(
                f"{self.path}: make_batch({batch_size}) gave inputs with leading dimension "
                f"{inputs[0].shape[0]}, expected the batch size {batch_size}"
            )
        return inputs, targets

    def loss(self, output, targets):
        """Call the loss function; check that it returns a scalar tensor."""
        import torch

        loss = self._call("loss_fn(output, targets)", self.loss_fn, output, targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ModelFileError(f"{self.path}: loss_fn must return a scalar tensor")
        return loss

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except ModelFileError:
            raise
        except Exception as exc:  # the user's code failed: name it in one line
            raise ModelFileError(f"{self.path}: {what} raised {type(exc).__name__}: {_first_line(exc)}") from exc


def load_model_file(path: str) -> ModelFile:
    """Import ``path`` (a .py file or ``package.module``) and check the contract."""
    module = _import(path)
    build_model = getattr(module, "build_model", None)
    make_batch = getattr(module, "make_batch", None)
    for name, fn in (("build_model", build_model), ("make_batch", make_batch)):
        if fn is None:
            raise ModelFileError(f"{path}: defines no {name}(); see the model-file contract in the README")
        if not callable(fn):
            raise ModelFileError(f"{path}: {name} is not a function")
    loss_fn = getattr(module, "loss_fn", None) or default_loss_fn
    if not callable(loss_fn):
        raise ModelFileError(f"{path}: loss_fn is not a function")
    training = getattr(module, "TRAINING", None) or {}
    return ModelFile(path, build_model, make_batch, loss_fn, _check_training(path, training))


def load_unless_trace(model: str) -> ModelFile | None:
    """The model file behind a command's MODEL argument, loaded once; None for a trace.json."""
    return None if str(model).endswith(".json") else load_model_file(model)


def training_defaults(model_file: ModelFile | None) -> TrainingDefaults:
    """The model file's defaults (:attr:`ModelFile.defaults`); :class:`TrainingDefaults` for a trace.json."""
    return model_file.defaults if model_file is not None else TrainingDefaults()


def _check_training(path: str, training: Any) -> dict:
    if not isinstance(training, dict):
        raise ModelFileError(f"{path}: TRAINING must be a dict, got {type(training).__name__}")
    for key, value in training.items():
        kind = TRAINING_KEYS.get(key)
        if kind is None:
            raise ModelFileError(f"{path}: TRAINING has unknown key {key!r}; known: {', '.join(TRAINING_KEYS)}")
        if kind is str:
            ok = isinstance(value, str)
        else:  # a positive number; an int is fine where a float is expected
            allowed = (int, float) if kind is float else (int,)
            ok = isinstance(value, allowed) and not isinstance(value, bool) and value > 0
        if not ok:
            wanted = "a string" if kind is str else f"a positive {kind.__name__}"
            raise ModelFileError(f"{path}: TRAINING[{key!r}] must be {wanted}, got {value!r}")
    if training.get("optimizer", TrainingDefaults.optimizer) not in OPTIMIZERS:
        raise ModelFileError(f"{path}: TRAINING['optimizer'] must be one of {', '.join(OPTIMIZERS)}")
    return dict(training)


def _import(path: str):
    file = Path(path)
    if path.endswith(".py") or file.exists():
        if not file.is_file():
            raise ModelFileError(f"{path}: no such model file")
        name = f"_shard_planner_model_{abs(hash(str(file.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ModelFileError(f"{path}: cannot be imported as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except SyntaxError as exc:
            sys.modules.pop(name, None)
            raise ModelFileError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from exc
        except Exception as exc:
            sys.modules.pop(name, None)
            raise ModelFileError(f"{path}: importing it raised {type(exc).__name__}: {_first_line(exc)}") from exc
        return module
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        raise ModelFileError(f"{path}: no such file or importable module ({_first_line(exc)})") from exc
    except SyntaxError as exc:
        raise ModelFileError(f"{path}: syntax error in {exc.filename}:{exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        raise ModelFileError(f"{path}: importing it raised {type(exc).__name__}: {_first_line(exc)}") from exc
