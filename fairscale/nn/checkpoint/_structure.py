# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The arguments and outputs of a checkpointed forward as a flat list of tensors plus a spec to rebuild them from.

Tuples, namedtuples, lists, dicts and dataclass instances are walked, and for outputs the attributes of plain
objects (a hand-written output record); every other value is kept as it is.
"""

import copy
import dataclasses
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import nn

from fairscale.internal.containers import rebuild_sequence

# How deep outputs' plain objects are walked (an output record holding another); specs hold their copies.
OUTPUT_OBJECTS = 2


class ObjectWalk(NamedTuple):
    """Which plain objects :func:`_map_structure` walks: ``depth`` levels of them, not those in ``skip`` (ids)."""

    depth: int
    skip: FrozenSet[int] = frozenset()


class _Slot:
    """Placeholder for the i-th tensor in a flattened structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _map_structure(
    obj: Any,
    fn: Callable[[Any], Any],
    is_leaf: Callable[[Any], bool],
    always_copy: bool = False,
    objects: Optional[ObjectWalk] = None,
) -> Any:
    """Rebuild ``obj`` (nested tuples, namedtuples, lists, dicts and dataclasses) with ``fn`` applied to its leaves
    for which ``is_leaf`` holds; every other value is kept as is.

    A container none of whose leaves changed is returned itself, not a copy (unless ``always_copy``): an argument the
    checkpointed forward writes into (a list or a context object collecting auxiliary losses) is the caller's, as
    without checkpointing. ``objects``: which plain objects' attributes (``__dict__``) are walked too; one holding a
    leaf is rebuilt as a shallow copy (one that cannot be copied is kept as it is).
    """
    if is_leaf(obj):
        return fn(obj)

    def same(pairs: Iterator[Tuple[Any, Any]]) -> bool:
        return not always_copy and all(new is old for new, old in pairs)

    def walk(x: Any) -> Any:
        return _map_structure(x, fn, is_leaf, always_copy, objects)

    if isinstance(obj, (tuple, list)):
        items = [walk(x) for x in obj]
        if same(zip(items, obj)):
            return obj
        # A namedtuple by its fields, past the class's own __new__, which may check them: PackedSequence's refuses
        # the placeholders a spec holds (the fields were checked when the caller built it). List subclasses,
        # torch.return_types and torch.Size keep their type too (see rebuild_sequence).
        return rebuild_sequence(obj, items, keep_unchanged=False)
    if isinstance(obj, dict):
        values = {key: walk(value) for key, value in obj.items()}
        if same((values[key], value) for key, value in obj.items()):
            return obj
        # A shallow copy keeps the dict's type and extra state (OrderedDict, model-output classes); item by item,
        # through the class's own __setitem__ (HF's ModelOutput refuses update() and keeps attributes in step).
        new = copy.copy(obj)
        for key, value in values.items():
            new[key] = value
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # A dataclass instance (an argument object, a model-output record): its tensors are inputs and outputs
        # like any other. Untraversed, an output's tensors came from the no-grad first pass without a graph.
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        mapped = {name: walk(value) for name, value in fields.items()}
        if same((mapped[name], value) for name, value in fields.items()):
            return obj
        # A shallow copy, fields set past __init__ and frozen=True, keeps its type, init=False fields and extras.
        record = copy.copy(obj)
        for name, value in mapped.items():
            object.__setattr__(record, name, value)
        return record
    if objects is not None and objects.depth > 0 and id(obj) not in objects.skip and _is_plain_object(obj):
        # An output record of the user's own class: left as it was, its tensors came from the no-grad first pass and
        # the module got no gradient, silently (a fuzz of checkpointing, session 45). Its attributes are walked
        # like a dataclass's fields.
        inner = objects._replace(depth=objects.depth - 1)
        attributes = _attributes(obj)
        walked = {name: _map_structure(v, fn, is_leaf, always_copy, inner) for name, v in attributes.items()}
        if same((walked[name], value) for name, value in attributes.items()):
            return obj
        try:
            rebuilt = copy.copy(obj)
            for name, value in walked.items():
                object.__setattr__(rebuilt, name, value)
        except Exception:  # a class copy cannot handle (an attribute dict behind __getattr__): as before, untracked
            return obj
        return rebuilt
    return obj


def _attributes(obj: Any) -> Dict[str, Any]:
    """An object's attributes: its ``__dict__`` and the slots its classes declare (a review found slots left out:
    their tensors untracked beside tracked ones, a gradient missing their share silently)."""
    found = dict(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        slots = getattr(klass, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found[name] = getattr(obj, name)
    return found


def _is_plain_object(obj: Any) -> bool:
    """An instance with attributes of its own that is not a module, tensor, class, function or scalar."""
    if isinstance(obj, (type, nn.Module, torch.Tensor, str, bytes, int, float, bool, complex)) or callable(obj):
        return False
    return (isinstance(getattr(obj, "__dict__", None), dict) or hasattr(type(obj), "__slots__")) and bool(
        _attributes(obj)
    )


def object_ids(obj: Any, depth: int, found: Optional[Set[int]] = None) -> Set[int]:
    """The ids of the plain objects in ``obj`` (through containers, dataclasses and, ``depth`` levels deep, plain
    objects' attributes): the forward's inputs and the module's own state, which its outputs hand back as they are
    (a KV cache filled and returned; a review found the first version copying it, and a recomputation appending
    to it again)."""
    found = set() if found is None else found
    if isinstance(obj, (tuple, list)):
        for x in obj:
            object_ids(x, depth, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            object_ids(x, depth, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            object_ids(getattr(obj, f.name), depth, found)
    elif depth > 0 and _is_plain_object(obj) and id(obj) not in found:
        found.add(id(obj))
        for x in _attributes(obj).values():
            object_ids(x, depth - 1, found)
    return found


def output_walk(arguments: Any, module: Optional[nn.Module]) -> ObjectWalk:
    """How a checkpointed forward's outputs are walked: not into the objects it was given or its module held before
    it ran (see :func:`object_ids`)."""
    skip = object_ids(arguments, OUTPUT_OBJECTS)
    if module is not None:
        object_ids(list(vars(module).values()), OUTPUT_OBJECTS, skip)
    return ObjectWalk(OUTPUT_OBJECTS, frozenset(skip))


def _flatten(obj: Any, objects: Optional[ObjectWalk] = None) -> Tuple[List[torch.Tensor], Any]:
    """Split ``obj`` into its tensors (in traversal order) and a spec with a ``_Slot`` for each (``objects``: see
    :func:`_map_structure`)."""
    tensors: List[torch.Tensor] = []

    def to_slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _Slot(len(tensors) - 1)

    spec = _map_structure(obj, to_slot, lambda x: isinstance(x, torch.Tensor), objects=objects)
    return tensors, spec


def _unflatten(spec: Any, tensors: List[torch.Tensor], objects: Optional[ObjectWalk] = None) -> Any:
    """Inverse of :func:`_flatten` (with the same ``objects``)."""
    return _map_structure(spec, lambda slot: tensors[slot.index], lambda x: isinstance(x, _Slot), objects=objects)
