# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Full and local (sharded) state dicts of FullyShardedDataParallel, in upstream's formats.

Key rewriting: every FSDP instance strips ``_fsdp_wrapped_module.`` after ``state_dict`` and adds it back before
loading; FlattenParamsWrapper does the same with ``_fpw_module.``. So the keys are exactly the unwrapped module's.

Loading is all-or-nothing, and collective: the fp32 shards and buffers are snapshotted first, every rank loads, and
the ranks agree (:mod:`.loads`); if the load failed on any rank, every rank restores its snapshot and raises the same
error, so a wrong key, shape or world size on one rank never leaves a half-loaded model or ranks that differ.
"""

import contextlib
from typing import Any, Dict, Generator, Iterator, List, Mapping, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.internal.module_hooks import register_state_dict_hooks
from fairscale.internal.state_dict import replace_by_prefix_
from fairscale.nn.misc._flatten.state_dict_hooks import fpw_pre_load_hook_disabled

from . import failed_load, identity, loads, own_buffers, recovery
from .handle import FlatHandle
from .naming import clean_text
from .param_hooks import take_pending_data
from .runtime import lazy_init_for_call
from .state import TrainingState
from .summon import summon_full_params
from .unit import FSDPUnit, StateDictType, unit_of

_PRE_LOAD_HOOK_ENABLED = [True]


@contextlib.contextmanager
def no_pre_load_state_dict_hook() -> Iterator[None]:
    """Disable the prefix-adding load hooks of FSDP *and* FlattenParamsWrapper (for dicts with raw paths)."""
    _PRE_LOAD_HOOK_ENABLED[0] = False
    try:
        with fpw_pre_load_hook_disabled():
            yield
    finally:
        _PRE_LOAD_HOOK_ENABLED[0] = True


def register_hooks(module: nn.Module) -> None:
    """Put the key-rewriting state-dict hooks on an FSDP front module."""
    register_state_dict_hooks(module, _post_state_dict_hook, _pre_load_state_dict_hook, _post_load_state_dict_hook)


def _unit(module: nn.Module) -> FSDPUnit:
    unit = unit_of(module)
    if unit is None:
        raise RuntimeError("fairscale internal error: an FSDP state-dict hook ran on a module without an FSDP unit")
    return unit


def _post_state_dict_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> Any:
    unit = _unit(module)
    full = unit.state_dict_type == StateDictType.FULL
    # Only full state dicts are rank-0 only: a sharded (local) checkpoint needs every rank's shard.
    if unit.config.state_dict_on_rank_0_only and full and dist.get_rank() != 0:
        # This instance's entries only: under a plain parent module the dict is the parent's too, and clearing it
        # dropped the entries written before this instance and kept those after (found by a fuzz, session 43).
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
        return state_dict
    device = unit.config.state_dict_device
    in_summon = unit.training_state == TrainingState.SUMMON_FULL_PARAMS
    for key in list(state_dict.keys()):
        if not key.startswith(prefix):
            continue
        value = state_dict[key]
        if not isinstance(value, Tensor) or getattr(value, "_has_been_cloned", False):
            continue
        if value.device.type != device.type:
            value = value.to(device)
        elif in_summon:
            value = value.clone()
        else:
            value = value.detach()
        value._has_been_cloned = True  # type: ignore[attr-defined]
        state_dict[key] = value
    replace_by_prefix_(state_dict, prefix + "_fsdp_wrapped_module.", prefix)
    return state_dict


def _pre_load_state_dict_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Add ``_fsdp_wrapped_module.`` to this instance's keys; when a plain parent module loads a full dict into this
    instance, summon its full parameters first (released by :func:`_post_load_state_dict_hook`)."""
    unit = _unit(module)
    # Still open: the previous parent load raised inside this instance (torch skipped the post hook).
    failed_load.undo_own(unit)
    error_msgs = args[-1] if args and isinstance(args[-1], list) else None
    unit.pending_load_errors = None if error_msgs is None else (error_msgs, len(error_msgs))
    # As the other calls between steps: a backward that raised leaves units in a backward state (on some ranks only,
    # possibly), which skipped the agreed check below on those ranks while the others waited in it.
    recovery.recover_between_steps(unit)
    if unit.state_dict_type == StateDictType.FULL and unit.training_state == TrainingState.IDLE:
        _check_loadable(unit, "load_state_dict")
        with contextlib.ExitStack() as outer:
            # Closed by the post-load hook, outer last: the snapshot restores what the summon wrote back if the
            # ranks did not load the same values, then lazy init is undone if the load did it.
            outer.enter_context(lazy_init_for_call(unit))
            outer.enter_context(_restore_on_failure(unit))
            with contextlib.ExitStack() as inner:
                inner.enter_context(summon_full_params(unit, recurse=True, volatile=False))
                failed_load.opened(unit, (outer.pop_all(), inner.pop_all()))
    if _PRE_LOAD_HOOK_ENABLED[0]:
        # The instance's own buffers stay at its prefix: its own _load_from_state_dict loads them, as torch's does.
        own = {k: state_dict.pop(k) for k in own_buffers.own_buffer_keys(module, prefix) if k in state_dict}
        replace_by_prefix_(state_dict, prefix, prefix + "_fsdp_wrapped_module.")
        state_dict.update(own)


