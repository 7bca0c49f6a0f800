# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The machinery of :mod:`fairscale.optim.oss_dcp`: parameter names, this rank's name-keyed state, checked loads.

Names are torch's (``torch.distributed.checkpoint.state_dict``): each parameter under its first name in
``model.named_parameters()``, without the ``module.`` of a DistributedDataParallel wrapper or the ``_orig_mod.`` of
``torch.compile``; the ``module.`` of a ShardedDataParallel wrapper goes too, since it is a data-parallel wrapper
like DDP (torch does not know it). So a dict made here and one made by torch's helpers for the same model with a
plain optimizer have the same keys.
"""

import copy
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fairscale.internal import collectives
from fairscale.internal.device import DeviceHandle
from fairscale.internal.hyper_parameters import checked_hyper_parameters
from fairscale.internal.version import torch_version

from .._param_state import check_param_state, laid_out_like
from . import loading

__all__ = [
    "unwrap",
    "param_names",
    "owned_params",
    "init_state",
    "build_state_dict",
    "check_loadable",
    "check_model_loadable",
    "agree",
    "commit",
]

_STATE = "state"
_GROUPS = "param_groups"
_PARAMS = "params"
# torch.compile's wrapper and the attribute it keeps the compiled module under.
_COMPILED_MODULE = "torch._dynamo.eval_frame"
_COMPILED_ATTR = "_orig_mod"
# Error types a failing rank's error is re-created as on every rank (any other becomes RuntimeError).
_REBUILDABLE = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError, "RuntimeError": RuntimeError}


def _is_data_parallel(module: nn.Module) -> bool:
    if isinstance(module, DistributedDataParallel):
        return True
    # Looked up, not imported: fairscale.nn.data_parallel imports fairscale.optim, so an import here would be a
    # cycle; and while that module is not loaded, no ShardedDataParallel can exist.
    sharded_ddp = sys.modules.get("fairscale.nn.data_parallel.sharded_ddp")
    return sharded_ddp is not None and isinstance(module, sharded_ddp.ShardedDataParallel)


def _is_compiled(module: nn.Module) -> bool:
    return type(module).__module__ == _COMPILED_MODULE and isinstance(getattr(module, _COMPILED_ATTR, None), nn.Module)


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` without its outer ShardedDataParallel wrapper(s), which torch's helpers would keep in the names."""
    while not isinstance(model, DistributedDataParallel) and _is_data_parallel(model):
        model = model.module  # type: ignore[assignment]
    return model


def _fqn(model: nn.Module, name: str) -> str:
    """``name`` (from ``named_parameters()``) without the wrappers' path parts, as torch's ``_get_fqns`` does."""
    kept: List[str] = []
    current: Any = model
    for part in name.split("."):
        if isinstance(current, nn.Module) and part == "module" and _is_data_parallel(current):
            current = current.module
            continue
        if isinstance(current, nn.Module) and part == _COMPILED_ATTR and _is_compiled(current):
            current = getattr(current, _COMPILED_ATTR)
            continue
        kept.append(part)
        current = getattr(current, part)
    return ".".join(kept)


def param_names(model: nn.Module, groups: Sequence[Mapping[str, Any]], what: str) -> Dict[torch.Tensor, str]:
    """``{param: name}`` for every parameter of ``groups``.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: a parameter of the groups is not one of the model's.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}: model must be an nn.Module, got {type(model).__name__}")
    names: Dict[torch.Tensor, str] = {}
    for name, param in model.named_parameters():  # tied parameters: the first name only, as torch
        names.setdefault(param, _fqn(model, name))
    for g, group in enumerate(groups):
        for i, param in enumerate(group[_PARAMS]):
            if param not in names:
                raise ValueError(
                    f"{what}: parameter {i} of the optimizer's group {g} (shape {tuple(param.shape)}) is not a "
                    "parameter of the model; pass the model the optimizer was built on"
                )
    return names


def owned_params(optim: Any) -> List[torch.Tensor]:
    """The parameters this rank owns, in the order of its inner optimizer's groups (its state-dict order)."""
    return [p for group in optim.optim.param_groups for p in group[_PARAMS]]


def init_state(optim: Any) -> None:
    """Give the inner optimizer its state, as torch's ``get_optimizer_state_dict`` does for an optimizer without one.

    One step of the inner optimizer over zero gradients at learning rate 0: the state tensors exist (DCP loads into
    existing tensors) and the parameters do not change. Rank-local: the inner optimizer holds only this rank's
    parameters, and nothing needs broadcasting since nothing changed. Skipped, like torch's, when the inner
    optimizer has state or a parameter has a gradient (a real step is coming).
    """
    inner = optim.optim
    params = owned_params(optim)
    if inner.state or any(p.grad is not None for p in params):
        return
    optim._sync_param_groups(optim.param_groups, inner.param_groups)  # the hyper-parameters a real step would use
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for group in inner.param_groups:
        if "lr" in group:
            lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        inner.step()
    finally:
        for group in inner.param_groups:
            if "lr" in group:
                group["lr"] = lrs.pop(0)
        for p in params:
            p.grad = None


