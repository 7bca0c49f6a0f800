# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Reading a wrapped module's parameter between steps (``flatten_parameters=True``).

The modules' parameters are views of the full buffer, which is freed after the forward and the backward. Reading
one there (``model.weight`` through attribute forwarding, a weight norm logged between steps, an init function
applied to the model) read freed memory: the rank died of a segmentation fault (found by a fuzz of FSDP with
ordinary torch code, session 41). Now the modules hold a stand-in of the same shape, dtype and device whose every
operation raises a clear error; inside ``summon_full_params`` and during forward and backward the real values are
there, and training (with activation checkpointing recomputing from the views in backward) matches a single-process
model. Two gloo ranks, the same data on both.
"""

import copy
import functools
import io

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel._fsdp.freed_views import FreedViews
from fairscale.nn.data_parallel._fsdp.handle import FlatHandle

WORLD = 2
TIMEOUT = 120.0
FREED = "not in memory between steps"


class _Net(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.checkpointed:  # recomputed in backward from the views of this forward
            h = torch_checkpoint.checkpoint(self.mid, h, use_reentrant=False)
        else:
            h = self.mid(h)
        return self.head(torch.tanh(h))


def _net(checkpointed: bool) -> _Net:
    torch.manual_seed(0)
    return _Net(checkpointed)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step))


def _assert_freed(weight: torch.Tensor, shape: torch.Size) -> None:
    # Metadata stays readable (HF's resizing reads .shape, freezing loops .requires_grad), and can't be changed.
    assert weight.shape == shape and weight.dtype == torch.float32 and weight.requires_grad
    with pytest.raises(RuntimeError, match="cannot freeze or unfreeze"):
        weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="cannot freeze or unfreeze"):
        weight.requires_grad = False
    assert weight.requires_grad
    for read in (lambda: weight.norm(), lambda: weight + 1, lambda: weight.detach().clone(), lambda: weight.sum()):
        with pytest.raises(RuntimeError, match=FREED):
            read()
    with pytest.raises(RuntimeError, match=FREED):
        nn.init.zeros_(weight)


def _case_reads_between_steps(nested: bool, reshard: bool, checkpointed: bool) -> None:
    net = _net(checkpointed)
    if nested:
        net.mid = FSDP(net.mid, reshard_after_forward=reshard)  # type: ignore[assignment]
    model = FSDP(net, reshard_after_forward=reshard)
    reference = _net(checkpointed)
    full = {n: p.detach().clone() for n, p in reference.named_parameters()}
    mid = model.module.mid  # the nested instance when nested (its attributes forward to the Linear)
    # Before the first forward too: sharding dropped the unsharded parameter (as upstream, which left the views
    # pointing at its freed memory); before, the views kept it in memory, and a write through one was lost.
    _assert_freed(mid.weight, full["mid.weight"].shape)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        loss = model(_batch(step)).pow(2).mean()
        if nested and reshard:  # freed after the nested unit's forward
            _assert_freed(mid.weight, full["mid.weight"].shape)
        elif nested:  # kept for the backward: readable, the gathered values
            torch.testing.assert_close(mid.weight, reference.mid.weight)
        loss.backward()
        reference(_batch(step)).pow(2).mean().backward()
        _assert_freed(mid.weight, full["mid.weight"].shape)
        _assert_freed(model.module.head.weight, full["head.weight"].shape)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        _assert_freed(mid.weight, full["mid.weight"].shape)
        with model.summon_full_params():
            torch.testing.assert_close(mid.weight, reference.mid.weight)
            torch.testing.assert_close(model.module.head.weight.norm(), reference.head.weight.norm())
        _assert_freed(mid.weight, full["mid.weight"].shape)  # what was there before the summon
        with torch.no_grad():  # an evaluation pass between steps
            torch.testing.assert_close(model(_batch(50)), reference(_batch(50)))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], msg=lambda m: f"{name}: {m}")
    # Copies and pickles between steps still work, and the copy trains like the original.
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_freed(loaded.module.mid.weight, full["mid.weight"].shape)  # a stand-in in the copy too, not nothing
    _assert_freed(clone.module.mid.weight, full["mid.weight"].shape)
    torch.testing.assert_close(clone(_batch(9)), model(_batch(9)))


def _linear(reshard: bool = True) -> FSDP:
    torch.manual_seed(0)
    return FSDP(nn.Linear(4, 4), reshard_after_forward=reshard)


def _case_window_then_summon_or_load(how: str) -> None:
    """A unit that keeps its full parameters (reshard_after_forward=False) through a no_sync() backward, then a
    summon or a load frees them: the modules got the forward's views back after the free (found by a review)."""
    model = _linear(reshard=False)
    saved, local = model.state_dict(), model.local_state_dict()
    x = _batch(0)
    with model.no_sync():
        model(x).sum().backward()
    if how == "summon":
        with model.summon_full_params():
            pass
    elif how == "load":
        model.load_state_dict(saved)
    else:
        model.load_local_state_dict(local)
    _assert_freed(model.weight, torch.Size([4, 4]))
    model(x).sum().backward()  # the window goes on
    _assert_freed(model.weight, torch.Size([4, 4]))


