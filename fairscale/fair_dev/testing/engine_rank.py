# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The rank side of the multi-process test engine: what runs inside each rank process.

:func:`rank_main` prepares a freshly started rank (die with the parent, single-threaded torch, a
stack-dump handler, the common seed), runs the body and sends exactly one report to the parent:
the pickled result, or a :class:`RemoteFailure` from which the parent rebuilds the exception.
:class:`ProcessGroupBody` is the body :func:`~fairscale.fair_dev.testing.engine.run_distributed`
gives every rank: init the default group, run the test function, barrier, destroy the group.

Only :data:`SEED`, :data:`START_METHOD_ENV`, :func:`seed_everything`, :func:`use_loopback_for_gloo` and
:func:`init_gloo_world` are public (re-exported by :mod:`fairscale.fair_dev.testing.engine`); the rest is the engine's.
"""

import datetime
import os
import pickle
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, Type, Union

import pytest
import torch
import torch.distributed as dist

from fairscale.internal.device import CPU_ONLY_ENV, hide_accelerators_from_torch

__all__ = ["SEED", "START_METHOD_ENV", "seed_everything", "use_loopback_for_gloo", "init_gloo_world"]

#: Seed given to torch, ``random`` and numpy on every rank before the test body runs.
SEED = 0
#: Environment variable forcing the start method of the ranks ("fork" or "spawn").
START_METHOD_ENV = "FAIRSCALE_TEST_START_METHOD"

# The engine's own source files. Their frames are noise in a test's traceback or stack dump; the
# names are spelled out (not imported) because engine.py imports this module.
_HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_FILES: FrozenSet[str] = frozenset(
    os.path.join(_HERE, name) for name in ("engine.py", "engine_rank.py", "subtests.py")
)


def seed_everything(seed: int = SEED) -> None:
    """Seed torch (all devices), Python's ``random`` and numpy (when installed) with ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for the engine itself
        return
    numpy.random.seed(seed)


