# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""State-dict key rewriting for FlattenParamsWrapper.

Saving (post hook): keys under ``<prefix>_fpw_module.`` lose that level, so a wrapped module reports the keys of
the unwrapped one and flat parameters appear as ``<prefix>flat_param_<name>``.

Loading (pre hook, switchable): the reverse. Every key under ``<prefix>`` gets ``_fpw_module.`` back, except the
flat parameters, which live on the wrapper itself. The legacy single-group key ``flat_param`` is renamed to
``flat_param_0``. Finally, when a flattened wrapper is loaded as part of a parent module (so
``FlattenParamsWrapper.load_state_dict`` and its auto-unflatten are not involved) from a dict holding the
original parameter names, those entries are folded into the flat parameter entry so that
``parent.load_state_dict(parent.state_dict())`` works.
"""

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List

import torch
from torch import Tensor

from .grouping import FPW_MODULE

if TYPE_CHECKING:  # pragma: no cover
    from ..flatten_params_wrapper import FlattenParamsWrapper

__all__ = [
    "_enable_pre_load_state_dict_hook",
    "fpw_pre_load_hook_disabled",
    "rename_prefix_",
    "post_state_dict_hook",
    "pre_load_state_dict_hook",
]

FLAT_PARAM = "flat_param"
_LEGACY_FLAT_KEY = FLAT_PARAM  # the single flat parameter's name before groups existed
_DEFAULT_FLAT_KEY = FLAT_PARAM + "_0"

# Depth of nested fpw_pre_load_hook_disabled() contexts; the hook rewrites keys only at depth 0.
_disabled_depth = 0


def _enable_pre_load_state_dict_hook() -> bool:
    """Whether FlattenParamsWrapper's load pre hook rewrites keys (``False`` inside
    :func:`fpw_pre_load_hook_disabled`)."""
    return _disabled_depth == 0


@contextlib.contextmanager
def fpw_pre_load_hook_disabled() -> Iterator[None]:
    """Context manager: while active, loading does not add ``_fpw_module.`` to keys nor move flat keys.

    Use it to load a state dict that already holds the raw module paths (``..._fpw_module.0.weight``), e.g. one
    produced by ``nn.Module.state_dict`` with the hooks bypassed. Process-wide and re-entrant. The rename of the
    legacy ``flat_param`` key and the folding of original keys into a flat entry still happen.
    """
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


def rename_prefix_(state_dict: Dict[str, Any], old: str, new: str) -> None:
    """In place, replace the prefix ``old`` by ``new`` in every key that starts with ``old``, keeping key order.

    Raises:
        ValueError: ``old == new``.
    """
    if old == new:
        raise ValueError(f"old and new prefix must differ, both are {old!r}")
    if not any(k.startswith(old) for k in state_dict):
        return
    # Rebuild rather than pop/insert so that the position of every key stays as nn.Module produced it.
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        state_dict[new + key[len(old) :] if key.startswith(old) else key] = value


def _rename_key_(state_dict: Dict[str, Any], old: str, new: str) -> None:
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        state_dict[new if key == old else key] = value


def post_state_dict_hook(module: Any, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``nn.Module`` state-dict hook: drop the wrapper's ``_fpw_module.`` level from the keys."""
    rename_prefix_(state_dict, prefix + FPW_MODULE + ".", prefix)


def pre_load_state_dict_hook(
    module: "FlattenParamsWrapper",
    state_dict: Dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: List[str],
    unexpected_keys: List[str],
    error_msgs: List[str],
) -> None:
    """``nn.Module`` load pre hook (registered with the module): map saved keys back to the module's paths."""
    if module.is_flattened and _DEFAULT_FLAT_KEY in module.flat_param_names:
        if prefix + _LEGACY_FLAT_KEY in state_dict and prefix + _DEFAULT_FLAT_KEY not in state_dict:
            _rename_key_(state_dict, prefix + _LEGACY_FLAT_KEY, prefix + _DEFAULT_FLAT_KEY)
    if _enable_pre_load_state_dict_hook():
        _add_wrapper_level(module, state_dict, prefix)
    _fold_original_keys(module, state_dict, prefix)


def _add_wrapper_level(module: "FlattenParamsWrapper", state_dict: Dict[str, Any], prefix: str) -> None:
    inner = prefix + FPW_MODULE + "."
    rename_prefix_(state_dict, prefix, inner)
    wrapped = module.module
    own_names = {n for n, _ in wrapped.named_parameters(recurse=False)} | {
        n for n, _ in wrapped.named_buffers(recurse=False)
    }
    for key in [k for k in state_dict if k.startswith(inner + FLAT_PARAM)]:
        rest = key[len(inner) :]
        # Only direct attributes named like a flat parameter go back to the wrapper; a child module or a
        # genuine attribute of the wrapped module that happens to start with "flat_param" stays where it is.
        if "." in rest or rest in own_names or not rest.startswith(FLAT_PARAM + "_"):
            continue
        state_dict[prefix + rest] = state_dict.pop(key)


def _fold_original_keys(module: "FlattenParamsWrapper", state_dict: Dict[str, Any], prefix: str) -> None:
    """Replace complete sets of original-name entries of a flat group by one flat entry.

    Only done when the result can be loaded as is: the wrapper is flattened, the flat key is absent, every
    original name of the group is present with the right number of elements, and the flat parameter currently
    has its full size (inside FSDP it may hold only a shard, which this hook cannot produce; such dicts are left
    alone so the caller sees the usual missing/unexpected keys).
    """
    if not module.is_flattened:
        return
    for flat_name, flat in zip(module.flat_param_names, module.flat_params):
        if prefix + flat_name in state_dict or flat.numel() != sum(flat._param_numels):
            continue
        keys = [f"{prefix}{mname}.{pname}" for mname, _, pname in flat._param_infos]
        values = [state_dict.get(k) for k in keys]
        if not all(isinstance(v, Tensor) and v.numel() == n for v, n in zip(values, flat._param_numels)):
            continue
        with torch.no_grad():
            state_dict[prefix + flat_name] = torch.cat(
                [v.detach().reshape(-1).to(dtype=flat.dtype, device=flat.device) for v in values if v is not None]
            )
        for key in keys:
            del state_dict[key]
        for mname, _, _, pname, _, _ in flat._shared_param_infos:
            state_dict.pop(f"{prefix}{mname}.{pname}", None)
