# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What the DCP model and optimizer state dicts share: DTensor chunks, the check of a given value, the calls' frame.

* :func:`_as_dtensor` wraps this rank's chunk of an original parameter (or of a per-parameter optimizer state) as a
  DTensor with ``Shard(0)`` (``Replicate`` for 0-dim) over the 1-D DeviceMesh of the root's group, without
  communication; :func:`_value_lists` cuts those chunks out of flat tensors, or makes the views that a save writes
  from and a load reads into (:mod:`.dcp_views`).
  With hybrid sharding the layout is FSDP2 HSDP's: ``(Replicate(), Shard(0))`` (``(Replicate(), Replicate())``
  for 0-dim) over a 2-D DeviceMesh with dimensions ``("replicate", "shard")``, whose entry ``[i][j]`` is the rank
  with replicate index ``i`` and shard index ``j``. DCP's save planner then writes every chunk once, from one
  replica, and ``dcp.load`` reads it on every replica.
* :func:`_classify` checks a value given for a parameter on load and says whether it is this rank's chunk, the
  full tensor, or this rank's boxes (what ``load`` reads a checkpoint into).
* :func:`check_root`, :func:`_require_dtensor` and :func:`_initialized_tree` frame every call of
  :mod:`.dcp_state` and :mod:`.dcp_optim`.
"""

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fairscale.internal import collectives

from .dcp_layout import HandleLayout, ModelLayout, OrigParam
from .dcp_reshard import BOXES, CHUNK, FULL, flat_to_chunks
from .dcp_views import box_sources, is_sharded_tensor, shape_of, sharded_views, staging_views, views_available
from .runtime import check_zero2_groups_once, lazy_init, lazy_init_for_call
from .unit import FSDPUnit

try:  # torch >= 2.4: public DTensor (the one guarded import: .dcp_state and .dcp_optim take DTensor from here)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor as DTensor
    from torch.distributed.tensor import Replicate as Replicate
    from torch.distributed.tensor import Shard

    _DTENSOR_ERROR: Optional[str] = None
except ImportError as e:  # pragma: no cover - old torch
    _DTENSOR_ERROR = str(e)
try:  # what DTensor.from_local builds, without its autograd function (a tenth of a save's CPU time otherwise)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    _DIRECT_DTENSOR = [True]
except ImportError:  # pragma: no cover - another torch layout: from_local
    _DIRECT_DTENSOR = [False]

Value = Optional[Tuple[str, Tensor]]


def _require_dtensor(what: str) -> None:
    if _DTENSOR_ERROR is not None:  # pragma: no cover - old torch
        raise ImportError(
            f"{what} needs torch.distributed.tensor (DTensor, torch >= 2.4); this torch has none: {_DTENSOR_ERROR}"
        )


def check_root(unit: FSDPUnit, what: str) -> None:
    """Refuse a nested instance before lazy init could make it the root of its own subtree."""
    if unit.has_fsdp_parent or unit.is_root is False:
        raise ValueError(
            f"{what}: call it with the root FullyShardedDataParallel instance (the outermost one), not a nested one"
        )


# ---------------------------------------------------------------------------------------------------- DTensors


# The dimension names of FSDP2 HSDP's mesh (``init_device_mesh(..., mesh_dim_names=("replicate", "shard"))``).
HYBRID_MESH_DIM_NAMES = ("replicate", "shard")


class _Meshes:
    """The DeviceMesh of the layout's groups, per device type (``None`` without torch.distributed).

    1-D over the shard group; with hybrid sharding 2-D, ``("replicate", "shard")``. The 2-D mesh needs every shard
    group's ranks, which no rank knows alone: the constructor gathers them over the replicate group (collective: every
    rank builds its ``_Meshes`` at the same point of every call).
    """

    def __init__(self, layout: ModelLayout) -> None:
        self.layout = layout
        self._cache: Dict[str, Any] = {}
        self._grid: Optional[List[List[int]]] = None
        if layout.is_hybrid and dist.is_available() and dist.is_initialized():
            with layout.root.device.as_current():  # NCCL object collectives allocate on the current device
                # In replicate-group order: row i is the shard group of the replica with replicate index i.
                rows = collectives.all_gather_object(list(layout.group_ranks), group=layout.replicate_group)
            self._grid = [list(row) for row in rows]

    def writer_ranks(self) -> List[List[int]]:
        """Per replica (one row without hybrid sharding), the global rank of every shard-group rank."""
        if self._grid is not None:
            return self._grid
        return [list(self.layout.group_ranks)]

    def own_row(self) -> List[int]:
        """The global ranks of this rank's replica (its shard group), in shard order."""
        me = dist.get_rank()
        for row in self.writer_ranks():
            if me in row:
                return list(row)
        raise RuntimeError(f"rank {me} is in none of the shard groups {self.writer_ranks()}")

    def get(self, device_type: str) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if device_type not in self._cache:
            group = self.layout.group if self.layout.group is not None else dist.group.WORLD
            if group is None:
                return None
            if self._grid is not None:
                self._cache[device_type] = DeviceMesh.from_group(
                    [self.layout.replicate_group, group],
                    device_type,
                    mesh=self._grid,
                    mesh_dim_names=HYBRID_MESH_DIM_NAMES,
                )
            else:
                self._cache[device_type] = DeviceMesh.from_group(group, device_type)
        return self._cache[device_type]


