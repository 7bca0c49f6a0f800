# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Module patterns found by a review, trained side by side with the unwrapped module on the global batch.

* A unit whose forward returns its parameter or a view of it (a prompt, a class token, a positional table expanded
  to the batch): after the forward the full parameters are freed, and such an output pointed at freed memory (a
  segmentation fault in the parent's ``torch.cat``) or, with ``flatten_parameters=False``, was the parameter itself,
  now this rank's 1-D shard (rank 1 multiplied by its zero padding, silently).
* ``summon_full_params()`` before the first forward of a model whose units borrow a parameter
  (``append_shared_param``): the borrowing handle took the owner's summoned full tensor as its shard, and the first
  forward failed in its all-gather.
"""

import copy
from typing import Any, Dict, List

import torch
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


class _Prompt(nn.Module):
    """Learned prompt tokens returned expanded to the batch (a view of the parameter)."""

    def __init__(self, as_view: bool) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(2, 4))
        self.as_view = as_view

    def forward(self, x: Tensor) -> Tensor:
        if self.as_view:
            return self.tokens.unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.tokens  # the parameter itself


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor([2.0]))

    def forward(self) -> Tensor:
        return self.s


class _WithPrompt(nn.Module):
    def __init__(self, as_view: bool) -> None:
        super().__init__()
        self.prompt = _Prompt(as_view)
        self.scale = _Scale()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        p = self.prompt(x)
        if p.dim() == 2:
            p = p.unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.lin(torch.cat([p, x], 1)) * self.scale()


def _wrap(model: _WithPrompt, flatten: bool, reshard: bool) -> FSDP:
    kwargs: Dict[str, Any] = dict(flatten_parameters=flatten, reshard_after_forward=reshard)
    model.prompt = FSDP(model.prompt, **kwargs)  # type: ignore[assignment]
    model.scale = FSDP(model.scale, **kwargs)  # type: ignore[assignment]
    return FSDP(model, **kwargs)


def _batch(step: int, rank: int) -> Tensor:
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(10 * step + rank))


def _case_outputs_of_parameters(rank: int, world_size: int, as_view: bool, flatten: bool, reshard: bool) -> None:
    torch.manual_seed(0)
    plain = _WithPrompt(as_view)
    fsdp = _wrap(copy.deepcopy(plain), flatten, reshard)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        out = fsdp(_batch(step, rank))
        ref = plain(torch.cat([_batch(step, r) for r in range(world_size)]))
        torch.testing.assert_close(
            out, ref.chunk(world_size)[rank], rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step} output: {m}"
        )
        out.pow(2).sum().backward()
        (ref.pow(2).sum() / world_size).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    with fsdp.summon_full_params():
        got = {n: p.detach().clone() for n, p in fsdp.named_parameters()}
    for name, value in plain.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)

    def forward(self, ids: Tensor) -> Tensor:
        return self.emb(ids)


class _Head(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 10)
        self.proj.weight = emb.weight  # tied to the embedding, which another instance owns
        self.pre = nn.Linear(6, 6)

    def forward(self, h: Tensor) -> Tensor:
        return self.proj(torch.tanh(self.pre(h)))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = _Embed()
        self.head = _Head(self.embed.emb)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.embed(ids))


def _tied_model() -> FSDP:
    torch.manual_seed(0)
    net = _Tied()
    net.embed = FSDP(net.embed, flatten_parameters=False)  # type: ignore[assignment]
    net.head = FSDP(net.head, flatten_parameters=False)  # type: ignore[assignment]
    net.head.append_shared_param(net.embed.module.module.emb.weight)  # type: ignore[union-attr]
    return FSDP(net, flatten_parameters=False)


def _case_summon_before_the_first_forward_with_borrowed_parameters(rank: int, world_size: int) -> None:
    results: List[Dict[str, Tensor]] = []
    for summon_first in (False, True):
        model = _tied_model()
        if summon_first:
            with model.summon_full_params():
                pass
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            ids = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(10 * step + rank))
            model(ids).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        with model.summon_full_params():
            results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def _body(rank: int, world_size: int) -> None:
    cases: List[Any] = []
    for as_view in (True, False):
        for flatten in (True, False):
            for reshard in (True, False):
                name = f"outputs of parameters (view={as_view}, flatten={flatten}, reshard={reshard})"
                cases.append(
                    (
                        name,
                        lambda v=as_view, f=flatten, r=reshard: _case_outputs_of_parameters(rank, world_size, v, f, r),
                    )
                )
    cases.append(
        (
            "summon before the first forward, borrowed parameters",
            lambda: _case_summon_before_the_first_forward_with_borrowed_parameters(rank, world_size),
        )
    )
    run_cases(cases)


def test_module_patterns() -> None:
    run_distributed(_body, 2)
