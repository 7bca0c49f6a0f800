# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""One FSDP unit: the typed runtime state of one FullyShardedDataParallel instance, and its gather/free primitives.

The front (:class:`~fairscale.nn.data_parallel.FullyShardedDataParallel`, an ``nn.Module``) owns exactly one
:class:`FSDPUnit`; the unit owns the frozen :class:`~.config.FSDPConfig`, the :class:`~.handle.FlatHandle` of every
owned parameter, the training state and the per-instance phase data. The hook lifecycle (:mod:`.runtime`), the
reductions (:mod:`.reduction`), the state-dict and checkpoint code work on units, never on the front's attributes.

A unit finds the other units of its tree through its owner module's ``modules()`` (:meth:`FSDPUnit.tree_units`);
modules carry their unit under :data:`UNIT_ATTR`, which :func:`unit_of` reads, so this package never needs the
front class itself.
"""

import contextlib
import enum
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal import collectives
from fairscale.internal.device import DeviceHandle
from fairscale.internal.errors import FairscaleRuntimeError
from fairscale.nn.checkpoint.checkpoint_activations import _CheckpointedForward

from . import identity
from .config import FSDPConfig
from .handle import FlatHandle
from .naming import clean_path
from .state import _TRAINING_LEGAL, HandleState, TrainingState, check_training_transition
from .tree import PendingBackward, TreeState

# The attribute of an FSDP front module that holds its unit.
UNIT_ATTR = "_fsdp_unit"


def unit_of(module: nn.Module) -> Optional["FSDPUnit"]:
    """The unit of ``module`` when it is a FullyShardedDataParallel instance, else ``None``."""
    unit = module.__dict__.get(UNIT_ATTR)
    return unit if isinstance(unit, FSDPUnit) else None


def _required_unit(module: nn.Module) -> "FSDPUnit":
    unit = unit_of(module)
    if unit is None:
        raise AttributeError(f"{type(module).__name__} has no FSDP unit (not constructed, or being unpickled)")
    return unit


class ConfigAttribute:
    """An attribute of the front that reads one field of its unit's :class:`~.config.FSDPConfig`.

    Upstream kept the constructor arguments as plain instance attributes, and user code reads (and occasionally
    sets) them; here the config is the one source. Assigning replaces the frozen config with a copy holding the new
    value, so every reader sees it.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name

    def __get__(self, obj: Optional[nn.Module], objtype: Optional[type] = None) -> Any:
        if obj is None:
            return self
        return getattr(_required_unit(obj).config, self.field)

    def __set__(self, obj: nn.Module, value: Any) -> None:
        unit = _required_unit(obj)
        unit.config = unit.config.replace(**{self.field: value})


class StateDictType(enum.Enum):
    """What ``state_dict()`` of an instance returns (and what its load hooks expect)."""

    FULL = enum.auto()  # the unwrapped module's keys and full shapes
    LOCAL = enum.auto()  # this rank's padded flat shards (``local_state_dict``)


# Non-empty while copy.deepcopy of an FSDP model runs (see :func:`keeping_process_groups`).
_KEEP_GROUPS: List[bool] = []


@contextlib.contextmanager
def keeping_process_groups() -> Iterator[None]:
    """Within: units pickle with their process groups (for ``copy.deepcopy``, whose memo holds the groups)."""
    _KEEP_GROUPS.append(True)
    try:
        yield
    finally:
        _KEEP_GROUPS.pop()


def process_groups_of(unit: "FSDPUnit") -> List[Any]:
    """The process groups ``unit``'s config refers to (what a deep copy must keep by reference)."""
    c = unit.config
    groups = (c.process_group, c.process_group_reduce_scatter, c.zero2_process_group, c.replicate_process_group)
    return [g for g in groups if g is not None and not isinstance(g, str)]


