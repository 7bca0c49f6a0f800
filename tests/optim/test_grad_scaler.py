# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""fairscale's GradScaler and ShardedGradScaler on CPU (gloo) and, where two GPUs exist, CUDA (NCCL).

* GradScaler behaves step for step like ``torch.amp.GradScaler`` and also unscales fp16 gradients.
* ShardedGradScaler: an inf/nan on one rank only is seen by every rank (one all-reduce per ``unscale_``), every
  rank skips the step (parameters unchanged) and backs the scale off; a rank without gradients still takes part.
* ShardedGradScaler + FSDP trains to the parameters of a single-process reference using torch's scaler, through
  growth and an overflow on one rank; with DDP it matches DDP + torch's scaler.

Bodies are module-level functions with picklable arguments (the suite also runs with spawn).
"""

import copy
import functools
from typing import Dict, List

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.nn as nn
from torch import Tensor
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.internal.device import accelerator_available, device_generic_amp_scaler
from fairscale.optim.grad_scaler import GradScaler, OptState, ShardedGradScaler

if not device_generic_amp_scaler():  # before the annotations below, which name torch.amp.GradScaler
    pytest.skip(
        f"torch {torch.__version__} has no device-generic torch.amp.GradScaler (torch >= 2.3): its scalers, and "
        "fairscale's, are CUDA-only and disabled on the CPU",
        allow_module_level=True,
    )

WORLD = 2
DEVICES = ["cpu", "cuda"]
DIM = 5


def _device(device_type: str, rank: int) -> torch.device:
    return torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int, rank: int) -> Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).pow(2).mean()


def _poison(grads: List[Tensor], value: float) -> None:
    with torch.no_grad():
        grads[0].view(-1)[0] = value


# ----------------------------------------------------------------------------------------------
# Single process


def _run_scaler(scaler: torch.amp.GradScaler, inf_steps: List[int], device: str = "cpu") -> Dict[str, object]:
    model = _net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(5):
        opt.zero_grad()
        scaler.scale(_loss(model, _batch(step, 0).to(device))).backward()
        if step in inf_steps:
            _poison([p.grad for p in model.parameters()], float("inf"))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_matches_torch_amp(device: str) -> None:
    # accelerator_available() honours FAIRSCALE_CPU_ONLY: the suite's pytest process stays off the GPU (this case
    # runs in .ci/cuda-checks' first step).
    if device == "cuda" and not accelerator_available():
        pytest.skip("needs CUDA")
    kwargs = dict(init_scale=2.0**10, growth_interval=2)
    ours = _run_scaler(GradScaler(**kwargs, device=device), inf_steps=[2], device=device)  # type: ignore[arg-type]
    torch_ = _run_scaler(torch.amp.GradScaler(device, **kwargs), inf_steps=[2], device=device)  # type: ignore[arg-type]
    assert ours["scales"] == torch_["scales"] == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]
    for a, b in zip(ours["params"], torch_["params"]):  # type: ignore[call-overload]
        assert torch.equal(a, b)
    # The scaler really scaled: without it (disabled) the same run differs only in the skipped step.
    plain = _run_scaler(GradScaler(enabled=False), inf_steps=[], device=device)
    assert not all(torch.equal(a, b) for a, b in zip(ours["params"], plain["params"]))  # type: ignore[call-overload]


def test_grad_scaler_unscales_fp16_grads() -> None:
    for scaler_cls in (GradScaler, ShardedGradScaler):
        model = nn.Linear(3, 2).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = scaler_cls(init_scale=4.0)
        scaler.scale(model(torch.ones(1, 3, dtype=torch.float16)).float().sum()).backward()
        assert model.weight.grad is not None and torch.equal(model.weight.grad, torch.full((2, 3), 4.0).half())
        scaler.unscale_(opt)
        assert torch.equal(model.weight.grad, torch.ones(2, 3).half())
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
        scaler.update()
    torch_scaler = torch.amp.GradScaler("cpu")
    model = nn.Linear(3, 2).half()
    torch_scaler.scale(model(torch.ones(1, 3, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="FP16"):
        torch_scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))


def test_scaler_state_dict_and_signature() -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3)
    _run_scaler(scaler, inf_steps=[0])
    state = scaler.state_dict()
    assert state == {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
                     "_growth_tracker": 1}  # fmt: skip
    other = GradScaler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    # Upstream's positional order, and the torch.cuda.amp base class that isinstance checks look for.
    s = ShardedGradScaler(2.0, 3.0, 0.25, 7, True, None)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval(), s.group) == (3.0, 0.25, 7, None)
    assert isinstance(s, torch.amp.GradScaler) and s.is_enabled()
    # Without an initialised process group the sharded scaler is a local one (world of 1).
    _run_scaler(ShardedGradScaler(), inf_steps=[1])


@pytest.mark.parametrize("cls", [GradScaler, ShardedGradScaler])
def test_update_without_a_step_raises_and_changes_nothing(cls: type) -> None:
    scaler = cls(init_scale=8.0)
    model = _net()
    scaler.scale(_loss(model, _batch(0, 0))).backward()
    # torch asserted here on older versions (gone under python -O, where an IndexError followed).
    with pytest.raises(RuntimeError, match=r"update\(\) without a step") as info:
        scaler.update()
    assert isinstance(info.value, AssertionError)  # upstream callers catching the assert still do
    assert scaler.get_scale() == 8.0
    scaler.update(new_scale=4.0)  # an explicit scale needs no inf check
    assert scaler.get_scale() == 4.0
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler.update()
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("scale_used", [False, True])
def test_refused_load_state_dict_changes_nothing(scale_used: bool) -> None:
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3)
    if scale_used:  # the scale tensor exists: torch filled it before reading the next key
        _run_scaler(scaler, inf_steps=[])
    before = scaler.state_dict()
    good = GradScaler(init_scale=2.0, growth_factor=4.0, growth_interval=9).state_dict()
    for key in good:
        partial = {k: v for k, v in good.items() if k != key}
        with pytest.raises(KeyError, match=f"lacks \\['{key}'\\].*nothing was loaded"):
            scaler.load_state_dict(partial)
        assert scaler.state_dict() == before, key
    # Values torch stores without a look (or takes half-way, after the entries before them) and fails on later.
    for bad_entry, error, message in (
        ({"scale": 0.0}, ValueError, "the saved scale must be a positive number"),
        ({"scale": -1.0}, ValueError, "the saved scale must be a positive number"),
        ({"scale": 1e39}, ValueError, "within float32's range"),  # the first scale() failed on it
        ({"scale": float("nan")}, TypeError, "scale must be a finite real number"),
        ({"scale": float("inf")}, TypeError, "scale must be a finite real number"),
        ({"scale": "big"}, TypeError, "scale must be a finite real number, got 'big'"),
        ({"scale": torch.tensor([2.0, 3.0])}, TypeError, "scale must be a finite real number"),
        ({"_growth_tracker": None}, TypeError, "_growth_tracker must be a finite real number"),
        ({"_growth_tracker": -1}, TypeError, "_growth_tracker must be a non-negative integer"),
        ({"_growth_tracker": 2.5}, TypeError, "_growth_tracker must be a non-negative integer"),
        ({"growth_interval": object()}, TypeError, "growth_interval must be a finite real number"),
        ({"growth_factor": "2"}, TypeError, "growth_factor must be a finite real number"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor must be in"),  # zeroes the scale at an overflow
        # 1 or more never let an overflowing scale come down (every step skipped); a growth factor of 0 zeroed the
        # scale after one clean interval and the next step wrote NaN into every weight, silently.
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor must be in \\(0, 1\\)"),
        ({"growth_factor": 0.0}, ValueError, "growth_factor must be at least 1"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor must be at least 1"),
        ({"backoff_factor": float("nan")}, TypeError, "backoff_factor must be a finite real number"),
    ):
        with pytest.raises(error, match=message):
            scaler.load_state_dict({**good, **bad_entry})
        assert scaler.state_dict() == before, bad_entry
    # What torch's own scaler writes or takes: numpy scalars, 0-dim tensors, an integral float tracker, interval 0.
    for accepted in (
        {"scale": np.float32(1024.0), "growth_interval": np.int64(100), "_growth_tracker": np.int64(3)},
        {"scale": torch.tensor(4.0), "_growth_tracker": torch.tensor(3)},
        {"_growth_tracker": 3.0, "growth_interval": 0, "growth_factor": 1.0},
    ):
        scaler.load_state_dict({**good, **accepted})
        assert scaler.get_scale() == float(accepted.get("scale", good["scale"]))
    scaler.load_state_dict(before)
    assert scaler.state_dict() == before
    scaler.load_state_dict(good)
    assert scaler.state_dict() == good
    GradScaler(enabled=False).load_state_dict({"anything": 1})  # a disabled scaler ignores it, as torch's


def test_an_empty_state_from_a_disabled_scaler_keeps_the_cpu_scalers_state() -> None:
    # Upstream's scalers and torch.cuda.amp's are disabled without CUDA: their checkpoints there hold {} (ESPnet's
    # --use_amp on CPU, resumed with --sharded_ddp). This scaler is enabled on the CPU and resumes from them.
    if not device_generic_amp_scaler():
        pytest.skip("torch < 2.3: the scalers are CUDA-only, disabled on the CPU (any state is ignored)")
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=3)
    _run_scaler(scaler, inf_steps=[])
    before = scaler.state_dict()
    with pytest.warns(UserWarning, match="saved by a disabled scaler.*keeps its current state"):
        scaler.load_state_dict({})
    assert scaler.is_enabled() and scaler.state_dict() == before
    _run_scaler(scaler, inf_steps=[])  # and it goes on scaling
    with pytest.raises(TypeError):  # no state at all (a checkpoint without the entry) is not an empty one
        scaler.load_state_dict(None)  # type: ignore[arg-type]


def test_a_failure_inside_torchs_loader_puts_the_scaler_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # No input passing the checks above is known to make torch's loader fail half-way; should one (a later torch),
    # what torch assigned before failing is put back. torch's loader is replaced by one that fails half-way.
    scaler = GradScaler(init_scale=8.0, growth_interval=3)
    _run_scaler(scaler, inf_steps=[])  # the scale and tracker tensors exist: torch fills them in place
    before = (scaler.state_dict(), scaler._init_scale, scaler._init_growth_tracker)

    def assign_half_then_fail(self: torch.amp.GradScaler, state_dict: Dict[str, object]) -> None:
        self._init_scale = state_dict["scale"]
        self._scale.fill_(state_dict["scale"])  # type: ignore[union-attr]
        self._growth_factor = state_dict["growth_factor"]
        raise RuntimeError("failed half-way")

    monkeypatch.setattr(torch.amp.GradScaler, "load_state_dict", assign_half_then_fail)
    with pytest.raises(RuntimeError, match="failed half-way"):
        scaler.load_state_dict(GradScaler(init_scale=2.0, growth_factor=4.0).state_dict())
    assert (scaler.state_dict(), scaler._init_scale, scaler._init_growth_tracker) == before


# ----------------------------------------------------------------------------------------------
# Worlds


def _one_rank_overflow_case(device: torch.device, rank: int, bad_rank: int, value: float) -> None:
    """Each rank its own model and grads (the sharded situation); only ``bad_rank`` sees a non-finite grad."""
    model = _net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**8, device=device.type)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(_loss(model, _batch(0, rank).to(device))).backward()
    if rank == bad_rank:
        _poison([p.grad for p in model.parameters()], value)
    with count_collectives() as counter:
        scaler.step(opt)
    assert counter.count() == counter.count("all_reduce") == 1, counter.summary()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a rank stepped despite the overflow"
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert sum(v.item() for v in found.values()) >= 1.0
    scaler.update()
    assert scaler.get_scale() == 2.0**7
    # A clean iteration afterwards steps everywhere.
    opt.zero_grad()
    scaler.scale(_loss(model, _batch(1, rank).to(device))).backward()
    scaler.step(opt)
    scaler.update()
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**7


def _fused_optimizer_case(device: torch.device, rank: int) -> None:
    """torch's fused AdamW unscales inside its kernel (``_step_supports_amp_scaling``): the inf check that the
    scaler hands it is reduced over the group too, so an inf on rank 0 only skips the step on both ranks."""
    model = _net().to(device)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    except RuntimeError as e:  # older torch: no fused kernel for this device
        pytest.skip(f"no fused AdamW here: {e}")
    scaler = ShardedGradScaler(init_scale=2.0**8, device=device.type)
    for step, bad in enumerate([True, False]):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(_loss(model, _batch(step, rank).to(device))).backward()
        if bad and rank == 0:
            _poison([p.grad for p in model.parameters()], float("inf"))
        with count_collectives() as counter:
            scaler.step(opt)
        assert counter.count("all_reduce") == 1, counter.summary()
        scaler.update()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert unchanged == bad, f"step {step}: stepped={not unchanged}"
    assert scaler.get_scale() == 2.0**7


def _rank_without_grads_case(device: torch.device, rank: int) -> None:
    """Rank 1 holds no gradient at all (e.g. it owns no shard): it still takes part and skips with rank 0."""
    model = _net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**8, device=device.type)
    loss = scaler.scale(_loss(model, _batch(0, rank).to(device)))
    if rank == 0:
        loss.backward()
        _poison([p.grad for p in model.parameters()], float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**7


def _disabled_case(device: torch.device, rank: int) -> None:
    model = _net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(enabled=False)
    loss = _loss(model, _batch(0, rank).to(device))
    assert scaler.scale(loss) is loss
    loss.backward()
    with count_collectives() as counter:
        scaler.step(opt)
        scaler.update()
    assert counter.count() == 0


def _fsdp_parity_case(device: torch.device, rank: int, world_size: int, fp16: bool = False) -> None:
    """FSDP + ShardedGradScaler vs one process with torch's scaler on the global batch; an inf on rank 1's shard
    at step 2 must skip the step on every rank exactly as the reference skips it. fp16: FSDP computes (and
    reduces gradients) in fp16, the reference in fp32; parameters agree to fp16 rounding of the updates."""
    steps, inf_step, kwargs = 5, 2, dict(init_scale=2.0**6, growth_interval=2)
    init = {k: v.clone() for k, v in _net().state_dict().items()}
    model = FSDP(
        _net().to(device), flatten_parameters=True, mixed_precision=fp16, compute_dtype=torch.float16 if fp16 else None
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = ShardedGradScaler(device=device.type, **kwargs)  # type: ignore[arg-type]
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", **kwargs)  # type: ignore[arg-type]
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, _batch(step, rank).to(device))).backward()
        if step == inf_step and rank == world_size - 1:
            _poison([p.grad for p in model.parameters()], float("inf"))
        scaler.step(opt)
        scaler.update()

        ref_opt.zero_grad()
        for r in range(world_size):
            ref_scaler.scale(_loss(ref, _batch(step, r)) / world_size).backward()
        if step == inf_step:
            _poison([p.grad for p in ref.parameters()], float("inf"))
        ref_scaler.step(ref_opt)
        ref_scaler.update()

        assert scaler.get_scale() == ref_scaler.get_scale(), step
        with model.summon_full_params():
            got = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
        for k, want in ref.state_dict().items():
            if fp16:
                moved, err = (want - init[k]).norm().item(), (got[k] - want).norm().item()
                assert err <= 0.05 * moved + 1e-4, f"step {step} {k}: error {err:.3g} vs update {moved:.3g}"
            else:
                torch.testing.assert_close(got[k], want, atol=1e-6, rtol=1e-5, msg=f"step {step} {k}")
    assert scaler.get_scale() == 2.0**7  # grew at step 1, backed off at 2, grew at 4
    if fp16:
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())


def _ddp_parity_case(device: torch.device, rank: int) -> None:
    """DDP: ShardedGradScaler and torch's scaler take the same steps; a rank-local inf (after the reduction)
    skips the step on every rank with the sharded scaler."""
    results = []
    for scaler in (ShardedGradScaler(init_scale=2.0**4, device=device.type), torch.amp.GradScaler(device.type, 2.0**4)):
        model = DDP(_net().to(device))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(_loss(model, _batch(step, rank).to(device))).backward()
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in model.parameters()])
        if isinstance(scaler, ShardedGradScaler):
            before = copy.deepcopy(results[-1])
            opt.zero_grad()
            scaler.scale(_loss(model, _batch(9, rank).to(device))).backward()
            if rank == 0:
                _poison([p.grad for p in model.parameters()], float("-inf"))
            scaler.step(opt)
            scaler.update()
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _oss_sdp_parity_case(device: torch.device, rank: int) -> None:
    """OSS + ShardedDataParallel (each rank keeps only the gradients it owns) + ShardedGradScaler vs DDP + SGD +
    torch's scaler; at step 1 an inf in a gradient that only rank 1 holds skips the step on both ranks."""
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    kwargs = dict(init_scale=2.0**6, growth_interval=2)
    model = _net().to(device)
    optim = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    sdp = ShardedDataParallel(model, optim)
    scaler = ShardedGradScaler(device=device.type, **kwargs)  # type: ignore[arg-type]
    ref = DDP(_net().to(device))
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler(device.type, **kwargs)  # type: ignore[arg-type]
    for step in range(4):
        x = _batch(step, rank).to(device)
        sdp.zero_grad()
        scaler.scale(_loss(sdp, x)).backward()
        if step == 1 and rank == 1:
            _poison([p.grad for p in optim.optim.param_groups[0]["params"]], float("inf"))
        scaler.step(optim)
        scaler.update()
        ref_optim.zero_grad()
        ref_scaler.scale(_loss(ref, x)).backward()
        if step == 1:  # the reference sees the overflow everywhere (its gradients are replicated)
            _poison([p.grad for p in ref.parameters()], float("inf"))
        ref_scaler.step(ref_optim)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale(), step
        for a, b in zip(model.parameters(), ref.module.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"step {step}")


