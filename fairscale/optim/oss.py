# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS: optimizer state sharding (ZeRO stage 1) around any torch optimizer.

Every rank holds all parameters, but each parameter is *owned* by exactly one rank, and each rank runs the wrapped
optimizer over the parameters it owns only, so each rank stores about ``1 / world_size`` of the optimizer state.
After the owners' step the new values are broadcast from their owners. Parameters are never split; the assignment
(:meth:`OSS.partition_parameters`) is upstream fairscale's, so checkpoints interoperate.
"""

import logging
import math
from math import inf  # noqa: F401  # upstream's module namespace
from typing import Any, Callable, Dict, Iterable, List, Optional, Type, Union, cast

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from fairscale.internal import collectives
from fairscale.internal.agreement import check_ranks_agree, describe_tensors, first_device
from fairscale.internal.device import DeviceHandle
from fairscale.internal.grad_norm import total_norm_across_ranks
from fairscale.internal.params import calc_grad_norm, get_global_rank
from fairscale.internal.params import recursive_copy_to_device  # noqa: F401  # upstream's module namespace
from fairscale.nn.misc.param_bucket import ParamBucket  # noqa: F401  # upstream's module namespace

from ._oss import describe as _describe
from ._oss import loading as _loading
from ._oss import partition as _partition
from ._oss import state_dict as _state
from ._oss import state_hooks as _state_hooks
from ._oss.buckets import (
    Backing,
    Buckets,
    agree_on_frozen_with_grads,
    broadcast_buckets,
    broadcast_frozen_since,
    build_buckets,
    watch_frozen_with_grads,
)
from ._oss.inner_step import step_without_global_hooks
from ._oss.partition import ParamGroup
from ._oss.unfrozen import check_no_unfrozen_parameter

__all__ = ["OSS"]

_NOT_CONSOLIDATED = "Optimizer state has not been consolidated on this rank. \
                Please call `consolidate_state_dict()` on all ranks beforehand if you meant to save the global state"


def _broadcast_object(
    obj: Any, src_rank: int, group: Any = None, dist_device: torch.device = torch.device("cpu")
) -> Any:
    """Broadcast a picklable object through tensors (upstream's helper; ``src_rank`` is a global rank)."""
    return _state.broadcast_object(obj, src_rank, group=group, dist_device=dist_device)


class OSS(Optimizer):
    """Wraps an arbitrary :class:`torch.optim.Optimizer` and shards its state across the ranks of ``group``.

    Each rank steps the wrapped optimizer over the parameters it owns, then every owner broadcasts its updated
    parameters (one flat bucket per device and owner). Gradients must be identical on all ranks for the owned
    parameters before :meth:`step` (e.g. DDP), or reduced to the owners
    (:class:`~fairscale.nn.data_parallel.ShardedDataParallel`).

    Example::

        model = MyModel()
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
        model = ShardedDataParallel(model, optimizer)
        loss = model(batch).sum(); loss.backward(); optimizer.step()

    Args:
        params (list of tensors or dicts): the parameters to optimize, or parameter groups (as for any torch
            optimizer).
        optim (torch.optim.Optimizer): the optimizer class (or a callable ``(param_groups, **default)``) used for
            this rank's shard (default: ``torch.optim.SGD``).
        group (Optional[ProcessGroup]): the group to shard across (default: the world group).
        broadcast_buffer_size (int): deprecated, ignored (kept for compatibility).
        broadcast_fp16 (bool): broadcast the updated parameters as fp16 (halves the traffic; every trainable
            parameter ends up rounded to fp16 precision). An owner's bucket holding a value beyond the fp16 range
            travels in full precision for that step instead of becoming inf; deciding it costs one small
            all-reduce per step. Default ``False``.
        force_broadcast_object (bool): consolidate state dicts through byte tensors instead of
            ``torch.distributed.broadcast_object_list``. Default ``False``.
        **default: the hyper-parameters of ``optim`` (e.g. ``lr=0.1``).

    Raises:
        RanksDisagreeError: (a ``ValueError``, the same on every rank) the ranks passed parameters of other shapes,
            dtypes or ``requires_grad`` flags, another ``optim``, other hyper-parameters (``**default`` or those of
            the parameter groups) or other ``broadcast_fp16`` / ``force_broadcast_object`` values (checked with one
            small all-gather at construction).

    .. warning:: Every rank must call :meth:`step`, :meth:`consolidate_state_dict`, :meth:`clip_grad_norm`,
        :meth:`add_param_group` and :meth:`refresh_trainable` together (they communicate), with the same parameters
        in the same order.
    """

    in_super_constructor: bool

    def __init__(
        self,
        params: Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]],
        optim: Type[Optimizer] = torch.optim.SGD,
        group: Optional[Any] = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        **default: Any,
    ):
        # The base constructor calls add_param_group(); while this flag is set it only records the groups.
        self.in_super_constructor = True
        super().__init__(params, default)
        self.in_super_constructor = False

        self._partition_parameters: List[List[ParamGroup]] = []
        # {param: owning rank}: assigned once per parameter and never changed (the ranks' optimizers hold the
        # state of what they own); everything else about the partition is derived from it. Keyed by the tensors
        # (hashed by identity), as _param_to_rank.
        self._owners: Dict[torch.Tensor, int] = {}
        self.__param_to_rank: Dict[torch.Tensor, int] = {}
        self.__per_device_params: Dict[Any, List[List[torch.Tensor]]] = {}
        self.__param_to_index: Dict[int, int] = {}
        self._optim_defaults = _describe.constructor_defaults(optim, default)
        self._optim_constructor: Callable[..., Optimizer] = optim
        # The hyper-parameters the ranks must agree on: those the optimizer declares (a key only its **kwargs takes,
        # such as upstream's test optimizer's per-process `rank`, may differ).
        self._declared_hyper = _describe.declared_hyper_parameters(optim)

        self.group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.world_size = collectives.group_size(self.group)
        self.backend = str(dist.get_backend(self.group)) if dist.is_initialized() else "gloo"
        self.rank = collectives.group_rank(self.group)
        if self.rank < 0:
            raise ValueError("OSS: this process is not a member of `group`; build OSS on the group's ranks only")
        self._local_to_global_rank = [self._global_rank_of(r) for r in range(self.world_size)]
        self.global_rank = self._local_to_global_rank[self.rank]
        self.broadcast_fp16 = broadcast_fp16
        self.force_broadcast_object = force_broadcast_object
        self.buckets: Buckets = {}
        self._backing = Backing([])
        self._all_states: List[Dict[str, Any]] = []
        self._default_device = torch.device("cpu")
        # Before anything is partitioned or sent: ranks with other parameters would partition differently and then
        # broadcast buckets of other sizes (gloo aborts the process, NCCL hangs or corrupts memory).
        # The broadcast arguments ride along: another wire dtype or consolidation path is another collective.
        # So do the optimizer class and the hyper-parameters: ranks that step their shards with another optimizer or
        # learning rate train replicas that silently drift apart.
        arguments: List[Any] = [
            ("argument broadcast_fp16", bool(broadcast_fp16)),
            ("argument force_broadcast_object", bool(force_broadcast_object)),
            ("argument optim", _describe.callable_name(optim)),
        ]
        arguments += _describe.describe_hyper_parameters(self.param_groups, declared=self._declared_hyper)
        self._check_ranks_agree(arguments + self._describe_params(self.param_groups), "")
        self._refresh_trainable()

    @staticmethod
    def _describe_params(groups: List[Dict[str, Any]], first_group: int = 0) -> List[Any]:
        """``(name, shape, dtype, requires_grad)`` of every parameter, named by its place in the groups."""
        return describe_tensors(
            (f"group {first_group + g}, parameter {i}", p)
            for g, group in enumerate(groups)
            for i, p in enumerate(group["params"])
        )

    def _check_ranks_agree(self, description: List[Any], when: str) -> None:
        """One small all-gather: the same :class:`RanksDisagreeError` on every rank if the parameters differ."""
        arguments = {
            "": ", the optimizer, hyper-parameters and broadcast arguments",
            ".add_param_group": " and hyper-parameters",
        }
        check_ranks_agree(
            f"OSS{when}: the parameters (shape, dtype, requires_grad)" + arguments.get(when, ""),
            description,
            self.group,
            hint="Build OSS from the same model on every rank, with the same parameter groups and the same frozen "
            "parameters (freeze or unfreeze on every rank alike), and the same OSS arguments and hyper-parameters.",
            device=self._params_device(),
        )

    def _params_device(self) -> Optional[torch.device]:
        """The device of the first parameter: where this rank's object collectives run (see check_ranks_agree)."""
        return first_device(p for group in self.param_groups for p in group["params"])

    def _global_rank_of(self, rank: int) -> int:
        if not dist.is_initialized():
            return rank
        return get_global_rank(self.group, rank)

    # ------------------------------------------------------------------------------------------------
    # Partition

    def partition_parameters(self) -> List[List[Dict[str, Any]]]:
        """Partition the parameters over the ranks.

        Each parameter is given an owner once and keeps it. Walking the groups in order, a parameter goes to the
        rank with the fewest trainable elements so far (ties: the lowest rank; a frozen parameter counts one);
        parameters added by :meth:`add_param_group` are placed continuing from the current loads, and freezing or
        unfreezing parameters moves none (upstream re-partitioned every group with the current trainability there,
        while the wrapped optimizers kept their old shards).

        Returns:
            For each rank, one dict per parameter group holding the parameters that rank owns (lists may be empty).
            This rank's dicts are the wrapped optimizer's own ``param_groups``.
        """
        if not self._partition_parameters:
            self._owners = _partition.assign_owners(self.param_groups, self.world_size, self._owners)
            self._partition_parameters = _partition.split_by_owner(self.param_groups, self.world_size, self._owners)
        return self._partition_parameters

    @property
    def _param_to_rank(self) -> Dict[torch.Tensor, int]:
        """``{param: owning rank}``."""
        if not self.__param_to_rank:
            self.__param_to_rank = _partition.param_to_rank(self.partition_parameters())
        return self.__param_to_rank

    @property
    def _param_to_index(self) -> Dict[int, int]:
        """``{id(param): position in the concatenation of all groups}``."""
        if not self.__param_to_index:
            self.__param_to_index = _partition.param_to_index(self.param_groups)
        return self.__param_to_index

    @property
    def _per_device_params(self) -> Dict[Any, List[List[torch.Tensor]]]:
        """``{device: [params owned by rank 0, by rank 1, ...]}``, each list sorted by size."""
        if not self.__per_device_params:
            self.__per_device_params = _partition.per_device_params(self.param_groups, self.partition_parameters())
        return self.__per_device_params

    @property
    def _local_params(self) -> List[torch.Tensor]:
        """The parameters this rank owns that have a gradient now (recomputed at every access; upstream cached
        the first answer and missed gradients that appeared later)."""
        return [p for per_rank in self._per_device_params.values() for p in per_rank[self.rank] if p.grad is not None]

    def _clear_cache(self) -> None:
        """Forget what is derived from the parameters' devices and positions. The ownership and the shard groups
        stay: they never change, and this rank's shard groups are the wrapped optimizer's own groups."""
        self.__param_to_rank.clear()
        self.__per_device_params.clear()
        self.__param_to_index.clear()

    # ------------------------------------------------------------------------------------------------
    # Stepping

    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:  # type: ignore
        """Step the owned parameters with the wrapped optimizer, then share them with every rank.

        Every rank must call it (it broadcasts), including ranks that own nothing. If the parameters stopped being
        views of the broadcast buckets since the last step (the model was moved or converted, e.g.
        ``model.double()``, or a ``param.data`` was replaced; every rank alike), the buckets are rebuilt first from
        the parameters' current values, with the same owners and the optimizer state as it is.

        Args:
            closure (callable): re-evaluates the model and returns the loss (optional for most optimizers).
            **kwargs: passed to the wrapped optimizer's ``step``.

        Returns:
            The wrapped optimizer's return value (the loss when a closure is given).

        Raises:
            TypeError: (also an ``AssertionError``) after a conversion, one owner's trainable parameters on one
                device have several dtypes (e.g. one layer converted alone); on every rank, before any stepping.
            FairscaleRuntimeError: (a ``RuntimeError``, also an ``AssertionError``) a parameter was unfrozen
                (``requires_grad`` set to ``True``) without :meth:`refresh_trainable` since; raised on every rank
                that unfroze it, before any stepping.
        """
        # Hyper-parameters may have been changed on OSS's groups (e.g. by an LR scheduler).
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        # The first parameter of any group: the first group may be empty (upstream read its first entry, an
        # IndexError on every step).
        device = self._params_device()
        # The broadcast writes the buckets: a parameter that is no longer a view of its bucket (the model was moved
        # or converted, e.g. model.double(), or a .data was replaced) would not receive its owner's update, and the
        # ranks would drift apart silently. Upstream only noticed a change of device type.
        if (device is not None and device != self._default_device) or not self._backing.intact():
            logging.info("OSS detected that the parameters changed device, dtype or storage, re-allocating buffers")
            self._clear_cache()
            self._refresh_trainable()
        if closure is not None:
            # Checked after the closure, before the wrapped optimizer updates anything: the closure's forward is
            # where ShardedDataParallel(auto_refresh_trainable=True) takes an unfreezing in (checked before it, the
            # step refused what that forward was about to fix).
            def checked_closure() -> Any:
                value = closure()
                self._check_no_unfrozen_parameter()
                return value

            loss = step_without_global_hooks(self.optim, closure=checked_closure, **kwargs)
        else:
            self._check_no_unfrozen_parameter()
            loss = step_without_global_hooks(self.optim, **kwargs)
        self._broadcast_params()
        # Keys the wrapped optimizer added during its step become visible on OSS's groups.
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _check_no_unfrozen_parameter(self) -> None:
        """Refuse to step a parameter unfrozen since the broadcast buckets were built (see
        :func:`._oss.unfrozen.check_no_unfrozen_parameter`)."""
        check_no_unfrozen_parameter(self._backing, self.param_groups)

    def _broadcast_params(self) -> None:
        broadcast_buckets(self.buckets, self.group, self._local_to_global_rank, self.rank, self.broadcast_fp16)
        agree_on_frozen_with_grads(self._backing, self.group)
        broadcast_frozen_since(self._backing.frozen_since, self.group, self._local_to_global_rank, self.rank)

    def clip_grad_norm(
        self,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        filter_params_fn: Optional[Callable[[Any], Any]] = None,
    ) -> torch.Tensor:
        """Clip the gradients of all parameters by their total norm, computed across ranks.

        Each rank measures the gradients it owns; the norms are combined with an all-reduce over the **default
        (world) group**, whatever ``group`` OSS uses (upstream's choice, for model-parallel setups where the
        shards of one model span several data-parallel groups). Every rank of the world must call it. Only owned
        gradients are scaled: after :meth:`step` only owned gradients matter.

        Args:
            max_norm (float or int): the maximum norm of the gradients, at least 0.
            norm_type (float or int): the p of the p-norm, a positive number (``inf`` for the max norm). Unlike
                ``torch.nn.utils.clip_grad_norm_``, 0 and negative values (``-inf``) are refused: upstream divided
                by zero or returned meaningless norms for them.
            filter_params_fn (callable): optional filter applied to the owned parameters before measuring. Under
                tensor parallelism, drop the parameters every model-parallel rank holds whole (row-parallel biases,
                layer norms) on model-parallel ranks other than 0: the norm is combined over the world.

        Returns:
            torch.Tensor: the total norm of the gradients (before clipping).

        Raises:
            ValueError: ``max_norm`` is negative or NaN (a negative one flipped the gradients' signs, NaN skipped
                clipping silently), or ``norm_type`` is not a positive number; raised before any communication.
            RanksDisagreeError: (a ``ValueError``) the ranks passed different ``max_norm`` or ``norm_type``; raised
                on every rank, gradients unchanged (the norm's parts travel with both arguments, in the one
                collective the norm needs anyway).
        """
        max_norm = float(max_norm)
        norm_type = float(norm_type)
        if math.isnan(max_norm) or max_norm < 0:
            raise ValueError(f"OSS.clip_grad_norm: max_norm must be a number >= 0, got {max_norm}")
        if not norm_type > 0:  # NaN included
            raise ValueError(
                f"OSS.clip_grad_norm: norm_type must be a positive number or inf (the p of the p-norm), got "
                f"{norm_type}; 0 and negative norms are not supported"
            )
        # Listed once: a filter_params_fn may return an iterator, which the norm and the gradient test both walk.
        local_params = list(
            filter_params_fn(self._local_params) if filter_params_fn is not None else self._local_params
        )
        local_norm = calc_grad_norm(cast(List[torch.nn.Parameter], local_params), norm_type).to(self._default_device)
        world = dist.group.WORLD if dist.is_initialized() else None
        has_grads = any(p.grad is not None for p in local_params)
        total_norm = total_norm_across_ranks(local_norm, max_norm, norm_type, world, "OSS.clip_grad_norm", has_grads)
        clip_coef = torch.tensor(max_norm, dtype=total_norm.dtype, device=total_norm.device) / (total_norm + 1e-6)
        if clip_coef < 1:
            for per_rank in self._per_device_params.values():
                for param in per_rank[self.rank]:
                    if param.grad is not None:
                        param.grad.detach().mul_(clip_coef.to(param.grad.device))
        return total_norm

    # ------------------------------------------------------------------------------------------------
    # State dicts

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on ``recipient_rank`` (``-1``: on every rank).

        Every rank must call it. Afterwards :meth:`state_dict` works on the recipient(s). The gathered state is a
        CPU snapshot: later steps do not change it.

        Args:
            recipient_rank (int): the rank, inside ``group``, that receives the state; ``-1`` for all ranks.

        Raises:
            RanksDisagreeError: (a ``ValueError``, the same on every rank) the ranks passed different
                ``recipient_rank`` values (checked with one small all-gather first; the gathers that follow would
                otherwise never match up and hang).
            ValueError: ``recipient_rank`` is out of range (on every rank alike).
        """
        # Which rank sends in which round, and how, depends on these: ranks that disagree would wait in different
        # rounds forever. Checked before the range, so that a rank with a bad value does not leave the others
        # waiting in this gather.
        check_ranks_agree(
            "OSS.consolidate_state_dict: the recipient rank and the transport (force_broadcast_object)",
            [("recipient_rank", recipient_rank), ("force_broadcast_object", bool(self.force_broadcast_object))],
            self.group,
            hint="Call consolidate_state_dict() with the same recipient_rank on every rank.",
            device=self._params_device(),
        )
        if not -1 <= recipient_rank < self.world_size:
            raise ValueError(f"recipient_rank must be in [-1, {self.world_size - 1}], got {recipient_rank}")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._all_states = []
        dist_device = self._object_device()

        def transport(obj: Any, src: int) -> Any:
            if self.force_broadcast_object:
                return _broadcast_object(obj, src_rank=src, group=self.group, dist_device=dist_device)
            holder = [obj]
            with DeviceHandle.for_device(dist_device).as_current():
                collectives.broadcast_object_list(holder, src=src, group=self.group)
            return holder[0]

        self._all_states = _state.gather_shards(
            self.optim.state_dict(),
            self.rank,
            self.world_size,
            recipient_rank,
            self._local_to_global_rank,
            transport,
        )

    def _object_device(self) -> torch.device:
        """Where object collectives put their tensors: the parameters' accelerator for NCCL, else the CPU."""
        return self._default_device if "nccl" in self.backend else torch.device("cpu")

    def __getstate__(self) -> Dict[str, Any]:
        # Reached by copy.copy, copy.deepcopy and pickling. torch's Optimizer keeps only defaults, state and
        # param_groups: the copy lacked its sharded optimizer and failed at its first step ("no attribute 'optim'").
        # A process group cannot be copied, and this rank's shard alone is not the optimizer: refuse, and say what
        # carries the state instead. Without torch.distributed (no group) everything is local and copies.
        if self.group is not None:
            raise TypeError(
                "OSS cannot be copied or pickled: it is bound to a process group and holds only this rank's shard of "
                "the optimizer state. Carry the state instead: state_dict(all_ranks=True) (or consolidate_state_dict() "
                "then state_dict() on the recipient rank), then load_state_dict() into an OSS built over the copied "
                "model's parameters."
            )
        return dict(self.__dict__)

    def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:
        """The whole optimizer state in torch's format (global parameter indices in OSS group order).

        Args:
            all_ranks (bool): consolidate on every rank first (a collective: every rank must call it). With
                ``False``, :meth:`consolidate_state_dict` must have run on this rank since the last step for the
                result to be current.

        Returns:
            dict: ``{"state": {index: {...}}, "param_groups": [...]}`` with CPU tensors, loadable by OSS at any
            world size and by a plain torch optimizer over the same parameters.

        Raises:
            RuntimeError: the state was not consolidated on this rank.
        """
        if not all_ranks and len(self._all_states) == 0:
            raise RuntimeError(_NOT_CONSOLIDATED)
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        with _state_hooks.held_back(self, _state_hooks.STATE_DICT_POST) as (post,):  # they see the whole dict
            base = super().state_dict()
        merged = _state.merge_shards(base, self._all_states, self.partition_parameters(), self._param_to_index)
        return _state_hooks.run_returning(self, post, merged)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a consolidated OSS state dict, or a plain torch optimizer's, on this rank's shard.

        Every rank loads the same dict (every rank must call this); each keeps the state of the parameters it owns.
        The ranks agree first, in two small all-gathers: a check that fails on one rank fails on every rank, and
        dicts whose parameter groups (sizes, hyper-parameters) differ between ranks raise ``RanksDisagreeError``. As upstream, the
        per-parameter entries of the parameters this rank does not own are replaced by ``{}`` in ``state_dict``
        (pass a copy to keep it intact) once every rank loaded it. A dict that does not fit raises and changes nothing,
        neither the optimizer nor the dict, on any rank.

        The wrapped optimizer's own top-level entries (fairscale Adam's ``optim_scale``) are passed on to it. Every
        state tensor is checked against its parameter first, on every rank for every parameter (a per-element
        moment such as ``exp_avg`` must have the parameter's shape; another tensor of more than one element may not
        have more elements than the parameter), and with the wrapped optimizer's own checks
        when it has them (fairscale Adam), so that every rank raises the same error.

        With ``optim`` exactly ``torch.optim.SGD``, ``Adam``, ``AdamW`` or ``fairscale.optim.Adam``, the state must
        also be that optimizer's: a per-parameter state holding names the class does not use (another optimizer's
        state, e.g. an SGD ``momentum_buffer`` loaded into Adam, or Adam's moments into SGD, which torch accepts and
        then ignores), a non-empty Adam state without ``step``, ``exp_avg`` or ``exp_avg_sq``, or a group without
        the hyper-parameters the class reads, is refused. If the wrapped optimizer's own loader raises nonetheless
        (another optimizer class), OSS and the wrapped optimizer are put back as they were before the call, on every
        rank.

        Raises:
            RanksDisagreeError: (a ``ValueError``, on every rank) the ranks' dicts have other parameter groups.
            RuntimeError: on the other ranks, when the dict failed a check or the load on some rank (which raises
                its own error, below); the message names that rank and its error.
            TypeError: not a state dict, or one whose ``state``, ``param_groups``, groups or ``params`` are not of
                the types of an optimizer state dict.
            ValueError: different group count or sizes (e.g. a per-rank shard), unknown parameter indices, state
                shaped for other parameters (the message names the parameter and both shapes), state of another
                optimizer class (the message names the keys), or a dict the wrapped optimizer's loader refused (its
                error is chained; a ``ValueError`` or ``TypeError`` of that loader is raised as it is).
            KeyError: ``optim=fairscale.optim.Adam`` and the dict has no ``optim_scale``.
        """
        _loading.load_on_every_rank(self, state_dict, super().load_state_dict)

    # ------------------------------------------------------------------------------------------------
    # Structure changes

    def refresh_trainable(self) -> None:
        """Rebuild the broadcast buckets after parameters were frozen or unfrozen. Every rank must call it.

        Ownership does not change (a parameter keeps its owner for good); only which parameters are broadcast
        does.

        Raises:
            RanksDisagreeError: (a ``ValueError``, the same on every rank) the ranks do not have the same
                parameters frozen; nothing is changed then.
        """
        # One small all-gather: buckets built from different trainable sets would have different sizes.
        self._check_ranks_agree(self._describe_params(self.param_groups), ".refresh_trainable")
        self._refresh_trainable()

    def _refresh_trainable(self) -> None:
        """:meth:`refresh_trainable` without the check (ShardedDataParallel checks the ranks itself)."""
        if not hasattr(self, "optim"):
            self._clear_cache()
            self.optim = self._optim_constructor(self.partition_parameters()[self.rank], **self._optim_defaults)
            self._sync_param_groups(self.optim.param_groups, self.param_groups)
            # The wrapped optimizer's own defaults (AdamW's betas, SGD's momentum) join OSS's, which held only what
            # was passed: torch's OneCycleLR and CyclicLR read optimizer.defaults and refused OSS(optim=AdamW).
            for key, value in self.optim.defaults.items():
                self.defaults.setdefault(key, value)
        self._default_device = next(iter(self._per_device_params))
        self._setup_flat_buffers()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group (on every rank, with the same parameters); its parameters are partitioned with
        the same greedy rule, continuing from the current loads (trainable elements per rank, with the current
        ``requires_grad`` flags). The parameters already there keep their owner, also after a change of
        trainability (upstream re-partitioned them, and the parameters that changed owner were no longer stepped).

        Args:
            param_group (dict): the parameters and group-specific hyper-parameters.

        Raises:
            RanksDisagreeError: (a ``ValueError``, the same on every rank) the ranks add different parameters or
                other hyper-parameters, or do not have the same parameters frozen (the new parameters' owners
                depend on it); nothing is changed then.
            TypeError: ``param_group`` is not a dict (on every rank alike).
            ValueError: ``param_group`` has no ``"params"`` entry (on every rank alike).
        """
        if self.in_super_constructor:
            super().add_param_group(param_group)
            return
        is_dict = isinstance(param_group, dict)
        has_params = is_dict and "params" in param_group
        if has_params:
            params = param_group["params"]
            # Listed once: a generator would be used up by the check.
            param_group = {**param_group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}
        first_group = len(self.param_groups)
        described = [param_group] if is_dict else []
        # The group's own hyper-parameters: the others come from the defaults, compared at construction. What is
        # wrong with the argument is compared too, and raised after the gather, so that every rank raises. The
        # parameters already there are compared as well: the new ones are placed by the current loads, which
        # depend on their requires_grad flags, and ranks placing them differently would broadcast other buckets.
        self._check_ranks_agree(
            self._describe_params(self.param_groups)
            + self._describe_params([{"params": _describe.tensors_of(param_group) if has_params else []}], first_group)
            + _describe.describe_hyper_parameters(described, first_group, self._declared_hyper)
            + [("param_group", type(param_group).__name__, has_params)],
            ".add_param_group",
        )
        if not is_dict:
            raise TypeError(
                f"OSS.add_param_group expects a dict such as {{'params': [...], 'lr': 0.1}}, got "
                f"{type(param_group).__name__}"
            )
        if not has_params:
            raise ValueError(
                f"OSS.add_param_group: the group has no 'params' entry (it has {sorted(map(str, param_group))}); "
                "pass the parameters to add as {'params': [...], ...}"
            )
        partition = self.partition_parameters()  # the groups there before, with their owners
        super().add_param_group(param_group)
        # Only the new parameters get an owner; the shard groups of the old ones stay the wrapped optimizers' own.
        self._owners = _partition.assign_owners(self.param_groups, self.world_size, self._owners)
        shares = _partition.split_by_owner(self.param_groups[-1:], self.world_size, self._owners)
        for rank_groups, share in zip(partition, shares):
            rank_groups.extend(share)
        self._clear_cache()
        self.optim.add_param_group(partition[self.rank][-1])
        self._setup_flat_buffers()

    def _setup_flat_buffers(self) -> None:
        previous = self._backing
        self.buckets, self._backing = build_buckets(self._per_device_params, self.buckets, previous)
        watch_frozen_with_grads(self._backing, previous, self.world_size)

    @staticmethod
    def _sync_param_groups(source: List[Dict[Any, Any]], destination: List[Dict[Any, Any]]) -> None:
        """Copy every key but ``params`` from each source group to the destination group at the same position."""
        for source_group, destination_group in zip(source, destination):
            for key in [k for k in source_group.keys() if k != "params"]:
                destination_group[key] = source_group[key]
