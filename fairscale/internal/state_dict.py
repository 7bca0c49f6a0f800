# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Helpers for rewriting state-dict keys and locating submodules by state-dict path."""

from typing import Any, Dict, List, Tuple, Type

from torch import nn

__all__ = ["find_module_instances", "replace_by_prefix_"]


def find_module_instances(module: nn.Module, search_class: Type[nn.Module]) -> List[Tuple[str, nn.Module]]:
    """Every submodule of ``module`` (itself included) that is a ``search_class``, with its state-dict prefix.

    Prefixes are in state-dict form: ``""`` for ``module`` itself, ``"1.ln."`` for
    ``module[1].ln``. The search continues inside matches, and a module reachable by several
    paths is reported once per path.

    Example::

        >>> net = nn.Sequential(nn.Linear(1, 1), nn.ModuleDict({"ln": nn.LayerNorm(1)}), nn.LayerNorm(1))
        >>> [(prefix, type(m).__name__) for prefix, m in find_module_instances(net, nn.LayerNorm)]
        [('1.ln.', 'LayerNorm'), ('2.', 'LayerNorm')]
        >>> find_module_instances(net, nn.Sequential) == [("", net)]
        True

    Args:
        module (nn.Module): the module to search.
        search_class (Type[nn.Module]): the class (subclasses match too).

    Returns:
        List[Tuple[str, nn.Module]]: ``(prefix, submodule)`` pairs, in ``named_children`` depth-first order
        (upstream's return type).
    """
    found: List[Tuple[str, nn.Module]] = []

    def visit(current: nn.Module, prefix: str) -> None:
        if isinstance(current, search_class):
            found.append((prefix, current))
        for name, child in current.named_children():
            visit(child, prefix + name + ".")

    visit(module, "")
    return found


def replace_by_prefix_(state_dict: Dict[str, Any], old_prefix: str, new_prefix: str) -> None:
    """Rename, in place, every key of ``state_dict`` that starts with ``old_prefix``.

    ``old_prefix + rest`` becomes ``new_prefix + rest``. Renamed keys move to the end of the
    dict in their original relative order (the state-dict hooks rely on this being stable).

    Example::

        >>> sd = {"layer.weight": 1, "other": 2}
        >>> replace_by_prefix_(sd, "layer.", "module.layer.")
        >>> sd
        {'other': 2, 'module.layer.weight': 1}

    Args:
        state_dict (Dict[str, Any]): the dict to modify (e.g. a state dict).
        old_prefix (str): the prefix to replace.
        new_prefix (str): its replacement.

    Raises:
        ValueError: if the two prefixes are equal, or a renamed key would replace a key that is not renamed (e.g.
            ``"module.w"`` and ``"w"`` with ``"module."`` -> ``""``); the dict is unchanged then.
    """
    if old_prefix == new_prefix:
        raise ValueError(f"replace_by_prefix_: old_prefix and new_prefix must be distinct, both are {old_prefix!r}")
    renamed = [(k, new_prefix + k[len(old_prefix) :]) for k in state_dict.keys() if k.startswith(old_prefix)]
    # All renames are taken out before any is put back: renaming one key at a time overwrote a key still waiting to
    # be renamed ("m.m.w" -> "m.w" before "m.w" -> "w"), and the result depended on the keys' order.
    moving = {old for old, _ in renamed}
    clashes = [new for _, new in renamed if new in state_dict and new not in moving]
    if clashes:
        raise ValueError(
            f"replace_by_prefix_: renaming {old_prefix!r} to {new_prefix!r} would overwrite the existing key(s) "
            f"{clashes[:4]}{' ...' if len(clashes) > 4 else ''}; remove or rename them first"
        )
    values = [state_dict.pop(old) for old, _ in renamed]
    for (_, new), value in zip(renamed, values):
        state_dict[new] = value