def use_loopback_for_gloo() -> None:
    """Make gloo connect over the loopback interface, unless ``GLOO_SOCKET_IFNAME`` is already set.

    All ranks of a test share one host; loopback avoids resolving the hostname, which is slow and on
    some CI machines resolves to an unreachable address. Call it in the rank, before the group exists.
    """
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def init_gloo_world(
    directory: str,
    rank: int,
    world_size: int,
    debug_level: Optional[Any] = None,
    timeout_s: float = 30.0,
) -> None:
    """Open a gloo default group on loopback, rendezvousing through a file store in ``directory``.

    For bodies run by :func:`~fairscale.fair_dev.testing.engine.run_ranks` that need a say in how the world is made,
    e.g. PyTorch's collective checker: ``debug_level`` (``dist.DebugLevel.DETAIL`` or ``OFF``) is set before the
    group exists, because torch reads it when it creates a group (and ``TORCH_DISTRIBUTED_DEBUG`` only at
    ``import torch``); ``None`` keeps the process's level.

    Args:
        directory (str): a directory all ranks share (the store file goes there; created if missing).
        rank (int): this rank.
        world_size (int): the number of ranks.
        debug_level (Optional[dist.DebugLevel]): the debug level to set first, or ``None``.
        timeout_s (float): the group's collective timeout.
    """
    if debug_level is not None:
        # Re-exported by torch.distributed at run time but absent from its type stubs.
        getattr(dist, "set_debug_level")(debug_level)
    use_loopback_for_gloo()
    # Made here if missing: a file store in a missing directory is never created, and the ranks would wait for it.
    os.makedirs(directory, exist_ok=True)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(directory, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def user_frames(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """Drop the engine's own leading frames: the reader wants the test body's frames."""
    start = tb
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ENGINE_FILES:
        tb = tb.tb_next
    return tb if tb is not None else start


def rebuild_exception(exc_type: Type[BaseException], message: str) -> Optional[BaseException]:
    """``exc_type(message)`` if that yields an exception whose text is exactly ``message``, else None."""
    if issubclass(exc_type, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return None
    try:
        rebuilt = exc_type(message)
    except Exception:
        return None
    # Types such as KeyError quote their argument, others ignore it: those would mangle the message.
    if not isinstance(rebuilt, exc_type) or str(rebuilt) != message:
        return None
    return rebuilt


# ----------------------------------------------------------------------------------------------
# The body a rank runs for run_distributed


@dataclass
class ProcessGroupBody:
    """Picklable (under spawn) closure: init the default group, run ``fn``, destroy the group."""

    fn: Callable[..., Any]
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    world_size: int
    device_type: str
    backend: str
    store_path: str
    pg_timeout_s: float

    def __call__(self, rank: int) -> Any:
        if self.device_type == "cuda":
            os.environ.pop(CPU_ONLY_ENV, None)  # inherited from the parent's environment, it would hide the GPUs
            torch.cuda.set_device(rank)
        else:
            # A CPU world stays on CPU on a machine with GPUs (FSDP's default compute device would be the GPU), and
            # never touches a CUDA context its parent may have created before the fork.
            hide_accelerators_from_torch()
        if self.backend == "gloo":
            use_loopback_for_gloo()
        dist.init_process_group(
            backend=self.backend,
            init_method=f"file://{self.store_path}",
            rank=rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.pg_timeout_s),
        )
        # On failure the group is deliberately left alone: the parent kills every rank anyway, and
        # tearing down a group whose peers are gone can block.
        result = self.fn(rank, self.world_size, *self.args, **self.kwargs)
        if dist.is_initialized():  # unless fn destroyed the group itself
            # gloo's init is no barrier: without this, a rank with nothing to do could tear down its
            # connections while a peer is still setting up its own, and fail that peer.
            if self.backend == "nccl":
                dist.barrier(device_ids=[rank])
            else:
                dist.barrier()
            dist.destroy_process_group()
        return result


# ----------------------------------------------------------------------------------------------
# The report a failing rank sends


@dataclass
class RemoteFailure:
    """What a failing rank tells the parent: enough to rebuild the exception there."""

    rank: int
    type_name: str
    message: str
    traceback: str
    is_skip: bool
    # CLOCK_MONOTONIC is system-wide on Linux, so failure times of different ranks are comparable.
    time: float = field(default_factory=time.monotonic)
    pickled_type: Optional[bytes] = None

    @classmethod
    def from_exception(cls, rank: int, error: BaseException) -> "RemoteFailure":
        try:
            pickled_type: Optional[bytes] = pickle.dumps(type(error))
        except Exception:  # a class defined inside a function: only its name travels
            pickled_type = None
        return cls(
            rank=rank,
            type_name=type(error).__name__,
            message=str(error),
            traceback="".join(traceback.format_exception(type(error), error, user_frames(error.__traceback__))),
            is_skip=isinstance(error, pytest.skip.Exception),
            pickled_type=pickled_type,
        )

    def exception_type(self) -> Optional[Type[BaseException]]:
        """The failing exception's class, when it could be pickled by reference and loads here."""
        if self.pickled_type is None:
            return None
        try:
            loaded = pickle.loads(self.pickled_type)
        except Exception:
            return None
        return loaded if isinstance(loaded, type) and issubclass(loaded, BaseException) else None


# ----------------------------------------------------------------------------------------------
# Inside a rank process


# See _forget_inherited_model_parallel.
_INHERITED_GROUPS: List[Any] = []


def _forget_inherited_model_parallel() -> None:
    """A forked rank starts without the model-parallel groups its parent may have set up (as a spawned rank does).

    A test that called ``initialize_model_parallel`` in the pytest process and never tore it down would otherwise
    make every later world's ``initialize_model_parallel`` fail with "already initialized" (upstream's ranks were
    spawned, so they never saw it). Only if the parent imported the module: nothing to forget otherwise.
    """
    initialize = sys.modules.get("fairscale.nn.model_parallel.initialize")
    if initialize is not None:
        # The inherited group objects are kept alive, never destroyed here: their C++ side (gloo's threads and
        # sockets) did not survive the fork, and running their destructors in this process can crash it.
        _INHERITED_GROUPS.extend(
            getattr(initialize, name, None)
            for name in ("_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_PIPELINE_PARALLEL_GROUP")
        )
        initialize.destroy_model_parallel()


def rank_main(
    rank: int,
    conn: Any,
    body: Union[Callable[[int], Any], bytes],
    parent_pid: int,
    stack_path: str,
    method: str,
    environ: Optional[Dict[str, str]] = None,
) -> None:
    """Entry point of every rank process: prepare the process, run ``body``, send one report.

    ``body`` comes pickled (bytes) to spawned ranks: each rank then unpickles a private copy of the arguments, as a
    forked rank has, instead of tensors in memory shared with its peers and the test process. ``environ`` is the test
    process's environment when the rank comes from the fork server (which has its own, from when it started).
    """
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    _die_with_parent(parent_pid, method)
    # Ctrl-C reaches the whole process group; the parent handles it and kills the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stack_file = open(stack_path, "w")
    _register_stack_dump(stack_file)
    torch.set_num_threads(1)
    if method == "fork":
        _forbid_more_threads()
        _forget_inherited_model_parallel()
    failed = False
    try:
        fn = pickle.loads(body) if isinstance(body, bytes) else body
        seed_everything(SEED)
        result = fn(rank)
        try:
            payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(
                f"the return value of the test body ({type(result).__name__}) cannot be pickled back to the "
                f"test process: {e}; return plain data (numbers, tensors, lists, dicts) instead"
            ) from e
        report: Tuple[str, Any] = ("ok", payload)
    except BaseException as e:  # everything, including pytest.skip and SystemExit, goes to the parent
        failed = True
        report = ("error", RemoteFailure.from_exception(rank, e))
    _flush_std_streams()
    conn.send_bytes(pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))
    conn.close()
    if failed:
        # Skip interpreter teardown: the parent kills the other ranks and does not need this one.
        os._exit(1)
    if method != "fork":
        # A forked rank ends with os._exit (multiprocessing's fork start); a spawned one would run the full
        # interpreter teardown, where libraries with background threads (RPC agents, NCCL watchdogs) can abort after
        # the result was reported. End the same way under every start method.
        os._exit(0)


def _die_with_parent(parent_pid: int, method: str) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a killed test run leaves no orphans.

    Under ``forkserver`` the parent is the fork server, which exits with the test process.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if method != "forkserver" and os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _register_stack_dump(stack_file: Any) -> None:
    import faulthandler

    # faulthandler writes from a C signal handler, so this works while Python is blocked in gloo.
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)


def _forbid_more_threads() -> None:
    original = torch.set_num_threads

    def set_num_threads(num: int) -> None:
        if num > 1:
            raise RuntimeError(
                f"torch.set_num_threads({num}) in a forked test rank would deadlock (GNU OpenMP is not "
                f"fork-safe once the parent used threads); ranks run single-threaded. Set "
                f"{START_METHOD_ENV}=spawn to run ranks with several threads."
            )
        original(num)

    setattr(torch, "set_num_threads", set_num_threads)


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
