# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS with a parameter frozen mid-training (``refresh_trainable()`` after it, as the docs ask), against torch's DDP
+ the same torch optimizer.

A frozen parameter whose gradient is zeroed rather than released (``zero_grad(set_to_none=False)``) is still
stepped by a torch optimizer: under DDP every rank moves it alike (Adam's moments, SGD's momentum and weight decay).
OSS's owner moved it the same way, but the refresh had taken it out of the broadcast buckets: no other rank received
the new value and the replicas drifted apart, silently. Now the owner's value is broadcast while it has a gradient.
A parameter frozen from the start costs no collective, unless it holds a gradient when OSS is built (gradients zeroed
rather than released, then the optimizer rebuilt after freezing, or the parameter given with ``add_param_group``):
then its owner steps it too, and it is broadcast the same way (before, no other rank received it).
"""

from typing import Any, Dict, List, Tuple

import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal import collectives
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 180.0
TOLERANCE = 1e-6  # reordered float sums only


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)
    return (model(x) - y).pow(2).mean()


def _gaps(model: nn.Module, ref: nn.Module) -> Tuple[float, float]:
    """(largest distance from the reference's parameters, largest distance between the ranks' parameters)."""
    to_ref = max((p - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
    spread = 0.0
    for param in model.parameters():
        copies = [torch.zeros_like(param) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, param.detach().contiguous())
        spread = max(spread, max((c - copies[0]).abs().max().item() for c in copies))
    return to_ref, spread


def _freeze_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    optimizers: List[Tuple[Any, Dict[str, Any]]] = [
        (torch.optim.Adam, dict(lr=1e-2)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    ]
    out = {}
    for optim, hyper in optimizers:
        for set_to_none in (False, True):
            model, ref = _mlp(), _mlp()
            ddp = DistributedDataParallel(model, find_unused_parameters=True)
            opt = OSS(model.parameters(), optim=optim, **hyper)
            ref_ddp = DistributedDataParallel(ref, find_unused_parameters=True)
            ref_opt = optim(ref.parameters(), **hyper)
            for step in range(8):
                if step in (3, 6):  # freeze both layer-0 tensors (different owners), unfreeze one
                    for m in (model, ref):
                        m[0].weight.requires_grad_(step == 6)
                        m[0].bias.requires_grad_(False)
                    opt.refresh_trainable()
                opt.zero_grad(set_to_none=set_to_none)
                ref_opt.zero_grad(set_to_none=set_to_none)
                _loss(ddp, step, rank).backward()
                _loss(ref_ddp, step, rank).backward()
                opt.step()
                ref_opt.step()
            out[f"{optim.__name__} set_to_none={set_to_none}"] = _gaps(model, ref)
    return out


def _frozen_from_start_body(rank: int, world_size: int) -> List[float]:
    """All-reduces of a step after the first: nothing frozen, layer 0 frozen from the construction on, layer 0 frozen
    since (one small all-reduce of the owners' flags). The first step after a build that changed the set of parameters
    frozen from the start agrees on those holding a gradient (one all-reduce), once."""
    counts = []
    for frozen in ("none", "start", "since"):
        model = _mlp()
        model[0].requires_grad_(frozen != "start")
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        _loss(model, 0, rank).backward()
        opt.step()
        _loss(model, 1, rank).backward()
        if frozen == "since":
            model[0].requires_grad_(False)
            opt.refresh_trainable()
        with collectives.count_collectives() as counter:
            opt.step()
        counts.append(float(counter.count("all_reduce")))
    return counts


def test_parameter_frozen_mid_training_stays_identical_on_every_rank() -> None:
    results = run_distributed(_freeze_body, 2, timeout=TIMEOUT)
    for rank, per_config in enumerate(results):
        for config, (to_ref, spread) in per_config.items():
            assert to_ref < TOLERANCE, f"rank {rank}, {config}: {to_ref:.2e} from DDP + {config}'s parameters"
            assert spread == 0.0, f"rank {rank}, {config}: the ranks' parameters differ by {spread:.2e}"
    # A parameter frozen from the start never has a gradient: its step adds no collective.
    assert run_distributed(_frozen_from_start_body, 2, timeout=TIMEOUT) == [[0.0, 0.0, 1.0]] * 2


def _rebuilt_after_freezing_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    """Train 3 steps, freeze layer 0 with its gradients zeroed rather than released, then build a new optimizer (all
    the parameters, or the trainable ones plus layer 0 through ``add_param_group``) and train on: the frozen layer
    holds a zero gradient, which weight decay and momentum step, on every rank alike under DDP."""
    out = {}
    for how in ("rebuilt", "add_param_group"):
        model, ref = _mlp(), _mlp()
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        ref_ddp = DistributedDataParallel(ref, find_unused_parameters=True)
        hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
        opt: Any = OSS(model.parameters(), optim=torch.optim.SGD, **hyper)
        ref_opt: Any = torch.optim.SGD(ref.parameters(), **hyper)
        for step in range(6):
            if step == 3:
                for m in (model, ref):
                    m.zero_grad(set_to_none=False)
                    m[0].requires_grad_(False)
                if how == "rebuilt":
                    opt = OSS(model.parameters(), optim=torch.optim.SGD, **hyper)
                    ref_opt = torch.optim.SGD(ref.parameters(), **hyper)
                else:
                    opt = OSS(list(model[2].parameters()) + list(model[4].parameters()), optim=torch.optim.SGD, **hyper)
                    opt.add_param_group({"params": list(model[0].parameters())})
                    ref_opt = torch.optim.SGD(list(ref[2].parameters()) + list(ref[4].parameters()), **hyper)
                    ref_opt.add_param_group({"params": list(ref[0].parameters())})
            opt.zero_grad(set_to_none=False)
            ref_opt.zero_grad(set_to_none=False)
            _loss(ddp, step, rank).backward()
            _loss(ref_ddp, step, rank).backward()
            opt.step()
            ref_opt.step()
        out[how] = _gaps(model, ref)
    return out


def test_parameter_frozen_with_a_gradient_when_oss_is_built_stays_identical() -> None:
    for rank, per_case in enumerate(run_distributed(_rebuilt_after_freezing_body, 2, timeout=TIMEOUT)):
        for case, (to_ref, spread) in per_case.items():
            assert to_ref < TOLERANCE, f"rank {rank}, {case}: {to_ref:.2e} from DDP's parameters"
            assert spread == 0.0, f"rank {rank}, {case}: the ranks' parameters differ by {spread:.2e}"


def _rank0_eval_body(rank: int, world_size: int) -> float:
    """A parameter frozen from the start, and an eval() forward on rank 0 alone between steps (validation there):
    ShardedDataParallel rebuilds OSS's buckets on that rank only, which must not communicate (the agreement on
    frozen parameters holding a gradient ran there too, and gloo aborted on the unmatched collective)."""
    model = _mlp()
    model[0].weight.requires_grad_(False)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    for step in range(3):
        _loss(sdp, step, rank).backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            sdp.eval()
            with torch.no_grad():
                sdp(torch.randn(3, 4))
            sdp.train()
    return float(sum(p.detach().sum() for p in model.parameters()))


def test_eval_on_one_rank_with_a_parameter_frozen_from_the_start() -> None:
    sums = run_distributed(_rank0_eval_body, 2, timeout=TIMEOUT)
    assert sums[0] == sums[1], sums


def _unfreeze_then_rank0_eval_body(rank: int, world_size: int) -> Tuple[int, float]:
    """A layer unfrozen on every rank, then an eval() forward on rank 0 alone (validation there) before the next
    training forward, the other rank waiting in a barrier: the rebuild there changed the set of parameters frozen from
    the start, and the ranks' agreement on those holding a gradient ran in it, a collective of rank 0 alone."""
    model = _mlp()
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, opt)
    ref = _mlp()
    ref[0].weight.requires_grad_(False)
    ref[2].requires_grad_(False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    eval_collectives = 0
    for step in range(4):
        if step == 2:
            model[2].requires_grad_(True)
            ref[2].requires_grad_(True)
            if rank == 0:
                with collectives.count_collectives() as counter:
                    sdp.eval()
                    with torch.no_grad():
                        sdp(torch.randn(3, 4))
                    sdp.train()
                eval_collectives = counter.count()
            dist.barrier()
        _loss(sdp, step, rank).backward()
        # The one-process reference: DDP leaves out of its reducer what was frozen when it was built.
        (sum(_loss(ref, step, r) for r in range(world_size)) / world_size).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    to_ref, spread = _gaps(model, ref)
    if spread != 0.0:
        raise AssertionError(f"rank {rank}: the ranks' parameters differ by {spread:.2e}")
    return eval_collectives, to_ref


def test_unfreeze_then_eval_on_one_rank_makes_no_collective() -> None:
    results = run_distributed(_unfreeze_then_rank0_eval_body, 2, timeout=60.0)
    assert results[0][0] == 0, f"rank 0's eval() forward called {results[0][0]} collectives"
    for rank, (_, to_ref) in enumerate(results):
        assert to_ref < TOLERANCE, f"rank {rank}: {to_ref:.2e} from DDP's parameters"
