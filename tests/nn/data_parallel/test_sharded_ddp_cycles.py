# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel and OSS are freed by reference counting, not left to the cycle collector.

The wrapper used to sit in a reference cycle (wrapper -> gradient reducer -> the wrapper's bound
``_describe_reduction`` -> wrapper). Only the cycle collector freed it, and at interpreter exit that came after
``destroy_process_group()``: the wrapper's process group and buckets were then torn down during finalization, where
gloo aborted the process now and then (``terminate called without an active exception``, about 1 run in 10 of
the exit script below). These tests drop the objects with the collector off and check weak references to them.
"""

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not inside a rank
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.fair_dev.testing.testing_memory import alive_without_cycle_collector
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 60.0
REPO_ROOT = Path(__file__).resolve().parents[3]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, buffer: int, case: str) -> Dict[str, Any]:
    """A few steps of ShardedDataParallel + OSS; returns the objects to drop (the caller's only references)."""
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, oss, reduce_buffer_size=buffer, reduce_fp16=case == "fp16")
    for step in range(2):
        if case == "no_sync":
            with sdp.no_sync():
                sdp(_batch(step, rank)).sum().backward()
            sdp.reduce()
        else:
            sdp(_batch(step, rank)).sum().backward()
        oss.step()
        sdp.zero_grad()
    if case == "refresh":
        model[0].weight.requires_grad_(False)  # rebuilds hooks and buckets at the next forward
        sdp(_batch(2, rank)).sum().backward()
        oss.step()
        sdp.eval()
        sdp(_batch(3, rank))
    return {"wrapper": sdp, "reducer": sdp._reducer, "optimizer": oss, "inner optimizer": oss.optim, "model": model}


def _freed_body(rank: int, world_size: int, buffer: int, case: str) -> List[str]:
    return alive_without_cycle_collector(_train(rank, buffer, case))


@pytest.mark.parametrize(
    "buffer,case",
    [(2**20, "plain"), (0, "plain"), (0, "fp16"), (2**20, "no_sync"), (2**20, "refresh")],
    ids=["buckets", "no buckets", "reduce_fp16", "no_sync and reduce", "freeze and eval"],
)
def test_dropped_wrapper_and_optimizer_are_freed_without_the_cycle_collector(buffer: int, case: str) -> None:
    alive = run_distributed(_freed_body, 2, buffer, case, timeout=TIMEOUT)
    assert alive == [[], []], f"still alive after del with gc disabled (rank 0, rank 1): {alive}"


def _hooks(param: torch.Tensor) -> int:
    # torch keeps the post-accumulate-grad hooks in this dict (None before the first one is registered).
    return len(getattr(param, "_post_accumulate_grad_hooks", None) or {})


def _rewrap_body(rank: int, world_size: int) -> List[int]:
    """Wrap the same model three times, dropping each wrapper: only the live wrapper's hooks stay on the
    parameters, and the model then trains plainly with no hook left."""
    model = _mlp()
    counts = []
    for step in range(3):
        oss = OSS(model.parameters(), lr=0.1)
        sdp = ShardedDataParallel(model, oss)
        sdp(_batch(step, rank)).sum().backward()
        oss.step()
        counts.append(sum(_hooks(p) for p in model.parameters()))
        del sdp, oss
    counts.append(sum(_hooks(p) for p in model.parameters()))
    model(_batch(3, rank)).sum().backward()
    return counts


def test_dropped_wrapper_takes_its_hooks_off_the_parameters() -> None:
    params = len(list(_mlp().parameters()))
    for counts in run_distributed(_rewrap_body, 2, timeout=TIMEOUT):
        assert counts == [params, params, params, 0], counts


# A user script as Lightning runs one: train in a function, destroy the group at exit, never call gc.collect().
_EXIT_SCRIPT = textwrap.dedent("""
    import atexit
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn

    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS


    def main(rank: int, store: str) -> None:
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
        atexit.register(dist.destroy_process_group)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = OSS(model.parameters(), lr=0.1, momentum=0.9)
        wrapped = ShardedDataParallel(model, optimizer)
        for _ in range(3):
            wrapped(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            wrapped.zero_grad()


    main(int(sys.argv[1]), sys.argv[2])
    """)

# Each run costs two interpreter starts; the abort this guards against hit about 1 run in 10, so a few runs are a
# smoke test, and the weak-reference tests above are what fails deterministically.
EXIT_RUNS = 3


def test_script_that_destroys_the_group_at_exit_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = "1"  # two ranks on few cores
    for run in range(EXIT_RUNS):
        store = tmp_path / f"store{run}"
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), str(store)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        outputs = []
        try:
            for rank_process in ranks:
                outputs.append(rank_process.communicate(timeout=120)[0])
        finally:
            for rank_process in ranks:
                if rank_process.poll() is None:
                    rank_process.kill()
                    rank_process.wait()
        codes = [rank_process.returncode for rank_process in ranks]
        assert codes == [0, 0], f"run {run}: exit codes {codes}\n" + "\n".join(outputs)


def test_deep_copy_still_works_and_describes_the_copy() -> None:
    # The reducer holds the wrapper's method weakly now; a deep copy (one process, no group) must still work, as
    # with the strong method before, and the copy's reducer must describe the copy, not the original.
    model = _mlp()
    oss = OSS(model.parameters(), lr=0.1)
    sdp = ShardedDataParallel(model, oss)
    sdp(_batch(0, 0)).sum().backward()
    oss.step()
    clone = copy.deepcopy(sdp)
    describe = clone._reducer._describe()
    assert describe is not None and describe.__self__ is clone
    assert describe() == sdp._describe_reduction()
