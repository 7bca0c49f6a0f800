# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FullyShardedDataParallel: the public front. The machinery lives in :mod:`fairscale.nn.data_parallel._fsdp`."""

import contextlib
import logging
from typing import Any, Dict, Generator, Iterator, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.internal import collectives
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.internal.parallel import ProcessGroupName, enable_pytorch_sync_bn, get_process_group_cached
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

from ._fsdp import config as fsdp_config
from ._fsdp import grad_accum, summon, zero2
from ._fsdp import ties as fsdp_ties
from ._fsdp.handle import FlatHandle, alloc_storage_, free_storage_
from ._fsdp.metadata import CheckpointFormatsMixin
from ._fsdp.io import cast_inputs
from ._fsdp.runtime import FSDPRuntime
from ._fsdp.state import HandleState, TrainingState
from ._fsdp.state_dict import StateDictMixin

log = logging.getLogger(__name__)

# Names that upstream code imports from this module (upstream defined or imported them here); re-exported so that
# such imports keep working. Checked by tests/test_upstream_api.py.
from math import inf as inf  # noqa: E402

from fairscale.internal.containers import apply_to_tensors as apply_to_tensors  # noqa: E402
from fairscale.internal.errors import p_assert as p_assert  # noqa: E402
from fairscale.internal.parallel import chunk_and_pad as chunk_and_pad  # noqa: E402
from fairscale.internal.parallel import validate_process_group as validate_process_group  # noqa: E402
from fairscale.internal.params import calc_grad_norm as calc_grad_norm  # noqa: E402
from fairscale.internal.params import recursive_copy_to_device as recursive_copy_to_device  # noqa: E402
from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer as ReduceScatterBucketer  # noqa: E402
from fairscale.internal.reduce_scatter_bucketer import enable_nccl_base_collectives  # noqa: E402,F401
from fairscale.internal.state_dict import replace_by_prefix_ as replace_by_prefix_  # noqa: E402
from fairscale.nn.wrap.auto_wrap import auto_wrap as auto_wrap  # noqa: E402
from fairscale.nn.wrap.auto_wrap import config_auto_wrap_policy as config_auto_wrap_policy  # noqa: E402
from fairscale.nn.wrap.auto_wrap import enable_wrap as enable_wrap  # noqa: E402

from ._fsdp.batchnorm_wrap import auto_wrap_bn as auto_wrap_bn  # noqa: E402
from ._fsdp.state_dict import no_pre_load_state_dict_hook as no_pre_load_state_dict_hook  # noqa: E402

__all__ = [
    "FullyShardedDataParallel",
    "TrainingState",
    "get_fsdp_instances",
    "cast_floats_to_right_precision",
    "free_storage_",
    "alloc_storage_",
]


