# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""From FlattenParamsWrapper's ``param_list`` argument to validated groups with the location of every param.

Two steps, both pure (nothing is modified):

1. :func:`normalize_param_groups` accepts ``None`` / a flat list / a list of lists and returns a list of
   non-empty groups of distinct parameters, rejecting parameters that are not in the module or that are listed
   in two groups.
2. :func:`locate_groups` walks the module tree once and records, per group, where each parameter lives: the
   first owner (in ``named_modules()`` pre-order) becomes a ``ParamInfo``, and every further owner of the same
   parameter (tied weights) a ``SharedParamInfo`` pointing back at the first one. The order of the
   ``ParamInfo`` list is the order of the parameters inside the flat tensor.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence

import torch.nn as nn
from torch import Tensor

from fairscale.internal.errors import FairscaleValueError
from fairscale.internal.sparse_layers import sparse_gradient_layer

from .flat_parameter import FlatParameter, ParamInfo, SharedParamInfo

__all__ = ["GroupLayout", "normalize_param_groups", "locate_groups", "check_flat_param_names"]

# Name of the attribute under which FlattenParamsWrapper holds the wrapped module; module names produced by
# walking the wrapper start with it.
FPW_MODULE = "_fpw_module"


@dataclass
class GroupLayout:
    """Where the parameters of one future flat parameter live in the module tree.

    Attributes:
        param_infos: ``(module_name, module, param_name)`` of every distinct parameter, in flattening order.
        shared_param_infos: ``(module_name, shared_module_name, module, param_name, shared_module,
            shared_param_name)`` for every further name of a parameter already in ``param_infos``.
    """

    param_infos: List[ParamInfo] = field(default_factory=list)
    shared_param_infos: List[SharedParamInfo] = field(default_factory=list)

    def params(self) -> List[nn.Parameter]:
        """The parameters in flattening order (read from their owners)."""
        return [getattr(m, n) for _, m, n in self.param_infos]

    def user_names(self) -> List[str]:
        """Names of the parameters as the unwrapped module would report them (for error messages)."""
        return [user_param_name(mname, pname) for mname, _, pname in self.param_infos]


def user_param_name(module_name: str, param_name: str) -> str:
    """``"_fpw_module.0"`` + ``"weight"`` → ``"0.weight"``: the name without the wrapper's own level."""
    parts = [p for p in module_name.split(".") if p and p != FPW_MODULE]
    return ".".join(parts + [param_name])


def normalize_param_groups(module: nn.Module, param_list: Any) -> List[List[nn.Parameter]]:
    """Turn ``param_list`` into a list of non-empty groups of distinct parameters of ``module``.

    Args:
        module: the module being wrapped.
        param_list: ``None`` (all parameters, one group), an iterable of parameters (one group) or an iterable
            of iterables of parameters (several groups). Empty groups are dropped; repeats inside a group are
            ignored.

    Returns:
        The groups, in the given order, each in the given order (flattening order is decided later).

    Raises:
        ValueError: an element is not a parameter of ``module``, a parameter is in two groups, or the
            list mixes parameters and groups.
    """
    if param_list is None:
        return [list(module.parameters())] if any(True for _ in module.parameters()) else []
    if isinstance(param_list, Tensor):
        raise ValueError("param_list must be a list of parameters (or a list of such lists), not a single tensor")
    if isinstance(param_list, Mapping):
        # Iterating a dict (named_parameters() made into one) gives its names: "not a mix ... ['str']" misled.
        raise ValueError(
            "param_list must be a list of parameters (or a list of such lists), not a mapping; pass "
            "list(d.values()) for a dict of name to parameter"
        )
    items = list(param_list)
    if all(isinstance(p, Tensor) for p in items):
        raw_groups: List[List[Any]] = [items] if items else []
    elif all(_is_group(g) for g in items):
        raw_groups = [list(g) for g in items]
    else:
        raise ValueError(
            "param_list must be either a list of parameters (one group) or a list of lists of parameters "
            f"(several groups), not a mix; got element types {sorted({type(x).__name__ for x in items})}"
        )
    names = _first_names(module)
    group_of: Dict[int, int] = {}
    groups: List[List[nn.Parameter]] = []
    for gi, raw in enumerate(raw_groups):
        group: List[nn.Parameter] = []
        for p in raw:
            _check_member(p, gi, names)
            seen = group_of.get(id(p))
            if seen is None:
                group_of[id(p)] = gi
                group.append(p)
            elif seen != gi:
                raise ValueError(
                    f"parameter '{names[id(p)]}' is listed in param_list groups {seen} and {gi}; "
                    "a parameter can be flattened into one group only"
                )
        if group:
            groups.append(group)
    return groups


