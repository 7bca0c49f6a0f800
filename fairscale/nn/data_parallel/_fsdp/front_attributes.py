# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The front's attributes that only read (or write through) its unit: upstream's instance attributes.

Upstream kept its constructor arguments and runtime flags as plain attributes of the module, and user code and tests
read them; here the unit's config and state are the one source, and these descriptors and properties expose them
under upstream's names. A mixin of :class:`~fairscale.nn.data_parallel.FullyShardedDataParallel`, kept apart from
the front's methods (lifecycle, state dicts, checkpoint formats).
"""

from typing import List, Optional

from torch import nn

from .config import FSDPConfig
from .handle import FlatHandle
from .state import TrainingState
from .tree import TreeState
from .unit import UNIT_ATTR, ConfigAttribute, FSDPUnit

__all__ = ["UnitAttributes"]


class UnitAttributes:
    """Upstream's attributes of FullyShardedDataParallel, read from (and written through) the unit."""

    @property
    def _fsdp_unit(self) -> FSDPUnit:
        unit: FSDPUnit = self.__dict__[UNIT_ATTR]
        return unit

    @property
    def _config(self) -> FSDPConfig:
        return self._fsdp_unit.config

    # Upstream's instance attributes, read from (and written through) the unit's config.
    process_group = ConfigAttribute()
    process_group_reduce_scatter = ConfigAttribute()
    zero2_process_group = ConfigAttribute()
    replicate_process_group = ConfigAttribute()
    rank = ConfigAttribute()
    world_size = ConfigAttribute()
    disable_reshard_on_root = ConfigAttribute()
    mixed_precision = ConfigAttribute()
    fp32_reduce_scatter = ConfigAttribute()
    flatten_parameters = ConfigAttribute()
    move_params_to_cpu = ConfigAttribute()
    compute_dtype = ConfigAttribute()
    buffer_dtype = ConfigAttribute()
    move_grads_to_cpu = ConfigAttribute()
    bucket_cap_mb = ConfigAttribute()
    compute_device = ConfigAttribute()
    no_broadcast_optim_state = ConfigAttribute()
    state_dict_device = ConfigAttribute()
    clear_autocast_cache = ConfigAttribute()
    force_input_to_fp32 = ConfigAttribute()
    verbose = ConfigAttribute()
    state_dict_on_rank_0_only = ConfigAttribute()
    gradient_predivide_factor = ConfigAttribute()
    gradient_postdivide_factor = ConfigAttribute()
    allow_reset_parameters = ConfigAttribute()
    optimize_backward_concat = ConfigAttribute()
    forward_prefetch = ConfigAttribute()
    backward_prefetch = ConfigAttribute()

    @property
    def reshard_after_forward(self) -> bool:
        """The effective setting (``False`` on the root after lazy init when ``disable_reshard_on_root``)."""
        return self._fsdp_unit.reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool) -> None:
        unit = self._fsdp_unit
        unit.config = unit.config.replace(reshard_after_forward=bool(value))

    @property
    def _orig_reshard_after_forward(self) -> bool:
        return self._config.reshard_after_forward

    @property
    def training_state(self) -> TrainingState:
        """This instance's phase (upstream's attribute; changed only by the runtime)."""
        return self._fsdp_unit.training_state

    @property
    def params(self) -> List[nn.Parameter]:
        """The parameters this instance shards (flat parameters first), plus shared ones it borrows."""
        return self._fsdp_unit.params

    @property
    def numel_padded_per_param(self) -> List[int]:
        return [h.padding for h in self._fsdp_unit.handles]

    @property
    def _num_flatten_params(self) -> int:
        return self._fsdp_unit.num_flatten_params

    @property
    def _param_name_groups(self) -> List[List[str]]:
        return self._fsdp_unit.param_name_groups

    @property
    def _has_params(self) -> bool:
        return len(self._fsdp_unit.handles) > 0

    @property
    def _has_shared_params(self) -> bool:
        return self._fsdp_unit.has_shared_params

    @property
    def children_share_process_group(self) -> bool:
        return self._fsdp_unit.children_share_process_group

    # Runtime state, read by tests and debugging tools.
    @property
    def _handles(self) -> List[FlatHandle]:
        return self._fsdp_unit.handles

    @property
    def _is_root(self) -> Optional[bool]:
        return self._fsdp_unit.is_root

    @property
    def _tree(self) -> Optional[TreeState]:
        return self._fsdp_unit.tree

    @property
    def _require_backward_grad_sync(self) -> bool:
        return self._fsdp_unit.require_backward_grad_sync

    @property
    def _has_fsdp_parent(self) -> bool:
        return self._fsdp_unit.has_fsdp_parent
