"""autoshard: plan and run sharded PyTorch training from one ILP.

    plan = autoshard.plan(model, cluster, example_inputs)          # no process group needed
    dist_model = autoshard.compile(model, cluster, example_inputs)  # inside torch.distributed

The package follows the pipeline: ``passes/`` (trace, annotate, strategies, rewrite) and
``solver/`` (the ILP) under a small core (``_torch``, ``errors``, ``notation``, ``precision``);
``cluster/`` (the hardware and its cost model); ``planning/`` (plans, meshes, baselines);
``report/``; ``runtime/``; ``zoo/``; and ``api``, ``build`` and ``cli`` on top.

Its names load on first use, not at import: importing torch takes seconds, and ``autoshard
--help`` (whose entry point lives in this package) must not pay for it.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys

from autoshard import errors

# public name -> the module that defines it
_PUBLIC = {"compile": "autoshard.api", "plan": "autoshard.api", "trace": "autoshard.api",
           "Cluster": "autoshard.cluster", "DeviceSpec": "autoshard.cluster", "LinkSpec": "autoshard.cluster",
           "Plan": "autoshard.planning.plan", "MixedPrecision": "autoshard.precision"}
# module paths documented before the subpackages -> where the module lives now
_MOVED = {f"{__name__}.{old}": f"{__name__}.{new}" for old, new in {
    "baselines": "planning.baselines", "checkpoint": "runtime.checkpoint", "launch": "runtime.launch",
    "memtrack": "runtime.memtrack", "simulate": "runtime.simulate"}.items()}

__all__ = ["Cluster", "DeviceSpec", "LinkSpec", "MixedPrecision", "Plan", "compile", "errors", "plan", "trace"]


def __getattr__(name: str):
    if name in _PUBLIC:
        importlib.import_module("autoshard._torch")  # first: it checks the torch version before anything uses torch
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif not name.startswith("__"):
        # autoshard.api and the like, reachable without importing them first
        try:
            value = importlib.import_module(_MOVED.get(f"{__name__}.{name}", f"{__name__}.{name}"))
        except ModuleNotFoundError as exc:
            if exc.name not in (f"{__name__}.{name}", _MOVED.get(f"{__name__}.{name}")):
                raise
            value = None
    else:
        value = None
    if value is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import autoshard.checkpoint`` (and the other paths in ``_MOVED``) gives the module where it
    lives now, the same object under both names."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamps the old name's spec on the module it was handed; it keeps its own
        module.__spec__ = self.own_spec


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
if "torch" in sys.modules:   # torch is paid for already: check its version at import, as ever
    importlib.import_module("autoshard._torch")
