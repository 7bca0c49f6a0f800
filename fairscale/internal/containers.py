# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Walk nested containers of tensors, and flatten arguments for autograd functions."""

import copy
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from .errors import FairscaleTypeError, FairscaleValueError

__all__ = [
    "apply_to_type",
    "apply_to_tensors",
    "to_np",
    "from_np",
    "pack_kwargs",
    "unpack_kwargs",
    "split_non_tensors",
    "unpack_non_tensors",
    "rebuild_sequence",
]


def apply_to_type(type_fn: Callable[[Any], bool], fn: Callable[[Any], Any], container: Any) -> Any:
    """Apply ``fn`` to every leaf of ``container`` for which ``type_fn`` is true.

    Recurses into dicts (an ``OrderedDict`` stays one, a subclass keeps its type), lists, tuples, namedtuples (rebuilt as the
    same namedtuple type), ``torch.return_types`` results and other list or tuple subclasses (their type kept) and
    sets; other objects are returned as they are. A ``PackedSequence``
    is not rebuilt: ``fn`` is called on its ``data`` for its side effects only and the sequence
    itself is returned unchanged.

    Args:
        type_fn (Callable[[Any], bool]): selects the leaves to transform.
        fn (Callable[[Any], Any]): the transformation.
        container (Any): a leaf or a nested container.

    Returns:
        Any: a new container of the same structure holding the transformed leaves.
    """

    def walk(x: Any) -> Any:
        if type_fn(x):
            return fn(x)
        if isinstance(x, PackedSequence):
            walk(x.data)
            return x
        if isinstance(x, dict):
            return _rebuild_mapping(x, [(key, walk(value)) for key, value in x.items()])
        if isinstance(x, (list, tuple)):
            return rebuild_sequence(x, [walk(value) for value in x])
        if isinstance(x, set):
            return {walk(value) for value in x}
        return x

    return walk(container)


def rebuild_sequence(x: Any, values: List[Any], keep_unchanged: bool = True) -> Any:
    """A sequence like ``x`` holding ``values``. Plain lists and tuples are rebuilt; a subclass keeps its type
    (upstream's came back plain: ``torch.max(t, 0)`` lost ``.values``/``.indices``, a ``torch.Size`` became a tuple):
    itself when nothing in it changed (and ``keep_unchanged``), a list subclass as a shallow copy, a namedtuple by its
    fields (``_make``, past a ``__new__`` of its own, instance attributes carried over), ``torch.return_types`` and
    ``torch.Size`` through their constructor. Any other tuple subclass is rebuilt with ``type(x)(values)`` when that
    gives back exactly the values, else it becomes a plain tuple (a class taking ``*items`` got a tuple holding one
    list)."""
    if type(x) is list:
        return values
    if type(x) is tuple:
        return tuple(values)
    if keep_unchanged and all(a is b for a, b in zip(x, values)):
        return x
    if isinstance(x, list):
        try:
            out = copy.copy(x)
            out[:] = values
            return out
        except Exception:  # not copyable: keep the contents, lose the type
            return values
    if hasattr(x, "_make") and hasattr(x, "_fields"):  # namedtuple
        rebuilt = type(x)._make(values)
        if getattr(x, "__dict__", None):
            rebuilt.__dict__.update(x.__dict__)
        return rebuilt
    if type(x).__module__ == "torch.return_types" or isinstance(x, torch.Size):
        return type(x)(values)
    try:  # a constructor taking one iterable, as tuple's: kept when it gave back exactly the values
        rebuilt = type(x)(values)
        if isinstance(rebuilt, tuple) and len(rebuilt) == len(values) and all(a is b for a, b in zip(rebuilt, values)):
            return rebuilt
    except Exception:  # a constructor of its own
        pass
    return tuple(values)


def _rebuild_mapping(x: Dict[Any, Any], items: List[Tuple[Any, Any]]) -> Dict[Any, Any]:
    """A mapping of ``x``'s type holding ``items``: subclasses keep their type (Hugging Face's ``ModelOutput``, an
    ``OrderedDict`` subclass read by attribute, came back as a plain ``OrderedDict`` and ``batch.logits`` failed).
    The copy keeps the subclass's own attributes (a ``defaultdict``'s factory); one that cannot be copied becomes an
    ``OrderedDict`` (from one) or a ``dict``."""
    if type(x) not in (dict, OrderedDict):
        try:
            out = copy.copy(x)  # then every key is overwritten: same keys, same order
        except Exception:  # not copyable: keep the contents, lose the type
            pass
        else:
            for key, value in items:
                out[key] = value
            return out
    return OrderedDict(items) if isinstance(x, OrderedDict) else dict(items)


