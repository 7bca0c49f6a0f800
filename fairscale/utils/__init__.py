# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The helper modules under their names before fairscale 0.4.7, so that older client code still imports.

Upstream renamed ``fairscale/utils/`` to ``fairscale/internal/`` (and moved its test helpers to
``fairscale/fair_dev/testing/``) in 0.4.7, and 0.4.13 has no ``fairscale.utils``. Client code still imports the old
names: fairseq's and metaseq's FSDP wrappers do ``from fairscale.utils.testing import DummyProcessGroup`` (metaseq
inside the ``try`` that decides whether FSDP is available at all, so the failed import silently turned FSDP off), and
the feature branches this fork builds on import ``fairscale.utils.*`` throughout.

Each old name is the moved module itself, not a copy: ``fairscale.utils.containers is fairscale.internal.containers``,
so classes, ``isinstance`` checks and module state are shared. The one exception is :mod:`fairscale.utils.testing`,
which gives ``DummyProcessGroup`` without importing pytest (clients use it in training) and every other name of
``fairscale.fair_dev.testing.testing`` on first use. A name that never existed raises ``ModuleNotFoundError`` as usual.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Optional, Sequence

# The package itself exported this (`from fairscale.utils import torch_version`, in the code of that time).
from fairscale.internal.version import torch_version as torch_version

# Old module name (under fairscale.utils) -> where the module lives now.
MOVED_MODULES = {
    "containers": "fairscale.internal.containers",
    "object": "fairscale.internal.object",
    "parallel": "fairscale.internal.parallel",
    "params": "fairscale.internal.params",
    "reduce_scatter_bucketer": "fairscale.internal.reduce_scatter_bucketer",
    "state_dict": "fairscale.internal.state_dict",
    "version": "fairscale.internal.version",
    "golden_testing_data": "fairscale.fair_dev.testing.golden_testing_data",
    "testing_memory": "fairscale.fair_dev.testing.testing_memory",
}


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old name as the already-imported module at its new place (executed once, under its new name)."""

    def __init__(self) -> None:
        self._spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name.rpartition(".")[2]])
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Importing the new name ran the module already: running it again would make a second copy of its state.
        # The import system gave it this alias's spec meanwhile; its own spec (what reload() uses) goes back.
        module.__spec__ = self._spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``fairscale.utils.<old name>`` for the names in :data:`MOVED_MODULES`, and nothing else."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader())


def __getattr__(name: str) -> ModuleType:
    # `import fairscale.utils` then `fairscale.utils.containers`: the old package had its modules as attributes once
    # anything had imported them (fairscale.nn did), so code could reach them without importing each.
    if name in MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Appended (not prepended): real files of this package, such as testing.py, are found first by the path finder.
# Looked up by name, not class: importlib.reload() of this package makes a new class.
if not any(
    type(finder).__module__ == __name__ and type(finder).__qualname__ == "_MovedModuleFinder"
    for finder in sys.meta_path
):
    sys.meta_path.append(_MovedModuleFinder())
