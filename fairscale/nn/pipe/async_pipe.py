# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The multi-process front: :class:`AsyncPipe` runs one pipeline stage per process."""

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from threading import Event
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union, cast

import torch
import torch.distributed as dist
from torch import nn

from fairscale.internal import collectives
from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.internal.agreement import check_ranks_agree
from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_group as get_pipeline_parallel_group

from . import microbatch
from ._checks import balance_entries
from .async_pipeline import AsyncPipeline
from .async_schedule import Invocation, Location, ModuleWrapper, _group_ranks
from .batchnorm import DeferredBatchNorm, count_plain_batch_norms_once
from .checkpoint import guard_checkpointed
from .messages import use_rpc_by_default
from .microbatch import Batch
from .skip.layout import SkipLayout
from .skip.skippable import Skippable
from .types import LazyModule, TensorOrTensors

__all__ = ["AsyncPipe", "PartitionInfo", "verify_module", "check_balance"]

Module = Union[nn.Sequential, List[LazyModule]]


@dataclass
class PartitionInfo:
    location: Location
    modules: "OrderedDict[str, nn.Module]"
    invocations: List[Invocation] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.modules)


def verify_module(module: Module) -> None:
    """Raise ``ValueError`` if a layer object appears twice."""
    if len(set(map(id, module))) != len(module):
        raise ValueError("module with duplicate children is not supported")


def check_balance(module: Any, balance: List[int]) -> None:
    """Raise ``ValueError`` unless ``balance`` covers the layers of ``module`` with positive ints.

    Raises:
        ValueError: an entry is not an int (floats and bools are rejected) or not positive, or the sum is not
            ``len(module)``.
        TypeError: ``balance`` is not iterable.
    """
    balance = balance_entries(balance)
    if len(module) != sum(balance):
        raise ValueError(
            f"module and sum of balance have different length (module: {len(module)}, sum of balance: {sum(balance)})"
        )
    if any(x <= 0 for x in balance):
        raise ValueError(f"all balance numbers must be positive integer (balance: {balance})")