class FSDPUnit:
    """Runtime state of one FSDP instance.

    Args:
        owner: the front module (held weakly: the module owns the unit).
        config: the instance's resolved constructor arguments.
        handles: one handle per owned parameter (flat parameters first).
        param_name_groups: per owned parameter, the original names it holds.
        num_flatten_params: how many of ``handles`` are flat parameters of the FlattenParamsWrapper.
    """

    def __init__(
        self,
        owner: nn.Module,
        config: FSDPConfig,
        handles: List[FlatHandle],
        param_name_groups: List[List[str]],
        num_flatten_params: int,
    ) -> None:
        self._owner_ref: Callable[[], Optional[nn.Module]] = weakref.ref(owner)
        self.config = config
        self.handles = handles
        self.param_name_groups = param_name_groups
        self.num_flatten_params = num_flatten_params
        self._training_state = TrainingState.IDLE
        # Lazy init (first forward, state_dict, summon...): None before it, then whether this unit is its tree's root.
        self.is_root: Optional[bool] = None
        self.tree: Optional[TreeState] = None
        # False inside the root's no_sync(): gradients stay full-size and accumulate in p.grad, nothing is reduced.
        self.require_backward_grad_sync = True
        # A parent FSDP instance wraps this one (known at the parent's construction, before any lazy init).
        self.has_fsdp_parent = False
        # Activation checkpointing covers only part of this unit: its reduction waits for the end of backward.
        self.defer_post_backward = False
        # Forwards with autograd since the last end of backward whose graph is still alive, as their
        # PendingBackward tokens (a token dies with its forward's graph). Above one (the unit called twice in a
        # forward, a shared block), its gradient arrives in pieces (one per use in mixed precision and with
        # optimize_backward_concat): the reduction waits for the end of backward, once, over the whole gradient. A
        # count would also have kept a dropped forward (a grad-mode evaluation pass, a batch skipped after its
        # forward), deferring every unit's reduction of the next backward: no overlap, full gradients held.
        self.grad_forward_tokens: Optional["weakref.WeakSet[PendingBackward]"] = None
        # The autograd graph task of this unit's backward, and whether that task accumulates into the unit's
        # parameters itself (set at its pre-backward point). A parameter gradient that arrives in another task comes
        # from a nested backward (torch.utils.checkpoint with use_reentrant=True); when the outer task uses the
        # parameters too, the region covers only part of the unit, whose full parameters the outer backward still
        # reads.
        self.backward_task = -1
        self.outer_task_uses_params = False
        # The gradient accumulator nodes of the trainable parameters, made at the first backward (autograd nodes:
        # not copied or pickled).
        self.grad_accs: Optional[List[Any]] = None
        # Per forward whose backward may still run (its PendingBackward token, which dies with the forward's graph):
        # the accumulator nodes that forward's graph leads to, when they are not ``grad_accs``. Assigning
        # ``param.data`` a tensor of another dtype or device (mixed precision's compute copy, or a full parameter on
        # another device than the shard) makes autograd drop the parameter's accumulator, so each such forward
        # reaches the parameter through a node of its own; asked about ``grad_accs``, the engine would answer no.
        self.forward_grad_accs: Optional["weakref.WeakKeyDictionary[PendingBackward, List[Any]]"] = None
        # Whether every unit of the tree shares the root's process group (set on the root at lazy init).
        self.children_share_process_group = True
        # Parameters owned by a sibling instance found in this one's module, and ties FSDP cannot honour
        # (see ties.py); both raise at the first forward unless declared with append_shared_param.
        self.foreign_params: List[Tuple[str, nn.Parameter]] = []
        self.tie_problems: List[str] = []
        self.has_shared_params = False
        # The root's first forward checked the zero2 settings of the tree (collective; see runtime.py).
        self.zero2_checked = False
        # Checkpoint identity (see identity.py): a token all ranks agreed on, and the synchronizing backward count.
        self.ckpt_token: Optional[str] = None
        self.ckpt_step = 0
        self.state_dict_type = StateDictType.FULL
        # A plain parent module loading a full dict into this instance: the contexts the pre-load hook opened, (lazy
        # init and snapshot, summon), closed by the post-load hook (see state_dict.py).
        self.pending_load_summon: Optional[Tuple[Any, Any]] = None
        # A load in progress: torch's error list and its length when this instance's entries started loading, so
        # that the post-load hook can name the user's keys in the errors its subtree added (see state_dict.py).
        self.pending_load_errors: Optional[Tuple[List[str], int]] = None
        # Inside summon_full_params: whether that summon discards edits on exit (volatile=True).
        self.summon_volatile = False

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> Any:
        state = dict(self.__dict__)
        state["_owner_ref"] = None  # the front re-links its unit (a weak reference cannot be pickled)
        # An in-process deep copy (copy.deepcopy of the model, e.g. an EMA copy) keeps the process groups: the copy
        # lives on the same ranks. A pickle crosses processes, where the groups mean nothing.
        state["config"] = self.config if _KEEP_GROUPS else self.config.without_groups()
        state["tree"] = None
        state["is_root"] = None
        state["grad_accs"] = None
        state["forward_grad_accs"] = None
        state["grad_forward_tokens"] = None
        return state

    def live_grad_forwards(self) -> int:
        """Forwards with autograd whose backward may still reach this unit (see ``grad_forward_tokens``)."""
        return len(self.grad_forward_tokens) if self.grad_forward_tokens is not None else 0

    def forget_finished_forwards(self) -> None:
        """End of a backward: forget the uses by forwards a backward reached, and by older ones (outputs no backward
        needed: a logging forward before the training one). A newer forward still waits for its backward (several
        forwards before their backwards: micro-batches under ``no_sync()``): its uses stay counted, so that backward
        still sees every use of the unit. Forgetting them too made a unit used twice by that forward reduce-scatter
        its gradient once per use (mixed precision, ``optimize_backward_concat``: the gradient arrives in pieces).
        Nothing else is kept for it: its backward gathers the parameters again, as after any backward (full
        parameters kept over an optimizer step were stale where the step wrote through ``p.data``; a review)."""
        tokens = self.grad_forward_tokens
        if tokens and self.tree is not None:
            newest_reached = self.tree.newest_reached
            for t in list(tokens):
                if t.done or t.forward <= newest_reached:
                    tokens.discard(t)

    def relink(self, owner: nn.Module) -> None:
        """Attach to ``owner`` after unpickling or copying."""
        self._owner_ref = weakref.ref(owner)

    # ------------------------------------------------------------------ identity and tree
    @property
    def alive(self) -> bool:
        """Whether the module of this unit still exists (its graph may outlive it: a loss kept after the model was
        replaced holds the unit through its hooks)."""
        return self._owner_ref is not None and self._owner_ref() is not None

    @property
    def owner(self) -> nn.Module:
        owner = self._owner_ref() if self._owner_ref is not None else None
        if owner is None:
            raise RuntimeError("FullyShardedDataParallel: the module of this FSDP unit no longer exists")
        return owner

    @property
    def wrapped(self) -> Any:
        """The FlattenParamsWrapper around the user's module."""
        # A submodule: read from _modules directly (nn.Module's __getattr__, which finds it there, is Python code
        # run on every forward of every unit).
        owner = self.owner
        found = owner._modules.get("_fsdp_wrapped_module")
        return found if found is not None else owner._fsdp_wrapped_module

    @property
    def name(self) -> str:
        return type(self.owner).__name__

    @property
    def params(self) -> List[nn.Parameter]:
        return [h.param for h in self.handles]

    def tree_units(self) -> List["FSDPUnit"]:
        """This unit and every unit below it, in ``modules()`` order (pre-order)."""
        # The walk of modules(), without its generators and names: the root's forward and the end of backward list
        # the units of the tree every step, and the tree has a few modules per unit.
        out: List["FSDPUnit"] = []
        seen = set()
        stack: List[Optional[nn.Module]] = [self.owner]
        while stack:
            m = stack.pop()
            # A module registered twice counts once, at its first place (as modules() does).
            if m is None or id(m) in seen:
                continue
            seen.add(id(m))
            unit = m.__dict__.get(UNIT_ATTR)
            if isinstance(unit, FSDPUnit):
                out.append(unit)
            stack.extend(reversed(m._modules.values()))  # None entries (registered as None) are skipped below
        return out

    def qualified_name(self, name: str) -> str:
        """``name`` (a flat parameter's) prefixed by this unit's path in its tree, for messages (a walk: not per step).

        Every instance names its first flat parameter ``flat_param_0``; alone the name does not say which one.
        """
        root = self.tree.root() if self.tree is not None and self.tree.root is not None else None
        for path, u in (root.named_units() if isinstance(root, FSDPUnit) else []):
            if u is self:
                return clean_path(f"{path}.{name}")
        return name

    def named_units(self) -> List[Tuple[str, "FSDPUnit"]]:
        """``(path, unit)`` for this unit and every unit below it; paths as ``named_modules()`` gives them."""
        out = []
        for path, m in self.owner.named_modules():
            u = unit_of(m)
            if u is not None:
                out.append((path, u))
        return out

    def owned_modules(self) -> List[nn.Module]:
        """Modules whose buffers belong to this unit: its subtree without nested FSDP subtrees."""
        out: List[nn.Module] = []
        stack: List[nn.Module] = [self.owner]
        while stack:
            m = stack.pop()
            out.append(m)
            stack.extend(child for child in m.children() if unit_of(child) is None)
        return out

    def iter_materialized(self) -> Iterator[FlatHandle]:
        return (h for h in self.handles if h.materialized)

    @property
    def device(self) -> DeviceHandle:
        return DeviceHandle.for_device(self.config.compute_device)

    # ------------------------------------------------------------------ derived settings
    @property
    def reshard_after_forward(self) -> bool:
        """The effective setting: the root never reshards with ``disable_reshard_on_root`` (its backward is next)."""
        c = self.config
        return c.reshard_after_forward and not (self.is_root is True and c.disable_reshard_on_root)

    def has_inner_checkpoint_regions(self) -> bool:
        """Whether activation checkpointing covers only part of this unit.

        Each checkpointed region recomputes inside its own nested backward, so the unit's parameter gradients then
        arrive in several pieces; the full parameters must stay until the whole backward is done, and the gradient
        is reduced once in the final callback. (A checkpoint around the whole unit is a single region: no deferral.)
        """
        whole_unit = getattr(self.wrapped, "module", None)
        return any(
            isinstance(m.__dict__.get("forward"), _CheckpointedForward)
            for m in self.owned_modules()
            if m is not whole_unit
        )

    def checkpoint_identity(self) -> Any:
        """The identity of a sharded checkpoint taken from this unit now (see :mod:`.identity`)."""
        c = self.config
        return identity.make_identity(
            self.ckpt_token, self.ckpt_step, c.rank, c.world_size, c.replicate_rank, c.replicate_size
        )

    # ------------------------------------------------------------------ training state
    @property
    def training_state(self) -> TrainingState:
        return self._training_state

    def transition(self, new: TrainingState) -> None:
        """Change the training state; raises on a transition the lifecycle never makes (see state.py)."""
        if new not in _TRAINING_LEGAL[self._training_state]:
            check_training_transition(self._training_state, new, self.name)  # raises, naming the instance
        self._training_state = new

    def assert_state(self, states: List[TrainingState]) -> None:
        """Raise ``ValueError`` unless the unit is in one of ``states`` (upstream's ``assert_state``)."""
        if self._training_state not in states:
            raise ValueError(
                f"expected FSDP training state to be one of {[s.name for s in states]}, "
                f"but it is {self._training_state.name}"
            )

    def assert_idle_tree(self, what: str) -> None:
        """Raise unless every unit of the tree is idle (``what`` names the refused call)."""
        for u in self.tree_units():
            if u.training_state != TrainingState.IDLE:
                raise FairscaleRuntimeError(f"{what} needs every FSDP instance idle; one is in {u.training_state.name}")

    @property
    def pre_backward_ran(self) -> bool:
        """Whether this unit's pre-backward point ran in the current backward."""
        return self._training_state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)

    # ------------------------------------------------------------------ gathering
    def rebuild_full_params(self, phase: str) -> None:
        """Bring every owned handle to FULL (from its shard, or its zero2 slice over the zero2 group)."""
        todo = [h for h in self.handles if h.state is not HandleState.FULL]
        if not todo:
            return
        tree = self.tree
        assert tree is not None
        if not tree.device.is_accelerator:
            # CPU: streams are inert (kernels run in program order), so the same gathers without the stream calls
            # below, which cost a dozen Python calls per unit and do nothing here.
            with collectives.collective_phase(phase):
                for h in todo:
                    self.gather_one(h)
            return
        current = tree.device.current_stream()
        # The gathers write memory of the all-gather stream's pool that the compute stream may still read (a freed
        # full buffer): waiting here orders them after those reads (why FlatHandle needs no record_stream).
        tree.all_gather_stream.wait_stream(current)
        with collectives.collective_phase(phase), tree.device.stream(tree.all_gather_stream):
            for h in todo:
                self.gather_one(h)
        current.wait_stream(tree.all_gather_stream)

    def gather_one(self, h: FlatHandle, async_op: bool = False) -> None:
        """Gather ``h`` into its full buffer; with ``async_op`` (prefetch) the handle keeps the work in flight."""
        if h.full_padded is None:  # no buffer of its own: the full parameter is the shard itself
            h.set_state(HandleState.FULL)
            return
        out = h.alloc_full()
        source, from_zero2_slice = h.take_gather_source()
        work: Optional[collectives.WorkHandle] = None
        if from_zero2_slice:
            work = collectives.all_gather_into_flat(out, source, self.config.zero2_process_group, async_op=async_op)
        elif h.is_sharded:
            work = collectives.all_gather_into_flat(out, source, self.config.process_group, async_op=async_op)
        else:
            out.copy_(source.reshape(-1))
        h.mark_gathered(work, source)

    def drop_stale_full_params(self) -> None:
        """A new forward must not reuse gathered params (or zero2 slices) whose fp32 shard changed since the gather
        (optimizer step or summon write-back after a forward whose backward never ran)."""
        for h in self.handles:
            if h.state != HandleState.SHARDED and h.has_full_buffer and h.gathered_version != h.shard_version():
                h.free_full()
                h.drop_zero2_slice()

    def use_full_params(self) -> None:
        for h in self.handles:
            h.use_full()

    def use_fp32_shards(self) -> None:
        for h in self.handles:
            h.use_shard()

    def reshard(self, after_forward: bool) -> None:
        """Free full params; after a forward with a zero2 group keep this rank's zero2 slice instead."""
        keep_slice = after_forward and self.config.zero2_process_group is not None
        for h in self.handles:
            if h.state != HandleState.FULL:
                continue
            if keep_slice and h.is_sharded:
                h.keep_zero2_slice(self.config.zero2_rank, self.config.zero2_size)
            else:
                h.free_full()

    def release_all(self) -> None:
        """Every handle back to its fp32 shard alone (no full buffer, no zero2 slice)."""
        for h in self.iter_materialized():
            h.free_full()
            h.drop_zero2_slice()
            h.use_shard()

    # ------------------------------------------------------------------ memory
    @torch.no_grad()
    def cast_buffers(self, casts: Optional[Dict[int, Tuple[Tensor, Tensor]]] = None) -> None:
        """Buffers of this unit's own modules to the compute device, floating ones in ``buffer_dtype``.

        ``casts`` (id of a buffer -> (the buffer, its cast)), shared by the units of a tree, casts a buffer that
        several modules register once: each registration got a copy of its own before, and an in-place update
        through one module (a running statistic) no longer reached the others.
        """
        c = self.config
        casts = {} if casts is None else casts
        for owned in self.owned_modules():
            for name, buf in list(owned.named_buffers(recurse=False)):
                if buf is None:
                    continue
                dtype = c.buffer_dtype if buf.is_floating_point() else buf.dtype
                if buf.device != c.compute_device or buf.dtype != dtype:
                    if id(buf) not in casts:  # the buffer is kept in the entry, so its id is not reused meanwhile
                        casts[id(buf)] = (buf, buf.to(device=c.compute_device, dtype=dtype))
                    setattr(owned, name, casts[id(buf)][1])