def _post_load_state_dict_hook(module: nn.Module, incompatible_keys: Any) -> None:
    """Write the loaded full parameters back into the shards, and report the user's key names."""
    unit = _unit(module)
    errors, unit.pending_load_errors = unit.pending_load_errors, None
    if errors is not None:
        # torch words a wrong shape with the path it loaded into (`b._fsdp_wrapped_module._fpw_module.weight`):
        # name the key of the user's dict instead, as the missing and unexpected keys below are.
        error_msgs, start = errors
        error_msgs[start:] = [clean_text(m) for m in error_msgs[start:]]
    pending = failed_load.take(unit)
    if pending is not None:
        outer, inner = pending
        with outer:
            try:
                fingerprints = loads.parameter_fingerprints(unit)  # inside the summon: what this rank loaded
            finally:
                inner.close()  # writes the loaded full parameters back into the shards
            loads.check_loaded_same_values(unit, "load_state_dict", fingerprints)
    incompatible_keys.missing_keys[:] = [clean_text(k) for k in incompatible_keys.missing_keys]
    incompatible_keys.unexpected_keys[:] = [clean_text(k) for k in incompatible_keys.unexpected_keys]


# ---------------------------------------------------------------------------------------------------- saving


def state_dict(unit: FSDPUnit, *args: Any, **kwargs: Any) -> Any:
    """See :meth:`FullyShardedDataParallel.state_dict` (and :func:`local_state_dict` for the local type)."""
    unit.device.synchronize()
    with lazy_init_for_call(unit):
        if unit.state_dict_type == StateDictType.FULL:
            summon_ctx: Any = (
                contextlib.nullcontext()
                if unit.training_state == TrainingState.SUMMON_FULL_PARAMS
                else summon_full_params(unit, recurse=False, volatile=True)
            )
            with summon_ctx, _buffers_in_fp32(unit):
                sd = nn.Module.state_dict(unit.owner, *args, **kwargs)
        else:
            # fp32 buffers in the local format too, as upstream (they were in the compute dtype, and
            # consolidate_shard_weights wrote fp16 buffers into the full dict; found by a fuzz, session 43).
            with _buffers_in_fp32(unit):
                sd = nn.Module.state_dict(unit.owner, *args, **kwargs)
    if unit.config.move_params_to_cpu:
        for k, v in sd.items():
            if isinstance(v, Tensor) and v.device.type != "cpu":
                sd[k] = v.cpu()
    return sd


def local_state_dict(unit: FSDPUnit, *args: Any, **kwargs: Any) -> Dict[str, Any]:
    """See :meth:`FullyShardedDataParallel.local_state_dict`."""
    if unit.training_state == TrainingState.SUMMON_FULL_PARAMS:
        raise RuntimeError("local_state_dict() cannot be called inside summon_full_params()")
    # FSDP's own state_dict, not the module's method: a subclass whose state_dict calls local_state_dict would
    # otherwise recurse. A pending p.data = first: _shards_as_data hides it (its values were saved stale).
    take_pending_data(unit)
    with _local_mode(unit), _shards_as_data(unit):
        sd: Dict[str, Any] = state_dict(unit, *args, **kwargs)
    identity.attach_to_weights(sd, unit.checkpoint_identity())
    return sd


