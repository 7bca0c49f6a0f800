# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FullyShardedDataParallel under idioms of current training code (found by probing, session 10).

* ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` around part of an FSDP unit (HuggingFace's
  ``gradient_checkpointing_enable()`` default with one FSDP around the model, or a sub-layer checkpointed inside a
  wrapped block) failed in backward with "data is not allocated yet": the nested backward's gradient hook freed the
  unit's full parameters that the outer backward still read, and reduced a partial gradient.
* A first forward under ``torch.inference_mode()`` (a validation sanity check before training) made FSDP's
  lasting buffers inference tensors: the first training forward failed with "Inplace update to inference tensor
  outside InferenceMode".

Each case trains on 2 gloo ranks with the same data on both and compares with a single-process model.
"""

import functools
from typing import Dict

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

WORLD = 2
TIMEOUT = 120.0


class _Block(nn.Module):
    def __init__(self, reentrant_part: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 6)
        self.reentrant_part = reentrant_part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant_part:  # a sub-layer checkpointed inside the block
            h = torch_checkpoint.checkpoint(self.fc1, self.norm(x), use_reentrant=True)
        else:
            h = self.fc1(self.norm(x))
        return x + self.fc2(F.gelu(h))


class _Net(nn.Module):
    def __init__(self, reentrant_part: bool = False, reentrant_blocks: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList([_Block(reentrant_part) for _ in range(2)])
        self.head = nn.Linear(6, 3)
        self.reentrant_blocks = reentrant_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.reentrant_blocks:  # as HuggingFace's gradient checkpointing calls each layer
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=True)
            else:
                h = block(h)
        return self.head(h)


def _net(**kwargs: bool) -> _Net:
    torch.manual_seed(0)
    return _Net(**kwargs)


def _wrap(net: _Net, nested: bool, **fsdp_kwargs: object) -> FSDP:
    if nested:
        for i, block in enumerate(net.blocks):
            net.blocks[i] = FSDP(block, **fsdp_kwargs)  # type: ignore[assignment]
    return FSDP(net, **fsdp_kwargs)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step))


def _train(model: nn.Module, steps: int) -> None:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(_batch(step)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def _params(model: nn.Module) -> Dict[str, torch.Tensor]:
    if isinstance(model, FSDP):
        with model.summon_full_params():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_trains_like_the_module(model: FSDP, reference: nn.Module, steps: int = 2) -> None:
    _train(model, steps)
    _train(reference, steps)
    expected, got = _params(reference), _params(model)
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    handles = [h for m in model.modules() if isinstance(m, FSDP) for h in m._fsdp_unit.handles]
    assert all(
        h.full_padded is None or h.full_padded.untyped_storage().nbytes() == 0 for h in handles
    ), "full parameters kept after the step"


def _case_reentrant_checkpoint_of_part_of_a_unit(nested: bool, layout: str, reshard: bool) -> None:
    kwargs = {"reentrant_part": layout == "sub-layer", "reentrant_blocks": layout == "blocks"}
    model = _wrap(_net(**kwargs), nested, reshard_after_forward=reshard)
    _assert_trains_like_the_module(model, _net(**kwargs))


def _case_first_forward_under_inference_mode(nested: bool, mixed_precision: bool) -> None:
    model = _wrap(_net(), nested, mixed_precision=mixed_precision)
    reference = _net()
    with torch.inference_mode():
        for batch in (_batch(7), _batch(8)[:3]):
            out = model(batch)
            if not mixed_precision:  # bf16 compute: only the training below is compared, loosely by dtype
                torch.testing.assert_close(out, reference(batch), rtol=1e-5, atol=1e-6)
    if mixed_precision:
        _train(model, 2)  # bf16 compute differs from the fp32 reference; that it trains at all was the bug
        return
    _assert_trains_like_the_module(model, reference)


def _body(rank: int, world_size: int) -> None:
    cases = []
    for nested in (False, True):
        for layout in ("sub-layer", "blocks"):
            for reshard in (True, False):
                name = f"reentrant checkpoint of {layout}, nested={nested}, reshard_after_forward={reshard}"
                cases.append(
                    (name, functools.partial(_case_reentrant_checkpoint_of_part_of_a_unit, nested, layout, reshard))
                )
        for mixed in (False, True):
            name = f"first forward under inference_mode, nested={nested}, mixed_precision={mixed}"
            cases.append((name, functools.partial(_case_first_forward_under_inference_mode, nested, mixed)))
    run_cases(cases)


def test_training_idioms() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