class FullyShardedDataParallel(StateDictMixin, CheckpointFormatsMixin, FSDPRuntime):
    """A wrapper that shards a module's parameters, gradients and optimizer state across data-parallel ranks.

    Every rank keeps ``1/world_size`` of each owned parameter (its *shard*). Before this instance's forward, and
    again before its backward, the full parameters are rebuilt by an all-gather; after them they are freed, and the
    full gradients are reduce-scattered so every rank ends with the gradient of its shard. The optimizer is built
    on ``model.parameters()`` after wrapping and only ever sees shards. Nested instances (one per transformer block,
    say) keep only one block's full parameters alive at a time.

    This distribution runs on CPU with the gloo backend as well as on CUDA with NCCL, and adds
    ``zero2_process_group`` and ``optimize_backward_concat``. Usage::

        import torch.distributed as dist
        from fairscale.nn import FullyShardedDataParallel as FSDP

        dist.init_process_group("gloo")  # or "nccl"
        model = FSDP(MyModel())
        optim = torch.optim.Adam(model.parameters(), lr=1e-4)
        loss = model(batch).sum()
        loss.backward()
        optim.step()

    Args:
        module: the module to wrap.
        process_group: the sharding group. ``None`` uses a cached group over all ranks.
        process_group_reduce_scatter: group for the gradient reduce-scatter. ``ProcessGroupName.reduce_scatter``
            (default) creates a second cached all-ranks group so reductions can overlap gathers;
            ``ProcessGroupName.default`` reuses ``process_group``; a ``ProcessGroup`` is used as is. A group whose
            size differs from ``process_group`` falls back to ``process_group`` with a warning (as upstream).
        reshard_after_forward: free the full parameters after forward and gather again in backward (ZeRO-3).
            ``False`` keeps them until the end of backward (no second gather).
        disable_reshard_on_root: the root instance never reshards after forward (its backward comes first).
        mixed_precision: keep fp32 master shards but gather, compute and reduce in ``compute_dtype``.
        fp32_reduce_scatter: reduce gradients in fp32 (needs ``mixed_precision``).
        flatten_parameters: flatten the owned parameters into one ``FlatParameter`` (``flat_param_0``).
        move_params_to_cpu: keep the fp32 shards in (pinned) CPU memory and copy them to the device per use.
        compute_dtype: dtype of the gathered parameters; default fp16 with ``mixed_precision``, else fp32. bf16 is
            supported for mixed precision (inputs are then cast to bf16 by the root).
        buffer_dtype: dtype buffers are kept in; default ``compute_dtype``.
        move_grads_to_cpu: put the reduced gradient shards on the CPU; default ``move_params_to_cpu``.
        bucket_cap_mb: size of the reduce-scatter bucket in MiB; ``<= 0`` reduces each gradient on its own.
        compute_device: device for compute; default: the parameters' accelerator, else the current accelerator,
            else CPU (upstream defaulted to CUDA and failed on CPU-only machines).
        no_broadcast_optim_state: keep this instance's optimizer state out of
            :meth:`gather_full_optim_state_dict`'s gather (expert layers in MoE).
        state_dict_device: device of the tensors :meth:`state_dict` returns; default ``compute_device``.
        clear_autocast_cache: call ``torch.clear_autocast_cache()`` after every forward of this instance.
        force_input_to_fp32: without mixed precision, cast fp16/bf16 inputs to fp32.
        verbose: longer :meth:`extra_repr`.
        cpu_offload: deprecated alias of ``move_params_to_cpu``.
        state_dict_on_rank_0_only: :meth:`state_dict` returns an empty dict on every rank but global rank 0.
        gradient_predivide_factor: divide gradients by this before the reduction and by
            ``world_size / factor`` after; default: upstream's power-of-two rule.
        allow_reset_parameters: let :meth:`reset_parameters` forward to the wrapped module.
        zero2_process_group: (fork) a subgroup of ``process_group`` (e.g. the ranks of one node). After forward a
            resharding instance keeps a 1/G slice of its full parameters and rebuilds them in backward with an
            all-gather over this group only. See the docs page "zero2_process_group".
        optimize_backward_concat: (fork) in ``no_sync()`` microbatches, accumulate each parameter's gradient
            directly into one flat buffer instead of concatenating them into the flat gradient on every microbatch.
            Only has an effect with ``flatten_parameters=True``; the rule is that every non-last microbatch runs its
            forward *and* backward inside ``root.no_sync()``.
        forward_prefetch: (fork) while this instance's forward computes, the all-gather of the unit that ran next in
            the previous forward is already in flight (at most one unit ahead). Default ``False``.
        backward_prefetch: (fork) at this instance's pre-backward point, issue the all-gather of the unit whose
            backward ran next in the previous backward. Changes timing only, never numerics; costs at most one
            extra unit's full parameters of memory. Default ``True`` (upstream has no prefetch). See the docs page
            "Communication overlap".
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Optional[Any] = None,
        process_group_reduce_scatter: Any = ProcessGroupName.reduce_scatter,
        reshard_after_forward: bool = True,
        disable_reshard_on_root: bool = True,
        mixed_precision: bool = False,
        fp32_reduce_scatter: bool = False,
        flatten_parameters: bool = True,
        move_params_to_cpu: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
        buffer_dtype: Optional[torch.dtype] = None,
        move_grads_to_cpu: Optional[bool] = None,
        bucket_cap_mb: int = 25,
        compute_device: Optional[torch.device] = None,
        no_broadcast_optim_state: Optional[bool] = False,
        state_dict_device: Optional[torch.device] = None,
        clear_autocast_cache: bool = False,
        force_input_to_fp32: bool = False,
        verbose: bool = False,
        cpu_offload: bool = False,
        state_dict_on_rank_0_only: bool = False,
        gradient_predivide_factor: Optional[float] = None,
        allow_reset_parameters: bool = False,
        zero2_process_group: Optional[Any] = None,
        optimize_backward_concat: bool = False,
        forward_prefetch: bool = False,
        backward_prefetch: bool = True,
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            if process_group is None:
                raise RuntimeError(
                    "FullyShardedDataParallel needs torch.distributed to be initialized (e.g. "
                    "dist.init_process_group('gloo') on CPU or 'nccl' on CUDA), or an explicit process_group."
                )
        self.process_group = process_group if process_group is not None else get_process_group_cached()
        fsdp_config.check_group_membership(self.process_group, process_group_reduce_scatter)
        self.rank = self.process_group.rank()
        self.world_size = self.process_group.size()
        self.process_group_reduce_scatter = self._resolve_reduce_scatter_group(process_group_reduce_scatter)

        self.reshard_after_forward = self._orig_reshard_after_forward = reshard_after_forward
        self.disable_reshard_on_root = disable_reshard_on_root
        self.mixed_precision = mixed_precision
        if fp32_reduce_scatter and not mixed_precision:
            raise ValueError("fp32_reduce_scatter=True needs mixed_precision=True (fp32 params already reduce in fp32)")
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.flatten_parameters = flatten_parameters
        self.move_params_to_cpu = move_params_to_cpu or cpu_offload
        self.compute_dtype = fsdp_config.resolve_compute_dtype(mixed_precision, compute_dtype)
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        self._buffer_dtype_given = buffer_dtype is not None
        self.move_grads_to_cpu = self.move_params_to_cpu if move_grads_to_cpu is None else move_grads_to_cpu
        self.bucket_cap_mb = bucket_cap_mb
        self.no_broadcast_optim_state = bool(no_broadcast_optim_state)
        self.clear_autocast_cache = clear_autocast_cache
        self.force_input_to_fp32 = force_input_to_fp32
        self.verbose = verbose
        self.state_dict_on_rank_0_only = state_dict_on_rank_0_only
        self.allow_reset_parameters = allow_reset_parameters
        self.optimize_backward_concat = optimize_backward_concat
        self.forward_prefetch = bool(forward_prefetch)
        self.backward_prefetch = bool(backward_prefetch)
        self.gradient_predivide_factor, self.gradient_postdivide_factor = fsdp_config.divide_factors(
            self.world_size, gradient_predivide_factor
        )

        self._foreign_params: List[Tuple[str, nn.Parameter]] = []
        params = self._collect_params_to_own(module)
        self.compute_device = fsdp_config.resolve_compute_device((p for _, p in params), compute_device)
        self.state_dict_device = torch.device(state_dict_device) if state_dict_device else self.compute_device
        fsdp_config.validate_grad_placement(self.compute_device, self.move_params_to_cpu, self.move_grads_to_cpu)
        fsdp_config.validate_param_dtypes((p for _, p in params), mixed_precision, self.compute_dtype)
        self.zero2_process_group = zero2_process_group
        self._zero2_problem = zero2.local_problem(zero2_process_group, self.process_group)
        self._zero2_rank, self._zero2_size = zero2.rank_and_size(zero2_process_group, self._zero2_problem)

        to_flatten = [p for _, p in params] if flatten_parameters else []
        try:
            self._fsdp_wrapped_module = FlattenParamsWrapper(
                module, param_list=to_flatten, optimize_backward_concat=optimize_backward_concat
            )
        except ValueError as e:
            raise ValueError(
                f"{e}\nWith FullyShardedDataParallel: wrap the parameters that differ (e.g. the frozen part) in their "
                "own FullyShardedDataParallel instance, or pass flatten_parameters=False."
            ) from e
        if flatten_parameters:
            fsdp_ties.mark_flattened(p for _, p in params)
        del module  # reachable only through the wrapper from here on
        self._num_flatten_params = len(self._fsdp_wrapped_module.flat_params)
        flat = list(self._fsdp_wrapped_module.flat_params)
        kept = [(n, p) for n, p in params if not flatten_parameters]
        self.params: List[nn.Parameter] = flat + [p for _, p in kept]
        self._param_name_groups: List[List[str]] = ([[n for n, _ in params]] if flat else []) + [[n] for n, _ in kept]
        self._has_params = len(self.params) > 0
        self._has_shared_params = False

        self._handles: List[FlatHandle] = []
        self.numel_padded_per_param: List[int] = []
        self._shard_parameters_(
            [("flat_param_0" if flat and i == 0 else names[0]) for i, names in enumerate(self._param_name_groups)]
        )
        self.buffer_size = sum(p._orig_size.numel() for p in self.params)  # type: ignore[attr-defined]

        self.training_state = TrainingState.IDLE
        self._require_backward_grad_sync = True
        self._pre_backward_hook_has_run = False
        self._is_root: Optional[bool] = None
        self._tree = None
        self._return_full_state_dict = True
        enable_pytorch_sync_bn(self._fsdp_wrapped_module)
        self._register_state_dict_hooks()
        self._register_post_backward_hooks()
        grad_accum.install(self)
        for n, p in self.named_parameters():
            assert hasattr(p, "_is_sharded"), f"parameter {n} is not managed by any FSDP instance"

    # ------------------------------------------------------------------ construction helpers
    def _resolve_reduce_scatter_group(self, value: Any) -> Any:
        if value == ProcessGroupName.default or value is None:
            return self.process_group
        if value == ProcessGroupName.reduce_scatter:
            group = get_process_group_cached(ProcessGroupName.reduce_scatter)
            if group is None:
                return self.process_group
        elif isinstance(value, dist.ProcessGroup) or (hasattr(value, "rank") and not hasattr(value, "allgather")):
            group = value
        else:
            raise TypeError(
                f"process_group_reduce_scatter must be a ProcessGroupName or a ProcessGroup, got {type(value)!r}"
            )
        if group.size() != self.world_size:
            log.warning(
                "process_group_reduce_scatter has %d ranks but process_group has %d; using process_group for the "
                "reduce-scatter",
                group.size(),
                self.world_size,
            )
            return self.process_group
        return group

    def _collect_params_to_own(self, module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
        """Parameters not yet owned by a nested FSDP instance.

        A parameter already sharded by an FSDP instance outside ``module`` (a weight tied to a sibling) is skipped,
        as upstream, and remembered: unless :meth:`append_shared_param` declares it, the first forward raises.
        Ties that no declaration can make work are remembered in ``_tie_problems`` and raise at the first forward
        too (see :func:`fsdp_ties.find_unhonourable_ties`); owning such a parameter here would silently untie it.
        """
        nested_owned: Set[int] = set()
        for m in module.modules():
            if isinstance(m, FullyShardedDataParallel):
                m._has_fsdp_parent = True  # no_sync() is refused on it, before its lazy init as after
                nested_owned.update(id(p) for p in m.parameters())
        self._tie_problems = fsdp_ties.find_unhonourable_ties(module, nested_owned, FullyShardedDataParallel)
        out: List[Tuple[str, nn.Parameter]] = []
        seen = set()
        for name, p in module.named_parameters():
            if id(p) in seen or id(p) in nested_owned:
                continue
            seen.add(id(p))
            if hasattr(p, "_is_sharded"):
                self._foreign_params.append((name, p))
                continue
            out.append((name, p))
        return out

    @torch.no_grad()
    def _shard_parameters_(self, names: List[str]) -> None:
        for p, name in zip(self.params, names):
            p._is_sharded = self.world_size > 1  # type: ignore[attr-defined]
            p._orig_size = p.data.size()  # type: ignore[attr-defined]
            padding = 0
            if p._is_sharded:  # type: ignore[attr-defined]
                shard, padding = self._get_shard(p.data)
                p.data = shard
            if self._moves_shards_to_compute_device(p.data):
                # A model built on the CPU with an accelerator compute device: only the shard moves, and before the
                # user builds (or loads) the optimizer, so its state is created next to the parameters.
                p.data = p.data.to(self.compute_device)
            self.numel_padded_per_param.append(padding)
            self._handles.append(FlatHandle(p, name, self.world_size, self.rank, padding))

    def _moves_shards_to_compute_device(self, shard: Tensor) -> bool:
        accelerator = self.compute_device.type not in ("cpu", "meta")
        return (
            accelerator and not self.move_params_to_cpu and shard.device.type not in ("meta", self.compute_device.type)
        )

    def _get_shard(self, tensor: Tensor) -> Tuple[Tensor, int]:
        """This rank's chunk-and-pad shard of ``tensor`` (1-D, ``ceil(numel / world_size)`` elements) and padding."""
        chunks = torch.flatten(tensor).chunk(self.world_size)
        piece = chunks[self.rank] if self.rank < len(chunks) else tensor.new_empty(0)
        shard_numel = chunks[0].numel()
        padding = shard_numel - piece.numel()
        shard = torch.zeros(shard_numel, dtype=tensor.dtype, device=tensor.device)
        shard[: piece.numel()].copy_(piece)
        return shard, padding

    # ------------------------------------------------------------------ simple properties
    @property
    def module(self) -> FlattenParamsWrapper:
        """The FlattenParamsWrapper around the user module (the user module is ``self.module.module``)."""
        return self._fsdp_wrapped_module

    @property
    def has_full_params(self) -> bool:
        """Whether this instance's full parameters are currently gathered (upstream's flag, now derived)."""
        return any(h.state == HandleState.FULL for h in self._handles)

    def _print_r0(self, msg: str) -> None:
        """Debug print on rank 0 only (upstream helper)."""
        if self.rank == 0:
            print(f"{msg} (device memory allocated: {self._device.memory_allocated() / 2**20:.1f} MiB)")

    @property
    def cpu_offload(self) -> bool:
        return self.move_params_to_cpu

    @property
    def params_with_grad(self) -> List[nn.Parameter]:
        """Every parameter of the subtree whose ``.grad`` is set."""
        return [p for p in self.parameters() if p.grad is not None]

    def non_shared_params(self) -> List[nn.Parameter]:
        return [h.param for h in self._handles if not h.borrowed]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                raise  # protocol lookups (__deepcopy__, __getstate__...) must not find the wrapper's
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)

    def assert_state(self, state: Union[TrainingState, List[TrainingState]]) -> None:
        """Raise ``ValueError`` unless the instance is in ``state`` (or one of a list of states)."""
        states = state if isinstance(state, list) else [state]
        if self.training_state not in states:
            raise ValueError(
                f"expected FSDP training state to be one of {[s.name for s in states]}, "
                f"but it is {self.training_state.name}"
            )

    def extra_repr(self) -> str:
        rep = (
            f"world_size={self.world_size}, flatten_parameters={self.flatten_parameters}, "
            f"mixed_precision={self.mixed_precision}"
        )
        if self.verbose:
            rep = (
                f"rank={self.rank}, " + rep + f", reshard_after_forward={self.reshard_after_forward}, "
                f"compute_dtype={self.compute_dtype}, buffer_dtype={self.buffer_dtype}, "
                f"fp32_reduce_scatter={self.fp32_reduce_scatter}, compute_device={self.compute_device}, "
                f"move_params_to_cpu={self.move_params_to_cpu}, move_grads_to_cpu={self.move_grads_to_cpu}, "
                f"bucket_cap_mb={self.bucket_cap_mb}, clear_autocast_cache={self.clear_autocast_cache}, "
                f"force_input_to_fp32={self.force_input_to_fp32}, zero2={self._zero2_size if self.zero2_process_group is not None else None}, "
                f"optimize_backward_concat={self.optimize_backward_concat}"
            )
        return rep

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_forward(*args, **kwargs)

    # ------------------------------------------------------------------ accumulation
    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (unsharded, no communication) until the context exits.

        Call it on the root instance, outside forward/backward. The first backward after the context reduces the
        sum of all accumulated gradients.
        """
        # The same rule before the first forward as after it: a nested instance's own lazy init would otherwise
        # make it a root of its own subtree and accept the call.
        if self._has_fsdp_parent or self._is_root is False:
            raise FairscaleRuntimeError(
                "no_sync() must be called on the root FullyShardedDataParallel instance; this one is nested inside "
                "another FullyShardedDataParallel instance"
            )
        self._lazy_init()
        if not self._is_root:
            raise FairscaleRuntimeError("no_sync() must be called on the root FullyShardedDataParallel instance")
        self.assert_state(TrainingState.IDLE)
        instances = self._fsdp_instances()
        saved = [m._require_backward_grad_sync for m in instances]
        for m in instances:
            m._require_backward_grad_sync = False
        try:
            yield
        finally:
            for m, flag in zip(instances, saved):
                m._require_backward_grad_sync = flag

    # ------------------------------------------------------------------ full params
    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False) -> Generator[None, None, None]:
        """Expose full, full-precision parameters on every rank for the duration of the context.

        The user module then has real ``nn.Parameter`` objects with their original names and shapes. Collective:
        call it on all ranks. Not usable inside forward/backward.

        Args:
            recurse: also summon every nested instance.
            volatile: do not copy edits of the full parameters back into the shards on exit.
        """
        with summon.summon_full_params(self, recurse=recurse, volatile=volatile):
            yield

    def apply(self, fn: Any) -> "FullyShardedDataParallel":
        """Like ``nn.Module.apply`` but with this instance's full parameters summoned while ``fn`` runs."""
        uninitialized = self._is_root is None
        self._assert_idle_tree("apply")
        with self.summon_full_params(recurse=False):
            super().apply(fn)
        if uninitialized and self._is_root:
            for m in self._fsdp_instances():
                m._reset_lazy_init()
        return self

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "FullyShardedDataParallel":
        """``.to()/.half()/.float()/.cuda()``: allowed only when idle; shards are moved, lazy init is redone."""
        self._assert_idle_tree("_apply (.to/.half/.float)")
        if any(h.state != HandleState.SHARDED for m in self._fsdp_instances() for h in m._handles):
            for m in self._fsdp_instances():
                m._reshard(after_forward=False)
                for h in m._handles:
                    h.drop_zero2_slice()
                    h.use_shard()
        for m in self._fsdp_instances():
            m._reset_lazy_init()
        super()._apply(fn, *args, **kwargs)
        for m in self._fsdp_instances():
            if not m.mixed_precision and m.params:
                m.compute_dtype = m.params[0].dtype
                if not m._buffer_dtype_given:
                    m.buffer_dtype = m.compute_dtype
        return self

    def _assert_idle_tree(self, what: str) -> None:
        for m in self._fsdp_instances():
            if m.training_state != TrainingState.IDLE:
                raise FairscaleRuntimeError(f"{what} needs every FSDP instance idle; one is in {m.training_state.name}")

    # ------------------------------------------------------------------ gradients
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: Union[float, int], norm_type: Union[float, int] = 2.0) -> Tensor:
        """Clip the gradient norm of all parameters of the tree (root only); returns the total norm.

        The norm is computed over the sharded gradients and combined across ranks, so the result equals
        ``torch.nn.utils.clip_grad_norm_`` on the unwrapped model.
        """
        self._lazy_init()
        if not self._is_root:
            raise FairscaleRuntimeError("clip_grad_norm_ should only be called on the root (not nested) FSDP instance")
        self.assert_state(TrainingState.IDLE)
        groups = {id(m.process_group) for m in self._fsdp_instances() if m.params}
        if len(groups) > 1:
            raise NotImplementedError("clip_grad_norm_ with nested instances on different process groups")
        norm_type = float(norm_type)
        grads: List[Tensor] = [p.grad for p in self.params_with_grad if p.grad is not None]
        device = self.compute_device
        if not grads:
            local = torch.zeros((), device=device)
        elif norm_type == float("inf"):
            local = torch.stack([g.detach().abs().max().to(device, torch.float32) for g in grads]).max()
        else:
            local = torch.stack(
                [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device) for g in grads]
            ).norm(norm_type)
        local = local.to(torch.float32)
        if norm_type == float("inf"):
            collectives.all_reduce(local, group=self.process_group, op="max")
            total = local
        else:
            local = local**norm_type
            collectives.all_reduce(local, group=self.process_group, op="sum")
            total = local ** (1.0 / norm_type)
        if self.move_grads_to_cpu:
            total = total.cpu()
        clip_coef = torch.tensor(max_norm, dtype=total.dtype, device=total.device) / (total + 1e-6)
        if clip_coef < 1:
            for g in grads:
                g.detach().mul_(clip_coef.to(g.device, g.dtype))
        return total

    def set_gradient_divide_factors(self, pre: float, post: float, recursive: bool) -> None:
        """Set the pre- and post-reduction divide factors (optionally for every nested instance)."""
        self.assert_state(TrainingState.IDLE)
        targets = get_fsdp_instances(self) if recursive else [self]
        for m in targets:
            m.assert_state(TrainingState.IDLE)
            m.gradient_predivide_factor, m.gradient_postdivide_factor = float(pre), float(post)

    def reset_parameters(self) -> None:
        """Forward to the wrapped module's ``reset_parameters`` when ``allow_reset_parameters=True``."""
        if not self.allow_reset_parameters:
            raise RuntimeError(
                "FullyShardedDataParallel.reset_parameters() is disabled; pass allow_reset_parameters=True to "
                "forward it to the wrapped module (it then runs on the full parameters)."
            )
        with self.summon_full_params(recurse=False):
            self._fsdp_wrapped_module.module.reset_parameters()

    def append_shared_param(self, p: nn.Parameter) -> None:
        """(Experimental) Also treat ``p``, owned by a sibling instance, as used by this instance."""
        if self._is_root is not None:
            raise FairscaleRuntimeError("append_shared_param must be called before the first forward (lazy init)")
        if self.flatten_parameters:
            raise FairscaleRuntimeError("append_shared_param needs flatten_parameters=False")
        if not self.params:
            raise FairscaleRuntimeError("append_shared_param needs the instance to own at least one parameter")
        if not hasattr(p, "_is_sharded"):
            raise FairscaleValueError(
                "append_shared_param expects a parameter already sharded by another FSDP instance"
            )
        # The flag lives on this instance's handle, not on the parameter: the owner must keep treating it as its own.
        self.params.append(p)
        self._has_shared_params = True
        handle = FlatHandle(p, "shared", self.world_size, self.rank, 0)
        handle.borrowed = True
        self._handles.append(handle)
        self.numel_padded_per_param.append(0)

    # ------------------------------------------------------------------ naming
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[Tuple[str, nn.Parameter]]:
        """Raw names when flattened (outside summon); otherwise names without the wrapper path components."""
        in_summon = any(m.training_state == TrainingState.SUMMON_FULL_PARAMS for m in self._fsdp_instances())
        for name, p in super().named_parameters(*args, **kwargs):
            if self.flatten_parameters and not in_summon:
                yield name, p
            else:
                yield _clean_path(name), p

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("process_group", "process_group_reduce_scatter", "zero2_process_group"):
            if state.get(key) is not None:
                state[key] = "MISSING"
        state["_tree"] = None
        state["_is_root"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)


def _clean_path(path: str) -> str:
    """Drop every ``_fsdp_wrapped_module`` / ``_fpw_module`` component of a dotted path."""
    return ".".join(c for c in path.split(".") if c not in ("_fsdp_wrapped_module", "_fpw_module"))


def get_fsdp_instances(mod: nn.Module, skip_empty: bool = False) -> List[FullyShardedDataParallel]:
    """Every FSDP instance in ``mod.modules()`` (pre-order, ``mod`` included).

    Args:
        mod: the module to search.
        skip_empty: drop instances that own no (non-shared) parameters.
    """
    found = [m for m in mod.modules() if isinstance(m, FullyShardedDataParallel)]
    if skip_empty:
        found = [m for m in found if len(m.non_shared_params()) > 0]
    return found


def cast_floats_to_right_precision(to_fp16: bool, no_grad: bool, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
    """Cast floating tensors among ``args``/``kwargs`` to fp16 (``to_fp16``) or from fp16 to fp32 (upstream helper)."""
    if to_fp16:
        return cast_inputs(torch.float16, (torch.float32,), no_grad, args, kwargs)
    return cast_inputs(torch.float32, (torch.float16,), no_grad, args, kwargs)
