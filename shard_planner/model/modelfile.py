"""Load a user's model file and check it against the contract.

The contract (README, "The model file"): a Python file, or an importable ``package.module``, that
defines

- ``build_model()`` -> ``torch.nn.Module``, loading no weights; it is called under the meta device or
  FakeTensorMode by the tracer, and on the real device by the executor;
- ``make_batch(batch_size)`` -> ``(inputs, targets)`` of synthetic data; ``inputs`` is a tensor or a
  tuple of tensors passed positionally to the model, or a dict of tensors passed as keywords (the way
  a transformers model takes ``input_ids=``, ``labels=``); ``make_batch`` may also return the dict
  alone (no targets: the model computes its own loss from ``labels`` in the inputs);
- optionally ``loss_fn(output, targets)`` -> scalar loss (default: :func:`default_loss_fn`: the
  ``.loss`` a transformers ModelOutput carries, else cross-entropy over the last dim of the output or
  of its ``.logits``);
- optionally ``TRAINING``: a dict of defaults (``micro_batch``, ``seq_len``, ``optimizer``, ``lr``, ``loss``: one of
  shard_planner/plan/loss.py's ``LOSSES``, the loss over the output layer, shard_planner/model/loss.py).

Every violation raises :class:`ModelFileError` naming the file and the problem in one line. The model
is called with a batch's inputs in one place, :meth:`ModelFile.forward`; a transformers config file
(shard_planner/model/hf.py) is loaded as a ModelFile too, so nothing downstream asks where the model came from.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shard_planner.errors import ModelFileError
from shard_planner.errors import first_line as _first_line
from shard_planner.plan import DEFAULT_LR, OPTIMIZERS
from shard_planner.plan.loss import IGNORE_INDEX, LOSSES, MODEL

logger = logging.getLogger(__name__)

TRAINING_KEYS = {"micro_batch": int, "seq_len": int, "optimizer": str, "lr": float, "loss": str}


@dataclass(frozen=True)
class TrainingDefaults:
    """What a command uses where the user gives no value: the model file's TRAINING, else these (also for
    a trace.json, which carries no TRAINING)."""

    micro_batch: int = 1
    optimizer: str = "adamw"
    lr: float = DEFAULT_LR

    @classmethod
    def of(cls, training: dict) -> "TrainingDefaults":
        """The defaults a TRAINING dict names (``seq_len`` is the model's, not the plan's: left out)."""
        return cls(**{k: training[k] for k in ("micro_batch", "optimizer", "lr") if k in training})



def default_loss_fn(output, targets):
    """The loss the model computed itself (a transformers ModelOutput's ``.loss``, present when the inputs
    held ``labels``); else cross-entropy over the last dimension of the output (or of its ``.logits``),
    computed in fp32 as language-model trainers do, skipping targets equal to -100."""
    import torch.nn.functional as F

    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    logits = getattr(output, "logits", output)
    if targets is None:
        raise ValueError("the model computed no loss (no labels in the inputs?) and make_batch gave no targets")
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


# Plain values a keyword input may also be (a flag such as CLIPModel's ``return_loss=True``).
PLAIN_INPUTS = (bool, int, float, str, type(None))


def input_tensors(inputs) -> list:
    """The tensors of a batch's inputs (a tuple, or a dict of keyword inputs, less its plain values), in order."""
    if isinstance(inputs, dict):
        return [v for v in inputs.values() if not isinstance(v, PLAIN_INPUTS)]
    return list(inputs)


