# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Parse PyTorch version strings into comparable tuples."""

import logging
import re
from typing import Set, Tuple

import torch

__all__ = ["torch_version"]

# Three integers, each pair separated by any one character (upstream's unescaped ".": "1x2y3" parses as 1.2.3,
# kept for drop-in equality), a suffix without "+" (a pre-release tag), then an optional "+local" build part.
_VERSION_RE = re.compile(r"^(\d+).(\d+).(\d+)([^+]*)(\+.*)?$")

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
        ``major.minor.patch`` (any one character separates the numbers, as upstream). A version
        with a suffix before ``+`` (``2.4.0a0``, ``2.4.0.dev20240101``, ``2.4.0rc1``) parses to
        its base release and logs a warning once per distinct string, because pre-releases may
        lack features of the release they precede.
    """
    match = _VERSION_RE.match(version)
    if match is None:
        return tuple()
    # Any suffix before "+" counts as a pre-release, as upstream ("2.4.0post1" too); warned once per string (upstream
    # warns at every call: every version check of a run logged it again).
    if match.group(4) and version not in _warned:
        _warned.add(version)
        logging.warning(f"Pytorch pre-release version {version} - assuming intent to test it")
    return tuple(int(match.group(i)) for i in range(1, 4))
