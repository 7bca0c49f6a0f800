# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AsyncPipe in real 2-rank scripts that end (the test engine's ranks never do: they return to the engine)."""

from ._util import run_scripts

# Rank 1, the last stage, fails after its forward, before the backward (its loss raises, say), and its script ends.
_SCRIPT = """
import sys

import torch
import torch.distributed as dist
from torch import nn

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
from fairscale.nn.pipe import AsyncPipe

pipe = AsyncPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], group=dist.group.WORLD, chunks=2)
out = pipe(torch.randn(4, 4))
if pipe.final_stage:
    raise ValueError("the loss failed")
print("the first stage returned", flush=True)
"""

# Two interpreters import torch; the first stage is stopped right after the last one ends.
_TIMEOUT_S = 60.0


def test_last_stage_ends_before_backward(tmp_path) -> None:
    """When the last stage's process ends before its output's backward, the first stage, which waits for the
    gradients, stops with PipelineAbortedError (and exits) instead of waiting until the process-group timeout."""
    results = run_scripts(_SCRIPT, {"world": []}, str(tmp_path), _TIMEOUT_S)
    (first_rc, first_out), (last_rc, last_out) = results[("world", 0)], results[("world", 1)]
    assert last_rc == 1 and "ValueError: the loss failed" in last_out, last_out
    assert "the earlier stages were stopped with PipelineAbortedError" in last_out, last_out
    assert first_rc == 1 and "PipelineAbortedError: pipeline stage 1 failed" in first_out, (first_rc, first_out)


def test_last_stage_ends_after_destroying_the_group(tmp_path) -> None:
    """The script destroys the process group first (in a ``finally``): nothing can stop the first stage any more, and
    the warning said it was stopped (found by a review). It now says the earlier stages wait until their timeout."""
    script = _SCRIPT.replace(
        'rank, store = int(sys.argv[1]), sys.argv[2]\ndist.init_process_group("gloo", store=dist.FileStore(store, 2), '
        "rank=rank, world_size=2)",
        'import datetime\nrank, store = int(sys.argv[1]), sys.argv[2]\ndist.init_process_group("gloo", '
        "store=dist.FileStore(store, 2), rank=rank, world_size=2, timeout=datetime.timedelta(seconds=5))",
    )
    script = script.replace(
        "if pipe.final_stage:\n    raise", "if pipe.final_stage:\n    dist.destroy_process_group()\n    raise"
    )
    assert "timedelta(seconds=5)" in script and "destroy_process_group" in script
    results = run_scripts(script, {"world": []}, str(tmp_path), _TIMEOUT_S)
    (first_rc, first_out), (last_rc, last_out) = results[("world", 0)], results[("world", 1)]
    assert last_rc == 1 and "after its process group was destroyed" in last_out, last_out
    assert "were stopped with PipelineAbortedError" not in last_out, last_out
    assert first_rc not in (0, "hung"), (first_rc, first_out)  # the group's timeout ended it


# The same from multiprocessing children started by fork (Linux's default for mp.Process): they end with os._exit,
# which skips atexit, and the first stage waited until the process-group timeout (found by a fuzz).
_FORKED = """
import multiprocessing as mp
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from fairscale.nn.pipe import AsyncPipe


def body(rank, store, results):
    import datetime

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    pipe = AsyncPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], group=dist.group.WORLD, chunks=2)
    start = time.monotonic()
    try:
        global KEPT
        KEPT = pipe(torch.randn(4, 4))  # the last stage keeps its output and never back-propagates it
        results.put((rank, "returned", time.monotonic() - start))
    except Exception as e:
        results.put((rank, type(e).__name__, time.monotonic() - start))


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    store = tempfile.mkdtemp() + "/store"
    procs = [ctx.Process(target=body, args=(r, store, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    print(sorted(results.get(timeout=5) for _ in range(2)), flush=True)
"""


def test_forked_last_stage_ends_before_backward(tmp_path) -> None:
    import ast
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as run_scripts: no hostname lookup
    script = tmp_path / "forked.py"
    script.write_text(_FORKED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    (first, first_outcome, first_s), (last, last_outcome, _) = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert (first, last, last_outcome) == (0, 1, "returned"), done.stdout
    # Stopped when the last stage's process ended, not at the 120 s process-group timeout.
    assert first_outcome == "PipelineAbortedError" and first_s < 60, done.stdout
