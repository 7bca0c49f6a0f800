# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How deep a loaded object's containers may nest, and whether one holds itself: checked without recursing."""

from typing import Any, Dict, List, Optional

__all__ = ["MAX_NESTING", "nesting_problem"]

# How deep containers may nest in a checkpoint or a store object. Walks of loaded objects, copy.deepcopy and pickle
# recurse once or twice per level: much deeper, they reach Python's recursion limit and fail with a RecursionError
# traceback instead of a clear refusal. State dicts nest a few levels.
MAX_NESTING = 100
_END = object()


def _children(obj: Any) -> Optional[List[Any]]:
    """What copy.deepcopy and pickle would recurse into (``None``: ``obj`` is not a container)."""
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    return None


def nesting_problem(obj: Any, reader: str = "fairscale") -> Optional[str]:
    """What is wrong with how ``obj``'s containers nest (``None``: nothing), worded to follow "it".

    Refused: nesting deeper than :data:`MAX_NESTING`, and a container inside itself (walks of it never end).
    A container shared by several parents is fine and expanded once, so the walk costs the number of containers and
    references, not the number of paths (``2**depth`` for a list shared at every level: a file of a few hundred
    bytes). Iterative, so it never reaches the recursion limit itself. ``reader`` names who refuses it.
    """
    top = _children(obj)
    if top is None:
        return None
    deep = f"nests containers more than {MAX_NESTING} deep ({reader} handles at most {MAX_NESTING} levels)"
    heights: Dict[int, int] = {}  # id of a container walked to the end -> its levels (itself and below)
    path: List[List[Any]] = [[obj, iter(top), 0]]  # open containers: [container, its children, levels below]
    on_path = {id(obj)}
    while path:
        frame = path[-1]
        child = next(frame[1], _END)
        if child is _END:
            path.pop()
            on_path.discard(id(frame[0]))
            heights[id(frame[0])] = frame[2] + 1
            if path:
                path[-1][2] = max(path[-1][2], frame[2] + 1)
            continue
        if id(child) in on_path:
            return "holds a container inside itself (a cycle)"
        if id(child) in heights:  # shared: walked once already
            if len(path) + heights[id(child)] > MAX_NESTING:
                return deep
            frame[2] = max(frame[2], heights[id(child)])
            continue
        items = _children(child)
        if items is None:
            continue
        if len(path) >= MAX_NESTING:
            return deep
        path.append([child, iter(items), 0])
        on_path.add(id(child))
    return None
