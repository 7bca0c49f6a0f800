# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""State-dict key rewriting for FlattenParamsWrapper.

Saving (post hook): keys under ``<prefix>_fpw_module.`` lose that level, so a wrapped module reports the keys of
the unwrapped one and flat parameters appear as ``<prefix>flat_param_<name>``. The module versions in the dict's
``_metadata`` are listed under the unwrapped module's paths too (the internal paths stay, for loads into a wrapper
nested in a parent, which torch hands no metadata to rewrite).

Loading (pre hook, switchable): the reverse. Every key under ``<prefix>`` gets ``_fpw_module.`` back, except the
flat parameters and the members registered on the wrapper itself. ``FlattenParamsWrapper.load_state_dict`` also
lists a plain module's ``_metadata`` under the internal paths (:func:`with_wrapper_level_metadata`), so versioned
modules (BatchNorm, quantized layers) load as they would unwrapped. The legacy single-group key ``flat_param`` is
renamed to ``flat_param_0``. Finally, when a flattened wrapper is loaded as part of a parent module (so
``FlattenParamsWrapper.load_state_dict`` and its auto-unflatten are not involved) from a dict holding the
original parameter names, those entries are folded into the flat parameter entry so that
``parent.load_state_dict(parent.state_dict())`` works.

Reporting (post hook): missing/unexpected keys are given in the names of the dict that was loaded, without the
internal ``_fpw_module.`` level.
"""

import contextlib
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Protocol, Tuple, cast

import torch
from torch import Tensor, nn

from .flat_parameter import FlatParameter
from .grouping import FPW_MODULE

__all__ = [
    "FlatOwner",
    "_enable_pre_load_state_dict_hook",
    "fpw_pre_load_hook_disabled",
    "rename_prefix_",
    "post_state_dict_hook",
    "pre_load_state_dict_hook",
    "post_load_state_dict_hook",
    "refuse_flat_key_names",
    "with_wrapper_level_metadata",
    "errors_named_by_keys",
]

FLAT_PARAM = "flat_param"
_LEGACY_FLAT_KEY = FLAT_PARAM  # the single flat parameter's name before groups existed
_DEFAULT_FLAT_KEY = FLAT_PARAM + "_0"


class FlatOwner(Protocol):
    """What the hooks read from the wrapper they are registered on (``FlattenParamsWrapper`` satisfies it).

    Described structurally because the front imports this module; importing the front back would be a cycle.
    """

    is_flattened: bool
    flat_param_names: List[str]
    flat_params: List[FlatParameter]

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        ...


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


_LOAD_CONTEXT = "_fpw_load_context"


class _LoadContext(NamedTuple):
    prefix: str
    rewritten: bool  # the pre hook added the _fpw_module level
    absent: List[str]  # original keys of partially present groups that were not in the dict


def post_state_dict_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``nn.Module`` state-dict hook: drop the wrapper's ``_fpw_module.`` level from the keys (and metadata)."""
    rename_prefix_(state_dict, prefix + FPW_MODULE + ".", prefix)
    metadata = getattr(state_dict, "_metadata", None)
    if isinstance(metadata, dict):
        _add_plain_metadata(metadata, prefix)


def _add_plain_metadata(metadata: Dict[str, Any], prefix: str) -> None:
    """List the wrapped modules' metadata under the unwrapped paths as well (the wrapper's own entry takes the
    wrapped module's, as the unwrapped module's dict has it there).

    A plain module loading the dict looked its modules' versions up under paths it lacked and took the legacy path of
    versioned modules (a quantized Linear failed with ``KeyError``). torch records a module's entry before its
    children's and calls this hook after them, so the wrapper's entries are the ones after its own: only those are
    read (a model with many wrappers is not walked once per wrapper).
    """
    own, inner = prefix[:-1], prefix + FPW_MODULE
    found: List[str] = []
    for key in reversed(metadata):
        if key == own:
            break
        if key == inner or key.startswith(inner + "."):
            found.append(key)
    for key in reversed(found):
        plain = own if key == inner else prefix + key[len(inner) + 1 :]
        metadata[plain] = dict(metadata[key])