def _contiguous_stride(shape: torch.Size) -> Tuple[int, ...]:
    stride: List[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


@torch.no_grad()
def _as_dtensor(local: Tensor, p: OrigParam, meshes: _Meshes) -> Any:
    """This rank's chunk of ``p`` as a DTensor (``Shard(0)``; ``Replicate`` for 0-dim), without communication.

    With hybrid sharding (a 2-D mesh) the chunk is replicated over the first dimension: ``(Replicate(), Shard(0))``.
    """
    mesh = meshes.get(local.device.type)
    if mesh is None:
        return local  # no process group: world size 1, the chunk is the whole tensor
    placements: Tuple[Any, ...] = (Replicate(),) if p.is_scalar else (Shard(0),)
    if mesh.ndim == 2:
        placements = (Replicate(),) + placements
    stride = _contiguous_stride(p.shape)
    if _DIRECT_DTENSOR[0]:
        try:
            spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(p.shape, stride, local.dtype))
            return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call, unused-ignore]
        except TypeError:  # pragma: no cover - the private constructor changed: the public path from now on
            _DIRECT_DTENSOR[0] = False
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=stride)


def _classify(
    value: Any, p: OrigParam, hl: HandleLayout, layout: ModelLayout, key: str, what: str
) -> Tuple[str, Tensor]:
    """``(CHUNK, this rank's chunk)``, ``(FULL, full tensor)`` or ``(BOXES, ShardedTensor)`` for a value given for
    parameter ``p``."""
    if is_sharded_tensor(value):
        # Only load()'s staging views (:mod:`.dcp_views`): this rank's boxes of its own shard, copied without exchange.
        if shape_of(value) != tuple(p.shape):
            raise ValueError(
                f"{what}: {key!r} has global shape {shape_of(value)} but the model's parameter has shape "
                f"{tuple(p.shape)}; the checkpoint was saved from another model"
            )
        if box_sources(value, p, hl) is None:
            raise ValueError(
                f"{what}: {key!r} is a ShardedTensor whose local shards are not the pieces of this rank's flat shard "
                f"(group rank {hl.rank} of {hl.world_size}); pass DTensors (get_model_state_dict / "
                "get_optimizer_state_dict) or full tensors"
            )
        return BOXES, value
    if _DTENSOR_ERROR is None and isinstance(value, DTensor):
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{what}: {key!r} has global shape {tuple(value.shape)} but the model's parameter has shape "
                f"{tuple(p.shape)}; the checkpoint was saved from another model"
            )
        placements = tuple(value.placements)
        if all(isinstance(pl, Replicate) for pl in placements):
            return FULL, value.to_local()
        mesh_ranks = _shard_ranks(value, placements, layout, key, what)
        if mesh_ranks != layout.group_ranks:
            raise ValueError(
                f"{what}: {key!r} is sharded over ranks {list(mesh_ranks)} but this model shards over "
                f"{list(layout.group_ranks)}; load the checkpoint with dcp.load into the state dict that "
                "get_model_state_dict(model) / get_optimizer_state_dict(model, optim) returns, which reshards it"
            )
        local = value.to_local()
        expected = p.chunk_shape(hl.world_size, hl.rank)
        if tuple(local.shape) != tuple(expected):
            raise ValueError(
                f"{what}: the local chunk of {key!r} on group rank {hl.rank} has shape {tuple(local.shape)} but "
                f"Shard(0) of {tuple(p.shape)} over {hl.world_size} ranks gives {tuple(expected)}"
            )
        return CHUNK, local
    if isinstance(value, Tensor):
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{what}: size mismatch for {key!r}: the value has shape {tuple(value.shape)} but the model's "
                f"parameter has shape {tuple(p.shape)}; the checkpoint was saved from another model"
            )
        return FULL, value
    raise TypeError(f"{what}: {key!r} must be a Tensor or DTensor, got {type(value).__name__}")


def _is_shard0(placement: Any) -> bool:
    return type(placement) is Shard and placement.dim == 0