# ---------------------------------------------------------------------------------------------------- loading


def load_state_dict(unit: FSDPUnit, sd: Mapping[str, Any], strict: bool) -> Any:
    """See :meth:`FullyShardedDataParallel.load_state_dict`."""
    if _inside_own_summon(unit):
        # `with m.summon_full_params(): m.load_state_dict(sd)` (fairseq's wav2vec2 loads its FSDP layers so, one at a
        # time): the load writes the summoned full parameters, which the summon writes back into the shards on exit.
        # Undone on failure: those parameters are what the summon writes back. The ranks compare what they loaded,
        # as outside a summon: each writes back its own slice, and a different dict on one rank left the model part
        # one dict, part the other, silently.
        summoned_prints: List[Tuple[str, int]] = []

        def load_summoned() -> Any:
            result = _load_with_clean_errors(unit, sd, strict, full=True)
            summoned_prints[:] = loads.parameter_fingerprints(unit)
            return result

        return loads.load_collectively(
            unit, "load_state_dict", load_summoned, None, _restore_summoned_on_failure, summoned_prints
        )
    _check_loadable(unit, "load_state_dict")
    if unit.state_dict_type == StateDictType.LOCAL:
        return _load_local(unit, sd, strict)

    fingerprints: List[Tuple[str, int]] = []

    def load() -> Any:
        with summon_full_params(unit, recurse=True, volatile=False):
            result = _load_with_clean_errors(unit, sd, strict, full=True)
            fingerprints[:] = loads.parameter_fingerprints(unit)
            return result

    with lazy_init_for_call(unit):
        return loads.load_collectively(unit, "load_state_dict", load, None, _restore_on_failure, fingerprints)


def load_local_state_dict(unit: FSDPUnit, sd: Mapping[str, Any], strict: bool) -> Any:
    """See :meth:`FullyShardedDataParallel.load_local_state_dict`."""
    _check_loadable(unit, "load_local_state_dict")
    return _load_local(unit, sd, strict)


def _load_local(unit: FSDPUnit, sd: Mapping[str, Any], strict: bool) -> Any:
    with lazy_init_for_call(unit):
        unit.device.synchronize()
        loaded = identity.of_weights(sd)

        def load() -> Any:
            with _local_mode(unit):
                _check_local_shapes(unit, sd)  # first: its message names the mismatching shards
                identity.check_loadable_here(loaded, unit.config.rank, unit.config.world_size)
                return _load_with_clean_errors(unit, sd, strict)

        try:
            return loads.load_collectively(unit, "load_local_state_dict", load, loaded, _restore_on_failure)
        finally:
            for u in unit.tree_units():
                for h in u.handles:
                    h.free_full()  # gathered copies are stale now
                    h.drop_zero2_slice()


