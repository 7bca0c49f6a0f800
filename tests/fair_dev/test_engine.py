# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The multi-process test engine: results, failures, timeouts, skips, sub-tests, process hygiene."""

import os
import time
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from fairscale.fair_dev.testing import (
    DistributedTestError,
    DistributedTestTimeout,
    run_cases,
    run_distributed,
    run_ranks,
    subtest,
)
from fairscale.fair_dev.testing import engine
from fairscale.fair_dev.testing.engine import START_METHOD_ENV
from fairscale.internal.device import CPU_ONLY_ENV, default_compute_device


class CustomError(Exception):
    pass


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    # The collectives layer is written in parallel with this engine; a plain gloo all_reduce is
    # what this test needs to prove that the world is wired up.
    dist.all_reduce(value)
    return value


def _rank_sum(rank: int, world_size: int, scale: float = 1.0) -> Dict[str, Any]:
    total = _all_reduce_sum(torch.tensor([float(rank + 1)]))
    return {"rank": rank, "world": dist.get_world_size(), "sum": total.item() * scale, "pid": os.getpid()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_results_per_rank(world_size: int) -> None:
    results = run_distributed(_rank_sum, world_size, 2.0)
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size and r["sum"] == expected_sum for r in results)
    # Each rank is its own process, distinct from the test process.
    pids = {r["pid"] for r in results}
    assert len(pids) == world_size and os.getpid() not in pids


def test_closure_kwargs_and_tensors_travel() -> None:
    offset = 10  # captured by the closure: fine under fork

    def body(rank: int, world_size: int, *, factor: int) -> torch.Tensor:
        return torch.arange(3) * factor + offset + rank

    results = run_distributed(body, 2, factor=3)
    assert torch.equal(results[0], torch.tensor([10, 13, 16]))
    assert torch.equal(results[1], torch.tensor([11, 14, 17]))


def test_ranks_are_seeded_identically_and_single_threaded() -> None:
    def body(rank: int, world_size: int) -> Any:
        return torch.rand(4), torch.get_num_threads()

    (rand0, threads0), (rand1, threads1) = run_distributed(body, 2)
    assert torch.equal(rand0, rand1)
    assert threads0 == threads1 == 1


def test_parent_that_used_threads_can_fork_ranks_that_compute() -> None:
    # libgomp deadlocks a forked child that re-enters a multi-threaded region its parent used; the
    # engine runs ranks single-threaded. Use several threads here first, then compute in the ranks.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(256, 256)
        for _ in range(5):
            a = torch.tanh(a @ a)
    finally:
        torch.set_num_threads(previous)

    def body(rank: int, world_size: int) -> float:
        conv = torch.nn.Conv2d(4, 4, 3)
        loss = conv(torch.randn(2, 4, 32, 32)).sum() + (torch.randn(256, 256) @ torch.randn(256, 256)).sum()
        loss.backward()
        return float(_all_reduce_sum(torch.ones(1))[0])

    assert run_distributed(body, 2, timeout=60.0) == [2.0, 2.0]


def test_more_threads_in_forked_rank_is_an_error() -> None:
    def body(rank: int, world_size: int) -> None:
        torch.set_num_threads(2)

    with pytest.raises(RuntimeError, match=r"(?s)^\[rank \d\].*would deadlock"):
        run_distributed(body, 2)
    assert torch.set_num_threads.__module__ == "torch"  # the parent's torch is untouched


def test_failing_rank_ends_the_world_quickly_with_its_traceback() -> None:
    def body(rank: int, world_size: int) -> None:
        if rank == 1:
            assert rank == 0, "rank 1 disagrees"
        _all_reduce_sum(torch.ones(1))  # rank 0 waits here for a peer that never comes

    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(body, 2, timeout=60.0)
    assert time.monotonic() - start < 30.0, "the failing rank should end the world, not the timeout"
    message = str(info.value)
    assert message.startswith("[rank 1] rank 1 disagrees")
    assert "Traceback of rank 1" in message and "in body" in message


