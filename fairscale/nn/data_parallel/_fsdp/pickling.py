# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Pickling a whole FSDP model (``torch.save(model)``, ``pickle.dumps(model)``): what is written is a copy.

Between steps the wrapped modules' parameter attributes are views of freed full buffers: tensors larger than their
storage, which ``torch.load`` cannot rebuild ("Trying to resize storage that is not resizable"). A deep copy of the
model (``FullyShardedDataParallel.__deepcopy__``) has no such views (its next forward makes them), so pickling an
instance pickles a deep copy of it instead. The copy costs the memory of the instance's shards while it is written.
"""

import copy
import weakref
from typing import Any, Callable, Dict, Tuple, cast

from torch import nn

from . import runtime
from .freed_views import FreedParameter, FreedViews
from .unit import UNIT_ATTR, FSDPUnit, keeping_process_groups, process_groups_of

# Instances made by reduce_to_copy(): pickled as they are. Weak: a copy lives only as long as its pickling.
_COPIES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def is_copy_for_pickling(model: nn.Module) -> bool:
    """Whether ``model`` is (part of) a copy made by :func:`reduce_to_copy`."""
    return model in _COPIES


def _itself(model: nn.Module) -> nn.Module:
    """Unpickling side of :func:`reduce_to_copy`: the copy is the model."""
    return model


def reduce_to_copy(model: nn.Module, unit: FSDPUnit) -> Tuple[Callable[[nn.Module], nn.Module], Tuple[Any, ...]]:
    """``__reduce_ex__`` of an FSDP instance (``model``, whose unit is ``unit``): pickle a view-free deep copy.

    The copy is an argument of the reduction, not just its state: the pickler then holds it until it is written
    (module hooks refer to their module weakly) and memoizes it like any object.

    Raises:
        RuntimeError: inside a forward or backward, or between a forward and its backward (the copy could not run
            that backward).
    """
    runtime.check_copyable(unit, "pickling (torch.save or pickle.dumps of the model)")
    clone = copy.deepcopy(model)
    for m in clone.modules():
        if hasattr(m, UNIT_ATTR):
            _COPIES.add(m)
        for name in [n for n, value in vars(m).items() if isinstance(value, FreedParameter)]:
            del m.__dict__[name]  # a stand-in refuses pickling; unpickling makes the copy's (relink_copy)
    return _itself, (clone,)


def deep_copy(module: Any, unit: FSDPUnit, memo: Dict[int, Any]) -> nn.Module:
    """``copy.deepcopy`` of the FSDP instance ``module`` (whose unit is ``unit``): an independent model on the same
    process groups, usable at once. Refused while a step is under way (see ``runtime.check_copyable``)."""
    runtime.check_copyable(unit)
    # Groups are process-local handles: the copy shares them (a pickle, which crosses processes, drops them).
    for u in unit.tree_units():
        for group in process_groups_of(u):
            memo.setdefault(id(group), group)
    cls: Any = type(module)
    new = cls.__new__(cls)
    memo[id(module)] = new
    with keeping_process_groups():
        state = copy.deepcopy(module.__getstate__(), memo)
    new.__setstate__(state)
    return cast(nn.Module, new)


def relink_copy(model: nn.Module, unit: FSDPUnit) -> None:
    """``__setstate__`` of an instance (a copy's or an unpickled one's): link ``unit`` to ``model`` again."""
    unit.relink(model)
    for handle in unit.handles:
        if handle.is_sharded:  # a copy has no views: the shapes and dtypes until its first forward, as the original
            FreedViews.install_missing(handle.param)
    # Copies and pickles of a parameter drop its hooks: the copy's parameters get their own.
    runtime.register_post_backward_hooks(unit)
