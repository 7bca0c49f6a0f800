# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``copy.deepcopy`` of an object that holds a process group: the copy shares the group.

A process group cannot be copied ("cannot pickle ProcessGroup"), and a copy (an EMA or teacher model, a reference
scaler) is meant to communicate over the same ranks anyway. ``MOELayer``, the experimental ``SyncBatchNorm`` and
``ShardedGradScaler`` define their ``__deepcopy__`` with this, and refuse pickling (``torch.save`` of a whole model,
multiprocessing) with :func:`refuse_pickling_group` while they hold an explicit group: a group means nothing in
another process, and torch's own error ("cannot pickle ProcessGroup") names neither the object nor a way out.
"""

import copy
from typing import Any, Dict, Optional, TypeVar

__all__ = ["deepcopy_sharing_group", "refuse_pickling_group"]

_T = TypeVar("_T")


def deepcopy_sharing_group(obj: _T, memo: Dict[int, Any], group: Optional[Any]) -> _T:
    """A deep copy of ``obj`` (through its ``__getstate__``/``__setstate__`` when it has them, else its ``__dict__``)
    in which ``group`` (``None``: nothing shared) is the same object as in ``obj``."""
    if group is not None:
        memo[id(group)] = group
    cls = type(obj)
    copied = cls.__new__(cls)
    memo[id(obj)] = copied
    getstate = getattr(obj, "__getstate__", None)
    state = getstate() if getstate is not None else obj.__dict__
    state = copy.deepcopy(state, memo)
    setstate = getattr(copied, "__setstate__", None)
    if setstate is not None:
        setstate(state)
    else:
        copied.__dict__.update(state)
    return copied


def refuse_pickling_group(obj: Any, group: Optional[Any]) -> None:
    """Raise a ``TypeError`` naming ``obj`` when it holds an explicit process group (``None``: the default group, which
    is resolved again where it is unpickled, so nothing is raised)."""
    if group is None:
        return
    name = type(obj).__name__
    raise TypeError(
        f"{name} cannot be pickled (torch.save of the object or of a model holding it, multiprocessing): it holds an "
        "explicit process group, which means nothing in another process. Save its state_dict() instead and build the "
        f"{name} with its group where it is loaded; copy.deepcopy works (the copy shares the group)."
    )
