# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS rebuilt from an optimizer's own defaults, as PyTorch Lightning's sharded strategies do
(``OSS(params=opt.param_groups, optim=type(opt), **opt.defaults)``): with torch's AdamW, whose defaults hold a
``decoupled_weight_decay`` its constructor refuses, it builds and steps as AdamW does."""

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.optim import OSS


def _body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    user_opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    oss = OSS(params=user_opt.param_groups, optim=type(user_opt), **user_opt.defaults)  # a TypeError before
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5)
    x = torch.randn(4, 3)
    for m, opt in ((model, oss), (ref, ref_opt)):
        for _ in range(3):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    if "decoupled_weight_decay" in user_opt.defaults:  # torch releases whose Adam has the flag
        with pytest.raises(ValueError, match="always decouples weight decay"):
            OSS(nn.Linear(2, 2).parameters(), optim=torch.optim.AdamW, lr=0.1, decoupled_weight_decay=False)


def test_adamw_rebuilt_from_its_defaults() -> None:
    run_distributed(_body, 1, timeout=60)