def test_exception_types_are_kept_when_possible() -> None:
    def raise_in_rank0(error: BaseException) -> Any:
        def body(rank: int, world_size: int) -> None:
            if rank == 0:
                raise error

        return body

    with pytest.raises(CustomError, match=r"^\[rank 0\] custom"):
        run_distributed(raise_in_rank0(CustomError("custom")), 2)
    with pytest.raises(ValueError, match=r"^\[rank 0\] bad value"):
        run_distributed(raise_in_rank0(ValueError("bad value")), 2)

    class LocalError(Exception):  # not picklable by reference: only its name reaches the parent
        pass

    with pytest.raises(DistributedTestError, match=r"^\[rank 0\] LocalError: local") as info:
        run_distributed(raise_in_rank0(LocalError("local")), 2)
    assert info.value.rank == 0
    # KeyError quotes its message, which would mangle the traceback: reported as DistributedTestError.
    with pytest.raises(DistributedTestError, match=r"^\[rank 0\] KeyError: 'missing'"):
        run_distributed(raise_in_rank0(KeyError("missing")), 2)


def test_earliest_failure_wins_over_consequential_failures() -> None:
    def body(rank: int, world_size: int) -> None:
        if rank == 1:
            raise CustomError("first")
        time.sleep(0.5)
        raise RuntimeError("second, because rank 1 is gone")

    with pytest.raises(CustomError, match=r"^\[rank 1\] first"):
        run_distributed(body, 2)


def test_hung_collective_becomes_a_timeout_and_leaves_no_process(tmp_path: Any) -> None:
    def body(rank: int, world_size: int) -> None:
        (tmp_path / f"pid{rank}").write_text(str(os.getpid()))
        if rank == 0:
            _all_reduce_sum(torch.ones(1))  # rank 1 never joins
        else:
            time.sleep(600)

    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(body, 2, timeout=3.0)
    assert info.value.ranks == [0, 1]
    message = str(info.value)
    assert "ranks [0, 1]" in message and "3 s timeout" in message
    assert "--- rank 0 ---" in message and "_all_reduce_sum" in message  # stacks of the hung ranks
    for rank in range(2):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):  # killed and reaped: not even a zombie remains
            os.kill(pid, 0)


def test_skip_in_a_rank_skips_the_test() -> None:
    def body(rank: int, world_size: int) -> None:
        if rank == 1:
            pytest.skip("not supported here")
        _all_reduce_sum(torch.ones(1))

    with pytest.raises(pytest.skip.Exception, match=r"^\[rank 1\] not supported here"):
        run_distributed(body, 2)


def test_rank_dying_without_report() -> None:
    def body(rank: int, world_size: int) -> None:
        if rank == 1:
            os._exit(3)
        _all_reduce_sum(torch.ones(1))

    with pytest.raises(DistributedTestError, match=r"^\[rank 1\] exited with code 3 without reporting"):
        run_distributed(body, 2)


def test_unpicklable_result_is_reported() -> None:
    with pytest.raises(TypeError, match=r"(?s)^\[rank 0\].*cannot be pickled"):
        run_distributed(lambda rank, world_size: (lambda: None), 1)


def test_temporary_directory_is_removed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_distributed(_rank_sum, 2)
    with pytest.raises(ValueError):
        run_distributed(lambda rank, world_size: (_ for _ in ()).throw(ValueError("x")), 2)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_fork_a_process_that_has_a_group(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already has a default process group"):
            run_distributed(_rank_sum, 2)
    finally:
        dist.destroy_process_group()
    assert run_distributed(_rank_sum, 1)[0]["sum"] == 1.0


def test_run_ranks_has_no_process_group() -> None:
    assert run_ranks(lambda rank: (rank, dist.is_initialized()), 2) == [(0, False), (1, False)]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"world_size": 2, "timeout": 0}, "timeout must be a positive"),
        ({"world_size": 2, "device": "tpu"}, "device must be 'cpu' or 'cuda'"),
        ({"world_size": 2, "device": "cuda:1"}, "device must be 'cpu' or 'cuda'"),
    ],
)
def test_bad_arguments(kwargs: Dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        run_distributed(_rank_sum, **kwargs)


def test_cuda_world_runs_or_skips() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        # Real NCCL world when there are GPUs (spawned if this process already initialised CUDA).
        assert [r["sum"] for r in run_distributed(_rank_sum_cuda, 2, device="cuda")] == [3.0, 3.0]
    else:
        with pytest.raises(pytest.skip.Exception, match="needs 2 CUDA devices"):
            run_distributed(_rank_sum, 2, device="cuda")


def _rank_sum_cuda(rank: int, world_size: int) -> Dict[str, Any]:
    total = _all_reduce_sum(torch.tensor([float(rank + 1)], device="cuda"))
    return {"sum": total.item()}


def test_spawn_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawn is what CUDA runs use (a fresh interpreter per rank, several seconds): one world checks
    # that a module-level body with picklable arguments runs a collective and reports back.
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    with pytest.raises(CustomError, match=r"^\[rank 0\] sum=3.0 threads=1"):
        run_distributed(_collective_then_raise_on_rank0, 2)


def _collective_then_raise_on_rank0(rank: int, world_size: int) -> None:
    total = _all_reduce_sum(torch.tensor([float(rank + 1)]))
    if rank == 0:
        raise CustomError(f"sum={total.item()} threads={torch.get_num_threads()}")


def test_spawn_needs_picklable_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    with pytest.raises(TypeError, match="pass a module-level function"):
        run_distributed(lambda rank, world_size: None, 2)


def test_start_method_by_world_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the parent used CUDA: CPU worlds still fork (their ranks never touch CUDA), CUDA worlds spawn."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert engine._start_method("cpu") == "fork"
    assert engine._start_method("cuda") == "spawn"
    assert engine._start_method(None) == "spawn"  # run_ranks: the body may use CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert engine._start_method("cuda") == "fork"


def _cpu_only_flag(rank: int, world_size: int) -> Dict[str, Any]:
    return {"flag": os.environ.get(CPU_ONLY_ENV), "compute": str(default_compute_device(None))}


def test_cpu_world_ranks_stay_on_cpu() -> None:
    """The ranks of a CPU world see FAIRSCALE_CPU_ONLY=1 (FSDP computes on CPU there even on a GPU machine)."""
    assert os.environ.get(CPU_ONLY_ENV) is None, "the parent process must not be changed"
    results = run_distributed(_cpu_only_flag, 2)
    assert results == [{"flag": "1", "compute": "cpu"}] * 2
    assert os.environ.get(CPU_ONLY_ENV) is None


def test_bad_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match="must be 'fork' or 'spawn'"):
        run_distributed(_rank_sum, 1)


