# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's helpers that compare objects and models (``objects_are_equal``, ``check_same_model_params`` ...).

Also importable from :mod:`fairscale.fair_dev.testing.testing`, where upstream had them.
:func:`check_same_models_across_ranks` calls ``torch.distributed.all_gather`` directly: this is test
tooling, exempt from the rule that only the collectives layer does.
"""

from typing import Any, Dict, List, Optional, Tuple

import numpy
import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ObjectsNotEqualError",
    "objects_are_equal",
    "check_same_model_params",
    "check_same_models_across_ranks",
    "state_dict_norm",
]


class ObjectsNotEqualError(AssertionError, ValueError):
    """Raised by ``objects_are_equal(..., raise_exception=True)``; says where the objects differ.

    It is both an ``AssertionError`` and a ``ValueError`` because upstream raised either, depending on
    what differed.
    """


def objects_are_equal(
    a: Any,
    b: Any,
    raise_exception: bool = False,
    dict_key: Optional[Any] = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
) -> bool:
    """Compare two (nested) objects: dicts, lists, tuples, tensors, numpy arrays and plain values.

    Types must match exactly at every level; dicts need the same keys, sequences the same length;
    tensors are compared with ``torch.testing.assert_close`` (shape, dtype and device must match too;
    its default tolerances when neither ``rtol`` nor ``atol`` is given, 0 for the one not given).

    Args:
        a: first object.
        b: second object.
        raise_exception: raise :class:`ObjectsNotEqualError` (saying where they differ) instead of
            returning False.
        dict_key: the key under which ``a`` and ``b`` sit, used in messages.
        rtol: relative tolerance for tensors.
        atol: absolute tolerance for tensors.

    Returns:
        True if equal, False otherwise (unless ``raise_exception``).
    """
    path = "" if dict_key is None else f"[{dict_key!r}]"
    try:
        _assert_objects_equal(a, b, path, rtol, atol)
    except ObjectsNotEqualError:
        if raise_exception:
            raise
        return False
    return True


def _assert_objects_equal(a: Any, b: Any, path: str, rtol: Optional[float], atol: Optional[float]) -> None:
    where = path or "the top level"
    if type(a) is not type(b):
        raise ObjectsNotEqualError(f"type mismatch at {where}: {type(a).__qualname__} vs {type(b).__qualname__}")
    if isinstance(a, dict):
        if set(a.keys()) != set(b.keys()):
            only_a, only_b = sorted(map(repr, a.keys() - b.keys())), sorted(map(repr, b.keys() - a.keys()))
            raise ObjectsNotEqualError(f"keys differ at {where}: only in first {only_a}, only in second {only_b}")
        for key in a:
            _assert_objects_equal(a[key], b[key], f"{path}[{key!r}]", rtol, atol)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise ObjectsNotEqualError(f"length mismatch at {where}: {len(a)} vs {len(b)}")
        for index, (item_a, item_b) in enumerate(zip(a, b)):
            _assert_objects_equal(item_a, item_b, f"{path}[{index}]", rtol, atol)
    elif isinstance(a, torch.Tensor):
        if rtol is not None or atol is not None:
            rtol, atol = rtol or 0.0, atol or 0.0
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        except (AssertionError, RuntimeError) as e:
            raise ObjectsNotEqualError(f"tensors differ at {where}: {e}") from e
    elif isinstance(a, numpy.ndarray):
        if a.shape != b.shape or not numpy.array_equal(a, b):
            raise ObjectsNotEqualError(f"arrays differ at {where}: {a!r} vs {b!r}")
    elif not a == b:
        raise ObjectsNotEqualError(f"values differ at {where}: {a!r} vs {b!r}")


def check_same_model_params(
    model_a: nn.Module, model_b: nn.Module, message: str = "", rtol: float = 1e-5, atol: float = 1e-3
) -> None:
    """Assert that two models have the same parameters and buffers, in order, within tolerances.

    Args:
        model_a: first model.
        model_b: second model.
        message: appended to the assertion message.
        rtol: relative tolerance.
        atol: absolute tolerance.
    """
    for kind in ("parameters", "buffers"):
        named_a = list(getattr(model_a, f"named_{kind}")())
        named_b = list(getattr(model_b, f"named_{kind}")())
        if len(named_a) != len(named_b):
            raise AssertionError(f"the models have {len(named_a)} and {len(named_b)} {kind}. {message}")
        for (name_a, tensor_a), (name_b, tensor_b) in zip(named_a, named_b):
            tensor_b = tensor_b.detach().to(tensor_a.device)
            if tensor_a.shape != tensor_b.shape or not torch.allclose(tensor_a.detach(), tensor_b, rtol, atol):
                raise AssertionError(f"model {kind} differ: {name_a} vs {name_b}\n{tensor_a}\n{tensor_b}\n{message}")


def check_same_models_across_ranks(
    model: nn.Module, process_group: Any, params_should_be_equal: bool, check_broadcast_buffers: bool
) -> None:
    """Assert (on every rank of ``process_group``) whether each parameter is the same on all its ranks.

    Every rank must call this together; all of them see the same gathered values and agree.

    Args:
        model: the local replica.
        process_group: the group to compare across (``None`` for the default group).
        params_should_be_equal: True: every parameter (and, with ``check_broadcast_buffers``, every buffer) equals
            rank 0's. False: nothing is asserted (the values are still gathered), as upstream: its tests pass False
            for models whose ranks may or may not differ (a frozen layer stays equal).
        check_broadcast_buffers: also compare the buffers.
    """
    world_size = dist.get_world_size(process_group)
    checks: List[Tuple[str, torch.Tensor]] = list(model.named_parameters())
    if check_broadcast_buffers:
        checks += list(model.named_buffers())
    for name, tensor in checks:
        local = tensor.detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=process_group)
        for other in range(1, world_size):
            if params_should_be_equal and not torch.equal(gathered[0], gathered[other]):
                raise AssertionError(
                    f"{name} differs between group ranks 0 and {other}: {gathered[0]} vs {gathered[other]}"
                )


def state_dict_norm(state: Dict[str, Any]) -> torch.Tensor:
    """The sum of the L2 norms of a state dict's tensors (a quick fingerprint), as upstream's: a float32 tensor of
    shape ``(1,)`` on the CPU, integer and bool tensors counted as floats; non-tensor entries are skipped."""
    total = torch.zeros(1)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.detach().float().norm().cpu()
    return total
