# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's other names in ``fairscale.nn.checkpoint.checkpoint_activations`` and its argument handling."""

import copy
import threading
from typing import Any, List, Optional, Tuple

import pytest
import torch
from torch import nn

from fairscale.internal.device import accelerator_available
from fairscale.nn.checkpoint import checkpoint_activations as ca
from fairscale.nn.checkpoint import checkpoint_wrapper


class Block(nn.Module):
    """Dropout (RNG replay), kwargs, a non-tensor output, and a record of which pass ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.passes: List[Tuple[bool, bool, bool]] = []

    def forward(self, x: torch.Tensor, scale: Optional[torch.Tensor] = None, tag: str = "") -> Any:
        self.passes.append((ca.is_checkpointing(), ca.is_recomputing(), torch.is_grad_enabled()))
        h = self.drop(self.fc(x))
        return h * scale, tag, h.sum()


def _grads(block: Block, x: torch.Tensor, s: torch.Tensor) -> List[torch.Tensor]:
    return [t.grad.clone() for t in (x, s, block.fc.weight, block.fc.bias)]


def test_checkpoint_function_protocol() -> None:
    """CheckpointFunction.apply as upstream code calls it: same outputs and gradients as running the block."""
    torch.manual_seed(0)
    block = Block()
    ref = copy.deepcopy(block)
    x, s = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    x_ref, s_ref = x.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()

    torch.manual_seed(1)
    kwarg_keys, flat_args = ca.pack_kwargs(block, x, scale=s, tag="t")
    parent: dict = {"offload": True}
    outputs = ca.CheckpointFunction.apply(
        torch.tensor([], requires_grad=True), Block.forward, parent, kwarg_keys, *flat_args
    )
    assert parent["output_requires_grad"] is True
    out, tag, total = ca.unpack_non_tensors(outputs, parent["packed_non_tensor_outputs"])
    assert tag == "t"
    (out.pow(2).sum() + total).backward()
    assert block.passes == [(True, False, False), (False, True, True)]

    torch.manual_seed(1)
    out_ref, _, total_ref = ref(x_ref, scale=s_ref, tag="t")
    (out_ref.pow(2).sum() + total_ref).backward()
    torch.testing.assert_close(out, out_ref)  # the dropout mask was replayed
    for got, want in zip(_grads(block, x, s), _grads(ref, x_ref, s_ref)):
        torch.testing.assert_close(got, want)

    # Nothing requires grad: the caller is told so (upstream detaches the outputs then).
    frozen = Block().requires_grad_(False)
    keys, flat = ca.pack_kwargs(frozen, torch.randn(2, 4), scale=torch.ones(4))
    parent = {"offload": False}
    ca.CheckpointFunction.apply(torch.tensor([], requires_grad=True), Block.forward, parent, keys, *flat)
    assert parent["output_requires_grad"] is False
    with pytest.raises(ValueError, match="'offload'"):
        ca.CheckpointFunction.apply(torch.tensor([], requires_grad=True), Block.forward, {}, keys, *flat)


def test_thread_local_state_and_helpers() -> None:
    assert isinstance(ca.thread_local, ca.ThreadLocalCheckpointingState)
    assert isinstance(ca.thread_local, threading.local)
    assert ca.ThreadLocalCheckpointingState() == ca.ThreadLocalCheckpointingState(False, False, False)
    with ca.enable_recomputing():
        assert ca.thread_local.is_recomputing and ca.is_recomputing()
    seen: List[bool] = []
    with ca.enable_checkpointing():
        worker = threading.Thread(target=lambda: seen.append(ca.thread_local.is_checkpointing))
        worker.start()
        worker.join()
        assert ca.thread_local.is_checkpointing
    assert seen == [False], "the flags are per thread"

    state = ca.get_rng_state()
    assert "torch_rng_state" in state
    first = torch.rand(3)
    ca.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError) as bad_state:
        ca.set_rng_state({})
    assert isinstance(bad_state.value, AssertionError)
    # Accelerator autocast only, as upstream: nothing changes on a CPU-only machine.
    if not accelerator_available():  # FAIRSCALE_CPU_ONLY: also on a GPU machine (the suite's process)
        with ca.autocast(True):
            assert not ca.is_autocast_enabled()
            assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32

    # The container helpers are the same objects as fairscale.internal.containers'.
    from fairscale.internal import containers

    for name in ("pack_kwargs", "unpack_kwargs", "split_non_tensors", "unpack_non_tensors"):
        assert getattr(ca, name) is getattr(containers, name)


def test_offload_to_cpu_taken_by_truth() -> None:
    """Upstream takes any offload_to_cpu value by its truth (old code passed a dict positionally)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    with pytest.warns(DeprecationWarning, match="offload_to_cpu should be a bool"):
        wrapped = checkpoint_wrapper(model, {"unused": 1})
    assert wrapped.forward.offload_to_cpu is True
    with pytest.warns(DeprecationWarning):
        assert checkpoint_wrapper(nn.Linear(2, 2), 0).forward.offload_to_cpu is False
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(wrapped.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
