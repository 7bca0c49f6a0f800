# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The data-parallel implementations compared: this fork's FSDP, PyTorch FSDP2 and FSDP1, and DDP.

Each builder shards the same model (same seed, same units from :func:`model.wrap_plan`) and returns a
:class:`Peer`: the wrapped model plus what a training loop needs to run one microbatch of an accumulation window
the way that implementation's users do it (``no_sync()``, ``set_requires_gradient_sync`` ...).
"""

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import warnings
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fairscale.internal.version import torch_version
from fairscale.nn.data_parallel import FullyShardedDataParallel, zero2_groups
from fairscale.nn.wrap import auto_wrap, enable_wrap

from .config import BenchConfig, Reshard
from .link import register_group, register_layout_group
from .model import build_model, wrap_plan, wrap_policy

DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One benchmark run: a peer, a scenario and the settings that differ between runs.

    Attributes:
        scenario: ``"train"``, ``"accum"`` or ``"zero2"``.
        peer: ``"fairscale"``, ``"fsdp2"``, ``"fsdp1"`` or ``"ddp"``.
        reshard: ``reshard_after_forward`` (an int G: reshard to groups of G ranks).
        microbatches: microbatches per optimizer step.
        optimize_backward_concat: fairscale's flag (other peers ignore it).
        prefetch: fairscale's ``forward_prefetch`` and ``backward_prefetch`` (``None``: their defaults).
        hybrid: shard inside a node and replicate across nodes (fairscale ``replicate_process_group``, FSDP2 on a
            2-D mesh, FSDP1 ``HYBRID_SHARD``); the node size is ``--hybrid-ranks-per-node``.
        floor: run without the simulated link (the hybrid scenario's compute floor).
    """

    scenario: str
    peer: str
    reshard: Reshard
    microbatches: int
    optimize_backward_concat: bool = False
    prefetch: Optional[bool] = None
    hybrid: bool = False
    floor: bool = False

    @property
    def config_label(self) -> str:
        """The settings shared by the runs that are compared with each other."""
        if self.peer == "ddp":
            return "replicated"
        raf = self.reshard if isinstance(self.reshard, bool) else f"{self.reshard} (group)"
        return f"raf={raf}"

    @property
    def label(self) -> str:
        """Display name, e.g. ``fairscale raf=True obc``."""
        parts = [self.peer] + ([self.config_label] if self.peer != "ddp" else [])
        if self.optimize_backward_concat and self.peer == "fairscale":
            parts.append("obc")
        if self.prefetch is not None and self.peer == "fairscale":
            parts.append("prefetch" if self.prefetch else "no-prefetch")
        if self.scenario == "hybrid":
            parts.append("hybrid" if self.hybrid else "full")
        if self.floor:
            parts.append("no-link")
        return " ".join(parts)

    @property
    def key(self) -> str:
        """Unique id inside one invocation."""
        return f"{self.scenario}/{self.label.replace(' ', '/')}/M={self.microbatches}"


@dataclasses.dataclass
class Peer:
    """A wrapped model and how to run one microbatch with it.

    Attributes:
        model: the wrapped model; ``model(tokens)`` returns logits.
        microbatch: ``microbatch(is_last)`` returns the context a microbatch's forward and backward run in
            (gradient sync off for every microbatch but the last of the window).
        forward_context: context around the forward only (DDP's autocast under mixed precision).
        notes: how this peer was configured, for the report.
    """

    model: nn.Module
    microbatch: Callable[[bool], ContextManager[Any]]
    forward_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    notes: List[str] = dataclasses.field(default_factory=list)


