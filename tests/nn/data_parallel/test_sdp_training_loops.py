# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel + OSS in realistic training loops, against torch's DDP + the same torch optimizer.

Each body trains, in one world of 2 gloo ranks, a ShardedDataParallel model with OSS and a DDP model with the plain
optimizer, step by step on the same batches, and returns how far each rank's parameters are from DDP's and from the
other rank's. Every loop here was silently wrong before (the ranks stayed identical or drifted apart):

* gradient accumulation without ``no_sync()`` where the first micro-batch leaves a parameter of a bucket unused
  (multi-task heads): that bucket's other reduced values were reduced again; and where the second micro-batch uses
  nothing of a bucket the first used: the end of its backward sent that bucket again, its earlier result with it;
* a parameter that only the micro-batches inside ``no_sync()`` use: never reduced, its owner stepped with its own
  local gradient;
* an ``eval()`` forward between two micro-batches (logging): the first micro-batch's reduction was reduced again;
* a layer frozen mid-training, gradients zeroed with ``ShardedDataParallel.zero_grad()`` (zeroed, not released):
  its owner kept stepping it (as torch does on every rank under DDP) and nobody received the new value.

Each body covers unbucketed and bucketed reductions and both ways of zeroing the gradients.
"""

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS

TIMEOUT = 180.0
CONFIGS = [(bucket, zero) for bucket in (0, 2**10) for zero in ("wrapper", "optimizer")]
TOLERANCE = 1e-6  # reordered float sums only


class _TwoHeads(nn.Module):
    """A trunk and two task heads; ``task`` picks the head (every rank alike)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 8)
        self.head_a = nn.Linear(8, 2)
        self.head_b = nn.Linear(8, 2)
        self.task = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.trunk(x))
        return self.head_a(hidden) if self.task == "a" else self.head_b(hidden)