class AsyncPipe(nn.Module):
    """Pipeline parallelism over processes: each process (rank ``s`` of ``group``) runs stage ``s``.

    Every stage is called with an input that splits into the same number of micro-batches; only the first
    stage's values are used. Activations and gradients travel between stages as messages (point-to-point
    send/recv on the pipeline group, or ``torch.distributed.rpc`` when RPC is initialised, as upstream: then
    ``worker_map`` is required; see :mod:`fairscale.nn.pipe.messages`). The last stage returns the output; the others return
    their micro-batches. In training (with autograd on), a non-final stage's ``forward`` returns only once the
    backward pass through it is done, so the last stage must run backward (or every stage must be in eval mode, or
    under ``torch.no_grad()``). Nothing is left in flight when ``forward`` (or the last stage's backward) returns,
    and a failing stage stops the stages waiting for it with ``PipelineAbortedError``::

        model = AsyncPipe(nn.Sequential(a, b, c, d), balance=[2, 2], group=group, chunks=4)
        out = model(x)
        if model.final_stage:
            loss_fn(out, y).backward()

    Under PyTorch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) the send/recv messages travel on a twin of
    the pipeline group, so that the group's own collectives stay comparable across its ranks; the constructor creates
    it, collectively over the group: construct the pipe on every rank of the group then, those without a stage too.

    Args:
        module (nn.Sequential or List[LazyModule]): the model; with ``LazyModule`` entries, each process builds
            only its own layers.
        balance (Iterable[int]): number of layers of each stage.

    Keyword Args:
        group (ProcessGroup): the pipeline group (default: ``fairscale.nn.model_parallel``'s pipeline group).
        worker_map (Dict[int, str]): global rank to RPC worker name, for the RPC transport.
        input_device: where received activations are placed (default: where they arrive, the CPU).
        chunks (int): number of micro-batches (default ``1``).
        checkpoint (str): ``'always'``, ``'except_last'`` (default) or ``'never'``.
        deferred_batch_norm (bool): track batch-norm statistics over whole mini-batches (default ``False``).

    Raises:
        ValueError: invalid chunks, checkpoint, balance (each entry a positive int) or duplicate layers.
        TypeError: ``balance`` is not iterable.
        IndexError: fewer ranks than stages.
    """

    balance: List[int] = []
    chunks: int = 1
    checkpoint: str = "except_last"

    def __init__(
        self,
        module: Module,
        balance: Iterable[int],
        *,
        group: Optional[Any] = None,
        worker_map: Optional[Dict[int, str]] = None,
        input_device: Union[None, int, str, torch.device] = None,
        chunks: int = chunks,
        checkpoint: str = checkpoint,
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if chunks <= 0:
            raise ValueError("number of chunks must be positive integer")
        if checkpoint not in ["always", "except_last", "never"]:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")

        self.balance = balance_entries(balance)
        verify_module(module)
        check_balance(module, self.balance)

        self.chunks = chunks
        self.checkpoint = checkpoint
        self.pipeline: Optional[AsyncPipeline] = None
        # Whether the ranks were checked to agree on the shape of a step (at the first forward).
        self._ranks_agree = False
        self.lock = threading.Lock()
        self.worker_map = worker_map
        self.input_device = input_device
        self.group: Any = group if group is not None else get_pipeline_parallel_group()

        if self.group.size() < len(self.balance):
            raise IndexError(
                "too few ranks to hold given partitions "
                f"(ranks: {self.group.size()}, partitions: {len(self.balance)})"
            )

        # Skip connections across stages are not supported (as upstream): the layout is empty.
        self._skip_layout = SkipLayout(len(module), {})

        rank = self.group.rank()
        self.final_stage = rank == len(self.balance) - 1
        self.partitions: List[ModuleWrapper] = []
        # Under PyTorch's collective checker the stages' messages travel on a twin of the pipeline group (see
        # collectives.p2p_group), and creating it is collective over the group: every rank creates it here, at the
        # same point, the ranks without a stage included; the stages' transports then find it made. Without the
        # checker nothing happens here.
        if collectives.checked_by_torch(self.group) and self._messages_on_group():
            collectives.p2p_group(self.group)
        if rank >= len(self.balance):
            warnings.warn("More ranks than partitions, some ranks unused")
            self.partition: Optional[nn.Sequential] = None
            return

        self.partitions = self.instantiate_partition(module, self.balance, self.group)
        if deferred_batch_norm:
            for part in self.partitions:
                part.module = DeferredBatchNorm.convert_deferred_batch_norm(part.module, chunks)
        if checkpoint != "never":
            for part in self.partitions:
                count_plain_batch_norms_once(part.module)
        for name, part in enumerate(self.partitions):
            self.add_module(str(name), part.module)
        # Registered a second time under "partition", as upstream (state dicts have both keys).
        self.partition = self.partitions[0].module
        self.create_pipeline()

    def instantiate_partition(self, module: Module, balance: List[int], group: Any) -> List[ModuleWrapper]:
        """Build this rank's layers (realizing lazy ones) into its :class:`ModuleWrapper`."""
        rank = group.rank()
        start = sum(balance[:rank])
        stop = start + balance[rank]
        lazy = not isinstance(module, nn.Sequential)
        if isinstance(module, nn.Sequential):
            entries: List[Any] = list(module.named_children())
        else:
            entries = [(str(i), layer) for i, layer in enumerate(module)]

        layers: "OrderedDict[str, nn.Module]" = OrderedDict()
        for name, layer in entries[start:stop]:
            if isinstance(layer, nn.Module):
                built = layer
            elif callable(layer):
                built = layer()
            else:
                raise TypeError(f"layer must be nn.Module or callable, is {type(layer)}")
            if lazy and isinstance(built, Skippable):
                raise ValueError("Can't use Skippable layers with multi-process pipe and lazy construction")
            layers[name] = built

        location = Location(rank, 0)
        invocation = Invocation(
            order=rank,
            this=location,
            source=Location(rank - 1, 0) if rank > 0 else None,
            dest=Location(rank + 1, 0) if rank < len(balance) - 1 else None,
        )
        return [ModuleWrapper(nn.Sequential(layers), location, [invocation])]

    def _messages_on_group(self) -> bool:
        """Whether the stages' messages go point-to-point over the pipeline group (the send/recv transport, on a gloo
        or MPI group: ``create_pipeline`` refuses any other backend for it)."""
        if use_rpc_by_default(self.worker_map) or not isinstance(self.group, dist.ProcessGroup):
            return False
        backend = str(dist.get_backend(self.group))
        return "gloo" in backend or "mpi" in backend

    def create_pipeline(self) -> None:
        checkpoint_stop = {"always": self.chunks, "except_last": self.chunks - 1, "never": 0}[self.checkpoint]
        # Checked before the pipeline is built: under PyTorch's collective checker its send/recv transport looks for
        # a twin of the group (collectives.p2p_group), which __init__ made only for a backend that can carry it.
        if not use_rpc_by_default(self.worker_map) and isinstance(self.group, dist.ProcessGroup):
            backend = str(dist.get_backend(self.group))
            if "gloo" not in backend and "mpi" not in backend:
                raise ValueError(
                    f"AsyncPipe's send/recv transport needs a gloo (or MPI) pipeline group, not {backend!r}: a stage "
                    "receives from any neighbour, which NCCL cannot do. Create the pipeline group with gloo (e.g. "
                    "initialize_model_parallel(..., pipeline_backend='gloo')) or use RPC (rpc.init_rpc and worker_map)"
                )
        self.pipeline = AsyncPipeline(
            self.partitions,
            self._skip_layout,
            checkpoint_stop,
            group=self.group,
            worker_map=self.worker_map,
            input_device=self.input_device,
            final_stage=self.final_stage,
            num_stages=len(self.balance),
        )

    def __len__(self) -> int:
        """The number of this rank's layers."""
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        """This rank's ``index``-th layer (negative indices count from the end)."""
        partitions: List[nn.Sequential] = [p.module for p in self.partitions]
        if index < 0:
            partitions = partitions[::-1]
        for partition in partitions:
            try:
                layer: nn.Module = partition[index]
                return layer
            except IndexError:
                pass
            shift = len(partition)
            index = index + shift if index < 0 else index - shift
        raise IndexError

    def __iter__(self) -> Iterator[nn.Module]:
        """This rank's layers, in order."""
        for partition in self.partitions:
            yield from partition.module

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: tried on shape-only tensors first, so that a load that fails
        leaves the model as it was. Every entry appears under two names (``0.*`` and ``partition.*``); before, even the
        entry a failed load named was overwritten through its twin.

        Raises:
            RuntimeError: torch's load errors; also (a ``FairscaleRuntimeError``) when a dict gives the two names of
                one entry different values (edited by hand, or merged from two checkpoints): torch loaded whichever
                came last, silently.
        """
        _check_twins_agree(state_dict)
        return load_state_dict_all_or_nothing(self, state_dict, strict, assign)

    def forward(self, input: TensorOrTensors, *, event: Optional[Event] = None) -> Any:
        """Run this stage on a mini-batch.

        At the first call, when every rank of the (gloo) group holds a stage, the ranks check that they agree on the
        shape of the step (one small collective), see :meth:`_check_ranks_agree`. Every step, each stage checks that
        the messages it receives describe its own step (number, mode, number of micro-batches), at no extra cost:
        the message headers carry them.

        Args:
            input (torch.Tensor or Tuple[torch.Tensor, ...]): the mini-batch; only the first stage's values are
                used, the other ranks pass a tensor of the same shape.
            event (Optional[Event]): the first stage waits for it before it receives gradients (PipeRPCWrapper).

        Returns:
            The output on the final stage; this stage's micro-batches (a list of ``Batch``) elsewhere; the input
            itself on ranks without a stage. ``forward`` returns once every message of this stage was received by
            its peer, and the last stage's backward once its gradients were, so a script may simply end.

        Raises:
            RanksDisagreeError: at the first call, the stages differ in balance, chunks, number of micro-batches,
                batch size or mode (raised on every rank). At a later call, the stages differ in mode or number of
                micro-batches, or one ran more steps (``StagesDisagreeError``, a ``RanksDisagreeError``, raised by
                every stage that receives or waits for a message of that step; an earlier stage in eval mode, which
                waits for none, returns normally).
            PipelineAbortedError: another stage failed.
        """
        microbatch.check(input)
        # Gradients come back only in training mode with autograd on; otherwise no stage waits for them.
        training = self.training and torch.is_grad_enabled()
        with self.lock:
            if not self._ranks_agree:
                self._check_ranks_agree(input, training)
                self._ranks_agree = True
            if not self.pipeline:
                # No stage on this rank.
                return input
            batches = microbatch.scatter(input, self.chunks)
            self.pipeline.run(training, batches, event)
            if self.final_stage:
                if training and self.pipeline.checkpoint_stop > 0:
                    guard_checkpointed(batches)
                return microbatch.gather(batches)
            return batches

    def _check_ranks_agree(self, input: TensorOrTensors, training: bool) -> None:
        """Raise the same ``RanksDisagreeError`` on every rank when the ranks would run steps that do not match.

        A stage waits for as many messages as it has micro-batches, and for gradients only in training: ranks
        that differ there would wait for each other forever. Checked once, at the first step (one
        ``all_gather_object`` on the pipeline group). Not checked when some ranks of the group hold no stage (those
        need not call ``forward`` at all, so they cannot be asked to join), nor on a pipeline group other than gloo
        or MPI (an NCCL group carries RPC pipelines, whose stages may run ``forward`` on an RPC thread, without the
        CUDA device that an NCCL object collective would need).

        Every step, the first one included and whatever the group, is also checked without a collective: each
        message header carries the sender's step number, mode and number of micro-batches, which the receiver
        compares with its own (see ``AsyncEventLoop.check_header``). That finds the stages concerned, not every rank.
        """
        rpc_names, own_name_ok, problem = self._worker_map_problem()
        if not self._group_can_agree():
            if problem is not None:
                raise FairscaleValueError(problem)
            return
        tensors = (input,) if isinstance(input, torch.Tensor) else tuple(input)
        # A rank without a stage may get a 0-dim input (it returns it unchanged): it has no micro-batches.
        scalar = any(t.dim() == 0 for t in tensors)
        description = [
            ("balance", list(self.balance)),
            ("chunks", self.chunks),
            # Per tensor, not through scatter: scatter refuses tensors that split differently, and a rank raising
            # alone here would leave the others in the gather below (it raises after it, on every rank alike).
            ("micro-batches", None if scalar else _micro_batch_count(tensors, self.chunks)),
            ("batch size (dim 0 of each input tensor)", [int(t.shape[0]) if t.dim() else None for t in tensors]),
            ("gradients come back (training mode with autograd on)", training),
            # A wrong map sent to the wrong worker, or raised a bare KeyError on one rank: the others waited forever
            # (an RPC transport's receive has no timeout; found by a fuzz).
            ("worker_map (RPC transport)", rpc_names),
            ("this rank's worker_map entry is its own RPC worker name", own_name_ok),
        ]
        check_ranks_agree(
            "AsyncPipe: the balance, chunks, micro-batch count, batch size and mode of the first step",
            description,
            self.group,
            hint="Construct AsyncPipe with the same balance, chunks and worker_map on every rank, call it with an input "
            "of the same shape on every rank (only the first stage's values are used), in the same mode (train/eval, "
            "autograd on/off).",
        )
        if problem is not None:  # the same map on every rank, wrong everywhere: every rank raises
            raise FairscaleValueError(problem)

    def _worker_map_problem(self) -> Tuple[Optional[List[Tuple[int, str]]], bool, Optional[str]]:
        """For the RPC transport: the map's entries, whether this rank's entry names its own RPC worker, and what is
        wrong with the map (``None``: nothing); ``(None, True, None)`` for the send/recv transport.

        Only the stages' ranks (the first ``len(balance)`` of the group) need an entry; a value may be the worker's
        name, id or ``WorkerInfo``, as ``rpc_async`` takes any of them.
        """
        if not use_rpc_by_default(self.worker_map) or not isinstance(self.worker_map, dict):
            return None, True, None
        from torch.distributed import rpc

        stages = _group_ranks(self.group)[: len(self.balance)]
        entries = sorted((int(k), repr(v)) for k, v in self.worker_map.items())
        me, info = dist.get_rank(), rpc.get_worker_info()
        missing = [r for r in stages if r not in self.worker_map]
        mine = self.worker_map.get(me)
        # A name, an id or a WorkerInfo: what rpc_async resolves. Ranks without a stage receive nothing.
        own_ok = bool(missing) or me not in stages or mine in (info.name, info.id, info)
        problem: Optional[str] = None
        if missing:
            problem = (
                f"AsyncPipe: worker_map {self.worker_map} has no RPC worker for the global rank(s) {missing} of the "
                f"pipeline's stages {stages}; map every stage's global rank to its rpc.init_rpc name"
            )
        elif not own_ok:
            problem = (
                f"AsyncPipe: worker_map names global rank {me} {mine!r}, but its RPC worker is {info.name!r} "
                "(rpc.init_rpc's name): messages for it would go to another worker. Map each global rank to the "
                "name that rank gave rpc.init_rpc"
            )
        # With ranks missing (the same problem on every rank that shares the map), the entry is not compared.
        return entries, own_ok, problem

    def _group_can_agree(self) -> bool:
        """Whether every rank of the pipeline group holds a stage and can join an object collective (gloo or MPI;
        see :meth:`_check_ranks_agree`)."""
        if len(self.balance) != self.group.size() or not isinstance(self.group, dist.ProcessGroup):
            return False
        backend = str(dist.get_backend(self.group))
        return "gloo" in backend or "mpi" in backend

    def back_helper(self, output: List[Batch]) -> None:
        """Kept for upstream compatibility: a no-op on non-final stages (their backward ran inside ``forward``)."""
        if self.final_stage:
            raise ValueError("back_helper should only be called on non-final stages")
        if self.pipeline:
            self.pipeline.back_helper(output)


def _micro_batch_count(tensors: Tuple[torch.Tensor, ...], chunks: int) -> Union[int, List[int]]:
    """How many micro-batches ``tensors`` split into: one count, or each tensor's where they differ (which
    ``microbatch.scatter`` refuses, on every rank alike, after the agreement check)."""
    counts = [len(t.chunk(chunks)) for t in tensors]
    return counts[0] if len(set(counts)) == 1 else counts


def _check_twins_agree(state_dict: Mapping[str, Any]) -> None:
    """Both names of an entry (``0.<name>`` and ``partition.<name>``, the one partition registered twice) must hold the
    same value when a dict has both."""
    for key, value in state_dict.items():
        if not key.startswith("partition."):
            continue
        twin = "0." + key[len("partition.") :]
        other = state_dict.get(twin)
        if (
            other is None
            or other is value
            or not isinstance(value, torch.Tensor)
            or not isinstance(other, torch.Tensor)
        ):
            continue
        if value.shape != other.shape or value.dtype != other.dtype or value.device != other.device:
            continue  # torch's load names a wrong shape more precisely
        if value.is_meta or _same_memory(value, other) or _equal(value, other):
            continue
        raise FairscaleRuntimeError(
            f"AsyncPipe.load_state_dict: {key!r} and {twin!r} name the same entry (the partition is registered twice) "
            "but the state dict gives them different values; keep one of the two names, or give both the same value"
        )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both names over one tensor's memory: what ``state_dict()`` gives, and ``torch.load`` of it (no comparison)."""
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    )


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))  # a NaN equals itself here
    return bool(torch.equal(a, b))