def _refuse_sparse_gradients(module: nn.Module, groups: Sequence[Sequence[nn.Parameter]]) -> None:
    """Raise ``ValueError`` if a flattened parameter is the weight of a layer that makes sparse gradients.

    A flat parameter's gradient is one dense tensor: the first backward failed with "reshape is not implemented for
    sparse tensors" (a fuzz of FlattenParamsWrapper, session 46; FullyShardedDataParallel refused it already).
    """
    sparse = sparse_gradient_layer(module, among={id(p) for g in groups for p in g})
    if sparse is not None:
        path = ".".join(p for p in sparse[0].split(".") if p != FPW_MODULE)
        raise ValueError(
            f"FlattenParamsWrapper cannot flatten the weight of {path or 'the module'}, an {sparse[1]} with "
            "sparse=True (a flat parameter's gradient is dense). Build it with sparse=False, or leave its weight out "
            "of param_list."
        )


def locate_groups(wrapper: nn.Module, groups: Sequence[Sequence[nn.Parameter]]) -> List[GroupLayout]:
    """Find every (module, name) holding each grouped parameter, walking ``wrapper.named_modules()``.

    Module names are relative to ``wrapper`` (so they start with ``_fpw_module``). Also checks that each group
    is homogeneous in dtype, device and ``requires_grad``.

    Raises:
        ValueError: a group mixes dtypes, devices or ``requires_grad``; the message names the parameters. A grouped
            parameter is the weight of a layer with sparse gradients.
    """
    _refuse_sparse_gradients(wrapper, groups)
    group_of = {id(p): gi for gi, group in enumerate(groups) for p in group}
    layouts = [GroupLayout() for _ in groups]
    owners: Dict[int, ParamInfo] = {}
    for mname, m in wrapper.named_modules():
        for pname, p in nn.Module.named_parameters(m, recurse=False, remove_duplicate=False):  # not an override
            gi = group_of.get(id(p))
            if gi is None:
                continue
            owner = owners.get(id(p))
            if owner is None:
                owners[id(p)] = (mname, m, pname)
                layouts[gi].param_infos.append((mname, m, pname))
            else:
                omname, om, opname = owner
                layouts[gi].shared_param_infos.append((mname, omname, m, pname, om, opname))
    for gi, layout in enumerate(layouts):
        _check_homogeneous(gi, layout)
    return layouts


def check_flat_param_names(flat_param_names: Any, num_groups: int) -> List[str]:
    """Validate user-given flat parameter names (or make the default ``"0", "1", ...``).

    Returns:
        The full registered names, ``flat_param_<name>``.
    """
    if flat_param_names is None:
        names = [str(i) for i in range(num_groups)]
    else:
        names = [str(n) for n in flat_param_names]
        if len(names) != num_groups:
            raise ValueError(
                f"flat_param_names has {len(names)} entries but there are {num_groups} non-empty parameter "
                "groups; give one name per group (empty groups are ignored)"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"flat_param_names must be unique, got {names}")
        bad = [n for n in names if not n or "." in n]
        if bad:
            raise ValueError(f"flat_param_names must be non-empty and contain no '.', got {bad}")
    return [f"flat_param_{n}" for n in names]


def _is_group(g: Any) -> bool:
    return isinstance(g, (list, tuple, set, frozenset))


def _first_names(module: nn.Module) -> Dict[int, str]:
    names: Dict[int, str] = {}
    for name, p in nn.Module.named_parameters(module, remove_duplicate=False):  # registered ones, not an override's
        names.setdefault(id(p), name)
    return names


def _check_member(p: Any, gi: int, names: Dict[int, str]) -> None:
    if not isinstance(p, Tensor):
        raise ValueError(f"param_list group {gi} contains a {type(p).__name__}; only parameters can be flattened")
    if id(p) not in names:
        raise ValueError(
            f"param_list group {gi} contains a tensor of shape {tuple(p.shape)} that is not a parameter of the "
            "wrapped module; pass parameters taken from the module you wrap"
        )
    if isinstance(p, FlatParameter):
        raise ValueError(
            f"parameter '{names[id(p)]}' is already a FlatParameter and cannot be flattened again; leave it out of "
            "param_list (FlatParameters cannot be nested)"
        )


class MixedParameterGroupError(FairscaleValueError):
    """A flat parameter's group mixes dtypes, devices or ``requires_grad`` (FSDP adds how to split the group)."""


def _check_homogeneous(gi: int, layout: GroupLayout) -> None:
    params = layout.params()
    names = layout.user_names()
    for what, values in (
        ("dtypes", [p.dtype for p in params]),
        ("devices", [p.device for p in params]),
        ("requires_grad", [p.requires_grad for p in params]),
    ):
        if len(set(values)) > 1:
            listing = ", ".join(f"{n} ({v})" for n, v in zip(names, values))
            # Also an AssertionError: upstream asserted that requires_grad agrees.
            raise MixedParameterGroupError(
                f"parameter group {gi} mixes {what}: {listing}. All parameters of one flat parameter must "
                "agree; put the others in a separate group (param_list=[[...], [...]]) or leave them out"
            )
