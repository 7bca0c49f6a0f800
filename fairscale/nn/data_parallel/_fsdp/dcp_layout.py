# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Where every original parameter and buffer of an FSDP model lives, for DCP state dicts (no communication).

A flat parameter of ``numel`` elements is cut into ``W`` equal padded shards (chunk-and-pad, see :mod:`.handle`), so
its shards cut the original parameters it holds at arbitrary points. PyTorch's distributed checkpoint (DCP) format,
and FSDP2, use another layout: every original parameter is a DTensor with ``Shard(0)``, i.e. rank ``r`` holds rows
``[r * C, min((r + 1) * C, dim0))`` of it with ``C = ceil(dim0 / W)`` (``torch.chunk``'s cut; the last ranks may hold
fewer rows, or none). :class:`OrigParam` holds the arithmetic between the two; :func:`model_layout` lists, for a root
unit, every owned handle with the original parameters it holds (user-visible names, shapes, offsets in the flat
parameter), and every persistent buffer, in the order ``state_dict()`` gives them.

With hybrid sharding (``replicate_process_group``) the chunks are those of the shard group (``process_group``),
and every replica holds the same ones: the layout records the replicate group too, for FSDP2 HSDP's 2-D layout
(``(Replicate(), Shard(0))`` over a ``("replicate", "shard")`` DeviceMesh, see :mod:`.dcp_dtensor`).
"""

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal import collectives

from . import hybrid
from .handle import FlatHandle
from .metadata import _shared_param_pairs
from .naming import clean_path, join_path
from .unit import FSDPUnit

__all__ = ["OrigParam", "HandleLayout", "BufferEntry", "ModelLayout", "model_layout", "dim0_rows"]


def _fqn(path: str) -> str:
    """A DCP key: the path without FSDP's wrapper components, nor ``torch.compile``'s ``_orig_mod`` (a compiled
    block's), as torch's ``get_model_state_dict`` names it; the keys load into FSDP2 and the plain module whether or
    not the blocks were compiled (they kept ``0._orig_mod.weight``; found by a fuzz of torch.compile, session 43)."""
    return ".".join(c for c in clean_path(path).split(".") if c != "_orig_mod")


def dim0_rows(dim0: int, world_size: int, rank: int) -> Tuple[int, int]:
    """Rows ``[start, end)`` of a tensor with ``dim0`` rows that rank ``rank`` of ``world_size`` holds under Shard(0).

    The cut of ``torch.chunk`` and DTensor: ``ceil(dim0 / world_size)`` rows per rank, the last ranks short or empty.
    """
    if world_size <= 1:
        return 0, dim0
    chunk = -(-dim0 // world_size)
    start = min(rank * chunk, dim0)
    return start, min(start + chunk, dim0)


@dataclass(frozen=True)
class OrigParam:
    """One original parameter inside a flat parameter.

    Attributes:
        fqn: its user-visible name (as ``state_dict()`` gives it).
        aliases: the other names of the same tied parameter (``state_dict()`` lists it under each).
        shape: its full shape.
        offset: the index of its first element in the (unpadded) flat parameter.
    """

    fqn: str
    aliases: Tuple[str, ...]
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return int(self.shape.numel())

    @property
    def row_numel(self) -> int:
        """Elements per dim-0 row (1 for 1-D tensors; a 0-dim parameter is one row of one element)."""
        return int(torch.Size(self.shape[1:]).numel()) if len(self.shape) > 0 else 1

    @property
    def dim0(self) -> int:
        return int(self.shape[0]) if len(self.shape) > 0 else 1

    @property
    def is_scalar(self) -> bool:
        """A 0-dim parameter: it cannot be sharded along dim 0, every rank holds it whole (``Replicate``)."""
        return len(self.shape) == 0

    def rows(self, world_size: int, rank: int) -> Tuple[int, int]:
        """This rank's dim-0 rows ``[start, end)`` (the whole parameter when it is 0-dim)."""
        if self.is_scalar:
            return 0, 1
        return dim0_rows(self.dim0, world_size, rank)

    def chunk_shape(self, world_size: int, rank: int) -> torch.Size:
        """The shape of this rank's dim-0 chunk."""
        if self.is_scalar:
            return torch.Size([])
        start, end = self.rows(world_size, rank)
        return torch.Size([end - start]) + self.shape[1:]

    def slot_numel(self, world_size: int) -> int:
        """Elements of the largest chunk (rank 0's): every rank's slot in an exchange buffer has this size."""
        start, end = self.rows(world_size, 0)
        return (end - start) * self.row_numel


@dataclass
class HandleLayout:
    """An owned handle of a unit and the original parameters it holds, in flat order."""

    unit: FSDPUnit
    handle: FlatHandle
    params: List[OrigParam]
    # Exchange plans of :mod:`.dcp_reshard`, by the parameters they include (one layout lives for one call).
    plans: Dict[Tuple[bool, ...], Any] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.handle.world_size

    @property
    def rank(self) -> int:
        return self.handle.rank

    def shard_range(self) -> Tuple[int, int]:
        """The flat-parameter elements ``[lo, hi)`` this rank's shard covers (``hi`` may exceed ``numel``: padding)."""
        h = self.handle
        if not h.is_sharded:
            return 0, h.numel
        lo = h.rank * h.shard_numel
        return lo, lo + h.shard_numel


@dataclass
class BufferEntry:
    """A persistent buffer: its user-visible name, where it lives, and the unit whose settings apply to it."""

    fqn: str
    module: nn.Module
    name: str
    unit: FSDPUnit

    def tensor(self) -> Tensor:
        value = self.module._buffers[self.name]
        assert value is not None  # entries are only made for buffers that are set
        return value


@dataclass
class ModelLayout:
    """Every owned handle and persistent buffer of a root unit's tree, and the process groups shards live on.

    Attributes:
        group: the shard group (every unit's ``process_group``); ``group_ranks`` its global ranks.
        replicate_group: with hybrid sharding, every unit's ``replicate_process_group`` (``None`` otherwise);
            ``replicate_ranks`` its global ranks (empty without).
    """

    root: FSDPUnit
    handles: List[HandleLayout]
    buffers: List[BufferEntry]
    group: Any
    group_ranks: Tuple[int, ...]
    keys: List[str] = field(default_factory=list)
    replicate_group: Any = None
    replicate_ranks: Tuple[int, ...] = ()

    @property
    def is_hybrid(self) -> bool:
        return self.replicate_group is not None

    @property
    def agree_group(self) -> Any:
        """The group whose ranks must agree on a load or a save: the whole world with hybrid sharding (every replica
        loads the same values, and a bad dict on one replica must roll back all), else the shard group."""
        return hybrid.world_group() if self.is_hybrid else self.group

    @property
    def params(self) -> List[Tuple[HandleLayout, OrigParam]]:
        return [(hl, p) for hl in self.handles for p in hl.params]

    def param_by_name(self) -> Dict[str, Tuple[HandleLayout, OrigParam]]:
        """Every name of every parameter (aliases included) to its handle and parameter."""
        out: Dict[str, Tuple[HandleLayout, OrigParam]] = {}
        for hl, p in self.params:
            for name in (p.fqn,) + p.aliases:
                out.setdefault(name, (hl, p))
        return out


def check_checkpoint_group(root: FSDPUnit, process_group: Any, what: str) -> None:
    """Raise ``ValueError`` unless ``process_group`` (``None``: the world) holds exactly the ranks of ``root``'s model:
    its shard group, times its replicate group with hybrid sharding.

    ``fsdp_dcp.save``/``load`` write and read one checkpoint from every rank of that group. With the model sharded
    over a subgroup of the world (FSDP over each tensor-parallel rank's data-parallel group) and the world as the
    checkpoint's group, the other subgroups' shards bear the same names and offsets, and they overwrote each other in
    the files, loading back wrong values without an error: such a model needs its own group, and a directory per
    group.
    """
    ranks = tuple(collectives.group_ranks(root.config.process_group))
    replicate_ranks = _replicate_ranks(root)
    model_ranks = set(ranks)
    if replicate_ranks:
        # Every rank of the shard group lies in one replicate group; the model's ranks are their union. Each rank
        # knows its own groups only: ranks of other shard groups are those of the replicas' shard groups, which have
        # the same size (checked at construction), so the count is what can be checked here.
        model_ranks |= set(replicate_ranks)
        model_count = len(ranks) * len(replicate_ranks)
    else:
        model_count = len(ranks)
    model = f"the model shards over ranks {list(ranks)}" + (
        f" and replicates over {list(replicate_ranks)} ({model_count} ranks)" if replicate_ranks else ""
    )
    if process_group is None:
        world = collectives.group_ranks(None)
        if model_count != len(world):
            raise ValueError(
                f"{what}: {model}, which do not make up the world's {len(world)} ranks (FSDP over a data-parallel "
                "group of tensor or pipeline parallelism?); without process_group, the checkpoint is the world's and "
                "every group's shards would overwrite each other. Pass process_group=the model's data-parallel group "
                "and a checkpoint_id per group (e.g. one directory per tensor-parallel rank)."
            )
        return
    group_ranks = collectives.group_ranks(process_group)
    if collectives.group_rank(process_group) < 0:
        raise ValueError(
            f"{what}: this rank ({collectives.group_rank(None)}) is not in process_group (ranks {list(group_ranks)}); "
            "pass the group the model is sharded over (its data-parallel group), which holds this rank"
        )
    if len(group_ranks) != model_count or not model_ranks <= set(group_ranks):
        raise ValueError(
            f"{what}: process_group holds ranks {list(group_ranks)} but {model}; pass the group whose ranks hold the "
            "model's shards and replicas (its data-parallel group): every rank of it saves or loads this checkpoint, "
            "and only they"
        )
    first = collectives.group_leader(process_group)
    if first != 0 and not _dcp_takes_subgroups():
        raise NotImplementedError(
            f"{what}: this torch's DCP ({torch.__version__}) cannot save or load over a group whose first rank is not "
            f"global rank 0 (here {first}): its coordinator is the group's rank 0 taken as a global rank "
            "(pytorch/pytorch#141825, fixed in later releases). Upgrade torch, or save such a group's part with "
            "local_state_dict() or state_dict() on its rank 0."
        )


@functools.lru_cache(maxsize=None)
def _dcp_takes_subgroups() -> bool:
    """Whether torch's DCP addresses a subgroup's coordinator by its global rank (torch 2.7 and later): its object
    collectives take ``dst``/``src`` as global ranks, which earlier releases passed the group rank (0) as."""
    try:
        from torch.distributed.checkpoint.utils import _DistWrapper

        return "global_coordinator_rank" in inspect.getsource(_DistWrapper)
    except (ImportError, OSError, TypeError):  # pragma: no cover - no DCP, or a torch without its sources
        return True


def model_layout(root: FSDPUnit, what: str) -> ModelLayout:
    """The layout of ``root``'s tree (materialised handles: call it under lazy init).

    Raises:
        ValueError: ``root`` is not the root of its tree, or an instance shards over another process group than the
            root's, or replicates over another replicate group (DCP's placements describe one mesh for the whole
            model).
    """
    if root.has_fsdp_parent or root.is_root is False:
        raise ValueError(
            f"{what}: call it with the root FullyShardedDataParallel instance (the outermost one), not a nested one"
        )
    group = root.config.process_group
    ranks = tuple(collectives.group_ranks(group))
    replicate_group = root.config.replicate_process_group
    replicate_ranks = _replicate_ranks(root)
    handles: List[HandleLayout] = []
    aliases_of: Dict[str, List[str]] = {}
    for path, u in root.named_units():
        where = _fqn(path)
        u_ranks = tuple(collectives.group_ranks(u.config.process_group))
        owned = [(i, h) for i, h in enumerate(u.handles) if not h.borrowed]
        if owned and u_ranks != ranks:
            raise ValueError(
                f"{what}: the FSDP instance at {where or '(root)'!r} shards its parameters over ranks {list(u_ranks)} "
                f"but the root shards over {list(ranks)}; a DCP state dict describes one sharding group for the whole "
                "model (instances with their own group, e.g. no_broadcast_optim_state experts, are not supported). "
                "Save such models with local_state_dict() instead."
            )
        u_replicate = _replicate_ranks(u)
        if owned and u_replicate != replicate_ranks:
            raise ValueError(
                f"{what}: the FSDP instance at {where or '(root)'!r} replicates its shards over ranks "
                f"{list(u_replicate) or 'none (no replicate_process_group)'} but the root over "
                f"{list(replicate_ranks) or 'none (no replicate_process_group)'}; a DCP state dict describes one "
                "device mesh for the whole model: pass the same process_group and replicate_process_group to every "
                "instance, or save with local_state_dict() instead."
            )
        fpw: Any = u.wrapped
        flat_params = list(getattr(fpw, "flat_params", []))
        for src, dst in _shared_param_pairs(u, flat_params):
            aliases_of.setdefault(join_path(where, src), []).append(join_path(where, dst))
        for i, h in owned:
            if i < len(flat_params):
                names, shapes, numels = flat_params[i].metadata()
                entries: List[Tuple[str, torch.Size]] = [
                    (join_path(where, _fqn(n)), torch.Size(s)) for n, s in zip(names, shapes)
                ]
                if sum(int(n) for n in numels) != h.numel:
                    raise RuntimeError(
                        f"{what}: the flat parameter of {where or '(root)'!r} holds {h.numel} elements but its "
                        f"parameters add up to {sum(int(n) for n in numels)}"
                    )
            else:
                entries = [(join_path(where, u.param_name_groups[i][0]), torch.Size(h.orig_size))]
            params: List[OrigParam] = []
            offset = 0
            for name, shape in entries:
                params.append(OrigParam(name, (), shape, offset))
                offset += int(shape.numel())
            handles.append(HandleLayout(u, h, params))
    # Aliases are known once every instance was seen (a pair is reported by the instance that holds both names).
    for hl in handles:
        hl.params = [
            OrigParam(p.fqn, tuple(aliases_of.get(p.fqn, [])), p.shape, p.offset) if p.fqn in aliases_of else p
            for p in hl.params
        ]
    buffers = _buffers(root)
    layout = ModelLayout(root, handles, buffers, group, ranks, [], replicate_group, replicate_ranks)
    layout.keys = _ordered_keys(root, layout)
    return layout


def _replicate_ranks(unit: FSDPUnit) -> Tuple[int, ...]:
    group = unit.config.replicate_process_group
    return () if group is None else tuple(collectives.group_ranks(group))


def _buffers(root: FSDPUnit) -> List[BufferEntry]:
    owner_of: Dict[int, FSDPUnit] = {}
    for u in root.tree_units():
        for m in u.owned_modules():
            owner_of.setdefault(id(m), u)
    out: List[BufferEntry] = []
    seen = set()
    for mod_path, mod in root.owner.named_modules(remove_duplicate=False):
        for name, buf in mod._buffers.items():
            if buf is None or name in mod._non_persistent_buffers_set:
                continue
            key = _fqn(join_path(mod_path, name))
            if key in seen:
                continue
            seen.add(key)
            out.append(BufferEntry(key, mod, name, owner_of.get(id(mod), root)))
    return out


def _ordered_keys(root: FSDPUnit, layout: ModelLayout) -> List[str]:
    """Every key, in ``state_dict()``'s order: modules in pre-order, each module's parameters, then its buffers."""
    module_index: Dict[str, int] = {}
    for mod_path, _ in root.owner.named_modules(remove_duplicate=False):
        module_index.setdefault(_fqn(mod_path), len(module_index))

    def position(key: str, kind: int, seq: int) -> Tuple[int, int, int]:
        module = key.rsplit(".", 1)[0] if "." in key else ""
        return (module_index.get(module, len(module_index)), kind, seq)

    ranked: List[Tuple[Tuple[int, int, int], str]] = []
    seq = 0
    for _, p in layout.params:
        for name in (p.fqn,) + p.aliases:
            ranked.append((position(name, 0, seq), name))
            seq += 1
    for b in layout.buffers:
        ranked.append((position(b.fqn, 1, seq), b.fqn))
        seq += 1
    ordered: List[str] = []
    seen = set()
    for _, key in sorted(ranked):
        if key not in seen:
            seen.add(key)
            ordered.append(key)
    return ordered
