# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""WeiGit: git-like versioning of model weights.

``Repo`` needs ``pip install pygit2`` (and is faster with ``pgzip``); it is imported on first use and raises
``ImportError`` saying so when missing (upstream printed a message and exited at import). The signal sparsity tools
are pure torch and always importable.
"""

from typing import Any, List

from .signal_sparsity import Algo, SignalSparsity, random_sparse_mask
from .signal_sparsity_profiling import EnergyConcentrationProfile
from .version import __version_tuple__

__version__ = ".".join(str(x) for x in __version_tuple__)

__all__: List[str] = []


def __getattr__(name: str) -> Any:
    if name == "Repo":
        from .pygit import import_pygit2

        import_pygit2()
        from .repo import Repo

        return Repo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
