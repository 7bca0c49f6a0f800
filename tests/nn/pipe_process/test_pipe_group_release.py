# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AsyncPipe lets go of the process groups torch destroyed.

Each pipeline group got a sender thread (and, under PyTorch's collective checker, a point-to-point twin group) that
held the group, with its threads and sockets (gloo), for the rest of the process: a process that made a group per
trial, or re-initialised the world, gathered them (a leak fuzz, session 49). A destroyed group's thread ends and its
twin is dropped when the next group is first used.

Bodies are module-level functions (the suite also runs with ``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import functools
import threading
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import init_gloo_world, run_ranks
from fairscale.internal.collectives import p2p
from fairscale.nn.pipe import AsyncPipe
from fairscale.nn.pipe import messages

TRIALS, CHUNKS = 3, 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _senders_alive() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "fairscale-pipe-sender" and t.is_alive())


def _trial(group: Any) -> Tensor:
    """One training step of a two-stage pipe on ``group``; the sum of the stages' gradients on this rank."""
    pipe = AsyncPipe(_model(), [2, 1], group=group, chunks=CHUNKS)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = pipe(x)
    if pipe.final_stage:
        out.pow(2).sum().backward()
    else:
        pipe.back_helper(out)
    return sum((p.grad.sum() for p in pipe.parameters()), torch.zeros(()))


def _release_body(directory: str, detail: bool, rank: int) -> Dict[str, List[float]]:
    init_gloo_world(directory, rank, 2, dist.DebugLevel.DETAIL if detail else dist.DebugLevel.OFF)
    grads, threads, twins = [], [], []
    for _ in range(TRIALS):
        group = dist.new_group([0, 1])
        grads.append(float(_trial(group)))
        dist.barrier()
        dist.destroy_process_group(group)
        threads.append(float(_senders_alive()))
        twins.append(float(len(p2p._twins)))
    # The next group's first message lets the destroyed ones go; a thread told to end may take a moment.
    grads.append(float(_trial(dist.group.WORLD)))
    for _ in range(100):
        if _senders_alive() <= 1:
            break
        threading.Event().wait(0.05)
    return {"grads": grads, "threads": threads + [float(_senders_alive())], "twins": twins + [float(len(p2p._twins))]}


def _check(detail: bool, tmp_path: Any) -> None:
    results = run_ranks(functools.partial(_release_body, str(tmp_path), detail), 2, timeout=120)
    for result in results:
        # Every trial trains the same (each a fresh model): the pipes worked on their new groups.
        assert len(set(result["grads"])) == 1, result["grads"]
        # Before: one more thread per trial (3, then 4), each holding its destroyed group.
        assert result["threads"][-1] <= 1, result["threads"]
        assert max(result["threads"]) <= 2, result["threads"]
        assert max(result["twins"]) <= (1 if detail else 0), result["twins"]


def test_destroyed_groups_end_their_sender_threads(tmp_path: Any) -> None:
    _check(False, tmp_path)


def test_destroyed_groups_drop_their_twins_under_the_checker(tmp_path: Any) -> None:
    _check(True, tmp_path)


def _subgroup_after_world_body(directory: str, rank: int) -> str:
    """A pipeline on the world's group, destroyed; then one on a subgroup made with use_local_synchronization (as
    docs/pipe.rst recommends), under the checker: torch names such a subgroup by its ranks and the number of live
    groups, and destroying the first twin made the second twin's name the subgroup's own."""
    init_gloo_world(directory, rank, 3, dist.DebugLevel.DETAIL)
    group = dist.new_group([0, 1, 2])
    pipe = AsyncPipe(_model(), [1, 1, 1], group=group, chunks=CHUNKS)
    out = pipe(torch.randn(4, 3))
    if pipe.final_stage:
        out.pow(2).sum().backward()
    else:
        pipe.back_helper(out)
    dist.barrier()
    dist.destroy_process_group(group)
    result = "not a member"
    if rank < 2:
        result = str(float(_trial(dist.new_group([0, 1], use_local_synchronization=True))))
    dist.barrier()
    return result


def test_a_subgroup_after_a_destroyed_world_group_under_the_checker(tmp_path: Any) -> None:
    results = run_ranks(functools.partial(_subgroup_after_world_body, str(tmp_path)), 3, timeout=120)
    # Each stage's rank reports its own stage's gradients; that they trained is the point (the twin's creation
    # raised "The specified group name has already been created" on both).
    assert all(r not in ("not a member", "nan") for r in results[:2]) and results[2] == "not a member", results
