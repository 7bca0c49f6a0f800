# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream fairscale's test helpers (``fairscale.fair_dev.testing.testing``), working on CPU.

The names and arguments are upstream's so that tests written against fairscale keep working. The
differences: everything works without GPUs (gloo on CPU, ``get_world_sizes()`` never returns an
empty list), processes are started by the engine in :mod:`fairscale.fair_dev.testing.engine`
(fork on CPU, a timeout, the failing rank's traceback). As upstream, :func:`dist_init` starts torch RPC
(TensorPipe, workers named ``Test{rank}``, so :func:`get_worker_map` names them) when it is given an
``filename_rpc``, the ranks of :func:`torch_spawn` tests start with RPC and with model parallelism initialised
(model-parallel size 1, one pipeline group holding every rank), and :func:`teardown` shuts RPC down.

This module may call ``torch.cuda`` and ``torch.distributed`` collectives directly: it is test
tooling, exempt from the rule that only the device and collectives layers do.
"""

import contextlib
import functools
import inspect
import os
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from fairscale.internal import torch_version as torch_version
from fairscale.nn.model_parallel.initialize import destroy_model_parallel as destroy_model_parallel
from fairscale.nn.model_parallel.initialize import initialize_model_parallel as initialize_model_parallel
from fairscale.nn.model_parallel.random import model_parallel_cuda_manual_seed as model_parallel_cuda_manual_seed
from fairscale.nn.model_parallel.initialize import model_parallel_is_initialized

from fairscale.internal.device import accelerator_available
from fairscale.internal.dummy_process_group import DummyProcessGroup as DummyProcessGroup

from .engine import DEFAULT_TIMEOUT, run_distributed, run_ranks, seed_everything, use_loopback_for_gloo

# Upstream had these two here; they live with the other memory helpers now.
from .testing_memory import dump_all_tensors as dump_all_tensors
from .testing_memory import get_smi_memory as get_smi_memory

# Comparison helpers and toy models have their own modules; upstream imported them from here.
from .testing_compare import ObjectsNotEqualError as ObjectsNotEqualError
from .testing_compare import check_same_model_params as check_same_model_params
from .testing_compare import check_same_models_across_ranks as check_same_models_across_ranks
from .testing_compare import objects_are_equal as objects_are_equal
from .testing_compare import state_dict_norm as state_dict_norm
from .testing_models import GPT2 as GPT2
from .testing_models import DeviceAndTypeCheckModule as DeviceAndTypeCheckModule
from .testing_models import IdentityLayer as IdentityLayer

_F = TypeVar("_F", bound=Callable[..., Any])


def _gpu_count() -> int:
    # FAIRSCALE_CPU_ONLY (set in the test suite's own process and in CPU worlds) hides the GPUs here too, so that
    # in-process tests marked for a GPU run where the GPU is meant to be used (CUDA worlds, .ci/cuda-checks).
    return int(torch.cuda.device_count()) if accelerator_available() else 0


# ----------------------------------------------------------------------------------------------
# pytest marks and environment probes

skip_if_cuda = pytest.mark.skipif(_gpu_count() > 0, reason="Testing only on CPUs to save time")
skip_if_no_cuda = pytest.mark.skipif(_gpu_count() < 1, reason="CUDA required")
skip_if_single_gpu = pytest.mark.skipif(_gpu_count() < 2, reason="multiple GPUs required")
skip_if_less_than_four_gpu = pytest.mark.skipif(_gpu_count() < 4, reason="4 GPUs or more required")
skip_if_py38 = pytest.mark.skipif(sys.version_info[:2] == (3, 8), reason="Python3.8 is skipped")
skip_if_py39_no_cuda = pytest.mark.skipif(
    _gpu_count() == 0 and sys.version_info[:2] == (3, 9), reason="Python3.9 without CUDA is skipped"
)
skip_due_to_flakyness = pytest.mark.skip(reason="Flaky test to be fixed or removed")

#: Devices a test can be parametrised over: always "cpu", plus "cuda" when a GPU is present.
available_devices: List[str] = ["cpu"] + (["cuda"] if _gpu_count() > 0 else [])


def in_circle_ci() -> bool:
    """Whether the process runs on CircleCI (upstream's CI)."""
    return os.path.exists("/home/circleci") or bool(os.environ.get("CIRCLECI"))


def skip_a_test_if_in_CI() -> None:
    """Skip the calling test when running on CircleCI."""
    if in_circle_ci():
        pytest.skip("Skipped in CircleCI")


def torch_cuda_version(compiled: bool = False) -> Tuple[int, ...]:
    """The CUDA version torch was built with as ``(major, minor)``; ``()`` on a CPU-only build.

    Args:
        compiled: kept for upstream compatibility; the build version is what torch reports either way.
    """
    del compiled
    version = torch.version.cuda
    if not version:
        return ()
    return tuple(int(part) for part in version.split(".")[:2])


def make_cudnn_deterministic() -> None:
    """Make cuDNN pick deterministic algorithms and turn TF32 off for matmuls and cuDNN, as upstream (harmless
    without CUDA). With TF32 left on (cuDNN's default), float32 convolutions on Ampere and newer GPUs ran in TF32, and
    parity tests run with ``deterministic=True`` got other numbers than upstream's."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def set_random_seed(seed: int, model_parallel: bool = True) -> None:
    """Seed ``random``, numpy and torch (all devices), then the model-parallel RNG tracker.

    Args:
        seed: the seed.
        model_parallel: also call :func:`model_parallel_cuda_manual_seed` with ``seed`` when model
            parallelism is initialised (upstream raised ``AssertionError`` when it was not).
    """
    seed_everything(seed)
    if model_parallel and model_parallel_is_initialized():
        model_parallel_cuda_manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# Process groups and multi-process runners


def dist_init(rank: int, world_size: int, filename: str, filename_rpc: str = "") -> bool:
    """Initialise the default process group through a file store, and torch RPC as upstream did.

    NCCL when CUDA is available (and rank ``r`` uses ``cuda:r``), gloo otherwise or when ``FAIRSCALE_CPU_ONLY`` hides
    the GPUs (as in the test suite's own process and in CPU worlds).

    Args:
        rank: this process's rank.
        world_size: number of processes.
        filename: an absolute path shared by all ranks for the file store.
        filename_rpc: another path shared by all ranks: torch RPC (TensorPipe) starts with worker ``Test{rank}``
            rendezvousing through it (upstream always passed one). Empty: no RPC.

    Returns:
        ``False`` (nothing initialised) when CUDA is used and there are fewer GPUs than ranks.

    As upstream, it first sets the ``RANK`` and ``WORLD_SIZE`` environment variables to ``rank`` and ``world_size``
    (code run after it may read them).
    """
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    if _gpu_count() > 0:
        if _gpu_count() < world_size:
            return False
        torch.cuda.set_device(rank)
        backend = "nccl"
    else:
        backend = "gloo"
        use_loopback_for_gloo()
    dist.init_process_group(backend=backend, init_method=f"file://{filename}", rank=rank, world_size=world_size)
    if filename_rpc:
        _init_rpc(rank, world_size, filename_rpc)
    return True


def _init_rpc(rank: int, world_size: int, filename_rpc: str) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{filename_rpc}")
    rpc.init_rpc(_worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)


def _worker_name(rank: int) -> str:
    return f"Test{rank}"


def _rpc_running() -> bool:
    # torch exports no public "is RPC running" check; this private one has existed since RPC did.
    return bool(rpc.is_available() and getattr(rpc.api, "_is_current_rpc_agent_set")())


def teardown() -> None:
    """Forget the model-parallel groups, destroy the default process group and shut RPC down (each if present)."""
    destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if _rpc_running():
        # Not graceful, as upstream: a peer that failed will never join a graceful shutdown's barrier.
        rpc.shutdown(graceful=False)


def get_worker_map() -> Dict[Any, Any]:
    """Upstream's RPC worker map: ``{rank: "Test{rank}"}`` for every rank of the default group.

    The names are those :func:`dist_init` and :func:`torch_spawn` give the RPC workers (pass the map as
    ``AsyncPipe(..., worker_map=get_worker_map())``).

    Raises:
        RuntimeError: the default process group is not initialised (call :func:`dist_init` first).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("get_worker_map: the default process group is not initialised; call dist_init first")
    return {rank: _worker_name(rank) for rank in range(dist.get_world_size())}


def get_world_sizes() -> List[int]:
    """World sizes to test: powers of two up to the GPU count, or ``[1, 2, 4]`` on CPU (never empty)."""
    gpus = _gpu_count()
    if gpus > 0:
        return [size for size in (1, 2, 4, 8) if size <= gpus]
    return [1, 2, 4]


# Upstream's test_runner seed: tests that compare against values drawn after it need the same draws.
_TEST_RUNNER_SEED = 1357


def test_runner(
    rank: int, test_func: Callable[..., Any], deterministic: bool = False, *args: Any, **kwargs: Any
) -> None:
    """Run ``test_func(rank, *args, **kwargs)`` in a rank, optionally with deterministic settings.

    Args:
        rank: this process's rank.
        test_func: the per-rank function.
        deterministic: first call :func:`make_cudnn_deterministic` and seed everything with 1357, upstream's seed
            (torch draws the same numbers as after upstream's ``torch.manual_seed(1357)``).
        *args: passed after ``rank``.
        **kwargs: passed through.
    """
    if deterministic:
        make_cudnn_deterministic()
        set_random_seed(_TEST_RUNNER_SEED)
    test_func(rank, *args, **kwargs)


# A module-level name starting with "test" would otherwise be collected by pytest as a test.
setattr(test_runner, "__test__", False)


def spawn_for_all_world_sizes(
    test_func: Callable[..., Any],
    world_sizes: Optional[Sequence[int]] = None,
    args: Sequence[Any] = (),
    deterministic: bool = False,
) -> None:
    """Run ``test_func(rank, world_size, filename, filename_rpc, *args)`` for every world size.

    Each world gets fresh temporary files; ``test_func`` usually starts with :func:`dist_init`.
    The ranks are started by the engine (fork on CPU), with its timeout and error reporting.

    Args:
        test_func: the per-rank function.
        world_sizes: defaults to :func:`get_world_sizes`.
        args: extra positional arguments for ``test_func``.
        deterministic: see :func:`test_runner`.
    """
    sizes = list(world_sizes) if world_sizes is not None else get_world_sizes()
    for world_size in sizes:
        with temp_files_ctx(num=2) as (filename, filename_rpc):
            body = functools.partial(
                _spawned_rank, test_func, deterministic, world_size, filename, filename_rpc, tuple(args)
            )
            run_ranks(body, world_size, timeout=DEFAULT_TIMEOUT)


def _spawned_rank(
    test_func: Callable[..., Any],
    deterministic: bool,
    world_size: int,
    filename: str,
    filename_rpc: str,
    args: Tuple[Any, ...],
    rank: int,
) -> None:
    test_runner(rank, test_func, deterministic, world_size, filename, filename_rpc, *args)


def worker_process(
    rank: int,
    world_size: int,
    filename: str,
    filename_rpc: str,
    func: Callable[..., Any],
    args: Sequence[Any],
    error_queue: Any,
) -> None:
    """One rank of a :func:`torch_spawn` test: init the group, run ``func(*args)``, tear down.

    A ``pytest.skip`` raised by ``func`` is put on ``error_queue`` (anything with ``put``) as text.

    Args:
        rank: this process's rank.
        world_size: number of processes.
        filename: file-store path.
        filename_rpc: file for the RPC rendezvous (see :func:`dist_init`).
        func: the test body; it finds its rank through ``torch.distributed``.
        args: positional arguments for ``func``.
        error_queue: receives the skip message, if any.
    """
    if not dist_init(rank, world_size, filename, filename_rpc):
        return
    initialize_model_parallel(1, world_size, pipeline_backend="gloo")
    try:
        func(*args)
    except pytest.skip.Exception as e:
        error_queue.put(str(e))
    # Other errors propagate without teardown: the engine kills the world, and destroying a group
    # whose peers are gone can block.
    teardown()


def torch_spawn(world_sizes: Optional[Sequence[int]] = None) -> Callable[[_F], _F]:
    """Register ``test_<name>`` in the caller's module, running the decorated function on every rank.

    The decorated function runs with an initialised default group and reads its rank from
    ``torch.distributed``. pytest arguments (fixtures, ``parametrize``) are passed by keyword.

    Args:
        world_sizes: world sizes to run; defaults to :func:`get_world_sizes`.

    Raises:
        ValueError: the decorated function's name starts with ``test`` (pytest would collect it
            and run it without ranks).
    """
    sizes = list(world_sizes) if world_sizes is not None else get_world_sizes()

    def register(func: _F) -> _F:
        name = func.__name__
        if name.startswith("test"):
            raise ValueError(
                f"@torch_spawn registers test_{name} itself; rename {name!r} so that it does not start with "
                f"'test', otherwise pytest also collects it and runs it without ranks"
            )

        @functools.wraps(func)
        def spawned_test(**kwargs: Any) -> None:
            for world_size in sizes:
                with temp_files_ctx(num=1) as (filename_rpc,):
                    run_distributed(_RankCall(func, kwargs, filename_rpc), world_size)

        spawned_test.__name__ = f"test_{name}"
        spawned_test.__qualname__ = f"test_{name}"
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            raise RuntimeError("torch_spawn: cannot find the module to register the test in")
        caller.f_globals[f"test_{name}"] = spawned_test
        return func

    return register


class _RankCall:
    """Adapts ``func(**kwargs)`` to the engine's ``fn(rank, world_size)`` calling convention."""

    def __init__(self, func: Callable[..., Any], kwargs: Dict[str, Any], filename_rpc: str) -> None:
        self.func = func
        self.kwargs = kwargs
        self.filename_rpc = filename_rpc

    def __call__(self, rank: int, world_size: int) -> None:
        # As upstream's worker_process: RPC workers Test{rank}, model-parallel size 1, one pipeline group of every rank.
        _init_rpc(rank, world_size, self.filename_rpc)
        initialize_model_parallel(1, world_size, pipeline_backend="gloo")
        try:
            self.func(**self.kwargs)
        finally:
            destroy_model_parallel()
        # Graceful only after success: it waits for every peer (a failed rank ends the world instead).
        rpc.shutdown(graceful=True)


# ----------------------------------------------------------------------------------------------
# Optimizer, timing and memory helpers

# Nominal rate returned without CUDA: CPU work is synchronous, so callers only need a positive scale.
_CPU_NOMINAL_CYCLES_PER_MS = 1_000_000.0


@functools.lru_cache(maxsize=None)
def get_cycles_per_ms() -> float:
    """GPU cycles per millisecond for ``torch.cuda._sleep``; a nominal ``1e6`` without CUDA (or under
    ``FAIRSCALE_CPU_ONLY``, which the test suite's own process sets: measuring would create a CUDA context there)."""
    if not accelerator_available():
        return _CPU_NOMINAL_CYCLES_PER_MS
    cycles = 1_000_000
    rates = []
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rates.append(cycles / start.elapsed_time(end))
    return sorted(rates)[1]


class SGDWithPausingCompute(torch.optim.SGD):
    """SGD whose step pauses on rank 0 first, so ranks reach the next iteration at different times.

    Useful to catch a missing synchronisation between the optimizer step and communication.

    Args:
        *args: as ``torch.optim.SGD``.
        rank: keyword only; the pause happens on rank 0 (default 0).
        **kwargs: as ``torch.optim.SGD``.
    """

    # How long rank 0 pauses; long enough to reorder ranks, short enough for a test loop.
    pause_ms = 20.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.pop("rank", 0))
        super().__init__(*args, **kwargs)

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        if self.rank == 0:
            self._pause()
        return super().step(closure)

    def _pause(self) -> None:
        on_cuda = any(p.is_cuda for group in self.param_groups for p in group["params"])
        if on_cuda:
            # Busy the GPU stream the step will run on, which is what delays the step there.
            torch.cuda._sleep(int(self.pause_ms * get_cycles_per_ms()))
        else:
            time.sleep(self.pause_ms / 1000.0)


# ----------------------------------------------------------------------------------------------
# Files and directories


def rmf(filename: str) -> None:
    """Remove a file; a file that does not exist is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(filename)


@contextlib.contextmanager
def in_temporary_directory() -> Iterator[str]:
    """Change into a fresh temporary directory for the block, then come back and delete it."""
    previous = os.getcwd()
    with tempfile.TemporaryDirectory() as directory:
        os.chdir(directory)
        try:
            yield directory
        finally:
            os.chdir(previous)


@contextlib.contextmanager
def temp_files_ctx(num: int) -> Iterator[Tuple[str, ...]]:
    """Create ``num`` empty temporary files, yield their paths (a tuple, as upstream), remove them afterwards.

    Args:
        num: how many files.
    """
    paths = []
    try:
        for _ in range(num):
            handle, path = tempfile.mkstemp()
            os.close(handle)
            paths.append(path)
        yield tuple(paths)
    finally:
        for path in paths:
            rmf(path)