def _copy(value: Any, cpu_offload: bool) -> Any:
    if isinstance(value, torch.Tensor):
        copied = value.detach().clone()
        return copied.cpu() if cpu_offload else copied
    return copy.deepcopy(value)


class _LoadedInPlace(Dict[str, Any]):
    """The dict :func:`build_state_dict` returns on torch 2.3, whose ``dcp.load`` drops the non-tensor values.

    That release's load planner (``_init_state_dict``) rebuilds the containers of the dict it is given with
    ``torch.utils._pytree`` and writes what it reads as bytes (the parameter groups, with their ``lr``...) into the
    rebuilt ones, which ``dcp.load`` then drops: tensors loaded in place, but the hyper-parameters stayed the
    template's, silently (pytorch/pytorch#129079, fixed in 2.4). pytree keeps an instance of a dict subclass as a
    leaf (the same object), so what is read under it is written into this very dict. A dict without tensors (no
    optimizer state) is read as one value, which replaces the dict itself: as a top-level value of the dict given to
    ``dcp.load`` (the documented recipe) it is ``Stateful``, so ``dcp.load`` hands it what it read.
    """

    def state_dict(self) -> Dict[str, Any]:
        return self

    def __reduce__(self) -> Any:
        # Pickled (torch.save of the returned dict) or copied as the plain dict it stands for: a file that names this
        # class would not load with torch.load(weights_only=True).
        return (dict, (dict(self),))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict is not self:
            self.clear()
            self.update(state_dict)


# torch 2.3.x only: the planner change came in 2.3.0, its fix in 2.4.0.
_DCP_LOAD_DROPS_NON_TENSORS = (2, 3, 0) <= torch_version() < (2, 4, 0)


def build_state_dict(optim: Any, names: Mapping[torch.Tensor, str], cpu_offload: bool) -> Dict[str, Any]:
    """Torch's name-keyed format over this rank's owned parameters (copies) and all parameter groups."""
    state: Dict[str, Any] = {}
    for param in owned_params(optim):
        entry = optim.optim.state.get(param)
        if entry:
            state[names[param]] = {k: _copy(v, cpu_offload) for k, v in entry.items()}
    groups = [
        {**{k: copy.deepcopy(v) for k, v in group.items() if k != _PARAMS}, _PARAMS: [names[p] for p in group[_PARAMS]]}
        for group in optim.param_groups
    ]
    if _DCP_LOAD_DROPS_NON_TENSORS:
        return _LoadedInPlace({_STATE: state, _GROUPS: groups})
    return {_STATE: state, _GROUPS: groups}


