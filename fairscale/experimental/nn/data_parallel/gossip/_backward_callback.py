# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""One callback at the end of each backward through the model's output, queued by hooks on that output.

SlowMo averages the gradients inside the node once the whole backward is done (DDP does it bucket by bucket as the
gradients become ready). The autograd engine runs a queued callback when the graph is done, so a hook on every output
tensor that requires grad queues the callback, once per backward.
"""

import collections
import dataclasses
import functools
import inspect
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Set

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from fairscale.internal.errors import FairscaleTypeError
from fairscale.internal.tensor_hooks import current_graph_task, register_grad_hook

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

    "Once per backward" is kept per autograd graph task (each backward has its own id), not by a flag that the end of
    the backward clears: a backward that raised never runs its queued callback, and such a flag stayed set, so every
    later backward skipped the callback (in eval mode too, where nothing cleared it).

    A leaf tensor in the output (a parameter returned with the logits, or an input returned as it is) has no graph
    of its own: a hook on it stays on the tensor for good. Those hooks hold the callback weakly, are replaced at the
    next :meth:`attach` and removed when this object is freed (with its model); one hook was added per forward and
    never removed, kept the model alive, and ran its callback in later backwards of the unwrapped module.
    """

    def __init__(self) -> None:
        self.queued_task: Optional[int] = None  # the graph task the callback is queued for
        self._leaf_handles: List[RemovableHandle] = []
        # Holds the list, not this object: the hooks go when the model (the owner of this object) is freed.
        weakref.finalize(self, _remove_handles, self._leaf_handles)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "BackwardCallback":
        # A copy of the model (an EMA copy) hooks its own outputs; the original's hooks and queued task are not its.
        return BackwardCallback()

    def reset(self) -> None:
        """Forget a callback queued by a backward that raised (the engine dropped it without running it)."""
        self.queued_task = None

    def attach(self, output: Any, callback: Callable[[], None]) -> int:
        """Hook the tensors of ``output`` that require grad so that their backward ends with ``callback()``.

        Returns:
            int: how many tensors were hooked (0: a backward through ``output`` cannot run ``callback``).
        """
        _remove_handles(self._leaf_handles)  # the previous forward's leaves: this forward's output replaces them
        hooked = 0
        for t in output_tensors(output):
            if not t.requires_grad:
                continue
            if t.grad_fn is None:
                weak_callback = weakref.WeakMethod(callback) if inspect.ismethod(callback) else _strong(callback)
                leaf_hook = functools.partial(_queue_from_leaf, weakref.ref(self), weak_callback)
                self._leaf_handles.append(register_grad_hook(t, leaf_hook))
            else:
                register_grad_hook(t, functools.partial(self._queue, callback))
            hooked += 1
        return hooked

    def _queue(self, callback: Callable[[], None], grad: Tensor) -> None:
        # Once per backward, at its end: the engine runs queued callbacks when the graph is done.
        task = current_graph_task()
        if self.queued_task != task:
            self.queued_task = task
            Variable._execution_engine.queue_callback(functools.partial(self._run, callback))

    def _run(self, callback: Callable[[], None]) -> None:
        self.queued_task = None
        callback()


def _strong(callback: Callable[[], None]) -> Callable[[], Optional[Callable[[], None]]]:
    """A stand-in for a weak reference, for a callback that is no bound method (it ties no model to the tensor)."""
    return lambda: callback


def _queue_from_leaf(
    owner: "weakref.ReferenceType[BackwardCallback]",
    callback: Callable[[], Optional[Callable[[], None]]],
    grad: Tensor,
) -> None:
    # A leaf's hook: holds neither the BackwardCallback nor the model, and does nothing once either is gone.
    callback_now, owner_now = callback(), owner()
    if callback_now is not None and owner_now is not None:
        owner_now._queue(callback_now, grad)


def _remove_handles(handles: List[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
