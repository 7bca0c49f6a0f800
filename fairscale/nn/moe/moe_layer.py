# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Mixture-of-experts layer (GShard): gate, all-to-all dispatch to the experts of every rank, combine."""

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, ModuleList

from fairscale.internal import collectives

__all__ = ["MOELayer"]


class _AllToAll(torch.autograd.Function):
    """Equal-block all-to-all along dim 0; its own inverse, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        collectives.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> Any:
        return (None, _AllToAll.apply(ctx.group, *grad_output))


class MOELayer(Module):
    """Mixture of experts with the experts spread over the ranks of ``group`` (GShard, arXiv:2006.16668).

    ::

        gate = Top2Gate(model_dim, num_experts)
        moe = MOELayer(gate, experts)
        output = moe(input)
        l_aux = moe.l_aux

    Every rank holds ``L = len(experts)`` experts; global expert ``g * L + i`` is local expert ``i`` of
    group rank ``g``, so the gate must have ``world_size * L`` experts. Each expert receives a
    ``[world_size, 1, capacity, model_dim]`` tensor (one block of slots per source rank; empty slots
    are zeros) and must return the same shape. ``l_aux`` is this rank's load-balancing loss (not
    reduced over ranks). Expert parameters get the attribute ``expert = True`` (e.g. so that data
    parallelism can leave them out of its gradient reduction).

    Args:
        gate (Module): returns ``(l_aux, combine_weights, dispatch_mask)`` for ``[tokens, model_dim]``,
            e.g. :class:`~fairscale.nn.moe.Top2Gate`.
        experts (Union[Module, ModuleList]): this rank's experts; a module that is not exactly a
            ``ModuleList`` is one expert.
        group (Optional[Any]): the process group of the all-to-all (default: the world).
    """

    def __init__(self, gate: Module, experts: Union[Module, ModuleList], group: Optional[Any] = None) -> None:
        super().__init__()
        self.gate = gate
        # Exact type, as upstream: a ModuleList subclass is a single expert.
        if type(experts) == ModuleList:
            self.experts = experts
        else:
            self.experts = ModuleList([experts])
        self.group = group if group is not None else dist.group.WORLD
        for p in experts.parameters():
            p.expert = True  # type: ignore[attr-defined]
        self.world_size = dist.get_world_size(self.group)
        self.num_local_experts = len(self.experts)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        """Route ``input`` ``[sequence, tokens, model_dim]`` through the experts; same shape out.

        Keyword arguments are accepted and ignored (upstream's signature).
        """
        assert len(input) == 1, "only single input Tensor supported"
        assert len(input[0].shape) == 3, "input Tensor must have dimensions: (s)equence, (t)oken, (m)odel"
        assert input[0].shape[0] % len(self.experts) == 0, "num tokens must be order of number of local experts"

        d_model = input[0].shape[2]
        reshaped_input = input[0].reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input)
        self._check_expert_count(combine_weights.shape[1])
        # The mask takes the input's dtype (upstream used float32, which fails for fp16/bf16 inputs).
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.to(reshaped_input.dtype), reshaped_input)
        dispatched_input = _AllToAll.apply(self.group, dispatched_input)
        # [world, local experts, capacity, model]: block g came from group rank g.
        dispatched_input = dispatched_input.reshape(self.world_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = [expert(chunk) for chunk, expert in zip(chunks, self.experts)]
        expert_output = torch.cat(expert_outputs, dim=1)
        expert_output = _AllToAll.apply(self.group, expert_output)
        expert_output = expert_output.reshape(self.world_size * self.num_local_experts, -1, d_model)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights, expert_output)
        return combined_output.reshape(input[0].shape)

    def _check_expert_count(self, num_experts: int) -> None:
        expected = self.world_size * self.num_local_experts
        if num_experts != expected:
            raise ValueError(
                f"MOELayer: the gate routes to {num_experts} experts but the group has {self.world_size} ranks with "
                f"{self.num_local_experts} local experts each ({expected} in all); build the gate with "
                f"num_experts={expected}"
            )
