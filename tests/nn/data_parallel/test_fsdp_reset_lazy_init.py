# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``FSDP._reset_lazy_init()``, upstream's private hook that real clients call.

* fairseq's ``fsdp_wrap`` calls it on every FSDP instance inside a module before wrapping that module in a new root;
* vissl calls it after ``load_local_state_dict`` on instances that ran a forward already (``_is_root`` set);
* fairseq's checkpoint upgrades call it on one inner instance after loading its weights in ``summon_full_params``:
  the whole tree starts again (the instance alone became a second root, and the root warned that its order changed).

Both must then train exactly as a model that never ran before (compared with one built fresh, over two SGD steps at
world size 2), and a call between a forward and its backward is refused (that backward failed with a bare
``AssertionError``).
"""

import warnings
from typing import Callable, Dict, List

import pytest
import torch
from torch import nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn import enable_wrap, wrap
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP


def _inner(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    with enable_wrap(wrapper_cls=FSDP, flatten_parameters=True):
        return nn.Sequential(wrap(nn.Linear(4, 6)), nn.Tanh(), wrap(nn.Linear(6, 3)))


def _train(model: nn.Module, rank: int, steps: int = 2) -> Dict[str, torch.Tensor]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        optim.zero_grad()
        model(x).pow(2).sum().backward()
        optim.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reset_all(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, FSDP) and m._is_root is not None:
            m._reset_lazy_init()


def _assert_same(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for key in got:
        assert torch.equal(got[key], expected[key]), key


def _case_fairseq_rewrap(rank: int) -> None:
    """Inner instances that ran as roots (a forward each) are reset, then wrapped in a new root."""
    expected = _train(FSDP(_inner()), rank)
    inner = _inner()
    with torch.no_grad():
        inner[0](torch.randn(2, 4))  # now a root of its own
        inner(torch.randn(2, 4))
    assert inner[0]._is_root is True
    for m in inner.modules():
        if isinstance(m, FSDP):
            m._reset_lazy_init()
    assert all(m._is_root is None for m in inner.modules() if isinstance(m, FSDP))
    _assert_same(_train(FSDP(inner), rank), expected)


def _case_vissl_reset_after_load(rank: int) -> None:
    """A model that trained, then loads another's local checkpoint and resets: trains as that other model does."""
    source = FSDP(_inner(1))
    _train(source, rank, steps=1)
    checkpoint = {k: v.clone() for k, v in source.local_state_dict().items()}  # the live shards' values, copied
    expected = _train(source, rank)
    target = FSDP(_inner(2))
    _train(target, rank, steps=1)
    target.load_local_state_dict(checkpoint)
    _reset_all(target)
    assert target._is_root is None
    _assert_same(_train(target, rank), expected)


def _case_child_reset_inside_a_live_tree(rank: int) -> None:
    """fairseq's checkpoint upgrade: a child loads weights inside summon_full_params, then resets, mid-training."""
    source = FSDP(_inner(1))
    with source.summon_full_params():
        layer = {k: v.clone() for k, v in source.module[2].state_dict().items()}
    reference = FSDP(_inner(2))
    _train(reference, rank, steps=1)
    with reference.module[2].summon_full_params():
        reference.module[2].load_state_dict(layer)
    expected = _train(reference, rank)
    target = FSDP(_inner(2))
    _train(target, rank, steps=1)
    child = target.module[2]
    with child.summon_full_params():
        child.load_state_dict(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "order changed" warning: the child did not become a root of its own
        child._reset_lazy_init()
        assert target._is_root is None and child._is_root is None  # the whole tree starts again
        got = _train(target, rank)
    assert target._is_root is True and child._is_root is False
    _assert_same(got, expected)


def _case_refused_while_a_backward_is_pending(rank: int) -> None:
    model = FSDP(_inner())
    out = model(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="_reset_lazy_init called between a forward and its backward"):
        model._reset_lazy_init()
    out.sum().backward()  # unaffected
    model._reset_lazy_init()
    model(torch.randn(3, 4)).sum().backward()


def _body(rank: int, world_size: int) -> None:
    cases: List[Callable[[], None]] = [
        lambda: _case_fairseq_rewrap(rank),
        lambda: _case_vissl_reset_after_load(rank),
        lambda: _case_child_reset_inside_a_live_tree(rank),
        lambda: _case_refused_while_a_backward_is_pending(rank),
    ]
    names = [
        "fairseq_rewrap",
        "vissl_reset_after_load",
        "child_reset_inside_a_live_tree",
        "refused_while_a_backward_is_pending",
    ]
    run_cases(list(zip(names, cases)))


def test_reset_lazy_init() -> None:
    run_distributed(_body, 2, timeout=120)
