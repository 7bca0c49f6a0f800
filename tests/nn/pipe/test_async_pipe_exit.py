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