def map_inputs(inputs, fn):
    """``inputs`` with ``fn`` applied to every tensor, in the same form (tuple or dict; plain values kept)."""
    if isinstance(inputs, dict):
        return {name: v if isinstance(v, PLAIN_INPUTS) else fn(v) for name, v in inputs.items()}
    return tuple(fn(t) for t in inputs)


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file: its functions and defaults, checked against the contract."""

    path: str  # as given by the user: a file path or package.module
    build_model: Callable[[], Any]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]
    training: dict = field(default_factory=dict)
    # a transformers config's fine-tune (--lora, --qlora, --freeze), LoRA targets named: what a plan records
    finetune: Any = None
    # the loss over the output layer (shard_planner/model/loss.py): "model" is loss_fn; chunked or fused are
    # installed on the output layer by build() and computed by forward() and loss() (training["loss"] names it)
    loss_name: str = MODEL
    shift_labels: bool = False  # a transformers causal LM's labels become the targets, shifted by one token

    @property
    def defaults(self) -> TrainingDefaults:
        """The TRAINING micro-batch, optimizer and learning rate, with :class:`TrainingDefaults` where it
        names none."""
        return TrainingDefaults.of(self.training)

    def build(self):
        """Call ``build_model()`` and check that it returns an nn.Module."""
        import torch.nn as nn

        model = self._call("build_model()", self.build_model)
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{self.path}: build_model() returned {type(model).__name__}, expected a torch.nn.Module"
            )
        if self.loss_name != MODEL:
            from shard_planner.model.loss import HeadLoss

            try:
                HeadLoss.install(model, self.loss_name)
            except ModelFileError as exc:
                raise ModelFileError(f"{self.path}: {exc}") from exc
        return model

    def batch(self, batch_size: int) -> tuple[tuple | dict, Any]:
        """Call ``make_batch(batch_size)``; return ``(inputs, targets)``: inputs as a tuple (positional) or
        a dict (keyword), targets a tensor, or None where the inputs carry the labels."""
        import torch

        what = f"make_batch({batch_size})"
        result = self._call(what, self.make_batch, batch_size)
        if isinstance(result, dict):
            result = (result, None)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise ModelFileError(
                f"{self.path}: {what} returned {type(result).__name__}, expected a pair (inputs, targets) "
                "or a dict of keyword inputs"
            )
        inputs, targets = result
        if self.shift_labels and targets is None and isinstance(inputs, dict) and "labels" in inputs:
            from shard_planner.model.loss import shifted_labels

            inputs = dict(inputs)
            targets = shifted_labels(inputs.pop("labels"))
        if not isinstance(inputs, dict):
            inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        tensors = input_tensors(inputs)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ModelFileError(
                f"{self.path}: {what} inputs must be a tensor or a tuple of tensors (or a dict of tensors, passed as "
                "keywords, which may also hold plain values: flags, numbers, strings)"
            )
        if isinstance(inputs, dict) and not all(isinstance(k, str) and k.isidentifier() for k in inputs):
            raise ModelFileError(f"{self.path}: {what} keyword inputs must be named by identifiers")
        if not (isinstance(targets, torch.Tensor) or (targets is None and isinstance(inputs, dict))):
            raise ModelFileError(f"{self.path}: {what} targets must be a tensor (or none, with keyword inputs)")
        if tensors[0].dim() == 0 or tensors[0].shape[0] != batch_size:
            got = tensors[0].shape[0] if tensors[0].dim() else "none (a 0-d tensor)"
            raise ModelFileError(
                f"{self.path}: {what} gave inputs with leading dimension {got}, expected the batch size {batch_size}"
            )
        return inputs, targets

    def forward(self, model, inputs, targets=None):
        """Call ``model`` with a batch's inputs: ``model(**inputs)`` for keyword inputs, else
        ``model(*inputs)``; a fused loss reads ``targets`` meanwhile. Every caller (tracer, executor, timing)
        goes through here."""
        call = (lambda: model(**inputs)) if isinstance(inputs, dict) else (lambda: model(*inputs))
        if self.loss_name == MODEL:
            return call()
        from shard_planner.model.loss import HeadLoss

        return HeadLoss.of(model).run(call, targets)

    def loss(self, output, targets):
        """Call the loss function (the chunked or fused loss where one is installed); check that it returns a
        scalar tensor."""
        import torch

        if self.loss_name != MODEL:
            from shard_planner.model.loss import output_loss

            loss = self._call(f"the {self.loss_name} loss", output_loss, self.loss_name, output, targets)
        else:
            loss = self._call("loss_fn(output, targets)", self.loss_fn, output, targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ModelFileError(f"{self.path}: loss_fn must return a scalar tensor")
        return loss

    def _call(self, what: str, fn, *args):
        with _guarded(self.path, what):  # the user's code failed or tried to exit: name it in one line
            return fn(*args)


def load_model_file(path: str, hf_options=None) -> ModelFile:
    """Import ``path`` (a .py file or ``package.module``) and check the contract; a transformers config
    (a config.json, or a folder holding one) is built by :mod:`shard_planner.model.hf` with ``hf_options``
    (an :class:`~shard_planner.model.hf.HfOptions`: the task and sequence length where the config does not say)."""
    from shard_planner.model import hf

    asked = hf_options.loss if hf_options is not None else None
    if hf.config_file(path) is not None:
        made = hf.load_hf_config(str(path), hf_options or hf.HfOptions())
        loss = asked or MODEL
        if loss != MODEL and made.task != "causal-lm":
            raise ModelFileError(f"{path}: --loss {loss} applies to a causal language model (this config builds a "
                                 f"{made.task} model): use --loss model")
        return ModelFile(str(path), made.build_model, made.make_batch, default_loss_fn,
                         _with_loss(made.training, loss), made.finetune, loss, shift_labels=loss != MODEL)
    if hf_options is not None and hf_options.finetune is not None:
        raise ModelFileError(f"{path}: --lora, --qlora and --freeze apply to a transformers config (config.json) "
                             "only; a model file freezes parameters itself, in build_model()")
    if hf_options is not None and hf_options != hf.HfOptions(loss=asked):
        raise ModelFileError(f"{path}: --hf-task and --seq-len apply to a transformers config (config.json) only")
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
    training = _check_training(path, getattr(module, "TRAINING", None) or {})
    loss = asked or training.get("loss", MODEL)
    return ModelFile(path, build_model, make_batch, loss_fn, _with_loss(training, loss), loss_name=loss)


def _with_loss(training: dict, loss: str) -> dict:
    """``training`` naming the loss the model file is built with: ``loss`` unless it is the model's own (a
    trace of it, and its trace-cache key, then read as before the loss was chosen)."""
    rest = {k: v for k, v in training.items() if k != "loss"}
    return rest if loss == MODEL else {**rest, "loss": loss}


def is_trace_file(model: str) -> bool:
    """Whether a command's MODEL argument is a trace.json: a .json that is not a transformers config."""
    from shard_planner.model import hf

    return str(model).endswith(".json") and hf.config_file(model) is None


