# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel: data parallelism with gradient sharding (ZeRO stage 2), to be used with OSS.

Where DDP all-reduces every gradient, ShardedDataParallel *reduces* each gradient to the rank whose
:class:`~fairscale.optim.OSS` shard owns the parameter, and the other ranks drop it: each rank keeps about
``1 / world_size`` of the gradients once backward is done, and OSS's step then only needs those.
"""

import contextlib
import itertools
import logging
from typing import Any, Dict, Generator, List, Mapping, Optional, Tuple, Union, cast

import torch
import torch.distributed as dist
from torch import nn

from fairscale.internal import collectives
from fairscale.internal.compiler import call_outside_compiler
from fairscale.internal.collectives import WorkHandle
from fairscale.internal.agreement import check_ranks_agree, describe_tensors, first_device
from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.internal.errors import FairscaleRuntimeError, FairscaleValueError
from fairscale.internal.params import Workhandle, get_global_rank  # noqa: F401  # Workhandle: upstream's namespace
from fairscale.internal.params import conversion_in_place
from fairscale.internal.sparse_layers import sparse_gradient_layer
from fairscale.nn.misc.param_bucket import GradBucket  # noqa: F401  # upstream's namespace
from fairscale.optim.oss import OSS

from ._sharded_ddp.reducer import GradReducer, HookState

__all__ = ["ShardedDataParallel"]


class ShardedDataParallel(nn.Module):
    """Wrap a model for data-parallel training whose optimizer state (OSS) and gradients are sharded.

    Example::

        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        model = ShardedDataParallel(model, optimizer)
        for batch in data:
            model.zero_grad()
            model(batch).sum().backward()   # each gradient reduced to its owner during backward
            optimizer.step()                # owners step, then broadcast

    Args:
        module (nn.Module): the model to wrap; all its parameters on one device type.
        sharded_optimizer (OSS or list of OSS): the optimizer(s) owning the parameters, all of them the module's;
            parameters in no OSS are not reduced. Groups added later with ``OSS.add_param_group`` are reduced from
            the next forward on (with ``auto_refresh_trainable=False``: after :meth:`refresh_trainable`).
        process_group (Optional[ProcessGroup]): the data-parallel group (default: the world group); the same as the
            optimizers'.
        broadcast_buffers (bool): broadcast the module's buffers from group rank 0 at every forward (not inside
            :meth:`no_sync`). Default ``True``.
        sync_models_at_startup (bool): broadcast parameters and buffers from group rank 0 now. Default ``True``.
        reduce_buffer_size (int): the element capacity of each gradient bucket; small gradients of the same owner
            are reduced together. ``0`` disables buckets. Default ``2**23``.
        auto_refresh_trainable (bool): check at every forward whether parameters were frozen/unfrozen or added to
            the optimizers, or the train/eval mode changed, and rebuild hooks and buckets if so. Default ``True``;
            with ``False`` call :meth:`refresh_trainable` after such a change (a training forward raises
            ``RuntimeError`` when trainable parameters were added to an optimizer since, and a backward raises
            ``FairscaleRuntimeError``, on every rank, before reducing anything, when parameters were frozen or
            unfrozen since).
        reduce_fp16 (bool): reduce fp32 gradients as fp16 (only without buckets; ignored with a warning
            otherwise). Default ``False``.
        warn_on_trainable_params_changed (bool): log a warning when a trainability change is detected.
            Default ``True``.

    Raises:
        TypeError: an optimizer is not an :class:`~fairscale.optim.OSS` (e.g. a plain ``torch.optim.SGD``).
        ValueError: an optimizer holds parameters that are not the module's, or two optimizers hold the same
            parameter (at construction, or at the refresh after ``add_param_group``).
        RanksDisagreeError: (a ``ValueError``, the same on every rank) at construction, when the ranks wrap modules
            with other parameters (names, shapes, dtypes, ``requires_grad``) or buffers; in ``backward()``, when
            the ranks would reduce different parameters (one rank froze or unfroze a parameter alone, or called
            :meth:`refresh_trainable` alone). The first costs one small all-gather; the second one all-reduce of two
            integers before the first reduction of each backward (none inside :meth:`no_sync`).

    .. warning:: Every rank must run the same forward and backward, in the same mode (``train()``/``eval()``, in
        or out of :meth:`no_sync`), with the same parameters getting gradients, in the same order: the reductions
        are matched by order. A rank that skips a layer, or runs a forward the others do not, makes gloo abort the
        process or the ranks hang (see "When ranks disagree" in the FSDP page for ``TORCH_DISTRIBUTED_DEBUG``).
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: Union[OSS, List[OSS]],
        process_group: Any = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = 2**23,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
    ):
        super().__init__()
        self.module = module
        self._sharded_optimizers: List[OSS] = _check_optimizers(sharded_optimizer)
        _refuse_sparse_gradients(module)
        self._enable_broadcast_buffers = broadcast_buffers
        self._auto_refresh_trainable = auto_refresh_trainable
        self._warn_on_trainable_params_changed = warn_on_trainable_params_changed
        size = reduce_buffer_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not float(size).is_integer() or size < 0:
            # A negative size was taken for "no buckets" silently (min() with the model size).
            raise FairscaleValueError(
                f"ShardedDataParallel: reduce_buffer_size must be a whole number >= 0 (elements per gradient bucket; "
                f"0 disables the buckets), got {reduce_buffer_size!r}"
            )
        reduce_buffer_size = int(size)
        if reduce_fp16 and reduce_buffer_size > 0:
            logging.warning(
                "fp16 gradient reduction is not compatible with reduction buffers, which are requested. "
                "fp16 grad reduction is deactivated."
            )
            reduce_fp16 = False
        self._reduce_fp16 = reduce_fp16

        device_types = {p.device.type for p in self.module.parameters()}
        if len(device_types) > 1:
            raise FairscaleValueError(
                "ShardedDataParallel's input module must be on the same type of devices, but input module "
                f"parameters are located on {sorted(device_types)} different device types; move the module to one "
                "device type first."
            )
        self.is_multi_device_module = len({p.device for p in self.module.parameters()}) > 1
        self.device_type = next(iter(device_types)) if device_types else "cpu"

        self._process_group = process_group if process_group is not None else _world_group()
        world_size = collectives.group_size(self._process_group)
        self._rank = collectives.group_rank(self._process_group)
        if self._rank < 0:
            raise ValueError("ShardedDataParallel: this process is not a member of `process_group`")
        self._local_to_global_rank = [_global_rank(self._process_group, r) for r in range(world_size)]
        self._global_rank = self._local_to_global_rank[self._rank]
        self._reference_global_rank = self._local_to_global_rank[0]
        self._world_size_scaling = 1.0 / world_size
        for optim in self._sharded_optimizers:
            if optim.world_size != world_size:
                raise ValueError(
                    f"ShardedDataParallel: the process group has {world_size} ranks but an OSS optimizer shards "
                    f"over {optim.world_size}; build OSS with the same group"
                )

        # Every parameter the optimizers manage (see _optimizer_params), re-read when their groups change: a group
        # added to an OSS after wrapping (unfreezing a backbone) is reduced from the next refresh on.
        self._all_params: List[torch.Tensor] = []
        self._all_param_names: List[str] = []
        self._groups_seen: Optional[List[List[int]]] = None
        self._update_params()
        self._reference_trainable_mask = [p.requires_grad for p in self._all_params]

        model_size = sum(p.numel() for p in self.module.parameters())
        self._buffer_max_size = min(reduce_buffer_size, model_size)
        if world_size == 1:
            logging.info("Training is not really distributed, single rank. Deactivating buckets")
            self._buffer_max_size = 0
        logging.info(
            "ShardedDDP bucket size: {:.2f}M parameters, model size {:.2f}M parameters".format(
                self._buffer_max_size / 2**20, model_size / 2**20
            )
        )
        # Before the first collective: ranks with other models would broadcast or reduce tensors of other sizes
        # (gloo aborts the process, NCCL hangs or corrupts memory). The arguments that decide which collectives run
        # (a buffer broadcast per forward, a startup broadcast, the reduce buckets and their dtype, a check per
        # forward) ride along: a rank with another one would issue other collectives.
        arguments: List[Any] = [
            ("argument broadcast_buffers", bool(broadcast_buffers)),
            ("argument sync_models_at_startup", bool(sync_models_at_startup)),
            ("argument reduce_buffer_size (elements, as used)", self._buffer_max_size),
            ("argument auto_refresh_trainable", bool(auto_refresh_trainable)),
            ("argument reduce_fp16", bool(reduce_fp16)),
        ]
        check_ranks_agree(
            "ShardedDataParallel: the module's parameters (name, shape, dtype, requires_grad), buffers and arguments",
            # Arguments first: a module with an extra tensor then still reads "N entries vs N+1".
            arguments
            + describe_tensors(("parameter " + n, p) for n, p in self.module.named_parameters())
            + describe_tensors(("buffer " + n, b) for n, b in self.module.named_buffers()),
            self._process_group,
            hint="Wrap the same model on every rank, with the same parameters frozen and the same "
            "ShardedDataParallel arguments.",
            device=first_device(itertools.chain(self.module.parameters(), self.module.buffers())),
        )
        # The reducer holds this bound method weakly: nothing refers back to the wrapper, which is therefore freed
        # (with its process group and optimizers) by reference counting when the user drops it, not at exit.
        # Without the automatic refresh, a backward whose requires_grad flags no longer match the hooks (changed on
        # every rank alike, without refresh_trainable()) raises once the ranks agreed on the flags: see
        # TrainableAgreement._raise_stale (_sharded_ddp/trainable_agreement.py) for why there and not at the forward.
        self._reducer = GradReducer(
            self._process_group,
            world_size,
            self._buffer_max_size,
            self._reduce_fp16,
            describe=self._describe_reduction,
            strict_trainable=not auto_refresh_trainable,
        )
        if sync_models_at_startup:
            self._sync_params_and_buffers()

    def _groups_signature(self) -> List[List[int]]:
        """The number of parameters in each group of each optimizer: a change means ``add_param_group`` (the only
        way OSS takes new parameters) ran since. Cheap enough for every forward (no walk over the parameters)."""
        return [[len(group["params"]) for group in optim.param_groups] for optim in self._sharded_optimizers]

    def _optimizer_params(self) -> List[torch.Tensor]:
        """Every parameter the optimizers manage: per optimizer, per device, owner by owner (each by size)."""
        return [
            p
            for optim in self._sharded_optimizers
            for per_rank in optim._per_device_params.values()
            for params in per_rank
            for p in params
        ]

    def _update_params(self) -> bool:
        """Re-read the optimizers' parameters if their groups changed since they were last read.

        Returns:
            bool: whether they changed (the hooks and buckets then need a refresh).

        Raises:
            ValueError: an optimizer holds a parameter that is not the module's, or two optimizers hold the same
                parameter; nothing is changed then.
        """
        signature = self._groups_signature()
        if signature == self._groups_seen:
            return False
        params = self._optimizer_params()
        names = {id(p): name for name, p in self.module.named_parameters()}
        foreign = [p for p in params if id(p) not in names]
        if foreign:
            # Before anything is hooked: such a parameter would be "reduced" while the module's own parameters in
            # no optimizer never train, silently (an OSS built over another model, or a group added from one).
            shapes = ", ".join(str(list(p.shape)) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ValueError(
                f"ShardedDataParallel: the optimizers hold {len(foreign)} parameter(s) that are not parameters of the "
                f"wrapped module (shapes {shapes}). Build OSS over the parameters of the module you wrap, e.g. "
                "OSS(module.parameters(), optim=torch.optim.SGD, lr=0.1), and add_param_group() only that module's "
                "parameters; an OSS over a subset of them is fine."
            )
        seen: Dict[int, int] = {}
        for p in params:
            seen[id(p)] = seen.get(id(p), 0) + 1
        shared = [names[id(p)] for p in params if seen.pop(id(p), 1) > 1]
        if shared:
            # Its hook would be registered once per optimizer: its gradient reduced (and scaled) twice.
            raise ValueError(
                f"ShardedDataParallel: parameter(s) {', '.join(shared)} are held by more than one optimizer. Give "
                "each parameter to one OSS only (several OSS must hold disjoint parts of the module's parameters)."
            )
        self._all_params = params
        self._all_param_names = [names[id(p)] for p in params]
        self._groups_seen = signature
        return True

    def _check_no_unreduced_group(self) -> None:
        """With ``auto_refresh_trainable=False``: refuse to train parameters added to an optimizer since the last
        :meth:`refresh_trainable` (they would get no hook: each rank would step its own, unaveraged gradient)."""
        if self._groups_signature() == self._groups_seen:
            return
        known = {id(p) for p in self._all_params}
        added = [p for p in self._optimizer_params() if id(p) not in known]
        if any(p.requires_grad for p in added):
            raise RuntimeError(
                f"ShardedDataParallel: {len(added)} parameter(s) were added to the optimizers (add_param_group) "
                "since the gradient hooks were built, and auto_refresh_trainable=False: their gradients would not "
                "be reduced. Call refresh_trainable() on every rank after add_param_group(), or build "
                "ShardedDataParallel with auto_refresh_trainable=True."
            )
        # Frozen for now: nothing to reduce yet. refresh_trainable(), which unfreezing them needs, hooks them.
        self._update_params()

    def _describe_reduction(self) -> List[Any]:
        """What every rank's backward must agree on: each managed parameter's name, ``requires_grad`` flag and
        whether it is hooked for reduction (see :class:`GradReducer`)."""
        hooked = {id(p) for p in self._reducer.trainable} if self._reducer.state == HookState.READY else set()
        return [(name, p.requires_grad, id(p) in hooked) for name, p in zip(self._all_param_names, self._all_params)]

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks are looked up on the wrapped module (as DDP users expect)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def __getstate__(self) -> Dict[str, Any]:
        # Reached by copy.deepcopy and pickling. A wrapper bound to a process group cannot be copied (before:
        # "cannot pickle 'ProcessGroup' object", from inside the copy); one without (a single process without
        # torch.distributed) copies as before.
        if self._process_group is None:
            state: Dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call,unused-ignore]
            return state
        raise TypeError(
            "ShardedDataParallel cannot be copied or pickled: it is bound to its OSS optimizers and process group. "
            "Copy or save the wrapped module instead (copy.deepcopy(model.module), AveragedModel(model.module), "
            "torch.save(model.module.state_dict(), ...))."
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, after (re)building the gradient hooks if trainability or the mode changed.

        Under ``torch.compile`` the preparation runs outside the compiler (a graph break) and the wrapped module is
        traced: traced, the preparation re-pointed the parameters into OSS's broadcast buckets only in the captured
        graph, and the ranks drifted apart from the first step, silently.
        """
        call_outside_compiler(self._prepare_forward)
        output = self.module(*inputs, **kwargs)
        # Backwards through this output are this wrapper's (see _sharded_ddp/own_backward.py): once one completed,
        # a backward that another wrapper of the same module, or the bare module, started is not reduced here.
        call_outside_compiler(self._reducer.watch_outputs, output)
        return output

    def _prepare_forward(self) -> None:
        needs_setup = self._reducer.state == HookState.NONE and self.training
        # module.half() / .double() (torch's, past ShardedDataParallel.to) left the gradient buckets in the old dtype.
        needs_setup |= self.training and self._reducer.buckets_stale()
        if self._auto_refresh_trainable:
            needs_setup |= self._detect_train_change()
        elif self.training and not needs_setup:
            self._check_no_unreduced_group()
        if needs_setup:
            self.refresh_trainable()
        if self._enable_broadcast_buffers and not self._reducer.accumulating:
            self.sync_buffers(blocking=True)
        self._reducer.clear_counters(self.training)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: the load is tried on shape-only tensors first
        (:mod:`fairscale.internal.dry_load`), so a dict that does not fit raises torch's error before any value
        changes (``nn.Module`` copies the entries that fit, then raises).
        """
        return load_state_dict_all_or_nothing(self, state_dict, strict, assign)

    def _detect_train_change(self) -> bool:
        added = self._update_params()
        if added and self._warn_on_trainable_params_changed:
            logging.warning("ShardedDDP detected that parameters were added to the optimizers (add_param_group).")
        mask = [p.requires_grad for p in self._all_params]
        # An eval() forward takes the hooks off (a backward after it leaves gradients local), unless a training
        # forward's backward is still to come: an evaluation between a forward and its backward (logging) must not
        # cancel that backward's reduction.
        changed = mask != self._reference_trainable_mask or (
            not self.training and self._reducer.state == HookState.READY and not self._reducer.awaiting_backward
        )
        if added:
            self._reference_trainable_mask = mask
            return True
        if changed:
            if self._warn_on_trainable_params_changed:
                logging.warning(
                    "ShardedDDP detected that the trainable params changed, "
                    "either because of eval/train mode or parameter freezing/unfreeze."
                )
            # Remembered whether or not the warning is on (upstream only did with it on, and refreshed at every
            # forward after the first change otherwise).
            self._reference_trainable_mask = mask
        return changed

    def refresh_trainable(self) -> None:
        """Rebuild hooks and buckets (and the optimizers' broadcast buckets) for the current trainability.

        Called automatically when ``auto_refresh_trainable`` is set; ownership of the parameters never changes.
        Otherwise call it on every rank: the next backward checks that the ranks reduce the same parameters.
        Parameters added to an optimizer since (``OSS.add_param_group``, e.g. to unfreeze a backbone) are reduced
        from then on, like the others.

        Raises:
            ValueError: an optimizer now holds a parameter that is not the wrapped module's, or two optimizers hold
                the same parameter.
        """
        self._update_params()
        # The automatic check compares with this mask: the hooks are built for the current flags (and parameters)
        # now. Before, only a change of the optimizers' parameters updated it, so after freeze + refresh_trainable(),
        # an unfreeze matched the stale mask and no later forward hooked the parameter again (its owner stepped with
        # its own local gradient, silently).
        self._reference_trainable_mask = [p.requires_grad for p in self._all_params]
        if self._reducer.has_pending and not self._reducer.awaiting_backward:  # that backward reduces them
            logging.warning(
                "Grads waiting to be reduced. If this is on purpose (grad accumulation), please use a no_sync() context"
            )
        trainable = sorted((p for p in self._all_params if p.requires_grad), key=lambda p: p.numel())
        owners: Dict[int, Tuple[int, bool]] = {}
        for optim in self._sharded_optimizers:
            optim._refresh_trainable()
            param_to_rank = optim._param_to_rank
            for param in trainable:
                if param in param_to_rank:
                    owner = param_to_rank[param]
                    owners[id(param)] = (self._local_to_global_rank[owner], owner == self._rank)
        self._reducer.setup(trainable, owners, self.training)

    def reduce(self) -> None:
        """Reduce the gradients now, after a last backward that ran inside :meth:`no_sync`.

        Raises:
            RuntimeError: (also an ``AssertionError``, as upstream asserted) nothing is waiting to be reduced, or
                called inside ``no_sync()`` (it reduced part of the gradients wrong, silently; fuzz, session 42).
        """
        if self._reducer.accumulating:
            raise FairscaleRuntimeError(
                "ShardedDataParallel.reduce() inside no_sync(): leave the no_sync() context first, then call reduce()"
            )
        self._reducer.manual_reduce()

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (no reduction, no buffer broadcast) inside this context.

        The backward after it reduces the sums, also of the parameters that only the backwards inside it reached (as
        DDP with ``find_unused_parameters=True``; one small all-reduce per window agrees on which those are).
        """
        previous = self._reducer.accumulating
        self._reducer.accumulating = True
        try:
            yield
        finally:
            self._reducer.accumulating = previous

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients of the parameters the optimizers manage (and the gradient buckets).

        Args:
            set_to_none (bool): release the gradients instead of zeroing them, except those of trainable bucketed
                parameters, which stay views of their bucket (zeroed).
        """
        # Parameters added to an optimizer since the last forward are zeroed too (read without refreshing: the next
        # forward, or refresh_trainable(), does that).
        params = self._all_params if self._groups_signature() == self._groups_seen else self._optimizer_params()
        self._reducer.zero_grad(set_to_none, params)

    def sync_buffers(self, blocking: bool = False) -> None:
        """Broadcast the module's buffers from group rank 0.

        Args:
            blocking (bool): wait for the broadcasts to finish (those of non-contiguous buffers, which go through a
                contiguous copy, are always waited for).
        """
        self._broadcast_from_reference([b.data for b in self.module.buffers(recurse=True)], blocking)

    def _sync_params_and_buffers(self) -> None:
        """Make every rank start from group rank 0's parameters and buffers."""
        with torch.no_grad():
            tensors = [t for t in self.module.state_dict().values() if isinstance(t, torch.Tensor)]
            self._broadcast_from_reference(tensors, blocking=True)

    def _broadcast_from_reference(self, tensors: List[torch.Tensor], blocking: bool) -> None:
        """Broadcast ``tensors`` in place from group rank 0; wait for them when ``blocking``."""
        handles: List[WorkHandle] = []
        staged: List[Tuple[torch.Tensor, torch.Tensor, WorkHandle]] = []
        for tensor in tensors:
            # Collectives need dense memory. A non-contiguous tensor (a buffer registered transposed, as ESPnet's
            # mel filterbank is) goes through a contiguous copy, written back once it arrived (torch's DDP syncs
            # such buffers too). Those few are waited for here even when not blocking: the copy-back needs them.
            target = tensor if tensor.is_contiguous() else tensor.contiguous()
            handle = collectives.broadcast(
                target, src=self._reference_global_rank, group=self._process_group, async_op=True
            )
            handle = cast(WorkHandle, handle)  # async_op=True: always a handle
            if target is tensor:
                handles.append(handle)
            else:
                staged.append((tensor, target, handle))
        for tensor, target, handle in staged:
            handle.wait()
            _write_back(tensor, target)
        if blocking:
            for handle in handles:
                handle.wait()

    def to(  # type: ignore[override]
        self,
        device: Optional[Union[int, str, torch.device]] = None,
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
    ) -> "ShardedDataParallel":
        """Move and/or cast the wrapped module, then rebuild hooks and buckets.

        Args:
            device: the new device, or ``None`` to keep it; a dtype here is taken as ``dtype`` (``sdp.to(torch.half)``,
                as ``nn.Module.to`` takes it: torch refused it as a device, confusingly).
            dtype (torch.dtype): the new floating-point dtype, or ``None``.
            non_blocking (bool): asynchronous copies where possible.

        The device type cannot change once gradient buckets exist (it would break OSS's state); dtype changes
        work.

        Returns:
            ShardedDataParallel: ``self`` (upstream returned ``None``).

        Raises:
            ValueError: (also an ``AssertionError``, as upstream asserted) another device type than the gradient
                buckets', or buckets on several devices.
        """
        if isinstance(device, torch.dtype) and dtype is None:
            device, dtype = None, device
        if isinstance(device, (str, int)):
            device = torch.device(device)
        bucket_devices = self._reducer.bucket_devices()
        if device is not None and bucket_devices and device.type not in [d.type for d in bucket_devices]:
            raise FairscaleValueError(
                f"ShardedDataParallel.to({device}): Changing devices is not supported, because this would break "
                f"OSSs state (the gradient buckets are on {bucket_devices}); build the model, OSS and "
                "ShardedDataParallel on the target device instead."
            )
        if len(bucket_devices) >= 2:
            raise FairscaleValueError(
                "ShardedDataParallel.to: Several devices specified to begin with, incompatible with setting a single "
                f"device here (the gradient buckets are on {bucket_devices})."
            )
        with conversion_in_place():  # OSS and the gradient hooks hold the parameter objects
            self.module.to(device=device, dtype=dtype, non_blocking=non_blocking)
        self.refresh_trainable()
        return self

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "ShardedDataParallel":
        """``.double()/.half()/.float()``: the parameters are converted in place (same objects) whatever
        ``torch.__future__``'s conversion settings say: OSS and the gradient hooks hold them."""
        with conversion_in_place():
            cast(Any, super())._apply(fn, *args, **kwargs)
        return self


def _check_optimizers(sharded_optimizer: Any) -> List[OSS]:
    """The optimizers as a list, after checking that they are OSS (ShardedDataParallel reads their sharding)."""
    optimizers = sharded_optimizer if isinstance(sharded_optimizer, list) else [sharded_optimizer]
    for optim in optimizers:
        if not isinstance(optim, OSS):
            kind = type(optim)
            several = " (several OSS optimizers go in a list, not a tuple)" if isinstance(optim, tuple) else ""
            raise TypeError(
                "ShardedDataParallel needs fairscale.optim.OSS optimizers: it reduces each gradient to the rank whose "
                f"OSS shard owns the parameter. Got {kind.__module__}.{kind.__qualname__}{several}. Wrap the torch "
                "optimizer class in OSS, e.g. OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1), and pass it "
                "(or a list of them) to ShardedDataParallel."
            )
    return optimizers


def _refuse_sparse_gradients(module: nn.Module) -> None:
    """Refuse a trainable layer that makes sparse gradients: the reduction sends dense ones (in buckets or alone).

    Accepted before, it failed in the first backward with a message about contiguity that named neither the
    parameter nor sparse gradients (found by a fuzz of OSS and ShardedDataParallel, session 44).
    """
    sparse = sparse_gradient_layer(module)
    if sparse is not None:
        raise FairscaleValueError(
            f"ShardedDataParallel does not support sparse gradients: {sparse[0] or 'the module'} is an "
            f"{sparse[1]} with sparse=True. Build it with sparse=False, or freeze it; OSS with torch's "
            "DistributedDataParallel reduces sparse gradients."
        )


def _world_group() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


def _global_rank(group: Any, rank: int) -> int:
    return get_global_rank(group, rank) if dist.is_initialized() else rank


def _write_back(tensor: torch.Tensor, received: torch.Tensor) -> None:
    """Copy ``received`` (a dense copy of ``tensor`` as group rank 0 holds it) into ``tensor``'s own memory.

    A dimension of stride 0 (a buffer made with ``expand``) repeats one slice of memory: torch refuses to copy into
    it element by element, so only index 0 of such dimensions is written (all the memory there is; rank 0's tensor,
    expanded alike, holds the same values at every index). Other overlapping layouts (``as_strided`` windows) take
    the copy as it is: the elements sharing memory receive equal values from rank 0's tensor of the same layout.
    """
    for dim in range(tensor.dim()):
        if tensor.stride(dim) == 0 and tensor.size(dim) > 1:
            tensor, received = tensor.narrow(dim, 0, 1), received.narrow(dim, 0, 1)
    tensor.copy_(received)
