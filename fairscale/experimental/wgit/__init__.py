# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""WeiGit: git-like versioning of model weights.

``Repo`` needs ``pip install pygit2`` (and is faster with ``pgzip``); creating one raises ``ImportError`` saying so
when pygit2 is missing (upstream printed a message and exited at import). The signal sparsity tools are pure torch
and always importable.
"""

from typing import List

from .repo import Repo as Repo  # noqa: F401  # importable without pygit2; Repo() checks for it
from .signal_sparsity import Algo, SignalSparsity, random_sparse_mask
from .signal_sparsity_profiling import EnergyConcentrationProfile
from .version import __version_tuple__

__version__ = ".".join(str(x) for x in __version_tuple__)

__all__: List[str] = []
