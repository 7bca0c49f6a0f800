# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Let a dropped FlattenParamsWrapper take its flat parameters and wrapped modules with it.

Between forwards every wrapped module keeps the views it computed with as plain attributes, and those views carry
their autograd graph back to the flat parameter::

    FlatParameter.__dict__["_param_infos"] -> module -> module.weight (a view) -> view.grad_fn
        -> AccumulateGrad(flat parameter) -> flat parameter

The last two hops are C++ references. Python's cycle collector sees neither, and it counts a tensor that C++ still
holds as alive, so nothing on that ring was ever freed: every dropped wrapper (or FSDP model) kept its flat
parameters, its modules and their tensors, with or without a forward (the views installed at construction have the
same graph).

The ring cannot be cut while the wrapper lives: the views must keep their graph (a module may be called, or a
checkpointed region recomputed in the backward, with the views of the last forward), and ``_param_infos`` is the
flat parameter's public record of its owners. So the wrapper cuts it when it goes: a finalizer registered once per
wrapper (construction, deep copy, unpickling; nothing per forward) replaces, when the wrapper is freed, each view a
module holds under a flattened name by a detached alias of it (same storage, shape and values, no graph), and does
the same in ``_unflattened_param_views``. The views' graph is then released by reference counting, and the flat
parameters and modules follow as soon as nothing else (an optimizer, a live output's graph) holds them.

The finalizer holds only weak references (it never keeps anything alive), and a flat parameter shared by several
live wrappers (``copy.copy``) is only released by the last one to go.
"""

import weakref
from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["release_views_on_collection"]

# id(flat parameter) -> number of live wrappers holding it (a wrapper holds its flat parameters strongly, so an id
# counted here cannot be reused while its count is above zero).
_OWNERS: Dict[int, int] = {}

_FlatRefs = List[Tuple[int, "weakref.ReferenceType[Any]"]]


def release_views_on_collection(wrapper: nn.Module) -> None:
    """Detach the views of ``wrapper``'s flat parameters from their graph once ``wrapper`` is freed (module doc)."""
    flats = list(wrapper.__dict__.get("flat_params", None) or [])
    module = wrapper.__dict__["_modules"].get("_fpw_module")
    for flat in flats:
        _OWNERS[id(flat)] = _OWNERS.get(id(flat), 0) + 1
    flat_refs: _FlatRefs = [(id(flat), weakref.ref(flat)) for flat in flats]
    module_ref = None if module is None else weakref.ref(module)
    finalizer = weakref.finalize(wrapper, _release, flat_refs, module_ref)
    finalizer.atexit = False  # at exit there is nothing to free: do not walk every live wrapper


def _release(flat_refs: _FlatRefs, module_ref: "Optional[weakref.ReferenceType[nn.Module]]") -> None:
    # A wrapper may be collected while a tensor mode is active (FakeTensorMode while torch.compile traces): detach()
    # would go to that mode and fail on these real tensors ("Exception ignored", and the wrapper leaked; a fuzz,
    # session 46). The modes are for the traced program, not for this cleanup.
    with _disable_current_modes():
        _release_views(flat_refs, module_ref)


def _release_views(flat_refs: _FlatRefs, module_ref: "Optional[weakref.ReferenceType[nn.Module]]") -> None:
    # id(view) -> (view, its detached alias): a tied name keeps sharing one tensor; the view is kept so its id stays
    # unique until the end.
    detached: Dict[int, Tuple[Tensor, Tensor]] = {}
    all_released = True
    for flat_id, ref in flat_refs:
        left = _OWNERS.get(flat_id, 1) - 1
        if left > 0:
            _OWNERS[flat_id] = left
            all_released = False
            continue
        _OWNERS.pop(flat_id, None)
        flat = ref()
        if flat is None:
            continue
        slots = [(m, n) for _, m, n in getattr(flat, "_param_infos", [])]
        slots += [(m, n) for _, _, m, n, _, _ in getattr(flat, "_shared_param_infos", [])]
        for m, n in slots:
            attrs = m.__dict__
            view = attrs.get(n)
            if isinstance(view, Tensor) and view.grad_fn is not None:
                attrs[n] = _detached(view, detached)
    module = None if module_ref is None else module_ref()
    if module is None:
        return
    views = module.__dict__.get("_unflattened_param_views")
    if isinstance(views, list):
        if all_released:
            views = [_detached(v, detached) if isinstance(v, Tensor) and v.grad_fn is not None else v for v in views]
        else:  # some flat parameters still serve another wrapper: only swap what was detached above
            views = [detached[id(v)][1] if id(v) in detached else v for v in views]
        module.__dict__["_unflattened_param_views"] = views


def _detached(view: Tensor, memo: Dict[int, Tuple[Tensor, Tensor]]) -> Tensor:
    if id(view) not in memo:
        memo[id(view)] = (view, view.detach())
    return memo[id(view)][1]
