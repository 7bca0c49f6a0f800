# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP core: parity with a single-process reference over the option matrix, training states, final callback,
bucketing and the reduce-scatter group.

Each test starts one world and runs its cases as sub-tests (``run_cases``); models and the parity harness are in
``_models.py``.
"""

import itertools
import logging
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from _models import (
    MIXED,
    WRAP_MODES,
    ModelWithBatchNorm,
    ModelWithUnusedParams,
    NestedWrappedModule,
    TransformerWithSharedParams,
    assert_close_dict,
    assert_idle,
    build,
    gather_full_grads,
    global_batch,
    local_slice,
    scaled_loss,
    train_and_compare,
    wrap_model,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.internal.parallel import ProcessGroupName
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances

Case = Tuple[str, Callable[[], Any]]


def _matrix_cases(rank: int, world_size: int, optims: Tuple[str, ...]) -> List[Case]:
    cases: List[Case] = []
    for reshard, mp, flatten, mode, optim in itertools.product((True, False), MIXED, (True, False), WRAP_MODES, optims):
        kwargs = dict(reshard_after_forward=reshard, flatten_parameters=flatten, **MIXED[mp])
        name = f"reshard={reshard},{mp},flatten={flatten},{mode},{optim}"

        def case(kwargs: Dict[str, Any] = kwargs, mode: str = mode, optim: str = optim) -> None:
            train_and_compare(rank, world_size, NestedWrappedModule, kwargs, mode, optim)

        cases.append((name, case))
    return cases


def _parity_matrix_body(rank: int, ws: int, optims: Tuple[str, ...]) -> None:
    run_cases(_matrix_cases(rank, ws, optims))


# World size 3 needs padding in every owned tensor; Adam runs where worlds are cheap (the matrix is the same).
@pytest.mark.parametrize(
    "world_size,optims", [(1, ("sgd", "adam")), (2, ("sgd", "adam")), (3, ("sgd",)), (4, ("sgd",))]
)
def test_parity_matrix(world_size: int, optims: Tuple[str, ...]) -> None:
    """reshard_after_forward x {fp32, fp16, bf16} x flatten_parameters x {one, nested, leaf} == reference."""

    run_distributed(_parity_matrix_body, world_size, optims, timeout=240)


def _parity_matrix_adam_exhaustive_body(rank: int, ws: int) -> None:
    run_cases(_matrix_cases(rank, ws, ("adam",)))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_parity_matrix_adam_exhaustive(world_size: int) -> None:
    run_distributed(_parity_matrix_adam_exhaustive_body, world_size, timeout=600)


def _parity_other_models_body(rank: int, ws: int) -> None:
    cases: List[Case] = []
    for mp, mode, flatten in itertools.product(("fp32", "fp16"), ("one", "nested"), (True, False)):
        kwargs = dict(flatten_parameters=flatten, **MIXED[mp])
        cases.append(
            (
                f"transformer,{mp},{mode},flatten={flatten}",
                lambda kw=kwargs, m=mode: train_and_compare(rank, ws, TransformerWithSharedParams, kw, m),
            )
        )
    for mode, flatten in itertools.product(WRAP_MODES, (True, False)):
        kwargs = dict(flatten_parameters=flatten)
        cases.append(
            (
                f"batchnorm,{mode},flatten={flatten}",
                lambda kw=kwargs, m=mode: train_and_compare(rank, ws, ModelWithBatchNorm, kw, m),
            )
        )
        for optim in ("sgd", "adam"):
            cases.append(
                (
                    f"unused,{mode},flatten={flatten},{optim}",
                    lambda kw=kwargs, m=mode, o=optim: train_and_compare(rank, ws, ModelWithUnusedParams, kw, m, o),
                )
            )
    cases.append(("batchnorm,fp16", lambda: _batchnorm_mixed(rank, ws)))
    run_cases(cases)


def test_parity_other_models() -> None:
    """Shared (tied) parameters in a transformer, BatchNorm buffers, parameters forward never uses."""

    run_distributed(_parity_other_models_body, 2, timeout=180)


def _batchnorm_mixed(rank: int, ws: int) -> None:
    # buffer_dtype defaults to the compute dtype. (fp32 buffers with fp16 activations would need a separate fp32
    # BatchNorm instance, which CPU batch_norm cannot mix with fp16 inputs.)
    fsdp = train_and_compare(rank, ws, ModelWithBatchNorm, MIXED["fp16"], "nested", steps=2, local_batch=8)
    bn = fsdp.module.module.bn.module.module
    assert bn.running_mean.dtype == torch.float16 and bn.running_var.dtype == torch.float16
    assert bn.num_batches_tracked.dtype == torch.int64  # integer buffers keep their dtype


def _unused_params_get_no_gradient_and_states_stay_consistent_body(rank: int, ws: int) -> None:
    model, _ = build(ModelWithUnusedParams)
    fsdp = wrap_model(model, dict(flatten_parameters=False), "nested")
    unused = fsdp.module.module.unused
    for step in range(2):
        batch = local_slice(global_batch(model, step, 4), rank, ws)
        fsdp(*batch).sum().backward()
        assert_idle(fsdp)
        assert all(p.grad is None for p in unused.params), "a never-used parameter got a gradient"
        used = [p for m in get_fsdp_instances(fsdp) if m is not unused for p in m.params]
        assert all(p.grad is not None for p in used)


def test_unused_params_get_no_gradient_and_states_stay_consistent() -> None:
    run_distributed(_unused_params_get_no_gradient_and_states_stay_consistent_body, 2)


# ------------------------------------------------------------------------------------------------------ states


class StateProbe(nn.Module):
    """Identity that records every FSDP instance's training state in forward and when its gradient arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.root: Any = None
        self.forward_states: List[List[TrainingState]] = []
        self.backward_states: List[List[TrainingState]] = []

    def _states(self) -> List[TrainingState]:
        return [m.training_state for m in get_fsdp_instances(self.root)]

    def forward(self, x: Tensor) -> Tensor:
        self.forward_states.append(self._states())
        if x.requires_grad:
            x.register_hook(lambda g: self.backward_states.append(self._states()))
        return x


class ProbedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), StateProbe(), nn.Linear(6, 6))
        self.last = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.block(self.first(x))
        return self.last(h), h  # two outputs: both get pre-backward hooks


def _count_final_callbacks(root: FSDP) -> List[int]:
    """Spy on the root's final callback (set before lazy init, which queues the bound method)."""
    calls = [0]
    original = root._finalize_backward

    def counted() -> None:
        calls[0] += 1
        original()

    root._finalize_backward = counted  # type: ignore[method-assign]
    return calls


def _training_states_and_one_final_callback_per_backward_body(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    model = ProbedModel()
    model.block = FSDP(model.block)
    root = FSDP(model)
    probe = root.module.module.block.module.module[1]
    probe.root = root
    calls = _count_final_callbacks(root)
    x = torch.randn(3, 4)
    for it in range(3):
        out, hidden = root(x)
        assert_idle(root, after_forward=True)
        assert probe.forward_states[-1] == [TrainingState.FORWARD, TrainingState.FORWARD]
        # Several outputs, several hooks: still one final callback per backward.
        (out.sum() + hidden.sum()).backward()
        assert calls[0] == it + 1, f"iteration {it}: {calls[0]} final callbacks"
        for state in probe.backward_states[-1]:
            assert state in (TrainingState.BACKWARD_PRE, TrainingState.BACKWARD_POST)
        assert_idle(root)
    with root.summon_full_params():
        assert all(m.training_state == TrainingState.SUMMON_FULL_PARAMS for m in get_fsdp_instances(root))
    assert_idle(root)
    # A forward without backward (e.g. evaluation) does not queue anything; the next backward gets one callback.
    with torch.no_grad():
        root(x)
    assert_idle(root, after_forward=True)
    root(x)[0].sum().backward()
    assert calls[0] == 4


def test_training_states_and_one_final_callback_per_backward() -> None:
    run_distributed(_training_states_and_one_final_callback_per_backward_body, 2)


def _forward_under_no_grad_and_eval_body(rank: int, ws: int) -> None:
    model, ref = build(NestedWrappedModule)
    fsdp = wrap_model(model, dict(mixed_precision=False), "nested")
    x = torch.randn(4, 7)
    with count_collectives() as counter:
        with torch.no_grad():
            out = fsdp(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, ref(x))
    assert counter.count("reduce_scatter") == 0
    assert_idle(fsdp, after_forward=True)
    fsdp.eval()
    ref.eval()
    torch.testing.assert_close(fsdp(x), ref(x))
    assert_idle(fsdp, after_forward=True)
    # Training still works afterwards and matches the reference.
    fsdp.train()
    ref.train()
    fsdp(x).sum().backward()
    ref(x).sum().backward()
    expected = {n: p.grad * 1.0 for n, p in ref.named_parameters()}  # both ranks saw the same batch
    assert_close_dict(gather_full_grads(fsdp), expected, "grad", rtol=1e-5, atol=1e-6)


def test_forward_under_no_grad_and_eval() -> None:
    run_distributed(_forward_under_no_grad_and_eval_body, 2)


# ------------------------------------------------------------------------------------------------------ reduction


def _one_step_grads(rank: int, ws: int, **kwargs: Any) -> Tuple[Dict[str, Tensor], Any]:
    model, _ = build(NestedWrappedModule)
    fsdp = wrap_model(model, kwargs, "nested")
    batch = global_batch(model, 0, 2 * ws)
    with count_collectives() as counter:
        scaled_loss(NestedWrappedModule, fsdp(*local_slice(batch, rank, ws)), 2 * ws, ws).backward()
    assert_idle(fsdp)
    return gather_full_grads(fsdp), counter


def _bucketing_on_and_off_give_the_same_gradients_body(rank: int, ws: int) -> None:
    unbucketed, c0 = _one_step_grads(rank, ws, bucket_cap_mb=0)
    bucketed, c25 = _one_step_grads(rank, ws, bucket_cap_mb=25)
    assert_close_dict(bucketed, unbucketed, "grad", rtol=1e-6, atol=1e-7)
    assert c0.count("reduce_scatter") == 3, c0.summary()  # one per instance
    assert c25.count("reduce_scatter") == 1, c25.summary()  # everything fits one bucket
    assert c25.total_bytes("reduce_scatter") == c0.total_bytes("reduce_scatter")
    # A bucket smaller than the largest gradient: that one goes alone, the small ones share a flush.
    # Per-rank chunks at world size 3: 10 (block 2), 35 (block 1), 20 (root); a bucket row of 30 elements.
    tiny, c_tiny = _one_step_grads(rank, ws, bucket_cap_mb=90 * 4 / 2**20)
    assert_close_dict(tiny, unbucketed, "grad", rtol=1e-6, atol=1e-7)
    assert c_tiny.count("reduce_scatter") == 2, c_tiny.summary()


def test_bucketing_on_and_off_give_the_same_gradients() -> None:
    run_distributed(_bucketing_on_and_off_give_the_same_gradients_body, 3)


def _reduce_scatter_group_choices_body(rank: int, ws: int) -> None:
    default_pg = FSDP(nn.Linear(3, 3), process_group_reduce_scatter=ProcessGroupName.default)
    assert default_pg.process_group_reduce_scatter is default_pg.process_group
    separate = FSDP(nn.Linear(3, 3))
    assert separate.process_group_reduce_scatter is not separate.process_group
    assert separate.process_group_reduce_scatter.size() == ws
    explicit_group = dist.new_group()
    explicit = FSDP(nn.Linear(3, 3), process_group_reduce_scatter=explicit_group)
    assert explicit.process_group_reduce_scatter is explicit_group
    # A group of another size cannot line up with the shards: fall back to process_group, with a warning.
    single, _ = dist.new_subgroups(1)
    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("fairscale.nn.data_parallel.fully_sharded_data_parallel")
    logger.addHandler(handler)
    try:
        fallback = FSDP(nn.Linear(3, 3), process_group_reduce_scatter=single)
    finally:
        logger.removeHandler(handler)
    assert fallback.process_group_reduce_scatter is fallback.process_group
    assert any("process_group_reduce_scatter" in r.getMessage() for r in records)
    with pytest.raises(TypeError, match="process_group_reduce_scatter"):
        FSDP(nn.Linear(3, 3), process_group_reduce_scatter="not a group")
    # Same numbers whichever group reduces.
    separate_grads, _ = _one_step_grads(rank, ws)
    default_grads, _ = _one_step_grads(rank, ws, process_group_reduce_scatter=ProcessGroupName.default)
    explicit_grads, _ = _one_step_grads(rank, ws, process_group_reduce_scatter=explicit_group)
    assert_close_dict(default_grads, separate_grads, "grad", rtol=1e-6, atol=1e-7)
    assert_close_dict(explicit_grads, separate_grads, "grad", rtol=1e-6, atol=1e-7)


def test_reduce_scatter_group_choices() -> None:
    run_distributed(_reduce_scatter_group_choices_body, 2)
