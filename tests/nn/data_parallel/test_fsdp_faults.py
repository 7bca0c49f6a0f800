# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""FSDP promises under faults and bad input (issue 19): tied weights, checkpoint identity, timeouts of FSDP's own
process groups, aborted backwards, collective loads, non-member groups, bad dtypes and no_sync() on nested instances.

Every body is a module-level function (spawn-safe); every multi-rank world is bounded by a timeout, and the engine
kills its ranks when the test ends.
"""

import atexit
import copy
import datetime
import functools
import os
import time
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from _models import FailInBackward

from fairscale.fair_dev.testing.engine import run_cases, run_distributed, run_ranks
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

WORLD = 2
TIMEOUT = 60.0


# ------------------------------------------------------------------------------------------------ 1. tied weights


class TiedSiblings(nn.Module):
    """An embedding and an output head sharing one weight (registered in both modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7)
        self.head.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


class ParentTiedToChild(nn.Module):
    """The parent's embedding weight is also the weight of a child that gets its own FSDP instance."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.child = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 7, bias=False))
        self.child[2].weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.child(self.embed(ids))


def _ids() -> Tensor:
    return torch.randint(7, (3, 5), generator=torch.Generator().manual_seed(0))


def _expect_tie_error(model: nn.Module) -> None:
    with pytest.raises(ValueError, match="tied|owned"):
        model(_ids())


def _case_siblings_flat_owner() -> None:
    m = TiedSiblings()
    m.embed = FSDP(m.embed)  # flatten_parameters=True: the original weight object is a dead copy from now on
    m.head = FSDP(m.head)
    _expect_tie_error(FSDP(m))


def _case_siblings_flat_owner_unwrapped_user() -> None:
    m = TiedSiblings()
    m.embed = FSDP(m.embed)
    _expect_tie_error(FSDP(m))  # the root itself holds the flattened-away weight through `head`


def _case_child_tied_to_parent(flatten: bool) -> None:
    m = ParentTiedToChild()
    m.child = FSDP(m.child, flatten_parameters=flatten)
    _expect_tie_error(FSDP(m, flatten_parameters=flatten))


def _case_separate_roots(flatten: bool) -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    fa = FSDP(a, flatten_parameters=flatten)
    fb = FSDP(b, flatten_parameters=False)
    if not flatten:
        fb.append_shared_param(a.weight)  # even a declaration cannot make two separate roots share
    fa(torch.randn(2, 4)).sum().backward()
    _expect_tie_error(fb)


def _case_append_shared_param_still_works() -> None:
    m = TiedSiblings()
    m.embed = FSDP(m.embed, flatten_parameters=False)
    shared = m.embed.module.module.weight
    m.head = FSDP(m.head, flatten_parameters=False)
    m.head.append_shared_param(shared)
    root = FSDP(m)
    root(_ids()).sum().backward()
    assert shared.grad is not None


def _tied_weights_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("siblings, owner flattened", _case_siblings_flat_owner),
            ("sibling weight used by the root", _case_siblings_flat_owner_unwrapped_user),
            ("nested child tied to parent, flatten", functools.partial(_case_child_tied_to_parent, True)),
            ("nested child tied to parent, no flatten", functools.partial(_case_child_tied_to_parent, False)),
            ("separate roots, flatten", functools.partial(_case_separate_roots, True)),
            ("separate roots, declared", functools.partial(_case_separate_roots, False)),
            ("append_shared_param", _case_append_shared_param_still_works),
        ]
    )


def test_tied_weights_fsdp_cannot_honour_raise_at_first_forward() -> None:
    run_distributed(_tied_weights_body, WORLD, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------ 6./7. construction checks


def _non_member_body(rank: int, world_size: int) -> str:
    only_rank_0 = dist.new_group(ranks=[0])
    if rank == 1:
        with pytest.raises(ValueError, match=r"global rank 1 is not a member of the process_group"):
            FSDP(nn.Linear(3, 3), process_group=only_rank_0)
        return "refused"
    model = FSDP(nn.Linear(3, 3), process_group=only_rank_0)  # a one-rank group: trains alone, no hang
    model(torch.randn(2, 3)).sum().backward()
    return "trained"


def test_non_member_process_group_is_a_clear_error_without_hang() -> None:
    assert run_distributed(_non_member_body, WORLD, timeout=30.0) == ["trained", "refused"]


def _case_compute_dtype(dtype: Any) -> None:
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point"):
        FSDP(nn.Linear(3, 3), mixed_precision=True, compute_dtype=dtype)


def _case_no_sync_on_nested() -> None:
    model = nn.Sequential(nn.Linear(3, 3), FSDP(nn.Linear(3, 3)))
    root = FSDP(model)
    inner = model[1]
    with pytest.raises(RuntimeError, match="root"):
        with inner.no_sync():
            pass
    assert inner._is_root is None  # the refused call did not make the nested instance a root
    root(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="root"):
        with inner.no_sync():
            pass
    with root.no_sync():
        root(torch.randn(2, 3)).sum().backward()


def _construction_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("compute_dtype=int32", functools.partial(_case_compute_dtype, torch.int32)),
            ("compute_dtype=bool", functools.partial(_case_compute_dtype, torch.bool)),
            ("compute_dtype=str", functools.partial(_case_compute_dtype, "float16")),
            ("no_sync on a nested instance", _case_no_sync_on_nested),
        ]
    )


def test_bad_compute_dtype_and_nested_no_sync() -> None:
    run_distributed(_construction_body, WORLD, timeout=TIMEOUT)


# ------------------------------------------------------------------------------- 3. timeouts of FSDP's own groups

SHORT_TIMEOUT_S = 3.0
USER_TIMEOUT_S = 1.0


def _timed_out_after(fn: Any) -> float:
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        fn()
    return time.monotonic() - start


def _timeout_body(directory: str, rank: int) -> List[float]:
    from fairscale.fair_dev.testing.engine import init_gloo_world
    from fairscale.internal import collectives
    from fairscale.internal.parallel import ProcessGroupName, get_process_group_cached

    init_gloo_world(directory, rank, WORLD, timeout_s=SHORT_TIMEOUT_S)
    # Both ranks create FSDP's groups (new_group is collective), then rank 1 stays alive without joining.
    model = FSDP(nn.Linear(3, 3), compute_device=torch.device("cpu"))
    user_group = get_process_group_cached(
        ProcessGroupName.reduce_scatter, ranks=[0, 1], timeout=datetime.timedelta(seconds=USER_TIMEOUT_S)
    )
    flag = os.path.join(directory, "rank0-done")
    if rank == 1:
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return []
    try:
        inherited = _timed_out_after(lambda: model(torch.randn(2, 3)))
        passed = _timed_out_after(lambda: collectives.all_reduce(torch.ones(1), group=user_group))
    finally:
        open(flag, "w").close()
    # gloo aborts the process when a group whose collective timed out is torn down at interpreter exit (a spawned
    # rank exits normally, a forked one does not): end this rank right after its report instead.
    atexit.register(os._exit, 0)
    return [inherited, passed]


def test_fsdp_groups_inherit_the_default_timeout_or_take_the_users(tmp_path: Any) -> None:
    inherited, passed = run_ranks(functools.partial(_timeout_body, str(tmp_path)), WORLD, timeout=40.0)[0]
    assert SHORT_TIMEOUT_S * 0.5 <= inherited < SHORT_TIMEOUT_S + 4.0, inherited
    assert passed < USER_TIMEOUT_S + 3.0, passed


# ------------------------------------------------------------------------------------ 4. aborted backward


class FailingNet(nn.Module):
    """linear -> (may fail in backward) -> nested FSDP linear (``inner_kwargs``): the nested unit's backward completes
    first. ``inner_first``: the first linear is the nested unit instead, which a failing backward never reaches."""

    def __init__(self, inner_first: bool = False, **inner_kwargs: Any) -> None:
        super().__init__()
        self.a = FSDP(nn.Linear(4, 5), **inner_kwargs) if inner_first else nn.Linear(4, 5)
        self.b = nn.Linear(5, 3) if inner_first else FSDP(nn.Linear(5, 3), **inner_kwargs)
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        return self.b(FailInBackward.apply(torch.tanh(self.a(x)), self.fail))


def _grads(model: nn.Module) -> Dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _aborted_case(how: str, move_grads_to_cpu: bool, zero: str) -> None:
    # After a backward that raised, FSDP held the reduced gradients of the completed backward aside (out of p.grad,
    # where autograd writes full-size ones): an optimizer's zero_grad() could not see them, and the recovery gave them
    # back, so the next step applied the dropped batch too (silently; found by a fuzz of recovery after exceptions,
    # session 39). They are dropped now where p.grad is empty at the recovery (the user's zero_grad(), or a gradient
    # the failed backward never reached), as zero_grad() drops a plain module's.
    torch.manual_seed(0)
    model = FSDP(FailingNet(), move_grads_to_cpu=move_grads_to_cpu)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    before = _grads(model)
    assert len(before) == len(list(model.parameters()))
    if how == "raising backward":
        model.module.module.fail = True
        with pytest.raises(RuntimeError, match="injected"):
            model(x).sum().backward()
        model.module.module.fail = False
    else:  # a second backward through a freed graph
        loss = model(x).sum()
        loss.backward()
        with pytest.raises(RuntimeError, match="second time|freed"):
            loss.backward()
    if zero == "optimizer":
        optimizer.zero_grad()
    elif zero == "optimizer, set_to_none=False":
        optimizer.zero_grad(set_to_none=False)
    with pytest.warns(UserWarning, match="did not finish"):
        with torch.no_grad():
            model(x)  # the next forward recovers from the aborted backward
    # Here every parameter of the tree took part in the failed backward (and none kept a full-size gradient): what
    # FSDP held aside is dropped, with or without the user's zero_grad().
    assert all(g is None or not g.any() for g in _grads(model).values()), zero
    # Training goes on as from a cleared gradient (the kept one would have doubled it).
    model(x).sum().backward()
    after = _grads(model)
    assert sorted(after) == sorted(before)
    for name, grad in after.items():
        assert torch.allclose(grad, before[name], rtol=1e-5, atol=1e-6), name


def _aborted_backward_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            (f"{how}, move_grads_to_cpu={cpu}, zero_grad={zero}", functools.partial(_aborted_case, how, cpu, zero))
            for how in ("raising backward", "second backward")
            for cpu in (False, True)
            for zero in ("none", "optimizer", "optimizer, set_to_none=False")
        ]
    )


def test_aborted_backward_drops_the_gradients_fsdp_held_aside() -> None:
    run_distributed(_aborted_backward_body, WORLD, timeout=TIMEOUT)


def _call_after_aborted_case(call: str) -> None:
    torch.manual_seed(0)
    model = FSDP(FailingNet())
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    before_grads = _grads(model)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.module.module.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        model(x).sum().backward()
    model.module.module.fail = False
    for p in model.parameters():  # the usual recovery (an optimizer's zero_grad()): the step is dropped
        p.grad = None
    with pytest.warns(UserWarning, match="did not finish"):  # the call recovers, as the next forward does
        if call == "state_dict":
            got = model.state_dict()
            for key, value in before_state.items():
                assert torch.equal(got[key], value), key
        elif call == "summon_full_params":
            with model.summon_full_params():
                pass
        elif call == "clip_grad_norm_":
            assert float(model.clip_grad_norm_(1e9)) == 0.0  # the dropped step's gradients are not counted
        elif call == "no_sync":
            with model.no_sync():
                pass
        else:
            copy.deepcopy(model)
    assert _grads(model) == {}  # the gradients FSDP held aside for the failed backward went with the zero_grad()
    model(x).sum().backward()  # training goes on from there
    assert sorted(_grads(model)) == sorted(before_grads)
    for name, grad in _grads(model).items():
        assert torch.allclose(grad, before_grads[name], rtol=1e-5, atol=1e-6), name


class _FailingForwardNet(nn.Module):
    """A root parameter, an inner instance, and a forward that may raise after both were used."""

    def __init__(self, mixed_precision: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = FSDP(nn.Linear(5, 3), mixed_precision=mixed_precision)
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        out = self.b(torch.tanh(self.a(x)))
        if self.fail:
            raise RuntimeError("injected forward failure")
        return out


def _recovered_step_case(where: str, mixed_precision: bool) -> None:
    # A forward that raised left the root's parameters as the gathered full ones until the next forward; a backward
    # that raised left them so until the next FSDP call. optimizer.step() then failed on the shapes (world > 1), or,
    # with mixed precision on one rank, updated the temporary low-precision copy and was lost (silently; found by a
    # fuzz of recovery after exceptions, session 39). The step equals a twin's that skipped the batch.
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(FSDP(_FailingForwardNet(mixed_precision), mixed_precision=mixed_precision))
    model, twin = models
    shapes = [p.shape for p in model.parameters()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    for m in models:
        m(x).sum().backward()
    if where == "forward":
        model.module.module.fail = True
        with pytest.raises(RuntimeError, match="injected forward"):
            model(x)
        model.module.module.fail = False
        assert [p.shape for p in model.parameters()] == shapes
        assert all(p.dtype == torch.float32 for p in model.parameters())
        optimizers[0].step()
    else:
        out = model(x)
        hook = out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected backward failure")))
        with pytest.raises(RuntimeError, match="injected backward"):
            out.sum().backward()
        hook.remove()
        model.zero_grad()
        twin.zero_grad()
        with pytest.warns(UserWarning, match="did not finish"):
            optimizers[0].step()  # recovers first (before, it stepped the gathered full parameters)
        assert [p.shape for p in model.parameters()] == shapes
    optimizers[1].step()
    for (key, value), expected in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(value, expected), key


def _recovered_step_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            (f"{where}, mixed_precision={mp}", functools.partial(_recovered_step_case, where, mp))
            for where in ("forward", "backward")
            for mp in (False, True)
        ]
    )


def test_a_step_after_a_failed_pass_steps_the_shards() -> None:
    run_distributed(_recovered_step_body, WORLD, timeout=TIMEOUT)


def _one_rank_mixed_precision_body(rank: int, world_size: int) -> None:
    _recovered_step_case("forward", True)


def test_a_step_after_a_failed_forward_one_rank_mixed_precision() -> None:
    run_distributed(_one_rank_mixed_precision_body, 1, timeout=TIMEOUT)


class _Armed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        return FailInBackward.apply(x, True) if self.armed else x


def _window_model(concat: bool) -> FSDP:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), _Armed(), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    net[3] = FSDP(net[3], optimize_backward_concat=concat)
    net[5] = FSDP(net[5], optimize_backward_concat=concat)
    return FSDP(net, optimize_backward_concat=concat)


def _failed_window_case(concat: bool, set_to_none: bool) -> None:
    # optimize_backward_concat: the first backward of a no_sync() window raised after inner instances wrote into the
    # window buffer, which no p.grad showed yet; the user's zero_grad() could not clear it and the next synchronizing
    # backward added it in (0.14 off; the docs promise a zero_grad() clears a window also after a backward that
    # raised; session 39). The buffer that backward opened holds its partial writes only and is dropped.
    model, twin = _window_model(concat), _window_model(concat)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x0, x1 = torch.randn(3, 8, generator=generator), torch.randn(3, 8, generator=generator)
    model.module.module[1].armed = True
    with pytest.raises(RuntimeError, match="injected"):
        with model.no_sync():
            model(x0).pow(2).mean().backward()
    model.module.module[1].armed = False
    optimizer.zero_grad(set_to_none=set_to_none)
    with pytest.warns(UserWarning, match="did not finish"):
        model(x1).pow(2).mean().backward()
    twin(x1).pow(2).mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _failed_window_body(rank: int, world_size: int) -> None:
    run_cases(
        [
            (f"concat={concat}, set_to_none={stn}", functools.partial(_failed_window_case, concat, stn))
            for concat in (False, True)
            for stn in (True, False)
        ]
    )


def test_zero_grad_clears_a_window_whose_first_backward_raised() -> None:
    run_distributed(_failed_window_body, WORLD, timeout=TIMEOUT)


def _call_after_aborted_body(rank: int, world_size: int) -> None:
    calls = ("state_dict", "summon_full_params", "clip_grad_norm_", "no_sync", "deepcopy")
    run_cases([(call, functools.partial(_call_after_aborted_case, call)) for call in calls])


def test_calls_between_steps_recover_from_an_aborted_backward() -> None:
    """After a backward that raised (caught by the loop), the calls a loop makes without a forward (save a
    checkpoint, clip, copy, open a no_sync() window) were refused until the next forward, with messages about being
    "inside forward or backward" (found by a randomized sequence of API calls)."""
    run_distributed(_call_after_aborted_body, WORLD, timeout=TIMEOUT)


def _kept_failed_loss_body(rank: int, world_size: int) -> None:
    # The failed batch's loss stays referenced (`loss = ...; try: loss.backward() except: ...`): its graph holds the
    # inner instance's pending-backward marker, which the failed backward never reached. Every later load_state_dict,
    # load_local_state_dict and deepcopy was refused as "called between a forward and its backward", even after
    # complete steps (found by a fuzz of hybrid sharding, session 40); only `del loss` got out of it.
    torch.manual_seed(0)
    model = FSDP(FailingNet(inner_first=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    saved = model.state_dict()
    model.module.module.fail = True
    loss = model(x).sum()
    with pytest.raises(RuntimeError, match="injected"):
        loss.backward()
    model.module.module.fail = False
    optimizer.zero_grad()
    with pytest.warns(UserWarning, match="did not finish"):
        model.load_state_dict(saved)  # recovers, then loads
    model(x).sum().backward()
    optimizer.step()
    model.load_state_dict(saved)
    model.load_local_state_dict(model.local_state_dict())
    copy.deepcopy(model)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    # A forward whose backward has not started is still pending, with the failed batch's graph alive beside it.
    pending = model(x).sum()
    with pytest.raises(RuntimeError, match="between a forward and its backward"):
        model.load_state_dict(saved)
    pending.backward()
    model.load_state_dict(saved)
    del loss


def test_a_kept_failed_loss_does_not_block_loads() -> None:
    run_distributed(_kept_failed_loss_body, WORLD, timeout=TIMEOUT)


class _CheckpointedSegment(nn.Module):
    """A layer that may fail in backward, then an inner instance, recomputed in backward (activation checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = FSDP(nn.Linear(4, 4))
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(FailInBackward.apply(self.pre(x), self.fail))


def _recomputed_token_body(rank: int, world_size: int) -> None:
    # Two forwards, then the first one's backward raises after recomputing the checkpointed inner instance, whose
    # recomputed forward made a pending-backward marker too: numbered as the root's latest forward, it marked the
    # second forward's backward as started at the recovery, and a load was accepted while that backward was still to
    # run (found by the session's review).
    from fairscale.nn.checkpoint import checkpoint_wrapper

    torch.manual_seed(0)
    segment = _CheckpointedSegment()
    model = FSDP(nn.Sequential(checkpoint_wrapper(segment), nn.Tanh(), nn.Linear(4, 1)))
    saved = model.state_dict()
    x = torch.randn(3, 4, requires_grad=True)
    first, second = model(x).sum(), model(x).sum()
    segment.fail = True
    with pytest.raises(RuntimeError, match="injected") as info:
        first.backward()
    segment.fail = False
    kept = info.value  # the exception (and its traceback's frames) kept, as a loop's `last_error = e` does
    with pytest.warns(UserWarning, match="did not finish"):
        # The message names the way out of a pending forward that cannot be run any more (found by a fuzz of MoE
        # under FSDP: it suggested only a forward under no_grad, which does not help).
        with pytest.raises(RuntimeError, match="between a forward and its backward(.|\n)*del loss"):
            model.load_state_dict(saved)
    second.backward()
    model.load_state_dict(saved)
    del kept, first


def test_a_recomputed_forward_does_not_release_a_later_forward() -> None:
    run_distributed(_recomputed_token_body, WORLD, timeout=TIMEOUT)


class _TwiceUsedNet(nn.Module):
    """``b`` (its own unit) is used twice per forward, so its reduction waits for the end of backward; the backward
    may fail after ``b``'s gradient accumulated, before ``a``'s."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = FSDP(nn.Linear(4, 4))
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        h = FailInBackward.apply(self.a(x), self.fail)
        return self.b(h) + self.b(h * 0.5)


def _aborted_deferred_case() -> None:
    """A step's first backward raises after a deferred unit's gradient accumulated in ``p.grad``: the retried step's
    gradients are those of the retry alone (the failed backward's unreduced gradient was kept and reduced with the
    retry's, as if it were a ``no_sync()`` window's sum)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x0, x1 = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    net = _TwiceUsedNet()
    model = FSDP(net)
    net.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        model(x0).sum().backward()
    net.fail = False
    with pytest.warns(UserWarning, match="did not finish"):
        loss = model(x1).sum()  # this forward recovers from the aborted backward
    loss.backward()
    fresh = FSDP(_TwiceUsedNet())
    fresh(x1).sum().backward()
    got, expected = _grads(model), _grads(fresh)
    assert sorted(got) == sorted(expected) and len(got) == 2
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def _aborted_deferred_body(rank: int, world_size: int) -> None:
    run_cases([("deferred unit", _aborted_deferred_case)])


def test_aborted_first_backward_drops_a_deferred_units_unreduced_gradient() -> None:
    run_distributed(_aborted_deferred_body, WORLD, timeout=TIMEOUT)


def _window_with_aborted_microbatch(obc: bool) -> Dict[str, Tensor]:
    """Microbatch 1 in no_sync, microbatch 2 in no_sync raises after the nested unit's backward, microbatch 3 syncs."""
    torch.manual_seed(0)
    net = FailingNet(optimize_backward_concat=obc)  # the root gets it from its constructor
    model = FSDP(net, optimize_backward_concat=obc)
    g = torch.Generator().manual_seed(dist.get_rank())
    x1, x2, x3 = (torch.randn(6, 4, generator=g) for _ in range(3))
    with model.no_sync():
        model(x1).sum().backward()
    net.fail = True
    with model.no_sync():
        with pytest.raises(RuntimeError, match="injected"):
            model(x2).sum().backward()
    net.fail = False
    with pytest.warns(UserWarning, match="did not finish"):
        loss = model(x3).sum()  # this forward recovers from the aborted backward
    loss.backward()
    return _grads(model)


def _aborted_window_body(rank: int, world_size: int) -> None:
    off, on = _window_with_aborted_microbatch(False), _window_with_aborted_microbatch(True)
    assert sorted(on) == sorted(off) and len(on) == 2
    for name in off:
        assert torch.equal(on[name], off[name]), name  # the window buffer kept what p.grad keeps without the flag


def test_aborted_microbatch_keeps_the_optimize_backward_concat_window() -> None:
    """A backward that raises inside a no_sync() window must not drop the window's completed microbatches."""
    run_distributed(_aborted_window_body, WORLD, timeout=TIMEOUT)


# -------------------------------------------------------------------- 2. checkpoint identity, 5. collective loads


def _ckpt_model() -> FSDP:
    torch.manual_seed(0)
    return FSDP(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), FSDP(nn.Linear(6, 3))))


