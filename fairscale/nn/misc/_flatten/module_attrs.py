# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Setting, saving and removing the attributes under which FlattenParamsWrapper's modules hold their views."""

from typing import Any, Dict, List, Tuple

from torch import Tensor, nn

from .flat_parameter import ParamInfo, SharedParamInfo

__all__ = ["ViewSnapshot", "drop_attr", "set_plain_tensor", "snapshot_views", "restore_views", "stash_views"]

#: ``([(module, name, tensor or None)], the module's _unflattened_param_views)``: the views a forward left behind.
ViewSnapshot = Tuple[List[Tuple[nn.Module, str, Any]], Any]

_ALL_VIEWS = "_unflattened_param_views"


def snapshot_views(
    param_infos: List[ParamInfo], shared_param_infos: List[SharedParamInfo], wrapped: nn.Module
) -> ViewSnapshot:
    """What every flattened name (tied names included) holds, and ``wrapped``'s list of all views.

    Run by every forward under ``no_grad``: one pass over the names, nothing built in between.
    """
    attrs = [(m, n, m.__dict__.get(n)) for _, m, n in param_infos]
    attrs += [(m, n, m.__dict__.get(n)) for _, _, m, n, _, _ in shared_param_infos]
    return attrs, wrapped.__dict__.get(_ALL_VIEWS)


def restore_views(snapshot: ViewSnapshot, wrapped: nn.Module) -> None:
    """Give the modules back the views of :func:`snapshot_views`."""
    attrs, views = snapshot
    for m, n, value in attrs:
        if value is not None:
            set_plain_tensor(m, n, value)
    if views is not None:
        setattr(wrapped, _ALL_VIEWS, views)


def stash_views(slots: List[Tuple[nn.Module, str]], wrapped: nn.Module) -> List[Tuple[Dict[str, Any], str, Any]]:
    """Remove the view attributes from the modules; return ``(module.__dict__, name, value)`` to put them back."""
    slots = slots + [(wrapped, _ALL_VIEWS)]
    return [(m.__dict__, n, m.__dict__.pop(n)) for m, n in slots if n in m.__dict__]


def drop_attr(module: nn.Module, name: str) -> None:
    """Delete ``module.<name>`` (parameter or plain attribute) if it exists."""
    if hasattr(module, name):
        delattr(module, name)


def set_plain_tensor(module: nn.Module, name: str, value: Tensor) -> None:
    """``setattr(module, name, value)`` for a plain (non-Parameter) tensor, as every forward does for every view.

    ``nn.Module.__setattr__`` checks the value against ``Parameter``, ``Module`` and ``Buffer`` (Python-level type
    checks, most of its cost: about 2.6 us a call against 0.3 us) and the name against the module's registries; for a
    plain tensor under a name none of them holds it ends in ``object.__setattr__``, which this calls directly. Any
    other case (a tensor subclass or Parameter, a module class with its own ``__setattr__``, a name that is
    registered) goes through ``setattr``.
    """
    d = module.__dict__
    if (
        type(value) is Tensor
        and type(module).__setattr__ is MODULE_SETATTR
        and name not in d["_parameters"]
        and name not in d["_buffers"]
        and name not in d["_modules"]
    ):
        object.__setattr__(module, name, value)
    else:
        if name in d["_parameters"] and not isinstance(value, nn.Parameter):
            # Only a parameter registered after wrapping gets here: the flat parameter owns this name.
            raise ValueError(
                f"{type(module).__name__}.{name} was registered as a parameter again after FlattenParamsWrapper "
                "flattened it (its values live in the flat parameter, which this module's forward reads). Change it "
                "in place (module.weight.data.copy_(...)), or inside unflatten_params() / summon_full_params(), or "
                "replace it before wrapping."
            )
        setattr(module, name, value)


MODULE_SETATTR = nn.Module.__setattr__
