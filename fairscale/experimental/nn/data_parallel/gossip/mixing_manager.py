# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Mixing weights of the gossip: how much of its own message a node keeps and how much it sends to each peer."""

from abc import ABC, abstractmethod
from typing import Dict, Optional, Union

import torch

from .graph_manager import GraphManager

__all__ = ["MixingManager", "UniformMixing"]


class MixingManager(ABC):
    """Base class: mixing weights over the current out-peers of ``graph``."""

    def __init__(self, graph: GraphManager, device: Optional[torch.device]) -> None:
        self.graph_manager = graph
        self.device = device

    def is_regular(self) -> bool:
        """Whether every node keeps and sends the same weights (the graph is regular and the mixing uniform)."""
        return self.graph_manager.is_regular_graph() and self.is_uniform()

    @abstractmethod
    def is_uniform(self) -> bool:
        """Whether all out-peers get the same weight."""

    @abstractmethod
    def get_mixing_weights(self, residual_adjusted: bool = True) -> Dict[Union[str, int], torch.Tensor]:
        """``{"lo": own weight, "uniform": peer weight, <peer rank>: weight, ...}`` (1-element tensors)."""


class UniformMixing(MixingManager):
    """``1 / (k + 1)`` for oneself and each of the ``k`` out-peers (``residual_adjusted``: peer weights / own)."""

    def get_mixing_weights(self, residual_adjusted: bool = True) -> Dict[Union[str, int], torch.Tensor]:
        mixing_weights: Dict[Union[str, int], torch.Tensor] = {}
        out_peers, _ = self.graph_manager.get_peers()
        w = torch.tensor([1.0 / (len(out_peers) + 1.0)], device=self.device)
        mixing_weights["lo"] = w.clone()
        w_op = w if not residual_adjusted else w / mixing_weights["lo"]
        mixing_weights["uniform"] = w_op.clone()
        for op in out_peers:
            mixing_weights[op] = w_op.clone()
        return mixing_weights

    def is_uniform(self) -> bool:
        return True
