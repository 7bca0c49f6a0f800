# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Parse PyTorch version strings into comparable tuples."""

import logging
import re
from typing import Set, Tuple

import torch

__all__ = ["torch_version"]

# "major.minor.patch" followed by anything (pre-release tags, local build suffixes).
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(.*)$")
# A pre-release tag right after the numbers: "a0", "b1", "rc2", ".dev20240101", "dev" ...
_PRE_RELEASE_RE = re.compile(r"^\.?(a|b|rc|dev|alpha|beta|pre)", re.IGNORECASE)

_warned: Set[str] = set()


def torch_version(version: str = torch.__version__) -> Tuple[int, ...]:
    """Return the ``(major, minor, patch)`` tuple of a PyTorch version string.

    Comparing tuples (``torch_version() >= (2, 1, 0)``) is how the rest of the package gates
    behaviour on the installed torch.

    Args:
        version (str): the version string to parse, ``torch.__version__`` by default. Local build
            suffixes such as ``+cpu`` or ``+cu121`` are ignored.

    Returns:
        Tuple[int, ...]: a 3-tuple of ints, or an empty tuple if the string does not start with
        ``major.minor.patch``. A pre-release (``2.4.0a0``, ``2.4.0.dev20240101``, ``2.4.0rc1``)
        parses to its base release and logs a warning once per distinct string, because
        pre-releases may lack features of the release they precede.
    """
    match = _VERSION_RE.match(version)
    if match is None:
        return tuple()
    suffix = match.group(4).split("+", 1)[0]
    if _PRE_RELEASE_RE.match(suffix) and version not in _warned:
        _warned.add(version)
        logging.warning(f"Pytorch pre-release version {version} - assuming intent to test it")
    return tuple(int(match.group(i)) for i in range(1, 4))
