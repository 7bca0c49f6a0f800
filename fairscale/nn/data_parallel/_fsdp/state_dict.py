# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Full and local (sharded) state dicts of FullyShardedDataParallel, in upstream's formats (spec 2.1-2.4).

Key rewriting: every FSDP instance strips ``_fsdp_wrapped_module.`` after ``state_dict`` and adds it back before
loading; FlattenParamsWrapper does the same with ``_fpw_module.``. So the keys are exactly the unwrapped module's.

Loading is all-or-nothing, and collective: the fp32 shards and buffers are snapshotted first, every rank loads, and
the ranks agree (:mod:`.loads`); if the load failed on any rank, every rank restores its snapshot and raises the same
error, so a wrong key, shape or world size on one rank never leaves a half-loaded model or ranks that differ.
"""

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Generator, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal.state_dict import replace_by_prefix_
from fairscale.nn.misc._flatten.state_dict_hooks import fpw_pre_load_hook_disabled

from . import identity, loads
from .state import TrainingState

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import FSDPRuntime

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


def _post_state_dict_hook(module: "FSDPRuntime", state_dict: Dict[str, Any], prefix: str, *args: Any) -> Any:
    import torch.distributed as dist

    # Only full state dicts are rank-0 only: a sharded (local) checkpoint needs every rank's shard.
    if module.state_dict_on_rank_0_only and module._return_full_state_dict and dist.get_rank() != 0:
        state_dict.clear()
        return state_dict
    device = module.state_dict_device
    in_summon = module.training_state == TrainingState.SUMMON_FULL_PARAMS
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


def _pre_load_state_dict_hook(module: Any, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Add ``_fsdp_wrapped_module.`` to this instance's keys; when a plain parent module loads a full dict into this
    instance, summon its full parameters first (released by :func:`_post_load_state_dict_hook`)."""
    if module._return_full_state_dict and module.training_state == TrainingState.IDLE:
        _check_loadable(module, "load_state_dict")
        stack = contextlib.ExitStack()
        module._load_summon = (stack, module._is_root is None)
        stack.enter_context(module.summon_full_params(recurse=True, volatile=False))
    if _PRE_LOAD_HOOK_ENABLED[0]:
        replace_by_prefix_(state_dict, prefix, prefix + "_fsdp_wrapped_module.")


def _post_load_state_dict_hook(module: Any, incompatible_keys: Any) -> None:
    """Write the loaded full parameters back into the shards, and report the user's key names."""
    pending = module.__dict__.pop("_load_summon", None)
    if pending is not None:
        stack, was_uninitialized = pending
        stack.close()
        if was_uninitialized and module._is_root:
            for m in module._fsdp_instances():
                m._reset_lazy_init()
    incompatible_keys.missing_keys[:] = [_clean_keys(k) for k in incompatible_keys.missing_keys]
    incompatible_keys.unexpected_keys[:] = [_clean_keys(k) for k in incompatible_keys.unexpected_keys]