def _train_step(model: FSDP, step: int) -> None:
    """One plain SGD step (by hand: building a torch.optim optimizer first costs seconds of imports in a rank)."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    for p in model.parameters():
        p.grad = None
    model(x).pow(2).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)


def _save(model: FSDP, directory: str, rank: int) -> None:
    os.makedirs(directory, exist_ok=True)
    torch.save(
        {"weights": model.local_state_dict(), "meta": model.local_metadata_dict()},
        os.path.join(directory, f"ckpt-rank-{rank}.pt"),
    )


def _load(directory: str, rank: int) -> Dict[str, Any]:
    return torch.load(os.path.join(directory, f"ckpt-rank-{rank}.pt"), weights_only=True)


def _snapshot(model: FSDP) -> Dict[str, Tensor]:
    return {k: v.clone() for k, v in model.local_state_dict().items()}


def _assert_unchanged(model: FSDP, before: Dict[str, Tensor]) -> None:
    after = model.local_state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def _expect_same_error_everywhere(fn: Any, match: str) -> str:
    from fairscale.internal import collectives

    with pytest.raises((RuntimeError, ValueError, KeyError), match=match) as info:
        fn()
    messages = collectives.all_gather_object(str(info.value))
    assert all(m == messages[0] for m in messages), messages
    return messages[0]


def _as_upstream(ckpt: Dict[str, Any]) -> Dict[str, Any]:
    """The same shard as upstream fairscale writes it: a plain dict, and metadata without the identity."""
    return {"weights": dict(ckpt["weights"]), "meta": {k: ckpt["meta"][k] for k in ("param_metadata", "buffer_names")}}


def _offline_identity_checks(root: str) -> None:
    """Consolidation of mixed, misordered or duplicated shard files fails with a clear error (no process group)."""
    s1 = [_load(os.path.join(root, "step1"), r) for r in range(WORLD)]
    s2 = [_load(os.path.join(root, "step2"), r) for r in range(WORLD)]

    def consolidate(ckpts: List[Dict[str, Any]]) -> Dict[str, Tensor]:
        return FSDP.consolidate_shard_weights([c["weights"] for c in ckpts], [c["meta"] for c in ckpts])

    assert [c["meta"]["checkpoint_identity"]["step"] for c in s1 + s2] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="different checkpoints"):
        consolidate([s1[0], s2[1]])
    with pytest.raises(ValueError, match="rank 0's shard is given 2 times"):
        consolidate([s2[0], s2[0]])
    with pytest.raises(ValueError, match="saved by 2 ranks but 1 shards"):
        consolidate([s2[0]])
    with pytest.raises(ValueError, match="weights are rank 0 of checkpoint .* but the metadata is"):
        consolidate([{"weights": s1[0]["weights"], "meta": s2[0]["meta"]}, s2[1]])
    # Upstream's files carry no identity: accepted, and equal to ours.
    upstream = [_as_upstream(c) for c in s2]
    full = consolidate(s2)
    assert {k: v.tolist() for k, v in consolidate(upstream).items()} == {k: v.tolist() for k, v in full.items()}
    # Shards out of rank order (a directory listing's order, e.g. allenai/tango's glob("worker*_model.pt")): each
    # says which rank saved it, so they are put back in rank order (this was refused; upstream built a wrong model).
    shuffled = consolidate([s2[1], s2[0]])
    assert list(shuffled) == list(full)
    assert {k: v.tolist() for k, v in shuffled.items()} == {k: v.tolist() for k, v in full.items()}
    # Only when both lists say which rank each entry is: weights copied into plain dicts (no identity) in rank order
    # beside metadata in another order would otherwise be paired with the wrong ranks.
    with pytest.raises(ValueError, match="cannot be put back in rank order safely"):
        FSDP.consolidate_shard_weights([dict(c["weights"]) for c in s2], [s2[1]["meta"], s2[0]["meta"]])
    for field, bad in (("rank", "x"), ("rank", 1.5), ("rank", 2), ("world_size", None)):
        meta = dict(s2[1]["meta"], checkpoint_identity=dict(s2[1]["meta"]["checkpoint_identity"], **{field: bad}))
        with pytest.raises(ValueError, match="identity is malformed"):
            FSDP.consolidate_shard_weights([dict(c["weights"]) for c in s2], [s2[0]["meta"], meta])
    with pytest.raises(ValueError, match="carry no checkpoint identity"):
        consolidate([upstream[0], s2[1]])
    # Re-sharding makes a new checkpoint whose shards consolidate back, and do not mix with the old ones.
    from fairscale.nn.data_parallel.consolidate import reshard_checkpoint

    resharded = reshard_checkpoint(full, s2[0]["meta"], WORLD)
    assert resharded[1]["meta"]["checkpoint_identity"]["step"] == 2
    assert {k: v.tolist() for k, v in consolidate(resharded).items()} == {k: v.tolist() for k, v in full.items()}
    with pytest.raises(ValueError, match="different checkpoints"):
        consolidate([resharded[0], s2[1]])
    with pytest.raises(ValueError, match="not a full state dict"):
        reshard_checkpoint(s2[0]["weights"], s2[0]["meta"], WORLD)


def _checkpoint_body(rank: int, world_size: int, root: str) -> Dict[str, Tensor]:
    model = _ckpt_model()
    for step in (1, 2):
        _train_step(model, step)
        _save(model, os.path.join(root, f"step{step}"), rank)
    from fairscale.internal import collectives

    collectives.barrier()
    if rank == 0:
        _offline_identity_checks(root)
    final = model.state_dict()
    # Loads check the identity too: every rank raises the same error and nothing changes.
    before = _snapshot(model)
    other = _load(os.path.join(root, "step2"), 1 - rank)["weights"]  # the peer's shard (same shapes here)
    _expect_same_error_everywhere(
        lambda: model.load_local_state_dict(other), "rank 1 of checkpoint|rank 0 of checkpoint"
    )
    _assert_unchanged(model, before)
    mixed = _load(os.path.join(root, "step1" if rank == 0 else "step2"), rank)["weights"]
    _expect_same_error_everywhere(lambda: model.load_local_state_dict(mixed), "different checkpoints")
    _assert_unchanged(model, before)
    # The right files load, and the identity of the next save continues from the loaded step.
    model.load_local_state_dict(_load(os.path.join(root, "step1"), rank)["weights"])
    assert model.local_metadata_dict()["checkpoint_identity"]["step"] == 1
    return final


def _bad_load_body(rank: int, world_size: int) -> None:
    model = _ckpt_model()
    _train_step(model, 1)
    full, local = model.state_dict(), model.local_state_dict()
    _train_step(model, 2)  # the live model now differs from the saved dicts, buffers included
    before = _snapshot(model)
    bad_full = dict(full)
    bad_local = dict(local)
    if rank == 0:
        del bad_full["0.weight"]
        bad_local["flat_param_0"] = bad_local["flat_param_0"][:-1]
    _expect_same_error_everywhere(lambda: model.load_state_dict(bad_full), r"failed on rank\(s\) \[0\]")
    _assert_unchanged(model, before)
    _expect_same_error_everywhere(lambda: model.load_local_state_dict(bad_local), r"failed on rank\(s\) \[0\]")
    _assert_unchanged(model, before)
    # Good dicts on every rank still load.
    model.load_state_dict(full)
    model.load_local_state_dict(local)


def test_checkpoint_identity_checked_by_consolidation_and_loads(tmp_path: Any) -> None:
    final = run_distributed(_checkpoint_body, WORLD, str(tmp_path), timeout=TIMEOUT)[0]
    from fairscale.nn.data_parallel.consolidate import main

    # The command line: shards of two checkpoints in one directory fail with a non-zero exit status.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    os.link(tmp_path / "step1" / "ckpt-rank-0.pt", mixed / "ckpt-rank-0.pt")
    os.link(tmp_path / "step2" / "ckpt-rank-1.pt", mixed / "ckpt-rank-1.pt")
    assert main(["consolidate", str(mixed), str(tmp_path / "out.pt")]) != 0
    assert not (tmp_path / "out.pt").exists()
    assert main(["consolidate", str(tmp_path / "step2"), str(tmp_path / "out.pt")]) == 0
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {k: v.tolist() for k, v in out.items()} == {k: v.tolist() for k, v in final.items()}


def test_bad_dict_on_one_rank_fails_on_every_rank_and_changes_nothing() -> None:
    run_distributed(_bad_load_body, WORLD, timeout=TIMEOUT)


class _Pause(torch.autograd.Function):
    """Identity whose backward signals ``started`` and waits for ``proceed`` (a backward caught midway)."""

    events: Dict[str, Any] = {}

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        _Pause.events["started"].set()
        _Pause.events["proceed"].wait(30)
        return grad


class _PausingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = FSDP(nn.Linear(4, 4))
        self.b = FSDP(nn.Linear(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.b(_Pause.apply(self.a(x)))


def _call_from_another_thread(model: FSDP, outcome: Dict[str, str]) -> None:
    _Pause.events["started"].wait(30)
    try:
        model.state_dict()
        outcome["state_dict"] = "ok"
    except RuntimeError as e:
        outcome["state_dict"] = str(e)
    finally:
        _Pause.events["proceed"].set()


def _other_thread_body(rank: int, world_size: int) -> None:
    import threading

    torch.manual_seed(0)
    model = FSDP(_PausingNet())
    x = torch.randn(3, 4)
    _Pause.events = {"started": threading.Event(), "proceed": threading.Event()}
    _Pause.events["proceed"].set()
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    _Pause.events = {"started": threading.Event(), "proceed": threading.Event()}
    outcome: Dict[str, str] = {}
    thread = threading.Thread(target=_call_from_another_thread, args=(model, outcome))
    thread.start()
    model(x).sum().backward()
    thread.join()
    assert outcome["state_dict"] != "ok" and "BACKWARD" in outcome["state_dict"], outcome
    for p, w in zip(model.parameters(), want):
        assert p.grad is not None and torch.equal(p.grad, w), "the running backward was disturbed"


def test_a_call_from_another_thread_does_not_reset_a_running_backward() -> None:
    """The recovery of calls between steps (after an aborted backward) took a backward running on another thread for
    an aborted one (the graph task id is per thread): it reset it, and its gradients came out wrong silently."""
    run_distributed(_other_thread_body, WORLD, timeout=TIMEOUT)