class _Branchy(nn.Module):
    """``b`` is skipped when ``use_b`` is off."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.a(x))
        if self.use_b:
            hidden = torch.relu(self.b(hidden))
        return self.c(hidden)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))


def _batch(step: int, rank: int, micro: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)


def _loss(model: nn.Module, step: int, rank: int, micro: int = 0) -> torch.Tensor:
    x, y = _batch(step, rank, micro)
    return (model(x) - y).pow(2).mean()


def _pair(
    make: Callable[[], nn.Module], bucket: int, optim: Any, **hyper: Any
) -> Tuple[nn.Module, ShardedDataParallel, OSS, nn.Module, DistributedDataParallel, torch.optim.Optimizer]:
    """The ShardedDataParallel model with OSS, and the DDP reference with the plain optimizer."""
    model, ref = make(), make()
    opt = OSS(model.parameters(), optim=optim, **hyper)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
    ddp = DistributedDataParallel(ref, find_unused_parameters=True)
    return model, sdp, opt, ref, ddp, optim(ref.parameters(), **hyper)


def _zero(zero: str, sdp: ShardedDataParallel, opt: OSS, ddp: nn.Module, ref_opt: torch.optim.Optimizer) -> None:
    if zero == "wrapper":  # ShardedDataParallel's default keeps the gradients, zeroed
        sdp.zero_grad()
        ddp.zero_grad(set_to_none=False)
    else:  # torch's default releases them
        opt.zero_grad()
        ref_opt.zero_grad()


def _spread(model: nn.Module) -> float:
    """The largest distance between the ranks' copies of ``model``'s parameters."""
    spread = 0.0
    for param in model.parameters():
        copies = [torch.zeros_like(param) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, param.detach().contiguous())
        spread = max(spread, max((c - copies[0]).abs().max().item() for c in copies))
    return spread


def _gaps(model: nn.Module, ref: nn.Module) -> Tuple[float, float]:
    """(largest distance from DDP's parameters, largest distance between the ranks' parameters)."""
    to_ddp = max((p - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
    return to_ddp, _spread(model)


def _check(results: List[Dict[str, Tuple[float, float]]]) -> None:
    for rank, per_config in enumerate(results):
        for config, (to_ddp, spread) in per_config.items():
            assert to_ddp < TOLERANCE, f"rank {rank}, {config}: {to_ddp:.2e} from DDP's parameters"
            assert spread == 0.0, f"rank {rank}, {config}: the ranks' parameters differ by {spread:.2e}"


def _heads_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    """Accumulation without no_sync(): micro-batch 0 uses head a, micro-batch 1 head b."""
    out = {}
    for bucket, zero in CONFIGS:
        model, sdp, opt, ref, ddp, ref_opt = _pair(_TwoHeads, bucket, torch.optim.SGD, lr=0.1)
        for step in range(3):
            _zero(zero, sdp, opt, ddp, ref_opt)
            for micro, task in enumerate("ab"):
                model.task = ref.task = task
                _loss(sdp, step, rank, micro).backward()
                _loss(ddp, step, rank, micro).backward()
            opt.step()
            ref_opt.step()
        out[f"bucket={bucket} zero={zero}"] = _gaps(model, ref)
    return out


def test_accumulation_with_a_head_unused_by_the_first_micro_batch() -> None:
    _check(run_distributed(_heads_body, 2, timeout=TIMEOUT))


def _window_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    """no_sync() accumulation: layer b is used by the micro-batch inside the window only (on both ranks, then on
    rank 0 only: the reduction after the window is agreed between the ranks)."""
    out = {}
    for alone in (False, True):
        for bucket, zero in CONFIGS:
            model, sdp, opt, ref, ddp, ref_opt = _pair(_Branchy, bucket, torch.optim.SGD, lr=0.1, momentum=0.9)
            for step in range(3):
                _zero(zero, sdp, opt, ddp, ref_opt)
                model.use_b = ref.use_b = rank == 0 or not alone
                with sdp.no_sync():
                    _loss(sdp, step, rank, 0).backward()
                with ddp.no_sync():
                    _loss(ddp, step, rank, 0).backward()
                model.use_b = ref.use_b = False
                _loss(sdp, step, rank, 1).backward()
                _loss(ddp, step, rank, 1).backward()
                opt.step()
                ref_opt.step()
            out[f"b used by {'rank 0' if alone else 'both ranks'}, bucket={bucket} zero={zero}"] = _gaps(model, ref)
            if _spread(ref) > 0:
                # torch 2.1's DDP itself lets its replicas drift here (fixed by 2.6): only the ranks' agreement is
                # checked then.
                out["ddp_replicas_drift"] = (0.0, 0.0)
    return out


def test_parameter_used_only_inside_no_sync_is_reduced() -> None:
    results = run_distributed(_window_body, 2, timeout=TIMEOUT)
    if "ddp_replicas_drift" in results[0]:
        for rank, per_config in enumerate(results):
            for config, (_, spread) in per_config.items():
                assert spread == 0.0, f"rank {rank}, {config}: the ranks' parameters differ by {spread:.2e}"
        pytest.skip(f"torch {torch.__version__}'s DDP lets its own replicas drift here: compared between ranks only")
    _check(results)


def _eval_between_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    """Accumulation without no_sync(), with an evaluation forward between the micro-batches of every step."""
    out = {}
    for bucket, zero in CONFIGS:
        model, sdp, opt, ref, ddp, ref_opt = _pair(_mlp, bucket, torch.optim.SGD, lr=0.1)
        for step in range(3):
            _zero(zero, sdp, opt, ddp, ref_opt)
            for micro in range(2):
                _loss(sdp, step, rank, micro).backward()
                _loss(ddp, step, rank, micro).backward()
                if micro == 0:
                    sdp.eval()
                    with torch.no_grad():
                        sdp(_batch(step, rank)[0])
                    sdp.train()
            opt.step()
            ref_opt.step()
        out[f"bucket={bucket} zero={zero}"] = _gaps(model, ref)
    return out


def test_eval_forward_between_micro_batches() -> None:
    _check(run_distributed(_eval_between_body, 2, timeout=TIMEOUT))


def _freeze_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    """The first layer's weight (owned by one rank) frozen after 3 steps; optimizers that move a parameter with a
    zero gradient (Adam's moments, SGD's momentum and weight decay)."""
    optimizers: List[Tuple[Any, Dict[str, Any]]] = [
        (torch.optim.Adam, dict(lr=1e-2)),
        (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    ]
    out = {}
    for optim, hyper in optimizers:
        for bucket, zero in CONFIGS:
            model, sdp, opt, ref, ddp, ref_opt = _pair(_mlp, bucket, optim, **hyper)
            for step in range(6):
                if step == 3:  # on every rank alike; ShardedDataParallel refreshes at the next forward
                    model[0].weight.requires_grad_(False)
                    ref[0].weight.requires_grad_(False)
                _zero(zero, sdp, opt, ddp, ref_opt)
                _loss(sdp, step, rank).backward()
                _loss(ddp, step, rank).backward()
                opt.step()
                ref_opt.step()
            out[f"{optim.__name__} bucket={bucket} zero={zero}"] = _gaps(model, ref)
    return out


def test_layer_frozen_mid_training_stays_identical_on_every_rank() -> None:
    _check(run_distributed(_freeze_body, 2, timeout=TIMEOUT))


class _HeadByName(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return (self.a if head == "a" else self.b)(x)


def _abandoned_window_body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _HeadByName()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, weight_decay=0.1)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=0)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    with sdp.no_sync():
        sdp(x, "a").sum().backward()  # a micro-batch of a step that is then abandoned (an OOM or NaN skip)
    sdp.zero_grad(set_to_none=True)  # discarded
    sdp(x, "b").sum().backward()  # a fresh step with the other head only
    # The abandoned window's head was reduced at this backward: zero gradients, which weight decay then stepped.
    assert model.a.weight.grad is None and model.a.bias.grad is None
    before = model.a.weight.detach().clone()
    opt.step()
    assert torch.equal(model.a.weight, before)


def test_zero_grad_drops_an_abandoned_no_sync_window() -> None:
    run_distributed(_abandoned_window_body, 2, timeout=TIMEOUT)


class _Aux(nn.Module):
    """``aux`` is used when ``use_aux`` is on (every rank alike)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3)
        self.aux = nn.Linear(3, 3)
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        return x + self.aux(x) if self.use_aux else x