def load_unless_trace(model: str, hf_options=None) -> ModelFile | None:
    """The model file behind a command's MODEL argument, loaded once; None for a trace.json
    (:func:`is_trace_file`)."""
    if is_trace_file(model):
        return None
    return load_model_file(model, hf_options)


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
    if training.get("loss", MODEL) not in LOSSES:
        raise ModelFileError(f"{path}: TRAINING['loss'] must be one of {', '.join(LOSSES)}")
    return dict(training)


def _import(path: str):
    file = Path(path)
    if file.is_dir():
        raise ModelFileError(f"{path}: is a folder without a config.json, expected a model file (path/to/model.py or "
                             "package.module) or a transformers config (config.json or a folder holding one)")
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
            with _guarded(path, "importing it"):
                spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module
    try:
        with _guarded(path, "importing it"):
            return importlib.import_module(path)
    except ModelFileError as exc:
        if isinstance(exc.__cause__, ModuleNotFoundError):
            raise ModelFileError(f"{path}: no such file or importable module ({_first_line(exc.__cause__)})") from exc
        raise


@contextmanager
def _guarded(path: str, what: str):
    """Run the user's code: whatever it raises or does to leave (``sys.exit()``, ``exit(0)``, a
    ``KeyboardInterrupt`` of its own) becomes one :class:`ModelFileError` naming the file. A real Ctrl-C
    (SIGINT received meanwhile) stays a KeyboardInterrupt."""
    with _sigint_watch() as interrupted:
        try:
            yield
        except ModelFileError:
            raise
        except SyntaxError as exc:
            if exc.filename and Path(exc.filename).resolve() != Path(path).resolve():  # in a module it imports
                raise ModelFileError(f"{path}: syntax error in {exc.filename}:{exc.lineno}: {exc.msg}") from exc
            line = f":{exc.lineno}" if exc.lineno else ""  # none for a file with NUL bytes (not Python source)
            raise ModelFileError(f"{path}{line}: syntax error: {exc.msg}") from exc
        except SystemExit as exc:
            code = "" if exc.code is None else f"({exc.code!r})"
            raise ModelFileError(f"{path}: {what} exited (sys.exit{code} or exit{code}): a model file must "
                                 "not exit") from exc
        except KeyboardInterrupt as exc:
            if interrupted():
                raise
            raise ModelFileError(f"{path}: {what} raised KeyboardInterrupt") from exc
        except Exception as exc:
            raise ModelFileError(f"{path}: {what} raised {type(exc).__name__}: {_first_line(exc)}") from exc


@contextmanager
def _sigint_watch():
    """Yield a function telling whether SIGINT arrived while the block ran (the main thread only; elsewhere
    it says no, since only the main thread receives signals)."""
    seen = []
    main = threading.current_thread() is threading.main_thread()
    if main:
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):
            seen.append(signum)
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # SIG_DFL, or a handler set outside Python: end the run
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: bool(seen)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
