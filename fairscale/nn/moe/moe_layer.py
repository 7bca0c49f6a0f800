# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Mixture-of-experts layer (GShard): gate, all-to-all dispatch to the experts of every rank, combine."""

import warnings
import zlib
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module, ModuleList

from fairscale.internal import collectives
from fairscale.internal.agreement import RanksDisagreeError, check_outcome_agrees, check_ranks_agree
from fairscale.internal.autocast import autocast_state
from fairscale.internal.dry_load import load_state_dict_all_or_nothing
from fairscale.internal.errors import FairscaleValueError
from fairscale.internal.group_copy import deepcopy_sharing_group, refuse_pickling_group
from fairscale.nn.checkpoint.checkpoint_activations import is_checkpointing

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
            e.g. :class:`~fairscale.nn.moe.Top2Gate`; any callable works, as upstream.
        experts (Union[Module, ModuleList]): this rank's experts; a module that is not exactly a
            ``ModuleList`` is one expert.
        group (Optional[Any]): the process group of the all-to-all (default: the world).

    Raises:
        TypeError: ``gate`` is not callable, ``experts`` is not a module (a plain list of experts, say), or ``group``
            is a list of ranks (or another non-group value) instead of a process group.
        ValueError: ``experts`` is an empty ``ModuleList``.
    """

    def __init__(self, gate: Module, experts: Union[Module, ModuleList], group: Optional[Any] = None) -> None:
        super().__init__()
        # Any callable, as upstream (a plain function of the input works; only a module's parameters train).
        if not callable(gate):
            raise TypeError(f"MOELayer: gate must be callable (e.g. a Top2Gate), got {type(gate).__name__}")
        if not isinstance(experts, Module):
            hint = "; wrap a list of experts in nn.ModuleList" if isinstance(experts, (list, tuple)) else ""
            raise TypeError(
                f"MOELayer: experts must be an nn.Module or nn.ModuleList, got {type(experts).__name__}{hint}"
            )
        if type(experts) == ModuleList and len(experts) == 0:
            raise ValueError("MOELayer: experts is an empty ModuleList; every rank needs at least one local expert")
        self.gate = gate
        # Exact type, as upstream: a ModuleList subclass is a single expert.
        if type(experts) == ModuleList:
            self.experts = experts
        else:
            self.experts = ModuleList([experts])
        # Not ints: dist.new_group(ranks) outside `ranks` returns one (torch's non-member marker), refused below.
        if isinstance(group, (list, tuple, set, range, str)):
            # Before: "TypeError: unhashable type: 'list'" from inside the collectives layer.
            raise TypeError(
                f"MOELayer: group must be a process group, got {type(group).__name__} {group!r}; pass "
                "torch.distributed.new_group(ranks) (called on every rank), or None for the default group"
            )
        # None: the default group, looked up at each use (upstream stored dist.group.WORLD, a ProcessGroup, which made
        # a model holding the layer impossible to deepcopy, an EMA copy say, or to save whole).
        self._group = group
        for p in experts.parameters():
            p.expert = True  # type: ignore[attr-defined]
        if collectives.group_rank(self.group) < 0:
            # dist.new_group(ranks) on a rank outside `ranks`: every forward would fail in its all-to-alls.
            raise ValueError(
                f"MOELayer: this process (global rank {dist.get_rank()}) is not a member of `group` (what "
                "dist.new_group(ranks) returns outside `ranks`); build the layer only on the group's ranks, or pass a "
                "group that contains this rank"
            )
        self.world_size = dist.get_world_size(self.group)
        self.num_local_experts = len(self.experts)

    @property
    def l_aux(self) -> Any:
        """This rank's load-balancing loss of the last forward (``None`` before any).

        Under :func:`fairscale.nn.checkpoint.checkpoint_wrapper` the first pass runs without autograd: the value read
        after the wrapped module returned carries no gradient, and adding it to the loss trained nothing, silently.
        Reading it there warns once; return it from the checkpointed module's forward instead (read inside that
        forward, it travels through the checkpoint with its gradient).
        """
        if self.__dict__.get("_l_aux_without_grad") and not is_checkpointing():
            if not self.__dict__.get("_warned_l_aux"):
                self.__dict__["_warned_l_aux"] = True
                warnings.warn(
                    "MOELayer.l_aux was computed in the first (no-grad) pass of checkpoint_wrapper: it carries no "
                    "gradient, so adding it to the loss trains nothing. Read it inside the checkpointed module's "
                    "forward and return it from there (the checkpoint then gives it its gradient)."
                )
        return self.__dict__.get("_l_aux", self.__dict__.get("l_aux"))

    @l_aux.setter
    def l_aux(self, value: Any) -> None:
        self.__dict__["_l_aux"] = value
        no_grad = isinstance(value, Tensor) and not value.requires_grad
        self.__dict__["_l_aux_without_grad"] = self.training and is_checkpointing() and no_grad

    @l_aux.deleter
    def l_aux(self) -> None:
        # `del moe.l_aux` (to free the graph it holds) worked on upstream's plain attribute.
        for key in ("_l_aux", "l_aux", "_l_aux_without_grad"):
            self.__dict__.pop(key, None)

    @property
    def group(self) -> Any:
        """The process group of the all-to-alls (the default group when none was given)."""
        return self._group if self._group is not None else dist.group.WORLD

    @group.setter
    def group(self, value: Any) -> None:
        self._group = value

    def __deepcopy__(self, memo: Dict[int, Any]) -> "MOELayer":
        # A copy (an EMA or teacher model) exchanges tokens over the same group: process groups cannot be copied.
        return deepcopy_sharing_group(self, memo, self._group)

    def __getstate__(self) -> Dict[str, Any]:
        # A copy (deepcopy for an EMA or teacher model, or a pickle) holds the last load-balancing loss without its
        # graph: the live value is an output of this layer's autograd graph, which torch cannot copy (deepcopy of a
        # non-leaf tensor raises), so copying a model after a training forward failed (as upstream's).
        state = dict(self.__dict__)
        for key in ("_l_aux", "l_aux"):
            value = state.get(key)
            if isinstance(value, Tensor) and value.grad_fn is not None:
                state[key] = value.detach()
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_pickling_group(self, self._group)  # a clear TypeError instead of torch's "cannot pickle ProcessGroup"
        return super().__reduce_ex__(protocol)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, all or nothing: tried on shape-only tensors first, so that a checkpoint
        of another world size (a gate over another number of experts) raises before any expert was replaced."""
        return load_state_dict_all_or_nothing(self, state_dict, strict, assign)

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        """Route ``input`` ``[sequence, tokens, model_dim]`` through the experts; same shape out.

        Every rank of the group must call it with the same number of tokens (``sequence * tokens``), model dim and
        dtype. One all-gather of a few integers per call checks that before the all-to-all (see
        :meth:`_check_ranks_agree`). Keyword arguments are accepted and ignored (upstream's signature).

        Raises:
            FairscaleValueError: not exactly one 3-D input tensor, or its first dimension is not a multiple of the
                number of local experts (both ``AssertionError`` as upstream).
            ValueError: the gate routes to another number of experts than the group holds.
            RanksDisagreeError: the ranks' inputs differ in token count, model dim or dtype, or their gates in expert
                count; raised on every rank with the same message.
            RuntimeError: another rank's input failed one of the checks above (that rank raises its own error).
        """
        error: Optional[BaseException] = None
        dispatched_input: Optional[Tensor] = None
        combine_weights: Optional[Tensor] = None
        try:
            dispatched_input, combine_weights = self._dispatch(input)
        except Exception as e:  # noqa: B902  # re-raised below, after every rank has learnt of it
            error = e
        # A rank that failed alone must not leave its peers waiting in the all-to-all, and ranks with mismatched
        # blocks must not reach it at all (gloo aborts the process, NCCL corrupts or hangs).
        self._check_ranks_agree(input, dispatched_input, error)
        # Past the check no rank failed, so both are set.
        dispatched_input, combine_weights = cast(Tensor, dispatched_input), cast(Tensor, combine_weights)
        d_model = input[0].shape[2]
        dispatched_input = _AllToAll.apply(self.group, dispatched_input)
        # [world, local experts, capacity, model]: block g came from group rank g.
        dispatched_input = dispatched_input.reshape(self.world_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = returned = [expert(chunk) for chunk, expert in zip(chunks, self.experts)]
        # Under autocast an expert may return another floating dtype by design (CUDA's autocast runs layer_norm,
        # softmax and reductions in fp32): it travels in its input's dtype, which the combining einsum would cast
        # it to anyway. Outside autocast another dtype is a user bug, refused below.
        if autocast_state(dispatched_input.device.type)[0]:
            expert_outputs = [
                out.to(chunk.dtype) if isinstance(out, Tensor) and out.is_floating_point() else out
                for chunk, out in zip(chunks, expert_outputs)
            ]
        for i, (chunk, out) in enumerate(zip(chunks, expert_outputs)):
            if not isinstance(out, Tensor) or out.shape != chunk.shape or out.dtype != chunk.dtype:
                # The second all-to-all sends what the experts return: another shape or dtype on some rank aborts
                # gloo (or hangs NCCL), and on every rank it failed in the combining einsum with a cryptic message.
                # Checked locally (no collective per forward): an expert that fails on some ranks only still leaves
                # the others waiting in the all-to-all, as documented.
                out = returned[i]  # as the expert returned it (before an autocast cast), for the message
                got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(
                    f"MOELayer: local expert {i} returned {got} for an input of shape {tuple(chunk.shape)} "
                    f"{chunk.dtype}; an expert must return a tensor of its input's shape (same model dim) and dtype "
                    "(under autocast, any floating dtype)"
                )
        expert_output = torch.cat(expert_outputs, dim=1)
        expert_output = _AllToAll.apply(self.group, expert_output)
        expert_output = expert_output.reshape(self.world_size * self.num_local_experts, -1, d_model)
        # The input's dtype, as the dispatch mask's: a gate run in fp32 for fp16/bf16 inputs (a router kept in full
        # precision) failed here on every rank, after both all-to-alls, with einsum's bare dtype error.
        combined_output = torch.einsum("sec,ecm->sm", combine_weights.to(expert_output.dtype), expert_output)
        return combined_output.reshape(input[0].shape)

    def _dispatch(self, input: Tuple[Tensor, ...]) -> Tuple[Tensor, Tensor]:
        """The local half before the all-to-all: check the input, gate it, gather each expert's slots.

        Returns:
            Tuple[Tensor, Tensor]: the ``[experts, capacity, model_dim]`` block to exchange and the combine weights.
        """
        # AssertionError subclasses with upstream's texts (its bare asserts), so they also hold under ``python -O``.
        if len(input) != 1:
            raise FairscaleValueError(f"only single input Tensor supported (MOELayer got {len(input)} inputs)")
        if not isinstance(input[0], Tensor) or input[0].dim() != 3:
            got = f"shape {tuple(input[0].shape)}" if isinstance(input[0], Tensor) else type(input[0]).__name__
            raise FairscaleValueError(f"input Tensor must have dimensions: (s)equence, (t)oken, (m)odel (got {got})")
        if input[0].shape[0] % self.num_local_experts != 0:
            raise FairscaleValueError(
                f"num tokens must be order of number of local experts: the first dimension ({input[0].shape[0]}) "
                f"must be a multiple of the {self.num_local_experts} local experts"
            )
        d_model = input[0].shape[2]
        if d_model == 0:
            # reshape(-1, 0) failed: "cannot reshape tensor of 0 elements ... ambiguous".
            raise FairscaleValueError(
                f"MOELayer: the input's model dimension (its last) is 0 (shape {tuple(input[0].shape)}); pass "
                "[sequence, tokens, model_dim] with model_dim >= 1"
            )
        reshaped_input = input[0].reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input)
        self._check_expert_count(combine_weights.shape[1])
        # The mask takes the input's dtype (upstream used float32, which fails for fp16/bf16 inputs).
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.to(reshaped_input.dtype), reshaped_input)
        return dispatched, combine_weights

    def _check_ranks_agree(
        self, input: Tuple[Tensor, ...], dispatched: Optional[Tensor], error: Optional[BaseException]
    ) -> None:
        """Raise the same error on every rank unless every rank dispatched a block of the same shape and dtype.

        The cost, paid at every forward: one all-gather of :data:`_AGREEMENT_FIELDS` + 1 int64 per rank (a host sync
        of that tiny tensor). Only when something differs, one or two object all-gathers build the message.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        device = _agreement_device(self, input, dispatched)
        # Whether this forward's backward runs the two all-to-alls again (reversed): an evaluation forward under
        # no_grad on one rank left the others waiting in the backward's all-to-all (found by a fuzz).
        backward = _runs_backward(self, dispatched) if dispatched is not None else (False, False)
        mine = torch.tensor([0 if error is None else 1] + _describe(input, dispatched, backward), device=device)
        gathered = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype, device=device)
        collectives.all_gather_into_flat(gathered, mine, self.group)
        rows = gathered.view(self.world_size, -1).tolist()
        if error is None and all(row == rows[0] for row in rows):
            return
        # Every rank saw the same rows, so every rank takes this path and joins the same collectives below.
        check_outcome_agrees("MOELayer forward", error, self.group, device=device)
        check_ranks_agree(
            "MOELayer: the all-to-all inputs (tokens, experts, capacity, model_dim, dtype, backward)",
            _description(input, dispatched, backward),
            self.group,
            "Every rank must feed MOELayer the same number of tokens (sequence * tokens) of the same model dim and "
            "dtype, with a gate of the same number of experts: pad the batches of all ranks to a common length. "
            "A 'backward' field differs when some ranks run the layer under torch.no_grad() (an evaluation on some "
            "ranks only), or with an input (or experts) requiring grad on some ranks only: their backward would skip "
            "the all-to-alls the others wait in; run every rank alike.",
            device=device,
        )
        # Equal descriptions but different rows cannot happen (the rows encode the descriptions); be loud if it does.
        raise RanksDisagreeError(f"MOELayer: the ranks' all-to-all inputs differ: {rows}")

    def _check_expert_count(self, num_experts: int) -> None:
        expected = self.world_size * self.num_local_experts
        if num_experts != expected:
            raise ValueError(
                f"MOELayer: the gate routes to {num_experts} experts but the group has {self.world_size} ranks with "
                f"{self.num_local_experts} local experts each ({expected} in all); build the gate with "
                f"num_experts={expected}"
            )


# What the ranks compare before the all-to-all (with the "failed" flag in front in the gathered rows).
_AGREEMENT_FIELDS = ("tokens", "experts", "capacity", "model_dim", "dtype", "backward (dispatch)", "backward (combine)")


def _dtype_code(dtype: torch.dtype) -> int:
    # crc32, not hash(): str hashes are salted per process, and the ranks are different processes.
    return zlib.crc32(str(dtype).encode())


def _runs_backward(layer: "MOELayer", dispatched: Tensor) -> Tuple[bool, bool]:
    """Whether autograd will run the backward of this forward's first all-to-all (its input, the dispatched block,
    requires grad) and of its second (that, or an expert's parameters require grad), with grad enabled. Two bits:
    an input requiring grad on some ranks only, experts trainable everywhere, differs in the first only."""
    if not torch.is_grad_enabled():
        return False, False
    first = dispatched.requires_grad
    return first, first or any(p.requires_grad for p in layer.experts.parameters())


def _description(
    input: Tuple[Tensor, ...], dispatched: Optional[Tensor], backward: Tuple[bool, bool]
) -> Tuple[Tuple[str, Any], ...]:
    """``(field, value)`` pairs of :data:`_AGREEMENT_FIELDS` (``None`` where this rank's input did not tell)."""
    if dispatched is None:
        return tuple((name, None) for name in _AGREEMENT_FIELDS)
    tokens = input[0].numel() // max(input[0].shape[-1], 1)
    experts, capacity, model_dim = dispatched.shape
    return (
        ("tokens", tokens),
        ("experts", experts),
        ("capacity", capacity),
        ("model_dim", model_dim),
        ("dtype", str(dispatched.dtype)),
        ("backward (dispatch)", backward[0]),
        ("backward (combine)", backward[1]),
    )


def _describe(input: Tuple[Tensor, ...], dispatched: Optional[Tensor], backward: Tuple[bool, bool]) -> List[int]:
    """:func:`_description` as integers (-1 for unknown), for the all-gather."""
    if dispatched is None:
        return [-1] * len(_AGREEMENT_FIELDS)
    values = [value for _, value in _description(input, dispatched, backward)[:-3]]
    return values + [_dtype_code(dispatched.dtype), int(backward[0]), int(backward[1])]


def _agreement_device(layer: Module, input: Tuple[Tensor, ...], dispatched: Optional[Tensor]) -> torch.device:
    """Where the check's tensor lives: where the all-to-all's would (NCCL groups take device tensors only)."""
    if dispatched is not None:
        return dispatched.device
    for t in list(input) + list(layer.parameters()):
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")