def skip_reason(spec: RunSpec, cfg: BenchConfig) -> Optional[str]:
    """Why ``spec`` cannot run with this torch and configuration (``None`` when it can); decided the same way on
    every rank, before anything collective happens."""
    if spec.peer == "fsdp2" and _fully_shard() is None:
        return f"torch {torch.__version__} has no fully_shard (FSDP2 needs torch >= 2.4)"
    if spec.peer == "fsdp2" and cfg.device == "cpu" and fsdp2_cpu_problem() is not None:
        return fsdp2_cpu_problem()
    if spec.peer == "fsdp2" and spec.hybrid and cfg.device == "cpu" and torch_version() < (2, 8):
        # Measured on torch 2.7.1: HSDP's post-backward asserts that its all-reduce recorded an event, and
        # torch.cpu.Stream.record_event returns None (torch 2.8 skips the assert on the CPU).
        return f"torch {torch.__version__}'s FSDP2 HSDP cannot run on the CPU (needs torch >= 2.8)"
    if spec.scenario == "zero2" and not isinstance(spec.reshard, bool):
        size = int(spec.reshard)
        if cfg.world_size % size or size >= cfg.world_size:
            # Under torchrun the world is torchrun's: a zero2 group of the whole world (or one that does not divide
            # it) is no zero2 comparison (the report showed [MISSED]); the self-launched path refuses it up front.
            return f"a zero2 group of {size} ranks must divide the world of {cfg.world_size} and be smaller than it"
    nodes, rest = divmod(cfg.world_size, cfg.hybrid_ranks_per_node)
    if spec.hybrid and (rest or nodes < 2):
        return f"a world of {cfg.world_size} ranks is not >= 2 nodes of {cfg.hybrid_ranks_per_node} ranks"
    if spec.peer == "fairscale" and spec.hybrid and not _has_hybrid():
        return "this fairscale's FullyShardedDataParallel has no replicate_process_group (hybrid sharding)"
    if spec.peer == "ddp" and spec.hybrid:
        return "DDP replicates everything; it has no hybrid mode"
    if spec.peer == "fsdp1" and cfg.device == "cpu" and not _cpu_streams_take_priority():
        # Measured on torch 2.1: FSDP1's lazy init makes its streams with torch.cpu.Stream(priority=...).
        return f"torch {torch.__version__}'s FSDP1 cannot run on the CPU (torch.cpu.Stream takes no priority)"
    if spec.peer == "fsdp1" and spec.hybrid and not _has_device_mesh():
        return f"torch {torch.__version__} has no DeviceMesh (FSDP1's hybrid mesh needs torch >= 2.2)"
    if spec.peer == "fsdp1" and not isinstance(spec.reshard, bool):
        return "FSDP1 has no reshard-to-a-subgroup mode (HYBRID_SHARD replicates instead)"
    if spec.peer == "fsdp1" and cfg.checkpoint_activations and cfg.auto_wrap_policy != "block":
        # Measured: FSDP1 frees a unit's parameters after the first recomputed block's backward, and the next
        # block's recomputation then reads freed storage.
        return "FSDP1 fails with checkpointed blocks inside a bigger unit; use --auto-wrap-policy block"
    return None


def fsdp2_cpu_problem() -> Optional[str]:
    """Why torch's FSDP2 cannot train on the CPU with this torch, or ``None`` when it can."""
    if _fully_shard() is None:
        return f"torch {torch.__version__} has no fully_shard (FSDP2 needs torch >= 2.4)"
    if not hasattr(torch.cpu.Stream, "record_event"):
        # Measured on torch 2.6: FSDP2's first all-gather records an event on its CPU stream.
        return f"torch {torch.__version__}'s FSDP2 cannot run on the CPU (torch.cpu.Stream has no record_event)"
    return None


def _cpu_streams_take_priority() -> bool:
    """Whether ``torch.cpu.Stream(priority=0)`` works, as FSDP1's lazy init on the CPU needs (not on torch 2.1)."""
    try:
        getattr(torch.cpu, "Stream")(priority=0)  # the stubs of some torch versions declare no arguments
    except TypeError:
        return False
    return True


def _has_device_mesh() -> bool:
    """Whether this torch has ``torch.distributed.device_mesh`` (torch >= 2.2)."""
    return importlib.util.find_spec("torch.distributed.device_mesh") is not None


def _has_hybrid() -> bool:
    """Whether fairscale's FSDP takes ``replicate_process_group`` (hybrid sharding)."""
    return "replicate_process_group" in inspect.signature(FullyShardedDataParallel.__init__).parameters