def _load_with_clean_errors(unit: FSDPUnit, sd: Mapping[str, Any], strict: bool, full: bool = False) -> Any:
    """Load through the wrapper; errors and missing/unexpected keys use the user's keys, not internal paths.

    A full dict's keys are the module's own names: one that names FSDP's wrappers (``0._fsdp_wrapped_module.weight``)
    never loads, and was reported cleaned, as "missing 0.weight" and "unexpected 0.weight" at once. It is named as
    written: refused first when ``strict``, an unexpected key otherwise.
    """
    # Inside no_pre_load_state_dict_hook() the keys are raw paths by design.
    raw_expected = not _PRE_LOAD_HOOK_ENABLED[0]
    internal = [k for k in sd if isinstance(k, str) and clean_text(k) != k] if full and not raw_expected else []
    if internal and strict:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {unit.name}: the keys {internal[:3]}"
            f"{' ...' if len(internal) > 3 else ''} name FullyShardedDataParallel's internal wrappers "
            "('_fsdp_wrapped_module.', '_fpw_module.'); a full state dict uses the module's own names, as state_dict() "
            "writes them: drop those components from the keys (or load a dict of raw paths inside "
            "no_pre_load_state_dict_hook()).\nThe model was left unchanged."
        )
    rest, own = own_buffers.split_own_buffers(unit.owner, sd)  # the root loads through the wrapped module only
    try:
        # No dry run of the wrapper's: a failed load is undone by _restore_on_failure, on every rank.
        result = unit.wrapped._load_state_dict(rest, strict, False, checked=False)
    except RuntimeError as e:
        message = clean_text(str(e)).replace("FlattenParamsWrapper", unit.name)
        raise RuntimeError(message + "\nThe model was left unchanged.") from e
    missing: List[str] = []
    errors: List[str] = []
    own_buffers.load_own_buffers(unit.owner, own, missing, errors)
    if strict and missing:
        errors.insert(0, f"Missing key(s) in state_dict: {', '.join(repr(k) for k in missing)}.")
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {unit.name}:\n\t"
            + "\n\t".join(errors)
            + "\nThe model was left unchanged."
        )
    result.missing_keys.extend(missing)
    result.missing_keys[:] = [clean_text(k) for k in result.missing_keys]
    result.unexpected_keys[:] = [clean_text(k) for k in result.unexpected_keys]
    if internal:
        cleaned = {clean_text(k) for k in internal}
        result.unexpected_keys[:] = [k for k in result.unexpected_keys if k not in cleaned] + internal
    return result


def _inside_own_summon(unit: FSDPUnit) -> bool:
    """Whether a full load may go into the full parameters of an enclosing ``summon_full_params()`` (upstream's way).

    Raises:
        RuntimeError: inside a summon that would discard the load (``volatile=True``), one that left units of the
            tree out (``recurse=False``), a local (sharded) load, or between a forward and its backward.
    """
    units = unit.tree_units()
    if unit.training_state != TrainingState.SUMMON_FULL_PARAMS:
        return False
    problem = None
    if any(u.training_state != TrainingState.SUMMON_FULL_PARAMS for u in units):
        problem = "an instance inside it is not summoned (summon_full_params(recurse=False)); use recurse=True"
    elif any(u.summon_volatile for u in units):
        problem = "the summon is volatile, so the loaded values would be discarded on exit; use volatile=False"
    elif unit.state_dict_type != StateDictType.FULL:
        problem = "a local (sharded) state dict loads into the shards, not into summoned parameters; load it outside"
    elif unit.tree is not None and unit.tree.backward_pending:
        problem = "a backward is pending, which would use weights that no longer exist; run it first"

    def refuse() -> None:
        if problem is not None:
            raise RuntimeError(
                f"load_state_dict() inside summon_full_params(): {problem}. The model was left unchanged."
            )

    # Agreed: a backward pending on one rank only refused there while the others waited in the load's gather.
    loads.agree_before_load(unit, "load_state_dict() inside summon_full_params()", refuse)
    return True


