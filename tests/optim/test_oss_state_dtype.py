# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS.load_state_dict keeps the dtype state tensors were saved in (upstream's rule), as fairseq relies on.

fairseq's memory-efficient fp16/bf16 trains fp16/bf16 parameters with an optimizer of its own that keeps fp32
moments; torch's loader casts floating state to the parameter's dtype, which fairseq repairs itself except under OSS
(it switches its repair off there because upstream's OSS never cast). A cast at load lost the moments' precision at
every resume. torch's own optimizers keep torch's cast: their kernels need the parameter's dtype.
"""

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.optim import Optimizer

from fairscale.fair_dev.testing import run_distributed
from fairscale.internal import collectives
from fairscale.optim import OSS

STEPS = 6
RESUME_AT = 3


class Fp32MomentSGD(Optimizer):
    """SGD with momentum whose buffer stays fp32 for low-precision parameters (as fairseq's Adam keeps fp32
    moments): the update is computed in fp32 and written back in the parameter's dtype."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad.float())
                p.copy_(p.float() - group["lr"] * buf)
        return None


def _build(optim: Any) -> Tuple[nn.Module, OSS]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.bfloat16)
    return model, OSS(model.parameters(), optim=optim, lr=0.05, momentum=0.9)


def _train(model: nn.Module, oss: OSS, rank: int, steps: range) -> None:
    for step in steps:
        oss.zero_grad()
        x = (torch.linspace(-1, 1, 12).view(3, 4) * (rank + 1) + step).to(torch.bfloat16)
        model(x).float().pow(2).sum().backward()
        for p in model.parameters():
            collectives.all_reduce(p.grad)  # type: ignore[arg-type]
            p.grad.div_(2)  # type: ignore[union-attr]
        oss.step()


def _resume_body(rank: int, world_size: int, optim: Any) -> Dict[str, Any]:
    model, oss = _build(optim)
    _train(model, oss, rank, range(STEPS))
    reference = [p.detach().clone() for p in model.parameters()]

    model, oss = _build(optim)
    _train(model, oss, rank, range(RESUME_AT))
    oss.consolidate_state_dict(recipient_rank=-1)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optim": oss.state_dict()})
    saved_dtypes = sorted({str(s["momentum_buffer"].dtype) for s in checkpoint["optim"]["state"].values()})

    model, oss = _build(optim)
    model.load_state_dict(checkpoint["model"])
    oss.load_state_dict(checkpoint["optim"])
    loaded_dtypes = sorted({str(s["momentum_buffer"].dtype) for s in oss.optim.state.values()})
    _train(model, oss, rank, range(RESUME_AT, STEPS))
    diffs: List[float] = [(a.float() - b.float()).abs().max().item() for a, b in zip(reference, model.parameters())]
    return {"saved": saved_dtypes, "loaded": loaded_dtypes, "max_diff": max(diffs)}


def test_fp32_state_of_low_precision_parameters_survives_a_resume() -> None:
    for result in run_distributed(_resume_body, 2, Fp32MomentSGD):
        assert result["saved"] == result["loaded"] == ["torch.float32"], result
        assert result["max_diff"] == 0.0, result


def test_torch_optimizers_keep_torchs_cast() -> None:
    # torch's Adam steps only with state in the parameter's dtype: a checkpoint with fp32 moments loaded onto bf16
    # parameters is cast as a plain torch Adam casts it, and the next step runs.
    for result in run_distributed(_torch_adam_body, 2):
        assert result == {"plain": "torch.bfloat16", "oss": ["torch.bfloat16"], "stepped": True}, result


def _torch_adam_body(rank: int, world_size: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    fp32_state = {
        "state": {
            i: {
                "step": torch.tensor(1.0),
                "exp_avg": torch.full(p.shape, 1e-3),
                "exp_avg_sq": torch.full(p.shape, 1e-8),
            }
            for i, p in enumerate(model.parameters())
        },
        "param_groups": [dict(torch.optim.Adam(model.parameters()).state_dict()["param_groups"][0])],
    }
    plain = torch.optim.Adam(model.parameters())
    plain.load_state_dict(copy.deepcopy(fp32_state))
    oss = OSS(model.parameters(), optim=torch.optim.Adam)
    oss.load_state_dict(copy.deepcopy(fp32_state))
    owned = [s["exp_avg"].dtype for s in oss.optim.state.values()]
    model(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    oss.step()
    return {
        "plain": str(plain.state[model.weight]["exp_avg"].dtype),
        "oss": sorted({str(d) for d in owned}),  # each rank owns one of the two parameters
        "stepped": True,
    }
