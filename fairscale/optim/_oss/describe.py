# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What OSS's rank-agreement checks compare beyond the parameters: the optimizer and its hyper-parameters.

Every rank of an OSS group must step its shard with the same optimizer class and hyper-parameters, or the replicas
drift apart silently. The descriptions here ride in OSS's existing construction (and ``add_param_group``) gather, so
they must compare equal across processes exactly when the values are equal.
"""

import functools
import inspect
import re
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch

__all__ = ["comparable", "callable_name", "declared_hyper_parameters", "describe_hyper_parameters"]

# A memory address in a repr (``<function f at 0x7f...>``): different in every process even for the same value.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# Hyper-parameter tensors up to this many elements are compared by value, larger ones by shape and dtype only.
_COMPARED_ELEMENTS = 64


def comparable(value: Any) -> str:
    """A description of a hyper-parameter that two ranks can compare: equal when the values are equal.

    Reprs, so that any value can be compared, but exact for tensors (whose repr rounds to four digits) and without
    the memory addresses that the repr of a function or of an arbitrary object carries.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() <= _COMPARED_ELEMENTS:
            return f"tensor({value.detach().cpu().tolist()!r}, dtype={value.dtype})"
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if type(value) in (tuple, list) and any(isinstance(v, torch.Tensor) for v in value):
        # betas=(tensor(0.9), tensor(0.999)): the repr of the tuple rounded its tensors too (a fuzz, session 49).
        inner = ", ".join(comparable(v) for v in value)
        return f"({inner})" if type(value) is tuple else f"[{inner}]"
    return _ADDRESS.sub(" at 0x...", repr(value))


def tensors_of(param_group: Dict[str, Any]) -> List[Any]:
    """A group's parameters: torch 2.6+ also takes ``(name, parameter)`` pairs, which it splits when it adds them
    (described as pairs, they failed with "'tuple' object has no attribute 'shape'"; a fuzz, session 49)."""
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in param_group["params"]]


def callable_name(fn: Any) -> str:
    """``module.qualname`` of the wrapped optimizer's class (or factory), the same on every rank that passes it."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({callable_name(fn.func)})"
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:
        return f"an instance of {type(fn).__module__}.{type(fn).__qualname__}"
    return f"{getattr(fn, '__module__', '?')}.{qualname}"


def declared_hyper_parameters(optim: Any) -> Optional[FrozenSet[str]]:
    """The hyper-parameters that the wrapped optimizer declares by name; ``None``: compare every key.

    For a class, the named parameters of every ``__init__`` in its MRO (a subclass that passes ``**kwargs`` on to
    ``torch.optim.SGD`` declares SGD's); for a ``functools.partial`` or another callable, its signature's. A keyword
    that only a ``**kwargs`` takes is then no hyper-parameter the optimizer knows: upstream's test optimizer takes
    each process's ``rank`` that way, which differs between ranks by design. An optimizer that declares none (a
    factory ``lambda params, **kw: ...``, a class taking ``**kwargs`` only) has every key compared.
    """
    names: Set[str] = set()
    # Each class's own __init__ (vars: not the inherited one again), or the factory itself.
    callables = [vars(c).get("__init__") for c in inspect.getmro(optim)] if inspect.isclass(optim) else [optim]
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for fn in callables:
        if not callable(fn):
            continue  # a class in the MRO without an __init__ of its own
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # object.__init__, builtins: nothing declared there
        names.update(name for name, p in signature.parameters.items() if p.kind in kinds)
    names -= {"self", "params", "defaults"}
    return frozenset(names) if names else None


def describe_hyper_parameters(
    groups: List[Dict[str, Any]], first_group: int = 0, declared: Optional[FrozenSet[str]] = None
) -> List[Tuple[str, Any]]:
    """``(group, ((name, value), ...))`` of every group's hyper-parameters, values as :func:`comparable` reprs.

    Args:
        groups: the parameter groups.
        first_group: the index of ``groups[0]`` in the optimizer (for the names).
        declared: when given, only these keys are described (see :func:`declared_hyper_parameters`).
    """
    return [
        (
            f"group {first_group + g} hyper-parameters",
            tuple(
                sorted(
                    (str(k), comparable(v))
                    for k, v in group.items()
                    if k != "params" and (declared is None or k in declared)
                )
            ),
        )
        for g, group in enumerate(groups)
    ]


def constructor_defaults(optim: Any, defaults: Dict[str, Any]) -> Dict[str, Any]:
    """``defaults`` as ``optim``'s constructor takes them.

    torch's ``AdamW`` lists ``decoupled_weight_decay=True`` in its ``defaults`` (inherited from ``Adam``) but its
    constructor refuses the keyword, so rebuilding it from ``**optimizer.defaults`` (PyTorch Lightning's sharded
    strategies: ``OSS(params, optim=type(opt), **opt.defaults)``) failed with a ``TypeError`` naming neither OSS nor
    the key. ``True`` is what ``AdamW`` always does: dropped; ``False`` cannot be honoured by ``AdamW``: refused.
    """
    key = "decoupled_weight_decay"
    if key not in defaults or not (inspect.isclass(optim) and issubclass(optim, torch.optim.AdamW)):
        return defaults
    if key in inspect.signature(torch.optim.AdamW.__init__).parameters:
        return defaults  # a torch whose AdamW takes it
    if defaults[key] is True:
        return {k: v for k, v in defaults.items() if k != key}
    raise ValueError(
        f"OSS: optim={optim.__name__} always decouples weight decay, but {key}={defaults[key]!r} was passed (AdamW's "
        "constructor does not take this keyword); leave it out, or use optim=torch.optim.Adam for coupled weight decay"
    )
