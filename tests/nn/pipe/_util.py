# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Helpers shared by the pipe tests."""

import os
import subprocess
import sys
import time
from typing import Any, Dict, List

import pytest
from torch import nn

from fairscale.internal.device import accelerator_available
from fairscale.nn.pipe.skip import pop, skippable, stash

NEEDS_CUDA = pytest.mark.skipif(not accelerator_available(), reason="cuda required")


def cuda_devices():
    """``["cpu"]`` plus ``"cuda"`` when a GPU exists: the device parameter of tests that run on both."""
    return ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


def run_scripts(script: str, worlds: Dict[str, List[str]], directory: str, timeout: float) -> Dict[Any, Any]:
    """Run ``script`` as real processes: one per rank of each world, all at once, each world with its own store.

    The script gets ``rank``, the ``FileStore`` path of its world and the world's extra arguments on its command
    line (``python script rank store *args``) and creates the gloo group itself; the world size is 2. A process
    still running after ``timeout`` seconds (counted for all of them together) is killed and reported as ``"hung"``.

    Returns:
        ``{(world, rank): (exit code or "hung", stdout and stderr)}``.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as the test engine's ranks: no hostname lookup
    path = os.path.join(directory, "script.py")
    with open(path, "w") as f:
        f.write(script)
    processes = {}
    for name, args in worlds.items():
        os.makedirs(os.path.join(directory, name))
        store = os.path.join(directory, name, "store")
        for rank in range(2):
            processes[(name, rank)] = subprocess.Popen(
                [sys.executable, path, str(rank), store, *args],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
    deadline = time.monotonic() + timeout
    results: Dict[Any, Any] = {}
    for key, process in processes.items():
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results[key] = (process.returncode, output)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            results[key] = ("hung", output)
    return results


@skippable(stash=["s"])
class StashInput(nn.Module):
    """Stashes its input as skip ``s`` and passes it on."""

    def forward(self, x):
        yield stash("s", x)
        return x  # noqa: B901


@skippable(pop=["s"])
class PopAdd(nn.Module):
    """Adds the popped skip ``s`` to its input."""

    def forward(self, x):
        s = yield pop("s")
        return x + s  # noqa: B901
