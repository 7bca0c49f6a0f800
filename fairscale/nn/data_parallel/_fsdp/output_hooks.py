# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The tensor hooks FSDP puts on a forward's outputs: where a unit learns that its backward starts.

A training forward frees (or swaps out) the full parameters its graph saved; the first output whose gradient is
computed gathers them again (the pre-backward). What gets a hook, and why:

* Tensors that require grad and were made by an op (``grad_fn``), in the containers :func:`.io.for_each_tensor` walks.
  A leaf is left alone (but the unit's own parameter): its gradient comes from the ops that used it, none of them
  the unit's, so it needs no gather. A leaf returned as it came in (a soft prompt kept outside the model) took one more hook per forward, never removed:
  every later backward through it ran all of them, and a backward of it alone gathered parameters (on one rank
  only: the ranks fell out of step; found by a fuzz of forward patterns, session 44).
* Not an input handed back as it came (the same tensor, with the ``grad_fn`` it came in with): see
  :func:`register_pre_backward_hooks`.
* Tensors held by a plain object among the outputs (its attributes and slots, four levels deep):
  an output class FSDP does not know (not a container or dataclass) left the unit without a hook, and its backward
  read the freed parameters ("setStorage ... storage of size 0", naming neither FSDP nor the cause).

A forward FSDP ran as evaluation (called under ``torch.no_grad()``) whose module turned grad back on inside
(``torch.enable_grad()``) returns outputs with a graph through freed (or detached) parameters: those in its
containers get a hook that raises a clear error if a backward reaches them (it failed with "setStorage" or gave no
parameter gradients). Inputs handed back as they came are not the forward's: they are left alone, and so are tensors
of input objects held by output objects (a KV cache passed in and returned) in a training forward.
"""

import weakref
from typing import Any, Callable, Dict, List, Set

from torch import Tensor, nn

from fairscale.internal import tensor_hooks

from .io import for_each_tensor
from .unit import FSDPUnit

__all__ = ["passed_in_graph_tensors", "refuse_backward_of_evaluation_outputs", "register_pre_backward_hooks"]

_OBJECT_DEPTH = 4  # how far into plain objects' attributes the fallback looks (an output wrapping an output)


def passed_in_graph_tensors(inputs: Any) -> Dict[int, Any]:
    """The tensors with a graph among a forward's ``inputs`` (containers only), by id, with their ``grad_fn``, taken
    before the forward runs (see :func:`register_pre_backward_hooks`)."""
    found: Dict[int, Any] = {}

    def note(t: Tensor) -> None:
        if t.grad_fn is not None:
            found[id(t)] = t.grad_fn

    for_each_tensor(inputs, note)
    return found


def register_pre_backward_hooks(
    unit: FSDPUnit,
    inputs: Any,
    outputs: Any,
    accs: List[Any],
    counted: bool,
    pre_backward: Callable[[FSDPUnit], None],
    passed_in: Dict[int, Any],
) -> Any:
    """Hook ``outputs`` of a training forward of ``unit`` (see the module docstring); returns them unchanged.

    Args:
        inputs: the forward's ``(args, kwargs)``: tensors of theirs held by an output object (a KV cache passed in
            and returned) are not hooked. They belong to earlier units, whose hooks fired late and gathered them
            again after their reduction (a fuzz of real-world output patterns, session 44).
        accs: the accumulator nodes this forward's graph leads to (see ``runtime._forward_grad_accumulators``).
        counted: whether this forward counts among the unit's uses in the coming backward.
        pre_backward: called with ``unit`` by each hook that fires.
        passed_in: :func:`passed_in_graph_tensors` of the inputs. An output that is one of them, with the
            ``grad_fn`` it came in with, is handed back as it came (T5's position bias, which every block receives and
            returns): not hooked. Its gradient is complete only after the whole backward through it, this unit's
            included; its hook gathered the unit's parameters again after their reduction, each block's at the end of
            backward, all of them at once (twice the gathers, and the whole unsharded model in memory). One changed in
            place by the forward (a new ``grad_fn``) is the unit's result and is hooked.
    """
    tree = unit.tree
    assert tree is not None
    token = tree.new_pending_backward()
    registered = [False]

    def hook(_grad: Tensor) -> None:
        tree.mark_reached(token)
        pre_backward(unit)

    hooked: Set[int] = set()

    def register(t: Tensor) -> None:
        if passed_in and passed_in.get(id(t), False) is t.grad_fn:
            return
        # The unit's own parameter returned as it is (a shard that is the whole parameter: one rank, not flattened;
        # runtime._unalias_outputs copies the others) is a leaf whose gradient needs the gather: hooked (a review).
        if t.requires_grad and (t.grad_fn is not None or any(t is h.param for h in unit.handles)):
            tensor_hooks.register_grad_hook(t, hook)
            registered[0] = True
            hooked.add(id(t))

    for_each_tensor(outputs, register)
    held: List[Tensor] = []
    _for_each_object_tensor(outputs, held.append, _OBJECT_DEPTH, set(), False)
    if held:  # rare: an output object; only then are the inputs walked
        of_inputs = _tensor_ids(inputs)
        for t in held:  # a dataclass's fields were hooked above already, and a tensor may be held twice
            if id(t) not in of_inputs and id(t) not in hooked:
                register(t)
    if not registered[0]:
        token.done = True
        return outputs
    if counted:
        if unit.grad_forward_tokens is None:
            unit.grad_forward_tokens = weakref.WeakSet()
        unit.grad_forward_tokens.add(token)  # dropped with this forward's graph
    if accs:
        if unit.forward_grad_accs is None:
            unit.forward_grad_accs = weakref.WeakKeyDictionary()
        unit.forward_grad_accs[token] = accs  # dropped with the token, i.e. with this forward's graph
    return outputs


def refuse_backward_of_evaluation_outputs(inputs: Any, outputs: Any) -> None:
    """After a forward run as evaluation: hook every output that has a graph anyway with a clear error.

    Not the forward's own ``inputs`` handed back as they came (the caller's graph, not this forward's: a teacher
    returning its input beside its result, torch's reentrant checkpoint or Pipe's first pass, which run under
    ``no_grad``; a review found the first version refusing them).
    """
    passed_through = _tensor_ids(inputs)

    def refuse(_grad: Tensor) -> None:
        raise RuntimeError(
            "FullyShardedDataParallel: a backward reached an output of a forward called under "
            "torch.no_grad() (or inference mode) whose module turned grad back on inside (torch.enable_grad()). "
            "FSDP ran that forward as evaluation: no gradient reduction, and its full parameters are freed or "
            "detached. Call the forward with grad enabled to train through it."
        )

    def register(t: Tensor) -> None:
        if t.requires_grad and t.grad_fn is not None and id(t) not in passed_through:
            tensor_hooks.register_grad_hook(t, refuse)

    # Containers only: an output object (a KV cache kept on the module and extended under no_grad) may hold
    # tensors of an earlier training forward, refused by mistake (a fuzz, session 44).
    for_each_tensor(outputs, register)


def _tensor_ids(inputs: Any) -> Set[int]:
    """The ids of every tensor in ``inputs`` (an ``(args, kwargs)`` pair), in containers and plain objects."""
    ids: Set[int] = set()
    _for_each_object_tensor(inputs, lambda t: ids.add(id(t)), _OBJECT_DEPTH + 2, set(), True)
    return ids


def _for_each_object_tensor(obj: Any, fn: Callable[[Tensor], None], depth: int, seen: Set[int], inside: bool) -> None:
    """``fn`` on the tensors held by plain objects in ``obj`` (through their attributes, ``__dict__``), at most
    ``depth`` levels down.

    Containers are walked to the objects they hold; tensors outside any object (:func:`.io.for_each_tensor`'s) are
    not passed again. Modules (a layer handed back holds parameters, not this forward's results), classes and objects
    already seen (an object graph may have cycles) are skipped.
    """
    if isinstance(obj, Tensor):
        if inside:
            fn(obj)
        return
    if depth <= 0 or id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, bool, nn.Module)):
        return
    seen.add(id(obj))
    values: Any
    if isinstance(obj, dict):
        values = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        values = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
        values = list(getattr(obj, "__dict__", {}).values())
        for klass in type(obj).__mro__:  # __slots__ classes keep their attributes out of __dict__
            for name in getattr(klass, "__slots__", ()):
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    values.append(getattr(obj, name))
        inside = True
    else:
        return
    for value in values:
        _for_each_object_tensor(value, fn, depth - 1, seen, inside)
