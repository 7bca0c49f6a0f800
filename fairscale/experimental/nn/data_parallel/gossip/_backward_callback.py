# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""One callback at the end of each backward through the model's output, queued by hooks on that output.

SlowMo averages the gradients inside the node once the whole backward is done (DDP does it bucket by bucket as the
gradients become ready). The autograd engine runs a queued callback when the graph is done, so a hook on every output
tensor that requires grad queues the callback, once per backward.
"""

import collections
import dataclasses
import functools
from typing import Any, Callable, List, Mapping, Set

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.autograd import Variable

from fairscale.internal.errors import FairscaleTypeError

__all__ = ["BackwardCallback", "has_opaque_parts", "output_tensors", "unhooked_output_error"]


def output_tensors(output: Any) -> List[Tensor]:
    """The tensors of ``output``, each once, wherever they are nested: in the containers ``torch.utils._pytree``
    knows (lists, tuples, namedtuples, dicts, ``OrderedDict``, ``deque``, and the types registered with it),
    dataclasses, and subclasses of ``Mapping``, ``list``, ``tuple``, ``set`` that pytree leaves whole."""
    found: List[Tensor] = []
    _collect(output, found, set(), [])
    return found


# Leaves that hold no tensor: what a walk may meet without missing one.
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def has_opaque_parts(output: Any) -> bool:
    """Whether ``output`` holds objects :func:`output_tensors` cannot look into (a class pytree does not know, that
    is no dataclass): tensors in them, and their gradients, go unseen. Tensors, containers and plain values
    (numbers, strings, ``None``) are not opaque: an output of predictions that need no gradient (``argmax``) is
    transparent."""
    opaque: List[Any] = []
    _collect(output, [], set(), opaque)
    return bool(opaque)


def _collect(obj: Any, found: List[Tensor], seen: Set[int], opaque: List[Any]) -> None:
    if isinstance(obj, Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            found.append(obj)
        return
    if id(obj) in seen:  # a container reached twice (or a cycle through a dataclass field)
        return
    seen.add(id(obj))  # the output keeps every object alive during the walk: ids are not reused
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Model-output records: pytree leaves them whole unless registered, and their tensors went unhooked.
        for field in dataclasses.fields(obj):
            _collect(getattr(obj, field.name, None), found, seen, opaque)
        return
    leaves, _ = pytree.tree_flatten(obj)
    if len(leaves) != 1 or leaves[0] is not obj:
        for leaf in leaves:  # pytree's leaves are no pytree containers; they may still be dataclasses
            _collect(leaf, found, seen, opaque)
        return
    if isinstance(obj, Mapping):
        for value in obj.values():
            _collect(value, found, seen, opaque)
    elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):  # torch < 2.2's pytree leaves deques
        for item in obj:
            _collect(item, found, seen, opaque)
    elif not isinstance(obj, _PLAIN_LEAVES):
        opaque.append(obj)


def unhooked_output_error(output: Any) -> FairscaleTypeError:
    """The error for a training output in which :func:`output_tensors` found no tensor that requires grad."""
    return FairscaleTypeError(
        f"SlowMoDistributedDataParallel: the module's output ({type(output).__name__}) holds no tensor that requires "
        "grad where SlowMo looks (tensors, and lists, tuples, dicts, dataclasses and the other containers "
        "torch.utils._pytree knows, nested), so the gradient averaging inside the node (or SGP's push-sum step) at "
        "the end of backward would not run; return the tensors the loss is computed from, in such a container (or "
        "register the output's type with torch.utils._pytree.register_pytree_node), or run forwards that are not "
        "followed by a backward under torch.no_grad() or after .eval()"
    )


class BackwardCallback:
    """Runs a callback once at the end of each backward that reaches a hooked output.

    The callback is passed to :meth:`attach` rather than kept here: the model owns this object, so a bound method of
    the model kept here would tie the two together for good; the hooks hold the callback only while the output's
    graph lives.
    """

    def __init__(self) -> None:
        self.queued = False  # the callback is queued for the running backward

    def reset(self) -> None:
        """Forget a callback queued by a backward that raised (the engine dropped it without running it)."""
        self.queued = False

    def attach(self, output: Any, callback: Callable[[], None]) -> int:
        """Hook the tensors of ``output`` that require grad so that their backward ends with ``callback()``.

        Returns:
            int: how many tensors were hooked (0: a backward through ``output`` cannot run ``callback``).
        """
        hook = functools.partial(self._queue, callback)
        hooked = 0
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(hook)
                hooked += 1
        return hooked

    def _queue(self, callback: Callable[[], None], grad: Tensor) -> Tensor:
        # Once per backward, at its end: the engine runs queued callbacks when the graph is done.
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(functools.partial(self._run, callback))
        return grad

    def _run(self, callback: Callable[[], None]) -> None:
        self.queued = False
        callback()