def _fully_shard() -> Optional[Callable[..., Any]]:
    """FSDP2's ``fully_shard`` (public since torch 2.6, under ``_composable`` in 2.4/2.5), or ``None``."""
    for module in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            found: Optional[Callable[..., Any]] = getattr(importlib.import_module(module), "fully_shard", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


_GROUP_CACHE: Dict[Tuple[str, int], Any] = {}


def _zero2_group(size: int) -> Any:
    """This rank's group of ``size`` consecutive ranks, created once per world (new_group is collective)."""
    key = ("zero2", size)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = zero2_groups(size)
        register_group(size, _GROUP_CACHE[key])  # --link-intra-gbps applies to it
    return _GROUP_CACHE[key]


def _mesh(device: torch.device) -> Any:
    key = ("mesh", dist.get_world_size())
    if key not in _GROUP_CACHE:
        from torch.distributed.device_mesh import init_device_mesh

        _GROUP_CACHE[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _GROUP_CACHE[key]


def _hybrid_mesh(device: torch.device, ranks_per_node: int) -> Any:
    """The (nodes, ranks per node) mesh of FSDP2 HSDP and FSDP1 HYBRID_SHARD: rows are nodes (consecutive ranks),
    the ``"shard"`` dimension runs inside a node and ``"replicate"`` across, as fairscale's hybrid groups."""
    key = ("hybrid_mesh", ranks_per_node)
    if key not in _GROUP_CACHE:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (dist.get_world_size() // ranks_per_node, ranks_per_node)
        _GROUP_CACHE[key] = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return _GROUP_CACHE[key]


def _hybrid_groups(ranks_per_node: int) -> Tuple[Any, Any]:
    """This rank's (shard, replicate) groups from fairscale's ``hybrid_groups``, created once per world."""
    key = ("hybrid", ranks_per_node)
    if key not in _GROUP_CACHE:
        from fairscale.nn import data_parallel

        shard, replicate = data_parallel.hybrid_groups(ranks_per_node)
        for group in (shard, replicate):
            register_layout_group(group)  # the simulated link gives each the bandwidth its ranks imply
        _GROUP_CACHE[key] = (shard, replicate)
    return _GROUP_CACHE[key]  # type: ignore[no-any-return]


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)


def build_peer(spec: RunSpec, cfg: BenchConfig, device: torch.device) -> Peer:
    """Build the model from ``cfg.seed`` and wrap it as ``spec.peer`` does."""
    builders = {"fairscale": _fairscale, "fsdp2": _fsdp2, "fsdp1": _fsdp1, "ddp": _ddp}
    model = build_model(cfg, device)
    plan = wrap_plan(cfg, model)
    return builders[spec.peer](model, plan, spec, cfg, device)


def _fairscale(model: nn.Module, plan: List[str], spec: RunSpec, cfg: BenchConfig, device: torch.device) -> Peer:
    dtype = DTYPES[cfg.mixed_precision]
    kwargs: Dict[str, Any] = dict(
        reshard_after_forward=spec.reshard is not False,
        mixed_precision=dtype is not None,
        flatten_parameters=cfg.flatten,
        compute_device=device,
        optimize_backward_concat=spec.optimize_backward_concat,
    )
    if spec.prefetch is not None:  # the overlap scenario: both directions off or on
        kwargs.update(forward_prefetch=spec.prefetch, backward_prefetch=spec.prefetch)
    if dtype is not None:
        kwargs["compute_dtype"] = dtype
    if not isinstance(spec.reshard, bool):
        kwargs["zero2_process_group"] = _zero2_group(spec.reshard)
    if spec.hybrid:
        kwargs["process_group"], kwargs["replicate_process_group"] = _hybrid_groups(cfg.hybrid_ranks_per_node)
    policy = wrap_policy(cfg)
    if policy is not None:
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **kwargs):
            model = auto_wrap(model, auto_wrap_policy=policy)
    fsdp = FullyShardedDataParallel(model, **kwargs)
    notes = [
        f"FullyShardedDataParallel({', '.join(f'{k}={_short(v)}' for k, v in kwargs.items())}), "
        f"auto_wrap {cfg.auto_wrap_policy}"
    ]

    def microbatch(is_last: bool) -> ContextManager[Any]:
        return contextlib.nullcontext() if is_last else fsdp.no_sync()

    return Peer(fsdp, microbatch, notes=notes)


def _fsdp2(model: nn.Module, plan: List[str], spec: RunSpec, cfg: BenchConfig, device: torch.device) -> Peer:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fully_shard = _fully_shard()
    assert fully_shard is not None  # skip_reason() said so
    dtype = DTYPES[cfg.mixed_precision]
    kwargs: Dict[str, Any] = {"mesh": _hybrid_mesh(device, cfg.hybrid_ranks_per_node) if spec.hybrid else _mesh(device)}
    if dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    inner = [model.get_submodule(path) for path in plan]
    for sub in inner:
        fully_shard(sub, reshard_after_forward=spec.reshard, **kwargs)
    # The root keeps FSDP2's default, which never reshards the root after forward, like fairscale's
    # disable_reshard_on_root; with reshard False it is False everywhere.
    root_kwargs = dict(kwargs, **({"reshard_after_forward": False} if spec.reshard is False else {}))
    fully_shard(model, **root_kwargs)
    sum_then_divide = device.type == "cpu" and torch_version() < (2, 9)
    if sum_then_divide:
        # gloo's reduce-scatter sums for ReduceOp.AVG before torch 2.9 (pytorch/pytorch#162338): FSDP2's gradients
        # came out world-size times too large; it sums and divides itself instead (torch 2.8 has the switch).
        for sub in [*inner, model]:
            if hasattr(sub, "set_force_sum_reduction_for_comms"):
                sub.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    keep_full_in_no_sync = spec.reshard is False

    @contextlib.contextmanager
    def microbatch(is_last: bool) -> Any:
        # Mirror fairscale's accumulation rule so both do the same communication: gradient sync only in the last
        # microbatch; units that do not reshard after forward (the root, or all with raf=False) keep their
        # parameters between microbatches instead of gathering again.
        model.set_requires_gradient_sync(is_last)  # type: ignore[operator]
        model.set_reshard_after_backward(is_last, recurse=False)  # type: ignore[operator]
        for sub in inner:
            sub.set_reshard_after_backward(is_last or not keep_full_in_no_sync, recurse=False)  # type: ignore
        yield

    notes = [
        f"fully_shard(reshard_after_forward={spec.reshard}{', mp_policy=' + str(dtype) if dtype else ''}"
        f"{', mesh=' + str(tuple(kwargs['mesh'].shape)) + ' (replicate, shard)' if spec.hybrid else ''}) on "
        f"{len(plan)} units + root; set_requires_gradient_sync/set_reshard_after_backward per microbatch"
    ]
    if sum_then_divide:
        notes.append("set_force_sum_reduction_for_comms(True): gloo averages wrongly before torch 2.9")
    return Peer(model, microbatch, notes=notes)


def _fsdp1(model: nn.Module, plan: List[str], spec: RunSpec, cfg: BenchConfig, device: torch.device) -> Peer:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    dtype = DTYPES[cfg.mixed_precision]
    strategy = ShardingStrategy.FULL_SHARD if spec.reshard else ShardingStrategy.SHARD_GRAD_OP
    kwargs: Dict[str, Any] = dict(sharding_strategy=strategy, device_id=device, use_orig_params=False)
    if spec.hybrid:
        # The same 2-D mesh as FSDP2's HSDP: shard inside a node, replicate across.
        strategy = ShardingStrategy.HYBRID_SHARD if spec.reshard else ShardingStrategy._HYBRID_SHARD_ZERO2
        kwargs.update(sharding_strategy=strategy, device_mesh=_hybrid_mesh(device, cfg.hybrid_ranks_per_node))
    if dtype is not None:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1 is deprecated in recent torch; the warning is not news here
        for path in plan:
            _set_submodule(model, path, TorchFSDP(model.get_submodule(path), **kwargs))
        wrapped = TorchFSDP(model, **kwargs)

    def microbatch(is_last: bool) -> ContextManager[Any]:
        return contextlib.nullcontext() if is_last else wrapped.no_sync()

    notes = [
        f"FullyShardedDataParallel(sharding_strategy={strategy.name}, use_orig_params=False"
        f"{', mixed_precision=' + str(dtype) if dtype else ''}) on {len(plan)} units + root"
    ]
    return Peer(wrapped, microbatch, notes=notes)


def _ddp(model: nn.Module, plan: List[str], spec: RunSpec, cfg: BenchConfig, device: torch.device) -> Peer:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    dtype = DTYPES[cfg.mixed_precision]

    def forward_context() -> ContextManager[Any]:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def microbatch(is_last: bool) -> ContextManager[Any]:
        return contextlib.nullcontext() if is_last else ddp.no_sync()

    notes = ["DistributedDataParallel, fp32 parameters" + (f", torch.autocast({dtype})" if dtype else "")]
    return Peer(ddp, microbatch, forward_context=forward_context, notes=notes)


def _short(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (bool, int, float, str)) or value is None:
        return str(value)
    if isinstance(value, torch.device):
        return repr(str(value))
    return type(value).__name__