# ----------------------------------------------------------------------------------------------
# Sub-tests


def _fail(error: Exception) -> Any:
    def case() -> None:
        raise error

    return case


def test_run_cases_reports_every_failing_case() -> None:
    ran: List[str] = []
    cases = [
        ("ok", lambda: ran.append("ok")),
        ("bad_value", _fail(ValueError("wrong value"))),
        ("skipped", lambda: pytest.skip("not here")),
        ("bad_assert", _fail(AssertionError("wrong assert"))),
    ]
    with pytest.raises(AssertionError) as info:
        run_cases(cases)
    message = str(info.value)
    assert ran == ["ok"]
    assert message.startswith("2 of 4 cases failed:")
    assert "- bad_value: ValueError: wrong value" in message
    assert "- bad_assert: AssertionError: wrong assert" in message
    assert "skipped cases: skipped: not here" in message
    assert "- ok" not in message


def test_run_cases_passes_skips_and_rejects_bad_input() -> None:
    run_cases([("a", lambda: None), ("b", lambda: None)])
    with pytest.raises(pytest.skip.Exception, match="every case skipped"):
        run_cases([("a", lambda: pytest.skip("x"))])
    with pytest.raises(ValueError, match="'a' is used twice"):
        run_cases([("a", lambda: None), ("a", lambda: None)])
    with pytest.raises(TypeError, match="expects \\(name, callable\\) pairs"):
        run_cases([("a", 1)])  # type: ignore[list-item]


def test_run_cases_inside_a_world() -> None:
    def body(rank: int, world_size: int) -> None:
        def case(multiplier: int) -> None:
            total = _all_reduce_sum(torch.ones(1) * multiplier)
            assert total.item() == 2 * multiplier and multiplier != 3, f"case {multiplier} fails on purpose"

        run_cases([(f"multiplier={m}", lambda m=m: case(m)) for m in (1, 2, 3, 4)])  # type: ignore[misc]

    with pytest.raises(AssertionError) as info:
        run_distributed(body, 2)
    message = str(info.value)
    assert message.startswith("[rank ") and "1 of 4 cases failed" in message
    assert "multiplier=3" in message and "multiplier=4" not in message.split("cases failed")[1].split("\n")[1]


def test_subtest_prefixes_and_keeps_type() -> None:
    with pytest.raises(ValueError, match=r"^\[outer\] \[inner\] boom$"):
        with subtest("outer"):
            with subtest("inner"):
                raise ValueError("boom")
    # A type that cannot be rebuilt from a message keeps its identity.
    error = KeyError("k")
    with pytest.raises(KeyError) as info:
        with subtest("case"):
            raise error
    assert info.value is error
    with subtest("fine"):
        pass
