# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The multi-process test engine: results, failures, timeouts, skips, sub-tests, process hygiene.

Every body is a module-level function (or a ``functools.partial`` of one): the engine refuses anything else, so
that each test runs the same under fork (CPU worlds) and spawn (CUDA worlds, ``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import functools
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

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
from fairscale.fair_dev.testing import engine, engine_rank
from fairscale.fair_dev.testing.engine import START_METHOD_ENV
from fairscale.internal.device import CPU_ONLY_ENV, default_compute_device, torch_sees_no_accelerator


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


def _scaled_arange(rank: int, world_size: int, offset: int, *, factor: int) -> torch.Tensor:
    return torch.arange(3) * factor + offset + rank


def test_args_kwargs_and_tensors_travel() -> None:
    results = run_distributed(_scaled_arange, 2, 10, factor=3)
    assert torch.equal(results[0], torch.tensor([10, 13, 16]))
    assert torch.equal(results[1], torch.tensor([11, 14, 17]))
    # A functools.partial of a module-level function is a body too.
    results = run_distributed(functools.partial(_scaled_arange, offset=20, factor=1), 1)
    assert torch.equal(results[0], torch.tensor([20, 21, 22]))


def test_closure_body_is_refused_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under fork too: a closure would run here and break on a GPU machine, where ranks are spawned."""
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    offset = 10

    def body(rank: int, world_size: int) -> int:
        return rank + offset

    start = time.monotonic()
    with pytest.raises(TypeError, match=r"(?s)would start with fork: pass a module-level function.*body"):
        run_distributed(body, 2)
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(_rank_sum, 2, lambda: None)  # arguments travel by pickling as well
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(functools.partial(body, 0), 1)
    assert time.monotonic() - start < 5.0, "refused up front, without starting ranks"


def _rand_and_threads(rank: int, world_size: int) -> Any:
    return torch.rand(4), torch.get_num_threads()


def test_ranks_are_seeded_identically_and_single_threaded() -> None:
    (rand0, threads0), (rand1, threads1) = run_distributed(_rand_and_threads, 2)
    assert torch.equal(rand0, rand1)
    assert threads0 == threads1 == 1


def _conv_then_all_reduce(rank: int, world_size: int) -> float:
    conv = torch.nn.Conv2d(4, 4, 3)
    loss = conv(torch.randn(2, 4, 32, 32)).sum() + (torch.randn(256, 256) @ torch.randn(256, 256)).sum()
    loss.backward()
    return float(_all_reduce_sum(torch.ones(1))[0])


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
    assert run_distributed(_conv_then_all_reduce, 2, timeout=60.0) == [2.0, 2.0]


def _set_two_threads(rank: int, world_size: int) -> None:
    torch.set_num_threads(2)


def test_more_threads_in_forked_rank_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "fork")  # spawned ranks may use threads
    with pytest.raises(RuntimeError, match=r"(?s)^\[rank \d\].*would deadlock"):
        run_distributed(_set_two_threads, 2)
    assert torch.set_num_threads.__module__ == "torch"  # the parent's torch is untouched


def _rank1_disagrees(rank: int, world_size: int) -> None:
    if rank == 1:
        assert rank == 0, "rank 1 disagrees"
    _all_reduce_sum(torch.ones(1))  # rank 0 waits here for a peer that never comes


def test_failing_rank_ends_the_world_quickly_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank1_disagrees, 2, timeout=60.0)
    assert time.monotonic() - start < 30.0, "the failing rank should end the world, not the timeout"
    message = str(info.value)
    assert message.startswith("[rank 1] rank 1 disagrees")
    assert "Traceback of rank 1" in message and "in _rank1_disagrees" in message


def _raise_in_rank0(error: BaseException, rank: int, world_size: int) -> None:
    if rank == 0:
        raise error


def _raise_local_error_in_rank0(rank: int, world_size: int) -> None:
    class LocalError(Exception):  # not picklable by reference: only its name reaches the parent
        pass

    if rank == 0:
        raise LocalError("local")


def test_exception_types_are_kept_when_possible() -> None:
    with pytest.raises(CustomError, match=r"^\[rank 0\] custom"):
        run_distributed(functools.partial(_raise_in_rank0, CustomError("custom")), 2)
    with pytest.raises(ValueError, match=r"^\[rank 0\] bad value"):
        run_distributed(functools.partial(_raise_in_rank0, ValueError("bad value")), 2)
    with pytest.raises(DistributedTestError, match=r"^\[rank 0\] LocalError: local") as info:
        run_distributed(_raise_local_error_in_rank0, 2)
    assert info.value.rank == 0
    # KeyError quotes its message, which would mangle the traceback: reported as DistributedTestError.
    with pytest.raises(DistributedTestError, match=r"^\[rank 0\] KeyError: 'missing'"):
        run_distributed(functools.partial(_raise_in_rank0, KeyError("missing")), 2)


def _first_on_rank1_then_consequence(rank: int, world_size: int) -> None:
    if rank == 1:
        raise CustomError("first")
    time.sleep(0.5)
    raise RuntimeError("second, because rank 1 is gone")


def test_earliest_failure_wins_over_consequential_failures() -> None:
    with pytest.raises(CustomError, match=r"^\[rank 1\] first"):
        run_distributed(_first_on_rank1_then_consequence, 2)


def _hang_in_a_collective(rank: int, world_size: int, directory: str) -> None:
    with open(os.path.join(directory, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        _all_reduce_sum(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


def test_hung_collective_becomes_a_timeout_and_leaves_no_process(tmp_path: Any) -> None:
    # Spawned ranks need a few seconds just to start: give them the time to reach the collective.
    timeout = 3.0 if engine._start_method("cpu") == "fork" else 15.0
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(_hang_in_a_collective, 2, str(tmp_path), timeout=timeout)
    assert info.value.ranks == [0, 1]
    message = str(info.value)
    assert "ranks [0, 1]" in message and f"{timeout:g} s timeout" in message
    assert "--- rank 0 ---" in message and "_all_reduce_sum" in message  # stacks of the hung ranks
    for rank in range(2):
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):  # killed and reaped: not even a zombie remains
            os.kill(pid, 0)


def _skip_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        pytest.skip("not supported here")
    _all_reduce_sum(torch.ones(1))


def test_skip_in_a_rank_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^\[rank 1\] not supported here"):
        run_distributed(_skip_on_rank1, 2)


def _exit_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    _all_reduce_sum(torch.ones(1))


def test_rank_dying_without_report() -> None:
    with pytest.raises(DistributedTestError, match=r"^\[rank 1\] exited with code 3 without reporting"):
        run_distributed(_exit_on_rank1, 2)


def _return_a_lambda(rank: int, world_size: int) -> Any:
    return lambda: None


def test_unpicklable_result_is_reported() -> None:
    with pytest.raises(TypeError, match=r"(?s)^\[rank 0\].*cannot be pickled"):
        run_distributed(_return_a_lambda, 1)


def _raise_value_error(rank: int, world_size: int) -> None:
    raise ValueError("x")


def test_temporary_directory_is_removed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_distributed(_rank_sum, 2)
    with pytest.raises(ValueError):
        run_distributed(_raise_value_error, 2)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_fork_a_process_that_has_a_group(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already has a default process group"):
            run_distributed(_rank_sum, 2)
    finally:
        dist.destroy_process_group()
    assert run_distributed(_rank_sum, 1)[0]["sum"] == 1.0


def _rank_and_group(rank: int) -> Any:
    return rank, dist.is_initialized()


def test_run_ranks_has_no_process_group() -> None:
    assert run_ranks(_rank_and_group, 2) == [(0, False), (1, False)]


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
    gpus = torch.cuda.device_count()  # asks NVML: no CUDA context in this process
    if gpus >= 2:
        # Real NCCL world when there are GPUs (always spawned).
        assert [r["sum"] for r in run_distributed(_rank_sum_cuda, 2, device="cuda")] == [3.0, 3.0]
    else:
        with pytest.raises(pytest.skip.Exception, match="needs 2 CUDA devices"):
            run_distributed(_rank_sum, 2, device="cuda")


def _rank_sum_cuda(rank: int, world_size: int) -> Dict[str, Any]:
    total = _all_reduce_sum(torch.tensor([float(rank + 1)], device="cuda"))
    return {"sum": total.item(), "initialised": torch.cuda.is_initialized()}


def _cuda_world_after_cuda_init(rank: int) -> Any:
    # This process plays a test process that used CUDA itself before starting a CUDA world.
    torch.cuda.init()
    assert torch.cuda.is_initialized()
    return engine._start_method("cuda"), run_distributed(_rank_sum_cuda, 1, device="cuda")


def test_cuda_world_after_the_parent_initialised_cuda() -> None:
    """The ranks of a CUDA world are spawned even when the caller holds a CUDA context (forked ones could not use it).

    The caller is itself an engine process, so that this test process never creates a CUDA context.
    """
    if torch.cuda.device_count() < 1:
        pytest.skip("needs 1 CUDA device")
    method, results = run_ranks(_cuda_world_after_cuda_init, 1)[0]
    assert method == "spawn" and results == [{"sum": 1.0, "initialised": True}]


def _sum_threads_and_private_args(scale: float, counter: torch.Tensor, rank: int, world_size: int) -> str:
    counter.add_(rank + 1)  # in place, on this rank's copy of the argument
    total = _all_reduce_sum(torch.tensor([float(rank + 1)]))  # both ranks have updated their counter by now
    return (
        f"sum={total.item() * scale} threads={torch.get_num_threads()} "
        f"method={engine._start_method('cpu')} counter={counter.item()}"
    )


def test_spawn_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawn is what CUDA worlds use (a fresh interpreter per rank, about 2 s): a module-level body with picklable
    # arguments and a functools.partial body run a collective and report back, a failure keeps its type, and each
    # rank gets its own copy of a tensor argument (as under fork), not memory shared with its peers and the caller.
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    with pytest.raises(CustomError, match=r"^\[rank 0\] sum=3.0 threads=1"):
        run_distributed(_collective_then_raise_on_rank0, 2)
    counter = torch.zeros(1)
    results = run_distributed(functools.partial(_sum_threads_and_private_args, 2.0, counter), 2)
    assert results == [f"sum=6.0 threads=1 method=spawn counter={r + 1.0}" for r in range(2)]
    assert counter.item() == 0.0


def _collective_then_raise_on_rank0(rank: int, world_size: int) -> None:
    total = _all_reduce_sum(torch.tensor([float(rank + 1)]))
    if rank == 0:
        raise CustomError(f"sum={total.item()} threads={torch.get_num_threads()}")


def test_spawn_needs_picklable_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    with pytest.raises(TypeError, match="would start with spawn: pass a module-level function"):
        run_distributed(lambda rank, world_size: None, 2)


def test_start_method_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA worlds always spawn; CPU worlds fork where no CUDA device is visible, else use the fork server (a forked
    child's backward fails there once this process ran one); the variable forces."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    initialised, devices = [False], [0]
    monkeypatch.setattr(engine, "accelerator_initialized", lambda: initialised[0])
    monkeypatch.setattr(engine, "_cuda_device_count", lambda: devices[0])
    # A machine without GPUs: CPU worlds and run_ranks bodies fork; a CUDA world (skipped there) would spawn.
    assert [engine._start_method(kind) for kind in ("cpu", None, "cuda")] == ["fork", "fork", "spawn"]
    # A GPU machine whose test process never used CUDA: what may use the GPU spawns, CPU worlds use the fork server.
    devices[0] = 1
    assert [engine._start_method(kind) for kind in ("cpu", None, "cuda")] == ["forkserver", "spawn", "spawn"]
    # The test process initialised CUDA: nothing forks from it any more.
    initialised[0] = True
    assert [engine._start_method(kind) for kind in ("cpu", None, "cuda")] == ["forkserver", "spawn", "spawn"]
    devices[0] = 0  # (CUDA initialised with no device left visible: the same rule)
    assert [engine._start_method(kind) for kind in ("cpu", None, "cuda")] == ["forkserver", "spawn", "spawn"]
    # Forced: spawn and forkserver everywhere, fork for CPU worlds only (a forked CUDA rank could not work).
    for forced in ("spawn", "forkserver"):
        monkeypatch.setenv(START_METHOD_ENV, forced)
        assert [engine._start_method(kind) for kind in ("cpu", None, "cuda")] == [forced] * 3
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    assert [engine._start_method(kind) for kind in ("cpu", None, "cuda")] == ["fork", "spawn", "spawn"]


def test_start_method_follows_the_real_device_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without patches: the test process has not initialised CUDA (the suite keeps it so), CUDA worlds spawn."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    if os.environ.get(CPU_ONLY_ENV) == "1":  # tests/conftest.py: the pytest process stays off the GPU
        assert not torch.cuda.is_initialized(), "something in this pytest process initialised CUDA"
    else:
        monkeypatch.setattr(engine, "accelerator_initialized", lambda: False)
    cpu_world = "forkserver" if torch.cuda.device_count() > 0 else "fork"  # next to a GPU: the fork server
    assert engine._start_method("cpu") == cpu_world and engine._start_method("cuda") == "spawn"
    with monkeypatch.context() as patch:  # undone before the suite's own check that no test initialised CUDA
        patch.setattr(torch.cuda, "is_initialized", lambda: True)  # what the device layer reads
        assert engine._start_method("cpu") == "forkserver"


def _cpu_only_flag(rank: int, world_size: int) -> Dict[str, Any]:
    return {"flag": os.environ.get(CPU_ONLY_ENV), "compute": str(default_compute_device(None))}


def test_cpu_world_ranks_stay_on_cpu() -> None:
    """The ranks of a CPU world see FAIRSCALE_CPU_ONLY=1 (FSDP computes on CPU there even on a GPU machine)."""
    before = os.environ.get(CPU_ONLY_ENV)
    results = run_distributed(_cpu_only_flag, 2)
    assert results == [{"flag": "1", "compute": "cpu"}] * 2
    assert os.environ.get(CPU_ONLY_ENV) == before, "the parent process must not be changed"


def test_bad_start_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "vfork")
    with pytest.raises(ValueError, match="must be one of fork, spawn, forkserver"):
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


def _cases_in_a_world(rank: int, world_size: int) -> None:
    # Cases run inside the rank: they may be closures (nothing is pickled).
    def case(multiplier: int) -> None:
        total = _all_reduce_sum(torch.ones(1) * multiplier)
        assert total.item() == 2 * multiplier and multiplier != 3, f"case {multiplier} fails on purpose"

    run_cases([(f"multiplier={m}", lambda m=m: case(m)) for m in (1, 2, 3, 4)])  # type: ignore[misc]


def test_run_cases_inside_a_world() -> None:
    with pytest.raises(AssertionError) as info:
        run_distributed(_cases_in_a_world, 2)
    message = str(info.value)
    assert message.startswith("[rank ") and "1 of 4 cases failed" in message
    assert "multiplier=3" in message and "multiplier=4" not in message.split("cases failed")[1].split("\n")[1]


def _one_rank_fails_then_peer_waits(rank: int, world_size: int) -> None:
    """Case "a" fails on rank 1 before a collective that rank 0 then waits in: the desync that used to hang."""

    def case_a() -> None:
        if rank == 1:
            raise AssertionError("rank 1 differs")
        _all_reduce_sum(torch.ones(1))  # rank 1 never joins this one

    # Not caught here: the body must fail (a rank that returned would reach the engine's barrier, which could pair
    # with the collective its peer waits in).
    run_cases([("a", case_a), ("b", lambda: _all_reduce_sum(torch.ones(1)))])


def test_run_cases_case_failing_on_one_rank_ends_the_world_in_seconds() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_one_rank_fails_then_peer_waits, 2, timeout=60)
    assert time.monotonic() - start < 30  # the failing rank's grace is 5 s; never the world's timeout
    message = str(info.value)
    assert message.startswith("[rank 1]") and "rank 1 differs" in message and "case 'a' failed on rank 1" in message


def _one_rank_fails_peer_passes(rank: int, world_size: int) -> str:
    ran: List[str] = []

    def case_a() -> None:
        ran.append("a")
        assert rank == 0, "only rank 0 passes"

    try:
        run_cases([("a", case_a), ("b", lambda: ran.append("b"))])
    except AssertionError as e:
        return f"{ran} {e}"
    return f"{ran} no error"


def test_run_cases_case_failing_on_one_rank_fails_every_rank_before_the_next_case() -> None:
    results = run_distributed(_one_rank_fails_peer_passes, 2, timeout=60)
    assert results[0].startswith("['a'] case 'a' passed on rank 0 but failed on ranks [1]")
    assert "only rank 0 passes" in results[0]
    assert results[1].startswith("['a'] case 'a' failed on ranks [1] only")


def _different_cases(rank: int, world_size: int) -> str:
    try:
        run_cases([(f"case{rank}", lambda: None)])
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_run_cases_ranks_running_different_cases_raise() -> None:
    results = run_distributed(_different_cases, 2, timeout=60)
    assert all("the ranks ran different cases at position 0" in r for r in results), results


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


def _initialize_model_parallel_in_rank(rank: int, world_size: int) -> int:
    from fairscale.nn.model_parallel.initialize import get_model_parallel_world_size, initialize_model_parallel

    initialize_model_parallel(1, world_size, pipeline_backend="gloo")
    return get_model_parallel_world_size()


def test_forked_ranks_do_not_inherit_model_parallel_groups(tmp_path: Any) -> None:
    """A test that left model parallelism initialised in the pytest process does not break later worlds."""
    from fairscale.nn.model_parallel.initialize import destroy_model_parallel, initialize_model_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        initialize_model_parallel(1, 1)  # and, like upstream's test_adjacency, never torn down
    finally:
        dist.destroy_process_group()
    try:
        assert run_distributed(_initialize_model_parallel_in_rank, 2) == [1, 1]
    finally:
        destroy_model_parallel()


def _backward_in_rank(rank: int, world_size: int) -> float:
    w = torch.ones(3, requires_grad=True)
    (w * (rank + 1)).sum().backward()
    assert w.grad is not None
    return float(w.grad.sum())


def test_forkserver_world_runs_autograd_after_this_process_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start method of CPU worlds next to a GPU: ranks forked by the (torch-preloaded) fork server run autograd
    although this process already did (which, with a CUDA device present, makes plain forked children refuse it)."""
    w = torch.ones(2, requires_grad=True)
    w.sum().backward()  # this process's autograd engine is started
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    assert engine._start_method("cpu") == "forkserver"
    assert run_distributed(_backward_in_rank, 2) == [3.0, 6.0]


def _probe_env(rank: int, world_size: int) -> Optional[str]:
    return os.environ.get("FAIRSCALE_TEST_ENGINE_PROBE")


def test_forkserver_ranks_see_the_current_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server keeps the environment it started with; ranks get the test process's as it is now."""
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    monkeypatch.delenv("FAIRSCALE_TEST_ENGINE_PROBE", raising=False)
    assert run_distributed(_probe_env, 2) == [None, None]  # the server is up now
    monkeypatch.setenv("FAIRSCALE_TEST_ENGINE_PROBE", "set later")
    assert run_distributed(_probe_env, 2) == ["set later"] * 2


def _preloaded_and_torch_answers(rank: int, world_size: int) -> Tuple[bool, bool, bool]:
    # Read before anything here imports more: the rank imported this test module (for this function) and torch.
    preloaded = "torch._dynamo" in sys.modules and "fairscale.optim" in sys.modules
    replaced = torch.cuda.is_available is torch_sees_no_accelerator
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        replaced = replaced and accelerator.is_available is torch_sees_no_accelerator
    return preloaded, replaced, torch.cuda.is_available()


def test_forkserver_ranks_start_with_the_big_imports_done_and_torch_seeing_no_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fork-server ranks (CPU worlds next to a GPU) inherit torch._dynamo and fairscale's namespaces from the server
    (each rank imported them again: about 0.9 s per world), and torch itself answers "no GPU" in a CPU world's rank:
    from torch 2.13 every optimizer step asks for the accelerator's stream where a GPU is visible, which opened a CUDA
    context in every CPU rank on a GPU machine."""
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    assert run_distributed(_preloaded_and_torch_answers, 2) == [(True, True, False)] * 2


def test_the_pytest_process_hides_devices_from_torch() -> None:
    """tests/conftest.py: while the pytest process stays off the GPU, torch's own availability answers are hidden for
    every test (an in-process optimizer step on torch 2.13 created a CUDA context here next to a GPU). Not named for
    .ci/cuda-checks' first step, whose FAIRSCALE_CPU_ONLY=0 lets in-process tests see the GPU."""
    if os.environ.get(CPU_ONLY_ENV, "") in ("", "0"):
        return  # the pytest process may use the GPU: nothing is hidden
    assert torch.cuda.is_available.__module__ != "torch.cuda" and not torch.cuda.is_available()
