# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Loading a state dict all or nothing: a dry run of ``nn.Module.load_state_dict`` on shape-only tensors.

``nn.Module.load_state_dict`` copies every entry that fits and raises only at the end, for a size mismatch, a value
that is not a tensor or (``strict``) a missing or unexpected key: a failed load leaves the model half loaded. Run
first with every parameter and buffer of the module tree swapped for a ``meta`` tensor of the same shape and dtype,
the same load makes torch's own checks (and the modules' load hooks) raise before anything is copied, without copying
or allocating any tensor data; then the real load runs. Modules' ``set_extra_state`` runs in the dry run too (it
checks its value) and their own extra state is put back after it. Load post-hooks run in both runs (they may edit
the incompatible keys, which decide whether a strict load fails): a post-hook that keeps what it sees keeps the
dry run's ``meta`` stand-ins when the dry run fails.
"""

import copy
import threading
import warnings
from typing import Any, Callable, Dict, List, Mapping, Tuple, TypeVar, cast

import torch
from torch import nn

__all__ = ["dry_run_load", "in_dry_run", "load_state_dict_all_or_nothing"]

_T = TypeVar("_T")

# Per thread: a load in another thread is not this dry run.
_dry_runs = threading.local()


def in_dry_run() -> bool:
    """Whether a :func:`dry_run_load` is running in this thread: load hooks that keep state outside the parameters
    and buffers (counts, caches) leave it alone then. With ``assign=True`` the dry run's modules hold the state
    dict's real tensors, so a hook cannot tell the trial from the real load by looking for ``meta`` tensors."""
    return getattr(_dry_runs, "depth", 0) > 0


def dry_run_load(module: nn.Module, load: Callable[[], _T]) -> _T:
    """Call ``load`` (a load of ``module``'s state) with the tree's parameters and buffers swapped for ``meta``
    tensors, so that it raises whatever the real load would raise but copies nothing; the tensors are put back.

    Args:
        module: the module whose parameters and buffers (and its submodules') are swapped.
        load: the load to try, e.g. ``lambda: nn.Module.load_state_dict(module, state_dict, strict)``.

    Returns:
        What ``load`` returned (for ``load_state_dict``: the missing and unexpected keys).
    """
    swapped: List[Tuple[Dict[str, Any], str, torch.Tensor]] = []
    hooks: List[Any] = []
    extra_states: List[_ExtraStateGuard] = []
    try:
        for m in module.modules():
            if getattr(type(m), "set_extra_state", nn.Module.set_extra_state) is not nn.Module.set_extra_state:
                extra_states.append(_ExtraStateGuard(m))
            names: List[str] = []
            for registry in (cast(Dict[str, Any], m._parameters), cast(Dict[str, Any], m._buffers)):
                for name, tensor in list(registry.items()):
                    if tensor is None:
                        continue
                    if tensor.is_meta:
                        # Left in place (it holds no data to protect), but put back afterwards: an ``assign=True``
                        # dry run replaces it with the state dict's tensor, and a failed load left that in the model.
                        swapped.append((registry, name, tensor))
                        continue
                    shape_only = torch.empty_like(tensor, device="meta")
                    if isinstance(tensor, nn.Parameter):
                        shape_only = nn.Parameter(shape_only, requires_grad=tensor.requires_grad)
                    swapped.append((registry, name, tensor))
                    registry[name] = shape_only
                    if name not in m._non_persistent_buffers_set:  # torch ignores a value given for those
                        names.append(name)
            if names:
                # The private registration (untyped in the stubs): it takes this hook form on every supported torch.
                register = cast(Any, m)._register_load_state_dict_pre_hook
                hooks.append(register(_refuse_meta_values(names), with_module=True))
        with warnings.catch_warnings():
            # torch warns that copying into a meta tensor does nothing: here that is the point.
            warnings.filterwarnings("ignore", message=".*non-meta parameter in the checkpoint to a meta parameter.*")
            _dry_runs.depth = getattr(_dry_runs, "depth", 0) + 1
            try:
                return load()
            finally:
                _dry_runs.depth -= 1
    finally:
        for guard in extra_states:
            guard.restore()
        for handle in hooks:
            handle.remove()
        for registry, name, tensor in reversed(swapped):
            registry[name] = tensor


_UNSAVED = object()


class _ExtraStateGuard:
    """Runs a module's ``set_extra_state`` in the dry run (so that it checks the value) and puts the module's own
    extra state back afterwards: torch calls it for real, and a dry run that then failed in a later module left the
    rejected checkpoint's extra state in place.

    The instance attribute shadows the class's method (torch looks the method up on the class to decide whether to
    call it, then calls it through the instance); ``restore`` removes it.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.shadowed = module.__dict__.get("set_extra_state")
        self.saved: List[Any] = []  # the state before the first call (a list: None is a valid extra state)
        self.inner = module.set_extra_state
        module.__dict__["set_extra_state"] = self.set_extra_state

    def set_extra_state(self, state: Any) -> None:
        if not self.saved:
            try:
                # A copy: get_extra_state may return the live object that set_extra_state then changes in place.
                self.saved.append(copy.deepcopy(self.module.get_extra_state()))
            except Exception:  # a module that cannot report its extra state: nothing to put back, as before
                self.saved.append(_UNSAVED)
        self.inner(state)

    def restore(self) -> None:
        if self.shadowed is None:
            self.module.__dict__.pop("set_extra_state", None)
        else:
            self.module.__dict__["set_extra_state"] = self.shadowed
        if self.saved and self.saved[0] is not _UNSAVED:
            self.inner(self.saved[0])


def _refuse_meta_values(names: List[str]) -> Callable[..., None]:
    """A load pre-hook for the dry run: a ``meta`` value (no data) for a tensor that holds data is an error.

    Copying meta into the dry run's meta stand-ins works, so the dry run passed and the real load failed partway
    ("Cannot copy out of meta tensor"), after copying the entries before it. The error goes where torch collects its
    own (``error_msgs``), so the load raises torch's ``RuntimeError`` with it, before anything is copied.
    """

    def hook(module: nn.Module, state_dict: Any, prefix: str, metadata: Any, strict: bool, *lists: Any) -> None:
        if metadata and metadata.get("assign_to_params_buffers"):
            return  # load_state_dict(assign=True) puts the meta tensor in place: nothing is copied, nothing fails
        error_msgs = lists[-1]
        for name in names:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.is_meta:
                error_msgs.append(
                    f"{prefix + name}: the state dict holds a meta tensor (a shape without data); load one with "
                    "data (e.g. a checkpoint saved from a materialized model)"
                )

    return hook


def load_state_dict_all_or_nothing(module: nn.Module, state_dict: Mapping[str, Any], strict: bool, assign: bool) -> Any:
    """``nn.Module.load_state_dict(module, ...)``, after a :func:`dry_run_load` of the same load.

    For wrappers whose ``load_state_dict`` is otherwise torch's; ``assign`` is passed only when set (torch before 2.1
    has no such argument).
    """
    kwargs = {"assign": True} if assign else {}
    dry_run_load(module, lambda: nn.Module.load_state_dict(module, state_dict, strict, **kwargs))
    return nn.Module.load_state_dict(module, state_dict, strict, **kwargs)