def _shard_ranks(value: Any, placements: Tuple[Any, ...], layout: ModelLayout, key: str, what: str) -> Tuple[int, ...]:
    """The global ranks, in shard order, over which ``value``'s chunk on this rank is cut (Shard(0) on one dimension).

    A 1-D ``Shard(0)`` mesh cuts over all its ranks; a 2-D ``(Replicate(), Shard(0))`` mesh (FSDP2 HSDP's, and this
    module's with hybrid sharding) over this rank's row, whatever the other rows (replicas) are. Any other layout
    raises: its local chunk is not a Shard(0) chunk of one group.
    """
    mesh = value.device_mesh
    reshard_hint = (
        "Load the checkpoint with dcp.load into get_model_state_dict(model) / get_optimizer_state_dict(model, optim) "
        "instead, which reshards it."
    )
    if len(placements) == 1 and _is_shard0(placements[0]):
        return tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if len(placements) == 2 and isinstance(placements[0], Replicate) and _is_shard0(placements[1]):
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # pragma: no cover - DTensors only exist on their mesh's ranks
            raise ValueError(f"{what}: {key!r} is a DTensor over a mesh {mesh.mesh.tolist()} without this rank")
        return tuple(int(r) for r in mesh.mesh[coordinate[0]].tolist())
    hybrid = " (this model is hybrid: (Replicate(), Shard(0)) over its shard groups)" if layout.is_hybrid else ""
    raise ValueError(
        f"{what}: {key!r} is a DTensor with placements {placements} over a {mesh.ndim}-D mesh; only Shard(0) over a "
        "1-D mesh (FSDP2's layout), (Replicate(), Shard(0)) over a 2-D (replicate, shard) mesh (FSDP2 HSDP's), or "
        f"Replicate can be loaded{hybrid}. {reshard_hint}"
    )


@contextlib.contextmanager
def _initialized_tree(unit: FSDPUnit) -> Iterator[None]:
    """Lazy init of every unit of the tree for one call (undone afterwards if the model was not initialised)."""
    with lazy_init_for_call(unit):
        for u in unit.tree_units():
            lazy_init(u)  # nested units materialise their shards at their own first use otherwise
        # The groups checks of the first forward (once per model): a call before any forward must not build a mesh
        # from hybrid groups that do not form a grid. Every DCP call is collective, so all ranks join it.
        check_zero2_groups_once(unit)
        unit.device.synchronize()
        yield


# What the values of a state dict are: COPIES, DTensor chunks (Shard(0)) copied out of the flat shards; VIEWS (save()
# only), no DTensor layout at all but ShardedTensors of views of the flat shards (:mod:`.dcp_views`), no copy and no
# exchange, whose chunks DCP reshards on load like any others; SNAPSHOT (async_save()), VIEWS of a CPU copy of every
# flat shard, taken before the call returns; STAGING (load()), ShardedTensors of this rank's boxes of a new, empty
# staging tensor per flat tensor, for dcp.load to read into and set_state_dict to copy from (no exchange).
COPIES, VIEWS, SNAPSHOT, STAGING = "copies", "views", "snapshot", "staging"


def _views_possible() -> bool:
    return views_available() and dist.is_available() and dist.is_initialized()


def _effective_values(values: str) -> str:
    """VIEWS needs ShardedTensor and a process group; without them (one process) the copies are as cheap."""
    if values in (VIEWS, SNAPSHOT) and not _views_possible():
        return COPIES
    return values


def _value_lists(
    items: List[Tuple[HandleLayout, Tensor, torch.device]], values: str, meshes: _Meshes
) -> List[List[Any]]:
    """Per ``(handle, flat tensor, device)``: the DCP value of every parameter (collective unless VIEWS)."""
    if values in (VIEWS, SNAPSHOT):
        writers = meshes.writer_ranks()
        out: List[List[Any]] = []
        index = 0  # the same on every rank: spreads the hybrid replicas' writes
        for hl, flat, _ in items:
            out.append(sharded_views(hl, flat, writers, index, snapshot=values == SNAPSHOT))
            index += len(hl.params)
        return out
    if values == STAGING:
        return [_staging_values(hl, flat, device, meshes) for hl, flat, device in items]
    chunk_lists = flat_to_chunks(items)
    return [
        [_as_dtensor(c, p, meshes) for p, c in zip(hl.params, chunks)] for (hl, _, _), chunks in zip(items, chunk_lists)
    ]


def _staging_values(hl: HandleLayout, flat: Tensor, device: torch.device, meshes: _Meshes) -> List[Any]:
    """STAGING values of one flat tensor (no communication): one staging tensor shaped like ``flat``, on ``device``."""
    if _views_possible():
        return staging_views(hl, flat, device, meshes.own_row())
    if hl.handle.is_sharded:  # pragma: no cover - a torch without ShardedTensor
        raise ImportError("loading a sharded model needs torch.distributed._shard's ShardedTensor")
    # One process: the flat parameter is not sharded, each parameter is a contiguous range of it (a FULL value).
    staging = torch.empty(flat.shape, dtype=flat.dtype, device=device).view(-1)
    return [staging.narrow(0, p.offset, p.numel).view(p.shape) for p in hl.params]
