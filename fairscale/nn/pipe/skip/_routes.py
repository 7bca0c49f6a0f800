# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The routes of skip connections between partitions (:class:`SkipLayout`).

Kept apart from :mod:`.layout` so that the tracker can use it without importing :func:`.layout.inspect_skip_layout`,
which needs the skippable layers, which need the tracker. Import it from :mod:`.layout` (upstream's path).
"""

from typing import Dict, Iterable, List, Tuple

from .namespace import Namespace

__all__ = ["SkipLayout"]

NsName = Tuple[Namespace, str]


class SkipLayout:
    """Routes of skip connections between partitions.

    Args:
        num_partitions (int): the number of partitions.
        skip_routes (Dict[Tuple[Namespace, str], Tuple[int, int]]): ``(ns, name) -> (source, destination)``.

    Attributes:
        by_ns_name: ``skip_routes`` itself.
        by_partition: for each destination partition, the sorted ``(source, ns, name)`` routes into it.
        by_src_partition: for each source partition, the sorted ``(destination, ns, name)`` routes out of it.
    """

    def __init__(self, num_partitions: int, skip_routes: Dict[NsName, Tuple[int, int]]) -> None:
        self.by_ns_name = skip_routes
        self.by_partition: List[List[Tuple[int, Namespace, str]]] = [[] for _ in range(num_partitions)]
        self.by_src_partition: List[List[Tuple[int, Namespace, str]]] = [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in skip_routes.items():
            self.by_partition[next_j].append((prev_j, ns, name))
            self.by_src_partition[prev_j].append((next_j, ns, name))
        # A fixed order (source partition, then namespace with None first, then name) keeps copies deterministic.
        for routes in self.by_partition:
            routes.sort()
        for routes in self.by_src_partition:
            routes.sort()

    def copy_policy(self, next_j: int) -> Iterable[Tuple[int, Namespace, str]]:
        """The ``(source, ns, name)`` skip tensors that partition ``next_j`` needs from other partitions."""
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield (prev_j, ns, name)

    def copy_policy_by_src(self, prev_j: int) -> Iterable[Tuple[int, Namespace, str]]:
        """The ``(destination, ns, name)`` skip tensors that partition ``prev_j`` sends to other partitions."""
        for next_j, ns, name in self.by_src_partition[prev_j]:
            if next_j != prev_j:
                yield (next_j, ns, name)

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Whether ``(ns, name)`` is known and crosses partitions."""
        prev_j, next_j = self.by_ns_name.get((ns, name), (-1, -1))
        return prev_j != next_j