def _scales_disagree_case(device: torch.device, rank: int, how: str) -> None:
    """A rank whose scale differs (another init_scale, a scaler state loaded there only) unscaled its owned gradients,
    which the reduction summed over ranks scaled alike, by its own scale: the update was silently wrong on every rank
    (found by a rank-disagreement fuzz, session 40). Every rank raises now, before the step."""
    from fairscale.internal.agreement import RanksDisagreeError
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    model = _net().to(device)
    optim = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, optim)
    scaler = ShardedGradScaler(device=device.type, init_scale=16.0 if how != "init_scale" or rank == 0 else 256.0)
    if how == "loaded on one rank":
        if rank == 1:
            scaler.load_state_dict({**scaler.state_dict(), "scale": 64.0})
    before = [p.detach().clone() for p in model.parameters()]
    sdp.zero_grad()
    scaler.scale(_loss(sdp, _batch(0, rank).to(device))).backward()
    with pytest.raises(RanksDisagreeError, match=r"loss scales differ \(from 16 to (256|64)\)"):
        scaler.step(optim)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "a step was taken"


def _scaler_world_body(rank: int, world_size: int, device_type: str) -> None:
    device = _device(device_type, rank)
    run_cases(
        [
            ("inf on rank 1", functools.partial(_one_rank_overflow_case, device, rank, 1, float("inf"))),
            ("nan on rank 0", functools.partial(_one_rank_overflow_case, device, rank, 0, float("nan"))),
            ("rank without grads", functools.partial(_rank_without_grads_case, device, rank)),
            ("fused optimizer", functools.partial(_fused_optimizer_case, device, rank)),
            ("disabled", functools.partial(_disabled_case, device, rank)),
            ("fsdp parity", functools.partial(_fsdp_parity_case, device, rank, world_size)),
            ("fsdp fp16 parity", functools.partial(_fsdp_parity_case, device, rank, world_size, True)),
            ("ddp parity", functools.partial(_ddp_parity_case, device, rank)),
            ("oss + sharded ddp parity", functools.partial(_oss_sdp_parity_case, device, rank)),
            ("init_scale differs", functools.partial(_scales_disagree_case, device, rank, "init_scale")),
            ("state loaded on one rank", functools.partial(_scales_disagree_case, device, rank, "loaded on one rank")),
        ]
    )


@pytest.mark.parametrize("device_type", DEVICES)
def test_sharded_grad_scaler_world(device_type: str) -> None:
    run_distributed(_scaler_world_body, WORLD, device_type, device=device_type, timeout=240.0)


def _subgroup_case(rank: int) -> None:
    """Two groups of two: an overflow in group {0, 1} does not make group {2, 3} skip."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(init_scale=2.0**8, process_group=group)
    scaler.scale(_loss(model, _batch(0, rank))).backward()
    if rank == 1:
        _poison([p.grad for p in model.parameters()], float("inf"))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == (2.0**7 if rank < 2 else 2.0**8)


def _four_rank_body(rank: int, world_size: int) -> None:
    device = _device("cpu", rank)
    run_cases(
        [
            ("fsdp parity", functools.partial(_fsdp_parity_case, device, rank, world_size)),
            ("process_group", functools.partial(_subgroup_case, rank)),
        ]
    )


def test_sharded_grad_scaler_world_of_four() -> None:
    """FSDP parity over 4 ranks, and a scaler per sub-group: only the group with the overflow skips."""
    run_distributed(_four_rank_body, 4)
