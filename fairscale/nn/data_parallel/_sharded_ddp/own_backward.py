# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Which backwards are a ShardedDataParallel's own: those that run through the outputs of its training forwards.

The reduce hooks sit on the parameters, and every backward that reaches a parameter calls them: also the backward of
another wrapper built over the same module later (two Lightning fits of one model, the first wrapper still referenced
by its trainer), and a plain backward through the bare module after training (a gradient check on rank 0 only). A
wrapper whose last backward was completely reduced started a new round of reductions for such a backward: two
reducers raced on the same gradients (wrong values, internal errors), and a backward run by one rank alone waited in
a collective until the group's timeout.

The first backward after each training forward is reduced as before: its loss may be built from any tensor of the
forward's graph. A later one (two forwards then two backwards, ``backward(retain_graph=True)`` twice, a second loss
over other parameters) is reduced only when it is the wrapper's own: it runs through a tensor the wrapper's forward
returned (a pre-hook on that tensor's autograd node says so, for that backward only), or it runs inside the wrapper's
forward (manual optimization). When the output holds no tensor with a graph (a type that the walk below does not
open), the reducer cannot tell and keeps reducing every backward, as before.
"""

import collections
import dataclasses
import functools
import weakref
from typing import Any, List, Mapping, Protocol, Set

import torch
import torch.utils._pytree as pytree
from torch.autograd import Variable

from fairscale.internal.compiler import call_outside_compiler

__all__ = ["OwnBackward", "graph_nodes", "watch"]


class OwnBackward(Protocol):
    """What the pre-hooks set on the reducer."""

    own_backward_running: bool


def graph_nodes(output: Any) -> List[Any]:
    """The distinct autograd nodes of the tensors in ``output`` that have one.

    Tensors are found in the containers ``torch.utils._pytree`` knows (tuples, lists, dicts, namedtuples, and the types
    registered with it, such as transformers' model outputs), in dataclasses, and in subclasses of ``Mapping``,
    ``list`` and ``tuple`` that pytree leaves whole.
    """
    nodes: List[Any] = []
    _walk(output, nodes, set(), set())
    return nodes


def _walk(obj: Any, nodes: List[Any], seen: Set[int], node_ids: Set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        node = obj.grad_fn
        if node is not None and id(node) not in node_ids:  # ``nodes`` keeps them alive: no id is reused
            node_ids.add(id(node))
            nodes.append(node)
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or id(obj) in seen:
        return
    seen.add(id(obj))  # the output keeps every object alive during the walk; also stops cycles
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _walk(getattr(obj, field.name, None), nodes, seen, node_ids)
        return
    leaves = pytree.tree_leaves(obj)
    if len(leaves) != 1 or leaves[0] is not obj:
        for leaf in leaves:
            _walk(leaf, nodes, seen, node_ids)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _walk(value, nodes, seen, node_ids)
    elif isinstance(obj, (list, tuple, collections.deque)):
        for item in obj:
            _walk(item, nodes, seen, node_ids)


def watch(nodes: List[Any], reducer: OwnBackward) -> None:
    """Make every backward that runs through one of ``nodes`` the reducer's own, until that backward ends.

    The pre-hooks hold the reducer weakly: a graph kept alive must not keep a dropped wrapper alive.
    """
    hook = functools.partial(_own_backward_starts, weakref.ref(reducer))
    for node in nodes:
        node.register_prehook(hook)


def _own_backward_starts(reducer_ref: "weakref.ReferenceType[OwnBackward]", grad_outputs: Any) -> None:
    # Eager even in a backward started inside a compiled function: the compiler traced this hook and rebuilt the
    # partial below with the reducer in place of its weak reference ("'GradReducer' object is not callable" at the
    # end of the backward; found by a fuzz of torch.compile, session 43).
    call_outside_compiler(_mark_own_backward, reducer_ref)


def _mark_own_backward(reducer_ref: "weakref.ReferenceType[OwnBackward]") -> None:
    # A node of the forward's output runs before any node of the forward itself (those were made earlier, and the
    # engine runs the ready node made last first), so before the hooks of every parameter it reaches.
    reducer = reducer_ref()
    if reducer is not None and not reducer.own_backward_running:
        reducer.own_backward_running = True
        Variable._execution_engine.queue_callback(functools.partial(_own_backward_ends, reducer_ref))


def _own_backward_ends(reducer_ref: "weakref.ReferenceType[OwnBackward]") -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.own_backward_running = False
