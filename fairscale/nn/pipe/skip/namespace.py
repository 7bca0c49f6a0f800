# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Namespaces isolate skip names, so that one skippable class can be used several times in a model."""

import abc
import uuid
from functools import total_ordering
from typing import Any

__all__ = ["Namespace"]


@total_ordering
class Namespace(metaclass=abc.ABCMeta):
    """A unique namespace for skip names (compared, ordered and hashed by a random UUID).

    ``None`` is the default namespace: ``isinstance(None, Namespace)`` is true.

    Example::

        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns2), Pop().isolate(ns1))
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    # Namespaces are sorted with skip names in a layout; the order only has to be total and stable.
    # None is a virtual subclass, so "is a real namespace" is a type check, not isinstance().
    def __lt__(self, other: Any) -> bool:
        if type(other) is Namespace:
            return bool(self.id < other.id)
        return False

    def __eq__(self, other: Any) -> bool:
        if type(other) is Namespace:
            return bool(self.id == other.id)
        return False


# The default namespace is None.
Namespace.register(type(None))
