"""Tracing without importing torch._dynamo, which the trace never runs.

[Note: torch._dynamo during a trace]
``FakeTensorMode.__init__`` reads two flags with ``import torch._dynamo.config``, and every
``TorchDispatchMode.__torch_dispatch__`` (FakeTensorMode's and ours) is wrapped by
``torch._disable_dynamo``, which on its first call runs ``import torch._dynamo`` to get
``torch._dynamo.disable`` (torch/_subclasses/fake_tensor.py, torch/utils/_python_dispatch.py
``__init_subclass__``, torch/_compile.py, torch 2.13). Importing the package runs its ``__init__``,
which imports the whole compiler (convert_frame, symbolic_convert, the variable trackers, ...): 1.2-1.7 s
on this 2-core machine, the largest single cost of ``plan`` after ``import torch`` itself, and all of it
for nothing: the trace compiles nothing, and ``torch._dynamo.disable(fn)`` outside a compiled region
calls ``fn`` unchanged.

:func:`dynamo_deferred` therefore puts a package object in ``sys.modules["torch._dynamo"]`` for the
duration of a trace, unless the real one is already imported (then it does nothing):

- its ``__path__`` is the real package's, so a submodule (``torch._dynamo.config``) imports from its own
  file as usual, and reads the same defaults;
- ``disable(fn)`` returns ``fn``: what the real one does for calls made outside a compiled region;
- any other attribute (``assume_constant_result``, ...) or submodule (``torch._dynamo.source``, which
  ``FakeTensorMode`` imports to convert a real tensor a model file made at import time): the real package
  is imported there and then (before the submodule's own code runs: the package's submodules import each
  other in the order its ``__init__`` gives, and fail on their own) and answers, so a trace that needs the
  compiler gets it, at today's cost, never an error.

On exit the package object and the submodules imported through it leave ``sys.modules``, and the
``__dynamo_disable`` each wrapped dispatch function cached (``torch._compile._disable_dynamo``) is
dropped, so a later ``import torch._dynamo`` in the same process (a test suite, ``torch.compile``)
imports and wraps as if this had never happened. The traces are identical with and without it
(tests/trace/test_dynamo_deferred.py).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

PACKAGE = "torch._dynamo"
LIGHT_SUBMODULES = frozenset({PACKAGE + ".config"})  # what FakeTensorMode reads; imports no sibling
_DISABLE_CACHE = "__dynamo_disable"  # the attribute torch._compile._disable_dynamo caches on the function


@contextmanager
def dynamo_deferred() -> Iterator[None]:
    """Run the block with ``torch._dynamo`` imported only if something in it needs more than
    ``disable`` and ``config`` ([Note: torch._dynamo during a trace])."""
    if PACKAGE in sys.modules:
        yield
        return
    before = set(sys.modules)
    disabled: list = []
    package = _deferred_package(disabled)
    finder = _RealPackageFirst(package)
    sys.modules[PACKAGE] = package
    setattr(torch, "_dynamo", package)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        if sys.modules.get(PACKAGE) is package:
            _remove(package, before)
        for fn in disabled:  # wrapped by the real torch._dynamo.disable when next called
            if getattr(fn, _DISABLE_CACHE, None) is fn:
                delattr(fn, _DISABLE_CACHE)


def _deferred_package(disabled: list) -> types.ModuleType:
    spec = importlib.util.find_spec(PACKAGE)
    package = types.ModuleType(PACKAGE)
    package.__spec__ = spec
    package.__file__ = spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    package.__package__ = PACKAGE

    def disable(fn=None, recursive=True, *, reason=None, wrapping=True):
        """``torch._dynamo.disable`` outside a compiled region: the function itself."""
        if fn is None:
            return lambda f: disable(f, recursive, reason=reason, wrapping=wrapping)
        disabled.append(fn)
        return fn

    def __getattr__(name: str):
        return getattr(_import_real(package), name)

    package.disable = disable
    package.__getattr__ = __getattr__
    return package


class _RealPackageFirst(importlib.abc.MetaPathFinder):
    """Imports the real package before any of its submodules but ``config`` (which imports no sibling)."""

    def __init__(self, package: types.ModuleType):
        self.package = package

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(PACKAGE + ".") or fullname in LIGHT_SUBMODULES:
            return None
        if sys.modules.get(PACKAGE) is not self.package:
            return None  # the real package is imported (or importing): the usual finders
        _import_real(self.package)
        module = sys.modules.get(fullname)
        # Imported by the package itself: that module, not a second copy (None: the usual finders load it).
        return importlib.util.spec_from_loader(fullname, _Imported(module)) if module is not None else None


class _Imported(importlib.abc.Loader):
    """Loads a module already in ``sys.modules`` as itself, keeping its own ``__spec__``."""

    def __init__(self, module: types.ModuleType):
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # importlib set the finder's spec on it


def _import_real(package: types.ModuleType) -> types.ModuleType:
    """The real package, imported in place of ``package`` (a block asked for more than it offers)."""
    if sys.modules.get(PACKAGE) is package:
        logger.debug("a traced model needs torch._dynamo itself: importing it")
        _unregister(package)  # torch.__getattr__ then imports lazily: the real package, also mid-import
    return importlib.import_module(PACKAGE)


def _unregister(package: types.ModuleType) -> None:
    """``package`` leaves ``sys.modules`` and ``torch``'s attributes."""
    del sys.modules[PACKAGE]
    if torch.__dict__.get("_dynamo") is package:
        delattr(torch, "_dynamo")


def _remove(package: types.ModuleType, before: set[str]) -> None:
    _unregister(package)
    for name in [n for n in sys.modules if n.startswith(PACKAGE + ".") and n not in before]:
        del sys.modules[name]