class StateDictMixin:
    """state_dict / local_state_dict / load_* for :class:`FullyShardedDataParallel`."""

    def _register_state_dict_hooks(self: Any) -> None:
        self._register_state_dict_hook(_post_state_dict_hook)
        self._register_load_state_dict_pre_hook(_pre_load_state_dict_hook, with_module=True)
        self.register_load_state_dict_post_hook(_post_load_state_dict_hook)

    # ------------------------------------------------------------------ saving
    def state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        """The full (unsharded) state dict: the unwrapped module's keys, fp32 values. Collective: call on all ranks.

        Safe at any point of a step, including between a forward and its backward.
        """
        self._device.synchronize()
        uninitialized = self._is_root is None
        self._lazy_init()
        try:
            if self._return_full_state_dict:
                summon_ctx: Any = (
                    contextlib.nullcontext()
                    if self.training_state == TrainingState.SUMMON_FULL_PARAMS
                    else self.summon_full_params(recurse=False, volatile=True)
                )
                with summon_ctx, _buffers_in_fp32(self):
                    sd = nn.Module.state_dict(self, *args, **kwargs)
            else:
                sd = nn.Module.state_dict(self, *args, **kwargs)
        finally:
            if uninitialized and self._is_root:
                for m in self._fsdp_instances():
                    m._reset_lazy_init()
        if self.move_params_to_cpu:
            for k, v in sd.items():
                if isinstance(v, Tensor) and v.device.type != "cpu":
                    sd[k] = v.cpu()
        return sd

    def local_state_dict(self: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """This rank's shards: ``[path.]flat_param_0`` padded 1-D shards, buffers with their clean names.

        The dict's ``_metadata`` table records the checkpoint identity (id, rank, world size, step) that
        :meth:`local_metadata_dict` also reports; consolidation and :meth:`load_local_state_dict` check it.
        """
        if self.training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError("local_state_dict() cannot be called inside summon_full_params()")
        with _local_mode(self), _shards_as_data(self):
            sd = self.__class__._fsdp_state_dict(self, *args, **kwargs)
        identity.attach_to_weights(sd, self._checkpoint_identity())
        return sd

    @staticmethod
    def _fsdp_state_dict(module: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        # Always FSDP's own state_dict, so a subclass whose state_dict calls local_state_dict does not recurse.
        return StateDictMixin.state_dict(module, *args, **kwargs)

    # ------------------------------------------------------------------ loading
    def load_state_dict(self: Any, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (the unwrapped module's keys). Collective: call it on every rank. All-or-nothing.

        Either every rank loads, or every rank raises the same error and leaves the model unchanged (one small
        ``all_gather_object`` decides).

        Raises:
            RuntimeError: when called between a forward and its backward, or when keys/shapes do not match (the
                model is then left exactly as it was).
        """
        _check_loadable(self, "load_state_dict")
        if not self._return_full_state_dict:
            return self._load_local(state_dict, strict)
        uninitialized = self._is_root is None
        self._lazy_init()

        def load() -> Any:
            with self.summon_full_params(recurse=True, volatile=False):
                return _load_with_clean_errors(self, state_dict, strict)

        try:
            return loads.load_collectively(self, "load_state_dict", load, None, _restore_on_failure)
        finally:
            if uninitialized and self._is_root:
                for m in self._fsdp_instances():
                    m._reset_lazy_init()

    def load_local_state_dict(self: Any, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load this rank's shards from :meth:`local_state_dict` output of an identically wrapped model.

        Collective, like :meth:`load_state_dict`: every rank loads or every rank raises and nothing changes. A dict
        that records its checkpoint identity must be this rank's of a checkpoint saved at this world size, and all
        ranks must load shards of the same checkpoint.
        """
        _check_loadable(self, "load_local_state_dict")
        return self._load_local(state_dict, strict)

    def _load_local(self: Any, state_dict: Mapping[str, Any], strict: bool) -> Any:
        uninitialized = self._is_root is None
        self._lazy_init()
        self._device.synchronize()
        loaded = identity.of_weights(state_dict)

        def load() -> Any:
            with _local_mode(self):
                _check_local_shapes(self, state_dict)  # first: its message names the mismatching shards
                identity.check_loadable_here(loaded, self.rank, self.world_size)
                return _load_with_clean_errors(self, state_dict, strict)

        try:
            return loads.load_collectively(self, "load_local_state_dict", load, loaded, _restore_on_failure)
        finally:
            for m in self._fsdp_instances():
                for h in m._handles:
                    h.free_full()  # gathered copies are stale now
                    h.drop_zero2_slice()
            if uninitialized and self._is_root:
                for m in self._fsdp_instances():
                    m._reset_lazy_init()


def _clean_keys(text: str) -> str:
    return text.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")


def _load_with_clean_errors(fsdp: Any, state_dict: Mapping[str, Any], strict: bool) -> Any:
    """Load through the wrapper; errors and missing/unexpected keys use the user's keys, not internal paths."""
    try:
        result = fsdp._fsdp_wrapped_module.load_state_dict(dict(state_dict), strict)
    except RuntimeError as e:
        message = _clean_keys(str(e)).replace("FlattenParamsWrapper", type(fsdp).__name__)
        raise RuntimeError(message + "\nThe model was left unchanged.") from e
    result.missing_keys[:] = [_clean_keys(k) for k in result.missing_keys]
    result.unexpected_keys[:] = [_clean_keys(k) for k in result.unexpected_keys]
    return result


def _check_loadable(fsdp: Any, what: str) -> None:
    for m in fsdp._fsdp_instances():
        if m.training_state != TrainingState.IDLE:
            raise RuntimeError(f"{what}() needs every FSDP instance idle; one is in {m.training_state.name}")
    tree = fsdp._tree
    if tree is not None and tree.backward_pending:
        raise RuntimeError(
            f"{what}() called between a forward and its backward: the pending backward would use weights that no "
            "longer exist. Run the backward first (or do the forward under torch.no_grad()), then load."
        )


@contextlib.contextmanager
def _local_mode(fsdp: Any) -> Generator[None, None, None]:
    """Switch every instance to local (sharded) state dicts, and every FPW to its flat form."""
    instances = fsdp._fsdp_instances()
    saved: List[Tuple[Any, bool, bool]] = []
    for m in instances:
        fpw = m._fsdp_wrapped_module
        saved.append((m, m._return_full_state_dict, fpw._auto_unflatten_state_dict))
        m._return_full_state_dict = False
        fpw._auto_unflatten_state_dict = False
    try:
        yield
    finally:
        for m, full, auto in saved:
            m._return_full_state_dict = full
            m._fsdp_wrapped_module._auto_unflatten_state_dict = auto


@contextlib.contextmanager
def _shards_as_data(fsdp: Any) -> Generator[None, None, None]:
    """Point every param at its fp32 shard for the duration (inside a forward p.data is the gathered param)."""
    saved = [(h, h.param.data) for m in fsdp._fsdp_instances() for h in m._handles if h.fp32_shard is not None]
    for h, _ in saved:
        h.use_shard()
    try:
        yield
    finally:
        for h, data in saved:
            h.param.data = data


@contextlib.contextmanager
def _buffers_in_fp32(fsdp: Any) -> Generator[None, None, None]:
    """State dicts carry fp32 buffers in mixed precision; cast this instance's buffers and restore afterwards."""
    if not fsdp.mixed_precision:
        yield
        return
    changed: List[Tuple[nn.Module, str, torch.dtype]] = []
    for owned in fsdp._owned_modules():
        for name, buf in list(owned.named_buffers(recurse=False)):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                changed.append((owned, name, buf.dtype))
                setattr(owned, name, buf.to(torch.float32))
    try:
        yield
    finally:
        for owned, name, dtype in changed:
            setattr(owned, name, getattr(owned, name).to(dtype))


@contextlib.contextmanager
def _restore_on_failure(fsdp: Any) -> Generator[None, None, None]:
    """Snapshot shards and buffers; put them back if the body raises (a failed load loses no data)."""
    shards: List[Tuple[Tensor, Tensor]] = []
    for m in fsdp._fsdp_instances():
        for h in m._handles:
            if h.fp32_shard is not None:
                shards.append((h.fp32_shard, h.fp32_shard.detach().clone()))
    buffers = [(b, b.detach().clone()) for b in fsdp.buffers()]
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for live, copy in shards + buffers:
                live.copy_(copy)
        raise


def _check_local_shapes(fsdp: Any, state_dict: Mapping[str, Any]) -> None:
    """A local dict from another world size has other shard sizes: say so before touching anything."""
    expected = fsdp.local_state_dict()
    bad = []
    for key, value in state_dict.items():
        if key in expected and isinstance(value, Tensor) and value.shape != expected[key].shape:
            bad.append(f"{key}: got {tuple(value.shape)}, expected {tuple(expected[key].shape)}")
    if bad:
        raise RuntimeError(
            "load_local_state_dict: shard shapes do not match this model (saved at another world size or from "
            "another model?). Use a full state dict or consolidate_shard_weights to change world size.\n  "
            + "\n  ".join(bad)
        )