def check_loadable(
    optim: Any, names: Mapping[torch.Tensor, str], sd: Any, what: str
) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Check ``sd`` against the optimizer (this rank's view); change nothing.

    Returns:
        The saved groups' hyper-parameters (one dict per group, in the optimizer's order) and
        ``{name: entry}`` of the owned parameters' saved state.

    Raises:
        TypeError: not a dict of torch's format.
        ValueError: other parameter groups, unknown names, state shaped for other parameters, or no state (or
            fewer state values) for an owned parameter that has state now.
    """
    if not isinstance(sd, Mapping) or not isinstance(sd.get(_STATE), Mapping) or not isinstance(sd.get(_GROUPS), list):
        raise TypeError(
            f"{what}: optim_state_dict must be a dict with a 'state' dict and a 'param_groups' list (torch's "
            "format, as get_optimizer_state_dict makes it)"
        )
    saved_groups = sd[_GROUPS]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(
            f"{what}: the state dict has {len(saved_groups)} parameter group(s) but the optimizer has "
            f"{len(optim.param_groups)}; build the optimizer with the groups it was saved with"
        )
    by_name = {name: param for param, name in names.items()}
    hyper: List[Dict[str, Any]] = []
    for g, (saved, group) in enumerate(zip(saved_groups, optim.param_groups)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get(_PARAMS), (list, tuple)):
            raise TypeError(f"{what}: parameter group {g} of the state dict is not a dict with a 'params' list")
        expected = [names[p] for p in group[_PARAMS]]
        missing = [n for n in expected if n not in saved[_PARAMS]]
        unexpected = [n for n in saved[_PARAMS] if n not in expected]
        if missing or unexpected:
            raise ValueError(
                f"{what}: parameter group {g} of the state dict does not list this optimizer's parameters (missing: "
                f"{missing}; unexpected: {unexpected}); it was saved from another model or with other groups"
            )
        # Checked and copied here, before the ranks compare them (a repr) and commit copies them.
        hyper.append(checked_hyper_parameters(saved, group, f"{what}: parameter group {g}"))
    unknown = sorted(str(k) for k in sd[_STATE] if k not in by_name)
    if unknown:
        raise ValueError(f"{what}: the state dict has state for {unknown}, which no parameter group of it lists")
    for name, entry in sd[_STATE].items():
        check_param_state(what, repr(name), entry, by_name[name])
    owned: Dict[str, Any] = {}
    for param in owned_params(optim):
        name = names[param]
        current = optim.optim.state.get(param)
        entry = sd[_STATE].get(name)
        if current and entry is None:
            raise ValueError(
                f"{what}: the state dict has no state for {name!r}, which this rank's optimizer has state for; the "
                "checkpoint holds the state of other parameters (or was read incompletely)"
            )
        if current and entry is not None:
            lacking = sorted(str(k) for k in current if k not in entry)
            if lacking:
                raise ValueError(f"{what}: the state of {name!r} lacks {lacking} (it has {sorted(map(str, entry))})")
        if entry is not None:
            owned[name] = entry
    return hyper, owned


def check_model_loadable(current: Mapping[str, Any], sd: Mapping[str, Any], strict: bool, what: str) -> None:
    """Check a model state dict's keys (with ``strict``) and tensor shapes against the model's current one.

    Raises:
        ValueError: missing or unexpected keys with ``strict``, or a value of another shape.
    """
    if strict:
        missing = [k for k in current if k not in sd]
        unexpected = sorted(str(k) for k in sd if k not in current)
        if missing or unexpected:
            raise ValueError(
                f"{what}: the model state dict does not match the model (missing key(s): {missing}; unexpected "
                f"key(s): {unexpected})"
            )
    for key, value in sd.items():
        mine = current.get(key)
        if isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor) and value.shape != mine.shape:
            raise ValueError(
                f"{what}: model value {key!r} has shape {tuple(value.shape)}, the model's {tuple(mine.shape)}"
            )


def agree(optim: Any, what: str, error: Optional[BaseException], hyper: List[Dict[str, Any]]) -> None:
    """One small all-gather over OSS's group: every rank raises the same error if any rank failed its check, or if
    the ranks were given other hyper-parameters (they would go on with different learning rates)."""
    mine = None if error is None else (_kind(error), str(error.args[0]) if error.args else str(error))
    described = repr(hyper) if error is None else None
    if collectives.group_size(optim.group) == 1:
        views: Sequence[Any] = [(mine, described)]
    else:
        # NCCL object collectives allocate on the current device.
        with DeviceHandle.for_device(optim._object_device()).as_current():
            views = collectives.all_gather_object((mine, described), optim.group)
    ranks = list(collectives.group_ranks(optim.group)) if collectives.group_size(optim.group) > 1 else [0]
    failed = [(rank, view[0]) for rank, view in zip(ranks, views) if view[0] is not None]
    if failed:
        kind, first = failed[0][1]
        head = f"{what} failed on rank(s) {[rank for rank, _ in failed]}; this call loaded nothing on any rank. "
        if all(message == first for _, (_, message) in failed):
            text = head + first
        else:
            text = head + " ".join(f"rank {rank}: {message}" for rank, (_, message) in failed)
        raise _REBUILDABLE.get(kind, RuntimeError)(text) from error
    if len({view[1] for view in views}) > 1:
        raise ValueError(
            f"{what}: the ranks passed different parameter groups' hyper-parameters "
            f"({', '.join(f'rank {r}: {v[1]}' for r, v in zip(ranks, views))}); this call loaded nothing on any rank. "
            "Pass every rank the same checkpoint."
        )


def _kind(error: BaseException) -> str:
    for cls in type(error).__mro__:
        if cls.__name__ in _REBUILDABLE and isinstance(error, _REBUILDABLE[cls.__name__]):
            return cls.__name__
    return "RuntimeError"


def commit(optim: Any, names: Mapping[torch.Tensor, str], hyper: List[Dict[str, Any]], owned: Dict[str, Any]) -> None:
    """Load the checked, agreed state: the inner optimizer's shard, then the hyper-parameters on OSS's groups."""
    state: Dict[int, Any] = {}
    inner_groups: List[Dict[str, Any]] = []
    index = 0
    for inner_group, saved in zip(optim.optim.param_groups, hyper):
        ids = []
        for param in inner_group[_PARAMS]:
            entry = owned.get(names[param])
            if entry is not None:
                # Copies: the optimizer must not share tensors with the caller's dict (torch's load keeps a tensor
                # that already has the right dtype and device).
                state[index] = laid_out_like({k: _copy(v, False) for k, v in entry.items()}, param)
            ids.append(index)
            index += 1
        # The current keys first: a checkpoint of another torch version may lack an option a step reads.
        current = {k: v for k, v in inner_group.items() if k != _PARAMS}
        inner_groups.append({**current, **copy.deepcopy(saved), _PARAMS: ids})
    shard = {_STATE: state, _GROUPS: inner_groups}
    optim.optim.load_state_dict(shard)
    if loading.keeps_saved_dtypes(optim.optim):  # as OSS.load_state_dict: the saved dtypes, not the parameters'
        loading.restore_saved_dtypes(optim.optim, shard)
    # In place: an LR scheduler (or user code) may hold OSS's group dicts.
    for group, saved in zip(optim.param_groups, hyper):
        for key, value in saved.items():
            group[key] = copy.deepcopy(value)
    optim._sync_param_groups(optim.param_groups, optim.optim.param_groups)