def apply_to_tensors(fn: Callable[[Tensor], Any], container: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested container (see :func:`apply_to_type`)."""
    return apply_to_type(torch.is_tensor, fn, container)


def to_np(tensor_or_container: Any) -> Any:
    """Convert every tensor in a (nested) container to a numpy array (detached, on CPU)."""
    return apply_to_tensors(lambda t: t.detach().cpu().numpy(), tensor_or_container)


def from_np(ndarray_or_container: Any, device: Union[str, torch.device] = "cpu") -> Any:
    """Convert every numpy array (or numpy scalar) in a (nested) container to a tensor on ``device``.

    Args:
        ndarray_or_container (Any): an array or a nested container of arrays.
        device (Union[str, torch.device]): where the tensors go, CPU by default.

    Returns:
        Any: the same structure with tensors in place of arrays (sharing memory on CPU).
    """

    def convert(x: Any) -> Tensor:
        return torch.as_tensor(np.asarray(x)).to(device)

    return apply_to_type(lambda x: isinstance(x, (np.ndarray, np.generic)), convert, ndarray_or_container)


def pack_kwargs(*args: Any, **kwargs: Any) -> Tuple[Tuple[str, ...], Tuple[Any, ...]]:
    """Turn positional and keyword arguments into one flat tuple plus the keyword names.

    Autograd functions and checkpointing only accept positional arguments; this packs kwargs
    after the positionals so :func:`unpack_kwargs` can restore them.

    Example::

        >>> kwarg_keys, flat_args = pack_kwargs(1, 2, a=3, b=4)
        >>> kwarg_keys, flat_args
        (('a', 'b'), (1, 2, 3, 4))
        >>> unpack_kwargs(kwarg_keys, flat_args)
        ((1, 2), {'a': 3, 'b': 4})

    Returns:
        Tuple[Tuple[str, ...], Tuple[Any, ...]]: ``(kwarg_keys, flat_args)``.
    """
    kwarg_keys = tuple(kwargs.keys())
    flat_args = tuple(args) + tuple(kwargs.values())
    return kwarg_keys, flat_args


def unpack_kwargs(kwarg_keys: Tuple[str, ...], flat_args: Tuple[Any, ...]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Inverse of :func:`pack_kwargs`: the last ``len(kwarg_keys)`` values become kwargs.

    Raises:
        FairscaleValueError: more keys than values (a ``ValueError`` and, as upstream, an ``AssertionError``).

    Returns:
        Tuple[Tuple[Any, ...], Dict[str, Any]]: ``(args, kwargs)``.
    """
    if len(kwarg_keys) > len(flat_args):
        raise FairscaleValueError(
            f"unpack_kwargs: {len(kwarg_keys)} keyword names but only {len(flat_args)} values; pass the "
            "(kwarg_keys, flat_args) pair that pack_kwargs returned"
        )
    if not kwarg_keys:
        return tuple(flat_args), {}
    num_args = len(flat_args) - len(kwarg_keys)
    return tuple(flat_args[:num_args]), dict(zip(kwarg_keys, flat_args[num_args:]))


def split_non_tensors(
    mixed: Union[Tensor, Tuple[Any, ...]],
) -> Tuple[Tuple[Tensor, ...], Optional[Dict[str, List[Any]]]]:
    """Separate the tensors of a flat tuple from the other values.

    Used where only tensors may cross an autograd boundary; :func:`unpack_non_tensors` puts the
    values back in their original positions.

    Example::

        >>> tensors, packed_non_tensors = split_non_tensors((x, 1, None, y))
        >>> tensors
        (x, y)
        >>> unpack_non_tensors(tensors, packed_non_tensors)
        (x, 1, None, y)

    Args:
        mixed (Union[Tensor, Tuple[Any, ...]]): a tensor or a tuple of tensors and other values.

    Returns:
        Tuple[Tuple[Tensor, ...], Optional[Dict[str, List[Any]]]]: the tensors, and
        ``{"is_tensor": [bool per position], "objects": [non-tensor values]}`` (``None`` when
        ``mixed`` is a single tensor).

    Raises:
        FairscaleTypeError: ``mixed`` is neither a tensor nor a tuple (or list); also an ``AssertionError``, as
            upstream asserted a tuple.
    """
    if isinstance(mixed, Tensor):
        return (mixed,), None
    if not isinstance(mixed, (tuple, list)):
        # A dict was split into its keys, silently; None or a number failed with "object is not iterable".
        raise FairscaleTypeError(
            f"split_non_tensors takes a tensor or a tuple of values, got {type(mixed).__name__}; pass the positional "
            "values as a tuple (pack_kwargs turns keyword arguments into one)"
        )
    tensors: List[Tensor] = []
    packed_non_tensors: Dict[str, List[Any]] = {"is_tensor": [], "objects": []}
    for value in mixed:
        is_tensor = isinstance(value, Tensor)
        packed_non_tensors["is_tensor"].append(is_tensor)
        if is_tensor:
            tensors.append(value)
        else:
            packed_non_tensors["objects"].append(value)
    return tuple(tensors), packed_non_tensors


def unpack_non_tensors(
    tensors: Tuple[Tensor, ...], packed_non_tensors: Optional[Dict[str, List[Any]]]
) -> Tuple[Any, ...]:
    """Inverse of :func:`split_non_tensors`: merge tensors and non-tensors back in order.

    Raises:
        FairscaleValueError: the layout does not fit the values (a ``ValueError`` and, as upstream, an
            ``AssertionError``).
    """
    if packed_non_tensors is None:
        return tensors
    if not isinstance(packed_non_tensors, dict) or set(packed_non_tensors) != {"is_tensor", "objects"}:
        raise FairscaleValueError(
            "unpack_non_tensors: packed_non_tensors must be the dict returned by split_non_tensors"
        )
    is_tensor = packed_non_tensors["is_tensor"]
    objects = packed_non_tensors["objects"]
    if sum(is_tensor) != len(tensors) or len(is_tensor) - sum(is_tensor) != len(objects):
        raise FairscaleValueError(
            f"unpack_non_tensors: {len(tensors)} tensors and {len(objects)} objects do not fit a layout of "
            f"{sum(is_tensor)} tensors and {len(is_tensor) - sum(is_tensor)} objects"
        )
    mixed: List[Any] = []
    tensor_iter, object_iter = iter(tensors), iter(objects)
    for flag in is_tensor:
        mixed.append(next(tensor_iter) if flag else next(object_iter))
    return tuple(mixed)