def _later_micro_batch_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    """Accumulation without no_sync(): micro-batch 0 uses ``aux``, micro-batch 1 does not. With 4-element buckets a
    bucket holds only ``aux.bias``: micro-batch 1 reaches nothing of it, and the end of its backward sent it again,
    the first reduction's result with it (0.86 off DDP's gradient)."""
    out = {}
    for bucket in (0, 4, 2**10):
        for zero in ("wrapper", "optimizer"):
            model, sdp, opt, ref, ddp, ref_opt = _pair(_Aux, bucket, torch.optim.SGD, lr=0.1)
            for step in range(2):
                _zero(zero, sdp, opt, ddp, ref_opt)
                for micro, uses in enumerate((True, False)):
                    model.use_aux = ref.use_aux = uses
                    x = (torch.arange(6.0).reshape(2, 3) * (rank + 1) + micro + step) / 10
                    sdp(x).pow(2).sum().backward()
                    ddp(x).pow(2).sum().backward()
                opt.step()
                ref_opt.step()
            out[f"bucket={bucket} zero={zero}"] = _gaps(model, ref)
    return out


def test_accumulation_with_a_parameter_unused_by_a_later_micro_batch() -> None:
    _check(run_distributed(_later_micro_batch_body, 2, timeout=TIMEOUT))


class _UnfrozenLater(nn.Module):
    """An embedding, two residual blocks (the second frozen when the optimizer is built), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(9, 5)
        self.lin1, self.ln1 = nn.Linear(5, 5), nn.LayerNorm(5)
        self.lin2, self.ln2 = nn.Linear(5, 5), nn.LayerNorm(5)
        self.head = nn.Linear(5, 9)
        self.lin2.requires_grad_(False)
        self.ln2.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + nn.functional.gelu(self.ln1(self.lin1(x)))
        x = x + nn.functional.gelu(self.ln2(self.lin2(x)))
        return self.head(x)


def _ids(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 9, (1, 3), generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _unfrozen_body(rank: int, world_size: int) -> Dict[str, Tuple[float, float]]:
    """The second block unfrozen after a step (picked up at the next forward, which rebuilds the buckets), then two
    reduced backwards per step, gradients zeroed by the wrapper or the optimizer; against one process training on
    every rank's micro-batches. With 50-element buckets a parameter that had a bucket no longer fits one after the
    rebuild: its gradient stayed a view of the old bucket, and the second backward reduced the first one's result
    again (0.09 off)."""
    out = {}
    for bucket in (0, 50, 2**10):
        for zero in ("wrapper", "optimizer"):
            model, ref = _UnfrozenLater(), _UnfrozenLater()
            opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
            sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            for step in range(3):
                if step == 1:
                    for m in (model, ref):
                        m.lin2.requires_grad_(True)
                        m.ln2.requires_grad_(True)
                if zero == "wrapper":
                    sdp.zero_grad()
                else:
                    opt.zero_grad()
                ref_opt.zero_grad()
                for micro in range(2):
                    sdp(_ids(step, micro, rank)).pow(2).mean().backward()
                    for r in range(world_size):
                        (ref(_ids(step, micro, r)).pow(2).mean() / world_size).backward()
                opt.step()
                ref_opt.step()
            out[f"bucket={bucket} zero={zero}"] = _gaps(model, ref)
    return out


def test_unfrozen_parameter_leaving_the_buckets_with_two_backwards_per_step() -> None:
    _check(run_distributed(_unfrozen_body, 2, timeout=TIMEOUT))
