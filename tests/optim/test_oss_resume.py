# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Resuming OSS with an LR scheduler: loading keeps the param-group dicts that other objects hold.

PyTorch Lightning's sharded strategies build OSS from the param groups of the user's optimizer, whose LR scheduler
keeps setting ``lr`` on those same dicts. A load that replaced OSS's group dicts cut that link: after a resume the
learning rate stopped following the schedule (upstream 0.4.13 too). Compared here with an uninterrupted run.
"""

import copy
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from fairscale.fair_dev.testing import run_distributed
from fairscale.internal import collectives
from fairscale.optim import OSS

STEPS = 6
RESUME_AT = 3


def _build() -> Tuple[nn.Module, OSS, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    user_optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(user_optimizer, step_size=2, gamma=0.5)
    # What Lightning's ddp_sharded strategies do: OSS over the user optimizer's own group dicts.
    oss = OSS(user_optimizer.param_groups, optim=torch.optim.SGD, **user_optimizer.defaults)
    return model, oss, scheduler


def _train(model: nn.Module, oss: OSS, scheduler: Any, rank: int, steps: range) -> List[float]:
    lrs = []
    for step in steps:
        oss.zero_grad()
        x = torch.linspace(-1, 1, 12).view(3, 4) * (rank + 1) + step
        model(x).pow(2).sum().backward()
        for p in model.parameters():
            collectives.all_reduce(p.grad)  # type: ignore[arg-type]
        oss.step()
        scheduler.step()
        lrs.append(oss.param_groups[0]["lr"])
    return lrs


def _resume_body(rank: int, world_size: int) -> Dict[str, Any]:
    model, oss, scheduler = _build()
    uninterrupted_lrs = _train(model, oss, scheduler, rank, range(STEPS))
    reference = [p.detach().clone() for p in model.parameters()]

    model, oss, scheduler = _build()
    _train(model, oss, scheduler, rank, range(RESUME_AT))
    oss.consolidate_state_dict(recipient_rank=-1)
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optim": oss.state_dict(), "sched": scheduler.state_dict()}
    )

    model, oss, scheduler = _build()
    held = list(oss.param_groups)
    model.load_state_dict(checkpoint["model"])
    oss.load_state_dict(checkpoint["optim"])
    scheduler.load_state_dict(checkpoint["sched"])
    resumed_lrs = _train(model, oss, scheduler, rank, range(RESUME_AT, STEPS))
    return {
        "same_dicts": all(a is b for a, b in zip(held, oss.param_groups)),
        "lrs": (uninterrupted_lrs[RESUME_AT:], resumed_lrs),
        "max_diff": max((a - b).abs().max().item() for a, b in zip(reference, model.parameters())),
    }


def test_resume_with_lr_scheduler_matches_uninterrupted_run() -> None:
    for result in run_distributed(_resume_body, 2):
        assert result["same_dicts"]
        uninterrupted, resumed = result["lrs"]
        assert resumed == uninterrupted, (resumed, uninterrupted)
        assert result["max_diff"] == 0.0, result["max_diff"]


def _adam_dict_into_adamw_body(rank: int, world_size: int) -> float:
    """An ``Adam`` state dict loaded into ``OSS(optim=AdamW)`` steps as a plain ``AdamW`` that loads it: torch's
    AdamW sets ``decoupled_weight_decay=True`` over the dict's False, and OSS copied its own groups (False) back over
    it, so it stepped with coupled weight decay, silently (a fuzz of torch 2.x optimizer flags, session 49)."""
    torch.manual_seed(0)
    source = nn.Linear(4, 3)
    adam = torch.optim.Adam(source.parameters(), lr=0.05, weight_decay=0.5)
    source(torch.ones(2, 4)).pow(2).sum().backward()
    adam.step()
    checkpoint = copy.deepcopy({"model": source.state_dict(), "optim": adam.state_dict()})
    models = [nn.Linear(4, 3), nn.Linear(4, 3)]
    for m in models:
        m.load_state_dict(checkpoint["model"])
    plain = torch.optim.AdamW(models[0].parameters(), lr=0.05)
    oss = OSS(models[1].parameters(), optim=torch.optim.AdamW, lr=0.05)
    for optimizer in (plain, oss):
        optimizer.load_state_dict(copy.deepcopy(checkpoint["optim"]))
    assert oss.optim.param_groups[0]["decoupled_weight_decay"] is True
    for step in range(3):
        for m, optimizer in zip(models, (plain, oss)):
            optimizer.zero_grad()
            m(torch.full((2, 4), float(step))).pow(2).sum().backward()  # the same batch on every rank
            optimizer.step()
    return max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters()))


def test_an_adam_dict_loaded_into_adamw_steps_as_plain_adamw() -> None:
    for max_diff in run_distributed(_adam_dict_into_adamw_body, 2):
        assert max_diff < 1e-6, max_diff