@contextlib.contextmanager
def _restore_summoned_on_failure(unit: FSDPUnit) -> Generator[None, None, None]:
    """:func:`_restore_on_failure` inside a summon: the summoned parameters (written back on exit) and buffers."""
    tensors = [t for m in unit.owner.modules() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    saved = [(t, t.detach().clone()) for t in tensors if t is not None]
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for t, copy in saved:
                t.copy_(copy)
        raise


def _check_loadable(unit: FSDPUnit, what: str) -> None:
    """Refuse a load in the wrong state, on every rank of the load's group if on any (before any collective).

    A backward that raised is recovered from first, as by the other calls between steps (its units were left in a
    backward state: the load was refused until the next forward)."""
    recovery.recover_between_steps(unit)
    loads.agree_before_load(unit, what, lambda: _check_loadable_here(unit, what))


def _check_loadable_here(unit: FSDPUnit, what: str) -> None:
    for u in unit.tree_units():
        if u.training_state != TrainingState.IDLE:
            raise RuntimeError(f"{what}() needs every FSDP instance idle; one is in {u.training_state.name}")
    tree = unit.tree
    if tree is not None and tree.backward_pending:
        raise RuntimeError(
            f"{what}() called between a forward and its backward: the pending backward would use weights that no "
            "longer exist. Run the backward first (or do the forward under torch.no_grad()), then load; a forward "
            "whose outputs are still referenced counts as pending (after a backward that raised before reaching "
            "FSDP, drop its loss: del loss)."
        )


@contextlib.contextmanager
def _local_mode(unit: FSDPUnit) -> Generator[None, None, None]:
    """Switch every unit to local (sharded) state dicts, and every FPW to its flat form."""
    saved: List[Tuple[FSDPUnit, StateDictType, bool]] = []
    for u in unit.tree_units():
        fpw = u.wrapped
        saved.append((u, u.state_dict_type, fpw._auto_unflatten_state_dict))
        u.state_dict_type = StateDictType.LOCAL
        fpw._auto_unflatten_state_dict = False
    try:
        yield
    finally:
        for u, kind, auto in saved:
            u.state_dict_type = kind
            u.wrapped._auto_unflatten_state_dict = auto


@contextlib.contextmanager
def _shards_as_data(unit: FSDPUnit) -> Generator[None, None, None]:
    """Point every param at its fp32 shard for the duration (inside a forward p.data is the gathered param)."""
    saved = [(h, h.param.data) for u in unit.tree_units() for h in u.handles if h.fp32_shard is not None]
    for h, _ in saved:
        h.use_shard()
    try:
        yield
    finally:
        for h, data in saved:
            h.param.data = data


@contextlib.contextmanager
def _buffers_in_fp32(unit: FSDPUnit) -> Generator[None, None, None]:
    """State dicts carry fp32 buffers in mixed precision; cast this unit's buffers and restore afterwards."""
    if not unit.config.mixed_precision:
        yield
        return
    # The buffers themselves are put back afterwards: casting the fp32 copies back rounded fp64 buffers through fp32
    # (1e300 became inf in the live model), and gave each registration of a shared buffer a copy of its own.
    changed: List[Tuple[nn.Module, str, Tensor]] = []
    fp32: Dict[int, Tensor] = {}
    for owned in unit.owned_modules():
        for name, buf in list(owned.named_buffers(recurse=False)):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                changed.append((owned, name, buf))
                if id(buf) not in fp32:
                    fp32[id(buf)] = buf.to(torch.float32)
                setattr(owned, name, fp32[id(buf)])
    try:
        yield
    finally:
        for owned, name, original in changed:
            setattr(owned, name, original)


@contextlib.contextmanager
def _restore_on_failure(unit: FSDPUnit) -> Generator[None, None, None]:
    """Snapshot shards and buffers; put them back if the body raises (a failed load loses no data).

    Looked up again on restore: before the first forward the nested units are not materialized yet (the load's
    summon does it, and may move a shard to the compute device or pin it), and lazy init may re-cast buffers.
    """
    shards = [(h, _shard_of(h).detach().clone()) for u in unit.tree_units() for h in u.handles if not h.borrowed]
    buffers = [
        (m, name, b.detach().clone()) for m in unit.owner.modules() for name, b in m.named_buffers(recurse=False)
    ]
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for h, copy in shards:
                _shard_of(h).copy_(copy)
            for m, name, copy in buffers:
                getattr(m, name).copy_(copy)
        raise


def _shard_of(h: FlatHandle) -> Tensor:
    """A handle's fp32 shard; before materialization the parameter's data is that shard."""
    return h.fp32_shard if h.fp32_shard is not None else h.param.data


def _check_local_shapes(unit: FSDPUnit, sd: Mapping[str, Any]) -> None:
    """A local dict from another world size has other shard sizes: say so before touching anything."""
    expected = local_state_dict(unit)
    bad = []
    for key, value in sd.items():
        if key in expected and isinstance(value, Tensor) and value.shape != expected[key].shape:
            bad.append(f"{key}: got {tuple(value.shape)}, expected {tuple(expected[key].shape)}")
    if bad:
        raise RuntimeError(
            "load_local_state_dict: shard shapes do not match this model (saved at another world size or from "
            "another model?). Use a full state dict or consolidate_shard_weights to change world size.\n  "
            + "\n  ".join(bad)
        )