def with_wrapper_level_metadata(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with its ``_metadata`` listed under the wrapper's internal paths too, for a dict whose metadata
    names none (a plain module's); otherwise ``state_dict`` itself.

    Used by the wrapper's own ``load_state_dict``: torch looks each module's version up under its path, which runs
    through ``_fpw_module``. The given dict is not changed.
    """
    metadata = getattr(state_dict, "_metadata", None)
    if not isinstance(metadata, Mapping) or any(k == FPW_MODULE or k.startswith(FPW_MODULE + ".") for k in metadata):
        return state_dict
    mapped: Dict[str, Any] = OrderedDict(metadata)
    for key, entry in metadata.items():
        mapped[FPW_MODULE + "." + key if key else FPW_MODULE] = dict(entry) if isinstance(entry, Mapping) else entry
    copied: Dict[str, Any] = OrderedDict(state_dict)
    setattr(copied, "_metadata", mapped)
    return copied


def pre_load_state_dict_hook(
    module: FlatOwner,
    state_dict: Dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: List[str],
    unexpected_keys: List[str],
    error_msgs: List[str],
) -> None:
    """``nn.Module`` load pre hook (registered with the module): map saved keys back to the module's paths.

    Raises:
        ValueError: a parent's ``load_state_dict(..., assign=True)`` reached a flattened wrapper: torch would register
            the loaded tensor in place of the flat parameter, which the wrapper's views and ``flat_params`` would
            not see (the load would be lost, silently). Raised before this wrapper changes.
    """
    # A wrapper without flat parameters (FSDP's flatten_parameters=False) holds the module's own parameters: assign
    # works there as on the module (FSDP copies what a load rebinds into its shards, as its own load does).
    if module.is_flattened and module.flat_params and local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            f"load_state_dict(assign=True) cannot load into the FlattenParamsWrapper at '{prefix[:-1] or '(root)'}': "
            "its parameters must stay views into its flat parameters; load with assign=False (modules loaded "
            "before it in this call were already assigned)"
        )
    if module.is_flattened and _DEFAULT_FLAT_KEY in module.flat_param_names:
        if prefix + _LEGACY_FLAT_KEY in state_dict and prefix + _DEFAULT_FLAT_KEY not in state_dict:
            _rename_key_(state_dict, prefix + _LEGACY_FLAT_KEY, prefix + _DEFAULT_FLAT_KEY)
    rewrite = _enable_pre_load_state_dict_hook()
    if rewrite:
        _add_wrapper_level(module, state_dict, prefix)
    absent = _fold_original_keys(module, state_dict, prefix, error_msgs, rewrite)
    # Handed to post_load_state_dict_hook, which has no access to the prefix.
    setattr(module, _LOAD_CONTEXT, _LoadContext(prefix, rewrite, absent))


def post_load_state_dict_hook(module: FlatOwner, incompatible_keys: Any) -> None:
    """``nn.Module`` load post hook: report missing/unexpected keys under the names of the given dict.

    Adds the original names that a partial fold could not find, and (when the pre hook rewrote keys) drops the
    internal ``_fpw_module.`` level from the reported names.
    """
    ctx = module.__dict__.pop(_LOAD_CONTEXT, None)
    if not isinstance(ctx, _LoadContext):
        return
    incompatible_keys.missing_keys.extend(ctx.absent)
    if ctx.rewritten:
        inner = ctx.prefix + FPW_MODULE + "."
        for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
            keys[:] = [ctx.prefix + k[len(inner) :] if k.startswith(inner) else k for k in keys]


def _add_wrapper_level(module: FlatOwner, state_dict: Dict[str, Any], prefix: str) -> None:
    inner = prefix + FPW_MODULE + "."
    wrapped = module.module
    # Members registered on the wrapper itself (by a subclass or user code) keep their keys: moved under the wrapped
    # module they were reported missing and unexpected at once. A name the wrapped module has too stays its.
    wrapper = cast(nn.Module, module)
    taken = set(wrapped._parameters) | set(wrapped._buffers) | set(wrapped._modules)
    own_tensors = (set(wrapper._parameters) | set(wrapper._buffers)) - taken
    own_children = set(wrapper._modules) - taken - {FPW_MODULE}
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        rest = key[len(prefix) :] if key.startswith(prefix) else None
        if rest is not None and rest not in own_tensors and rest.split(".", 1)[0] not in own_children:
            key = inner + rest
        state_dict[key] = value
    own_names = {n for n, _ in wrapped.named_parameters(recurse=False)}
    own_names |= {n for n, _ in wrapped.named_buffers(recurse=False)}
    mine = set(module.flat_param_names)
    for key in [k for k in state_dict if k.startswith(inner + FLAT_PARAM)]:
        rest = key[len(inner) :]
        # Only this wrapper's flat parameters go back to it; a child module, a genuine attribute of the wrapped module
        # that happens to start with "flat_param", or the flat parameter of a wrapper nested right inside (FSDP's
        # FSDP(FSDP(module)): the outer one has none, and its local dict names the inner one's "flat_param_0") stays.
        if "." in rest or rest in own_names or rest not in mine:
            continue
        state_dict[prefix + rest] = state_dict.pop(key)


def _fold_original_keys(
    module: FlatOwner, state_dict: Dict[str, Any], prefix: str, error_msgs: List[str], rewritten: bool
) -> List[str]:
    """Replace the original-name entries of each flat group by one flat entry; return the names not found.

    This is what lets a parent module load a wrapper nested in it from original names (the wrapper's own
    ``load_state_dict``, which unflattens instead, is not called then). A group is folded when the wrapper is
    flattened, the flat key is absent and at least one original name is present; absent names keep the current
    values and are reported missing, as a plain module would; of a parameter's names (tied weights, or a
    submodule registered under two names), the last one present in module order gives the value, as a plain
    module loads them in turn. A group none of whose names is present, when another group of this wrapper was
    given by original names, is reported by its original names too (the dict is in that form), not as a missing
    flat entry. Skipped when a flat parameter does not hold its full size (a shard inside FSDP), which this hook
    cannot produce: the caller then sees the plain missing/unexpected keys.
    """
    if not module.is_flattened:
        return []
    # Every path of every module, in the order nn.Module visits them when loading: a submodule registered under
    # two names is loaded (and saved) under both, although named_modules() lists it once.
    paths: Dict[int, List[Tuple[int, str]]] = {}
    for position, (mname, sub) in enumerate(cast(nn.Module, module).named_modules(remove_duplicate=False)):
        paths.setdefault(id(sub), []).append((position, mname))

    def shown(key: str) -> str:
        return prefix + key[len(prefix + FPW_MODULE + ".") :] if rewritten else key

    def keys_of(owner: nn.Module, pname: str) -> List[Tuple[int, str]]:
        return [(position, f"{prefix}{mname}.{pname}") for position, mname in paths.get(id(owner), [])]

    missing: List[Tuple[int, str]] = []
    unnamed: List[Tuple[str, FlatParameter, List[List[Tuple[int, str]]]]] = []
    folded_any = False
    for flat_name, flat in zip(module.flat_param_names, module.flat_params):
        if prefix + flat_name in state_dict or flat.numel() != sum(flat._param_numels):
            continue
        # Every name of each parameter: its first owner's and its tied owners' names under every path of those
        # modules, sorted into module order (stable, so two names in one module keep their registration order).
        names: List[List[Tuple[int, str]]] = [keys_of(owner, pname) for _, owner, pname in flat._param_infos]
        owner_index = {(mname, pname): i for i, (mname, _, pname) in enumerate(flat._param_infos)}
        for _, shared_mname, owner, pname, _, shared_pname in flat._shared_param_infos:
            names[owner_index[(shared_mname, shared_pname)]].extend(keys_of(owner, pname))
        names = [sorted(dict.fromkeys(per_param), key=lambda entry: entry[0]) for per_param in names]
        if not any(key in state_dict for per_param in names for _, key in per_param):
            unnamed.append((flat_name, flat, names))
            continue
        folded_any = True
        with torch.no_grad():
            pieces = list(torch.split(flat.detach(), flat._param_numels))
            for i, (per_param, shape) in enumerate(zip(names, flat._param_shapes)):
                for position, key in per_param:
                    if key not in state_dict:
                        missing.append((position, key))
                        continue
                    value = state_dict.pop(key)
                    # nn.Module's checks and messages, in its order.
                    if not isinstance(value, Tensor):
                        error_msgs.append(
                            f'While copying the parameter named "{shown(key)}", expected torch.Tensor or Tensor-like '
                            f"object from checkpoint but received {type(value)}"
                        )
                        continue
                    if len(shape) == 0 and value.dim() == 1:  # torch's rule for 0-dim parameters saved as 1-dim
                        value = value[0]
                    if value.shape != shape:
                        error_msgs.append(
                            f"size mismatch for {shown(key)}: copying a param with shape {value.shape} from "
                            f"checkpoint, the shape in current model is {torch.Size(shape)}."
                        )
                        continue
                    pieces[i] = value.detach().reshape(-1).to(dtype=flat.dtype, device=flat.device)
            state_dict[prefix + flat_name] = torch.cat(pieces)
    if folded_any:
        # The dict names this wrapper's parameters by their original names: report a wholly absent group the
        # same way. Its flat entry is its current value, so loading it changes nothing.
        for flat_name, flat, names in unnamed:
            state_dict[prefix + flat_name] = flat.detach().clone()
            missing.extend(entry for per_param in names for entry in per_param)
    return [key for _, key in sorted(missing, key=lambda entry: entry[0])]


def refuse_flat_key_names(module: nn.Module) -> None:
    """The wrapper's state dict keys name the module's own members at its top level, beside its flat parameters
    (``flat_param_0``): a member named ``flat_param`` or ``flat_param_*`` was taken for a flat parameter when
    loading (the wrapper could not load its own ``state_dict()``), or clashed with one at construction (``KeyError:
    attribute 'flat_param_0' already exists``).

    Raises:
        ValueError: naming the member and what to do.
    """
    members = [name for name, _ in module.named_children()]
    members += [name for name, p in module.named_parameters(recurse=False) if not isinstance(p, FlatParameter)]
    members += [name for name, _ in module.named_buffers(recurse=False)]
    clashing = [name for name in members if name == "flat_param" or name.startswith("flat_param_")]
    if clashing:
        raise ValueError(
            f"FlattenParamsWrapper: the wrapped {type(module).__name__} has member(s) named {clashing}, which its "
            "state dict keys would confuse with the wrapper's flat parameters ('flat_param', 'flat_param_*'); rename "
            "them, or wrap a module that holds this one (their keys then get its name as prefix)"
        )


@contextlib.contextmanager
def errors_named_by_keys() -> Iterator[None]:
    """Name the dict's keys in a failed load's message instead of the paths loaded into.

    torch words a wrong shape with the path it loaded into (``size mismatch for _fpw_module.0.weight``), where the
    missing and unexpected keys are reported under the dict's names (``0.weight``); found by a fuzz, session 43.
    """
    try:
        yield
    except RuntimeError as e:
        if type(e) is not RuntimeError or FPW_MODULE + "." not in str(e):
            raise
        raise RuntimeError(str(e).replace(FPW_MODULE + ".", "")) from e