def _case_moved_or_reset_then_evaluated(how: str) -> None:
    """After a step, .double() or _reset_lazy_init() replaces the full buffer; an evaluation forward then got the
    old buffer's freed views back (found by a review)."""
    model = _linear()
    model(_batch(0)).sum().backward()
    x = _batch(1)
    if how == "double":
        model = model.double()
        x = x.double()
    else:
        model._reset_lazy_init()
    with torch.no_grad():
        model(x)
    shape = torch.Size([4, 4])
    assert model.weight.shape == shape
    with pytest.raises(RuntimeError, match=FREED):
        model.weight.sum()


def _case_handle_pickled_without_stand_ins() -> None:
    """A model pickled by the version before the stand-ins has handles without them: it still runs."""
    model = _linear()
    model(_batch(0)).sum().backward()
    handle = model._fsdp_unit.handles[0]
    state = handle.__getstate__()
    del state["freed_views"]
    old = FlatHandle.__new__(FlatHandle)
    old.__setstate__(state)
    assert isinstance(old.freed_views, FreedViews)


def _case_construction_drops_the_unsharded_parameter() -> None:
    """Right after wrapping, the modules held views of the unsharded flat parameter: the whole parameter stayed in
    memory on every rank until the first forward (upstream frees it), and an init written through a view was lost."""
    net = _net(False)
    model = FSDP(net)
    shard_bytes = model.params[0].numel() * model.params[0].element_size()
    for module in model.modules():
        for name, value in vars(module).items():
            # Plain attributes: the views (parameters live in _parameters), and the wrapper's list of them.
            for t in value if isinstance(value, list) else [value]:
                if type(t) is torch.Tensor:
                    assert t.untyped_storage().nbytes() <= shard_bytes, f"{name} keeps the unsharded parameter"
    _assert_freed(model.module.mid.weight, torch.Size([6, 6]))
    with model.summon_full_params():  # the supported route for an init after wrapping
        nn.init.constant_(model.module.mid.weight, 0.5)
    torch.testing.assert_close(model.state_dict()["mid.weight"], torch.full((6, 6), 0.5))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _case_stand_ins_refuse_writes_and_saves() -> None:
    """Found by a fuzz of init patterns (session 42): `.data =` on a stand-in (loading a pretrained tensor) was lost
    at the next forward, silently; torch.save of one wrote a file of nothing; data_ptr() was 0 for every stand-in
    (storage-based tie detection saw them all tied), and tied names had two stand-ins (`is` was False)."""
    torch.manual_seed(0)
    model = FSDP(_Tied())
    user = model.module
    for when in ("after wrapping", "between steps"):
        weight = user.emb.weight
        assert user.head.weight is weight, when
        with pytest.raises(RuntimeError, match="is a stand-in.*summon_full_params"):
            weight.data = torch.ones(5, 4)
        with pytest.raises(RuntimeError, match="is a stand-in"):
            weight.data_ptr()
        with pytest.raises(RuntimeError, match="is a stand-in"):
            torch.save(weight, io.BytesIO())
        model(torch.arange(4)).sum().backward()
    with model.summon_full_params():
        assert user.head.weight is user.emb.weight


def _body(rank: int, world_size: int) -> None:
    cases = [
        ("stand-ins refuse writes and saves", _case_stand_ins_refuse_writes_and_saves),
        ("construction drops the unsharded parameter", _case_construction_drops_the_unsharded_parameter),
        ("no_sync window, then summon", functools.partial(_case_window_then_summon_or_load, "summon")),
        ("no_sync window, then load_state_dict", functools.partial(_case_window_then_summon_or_load, "load")),
        ("no_sync window, then load_local_state_dict", functools.partial(_case_window_then_summon_or_load, "local")),
        ("step, .double(), evaluation", functools.partial(_case_moved_or_reset_then_evaluated, "double")),
        ("step, _reset_lazy_init(), evaluation", functools.partial(_case_moved_or_reset_then_evaluated, "reset")),
        ("a handle pickled without stand-ins", _case_handle_pickled_without_stand_ins),
    ]
    for nested in (False, True):
        for reshard in (True, False):
            for checkpointed in (False, True):
                name = f"nested={nested}, reshard_after_forward={reshard}, checkpointed={checkpointed}"
                cases.append((name, functools.partial(_case_reads_between_steps, nested, reshard, checkpointed)))
    run_cases(cases)


def test_reading_a_parameter_between_steps_raises_instead_of_reading_freed_memory() -> None:
    run_distributed(_body, WORLD, timeout=TIMEOUT)
