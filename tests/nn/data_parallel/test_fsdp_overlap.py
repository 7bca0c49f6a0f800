# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Communication overlap (issue 14) on CPU with gloo: all-gather prefetch and the reduce-scatter bucket's memory.

* Ordering: with the collective counter, the all-gather of the next unit is already issued when a unit's forward
  (``forward_prefetch``) or backward (``backward_prefetch``) compute starts; off reproduces the old order. At most
  one extra unit is gathered at any time.
* Parity: gradients, parameters and losses are bitwise equal with prefetch on and off, and the number of
  collectives is the same, across reshard_after_forward, zero2, mixed precision, no_sync, optimize_backward_concat,
  checkpoint_wrapper (both nesting orders), shared parameters and a unit that runs twice per forward.
* Bucket: the bucket holds storage only while it holds gradients and is exactly as large as what it holds.
* Auto (``forward_prefetch=None``, the default): a training forward on CPU prefetches when ``backward_prefetch`` is
  on, a forward without autograd or with ``backward_prefetch=False`` does not, and results are bitwise those of
  ``forward_prefetch=False``.
"""

import contextlib
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import get_fsdp_instances
from fairscale.nn.data_parallel._fsdp.state import HandleState

TIMEOUT = 180.0
WS = 2
DIM = 6
HIDDEN = (5, 7, 9)  # distinct sizes: each unit's all-gather is recognisable by its numel

# Set by the ordering test: called by each block with its name and "fwd" / "bwd" when its compute starts.
PROBE: List[Optional[Callable[[str, str], None]]] = [None]


def _probe(name: str, where: str) -> None:
    if PROBE[0] is not None:
        PROBE[0](name, where)


class Block(nn.Module):
    def __init__(self, name: str, hidden: int, tie: bool = False) -> None:
        super().__init__()
        self.name = name
        self.a = nn.Linear(DIM, hidden)
        self.c = nn.Linear(DIM, hidden)
        self.b = nn.Linear(hidden, DIM)
        if tie:
            self.c.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        _probe(self.name, "fwd")
        h = torch.relu(self.a(x)) * torch.sigmoid(self.c(x))
        out = self.b(h)
        if out.requires_grad:
            out.register_hook(lambda g: _probe(self.name, "bwd"))  # first step of this block's backward
        return x + out


class Net(nn.Module):
    def __init__(self, tie: bool = False, twice: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList([Block(f"b{i}", h, tie) for i, h in enumerate(HIDDEN)])
        self.head = nn.Linear(DIM, 3)
        self.twice = twice

    def forward(self, x: Tensor, stop: Optional[int] = None) -> Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks[:stop]:  # stop: an early exit after that many blocks
            h = block(h)
        if self.twice:
            h = self.blocks[0](h)  # a unit that runs twice per forward
        return self.head(h)


# ``forward`` passed as build()'s forward_prefetch: the same as ``prefetch`` unless given (``None`` is auto).
SAME = "same"


def build(c: Dict[str, Any], prefetch: bool, zero2: Any, forward: Any = SAME) -> nn.Module:
    torch.manual_seed(0)
    net = Net(tie=c.get("tie", False), twice=c.get("twice", False))
    kwargs: Dict[str, Any] = dict(
        reshard_after_forward=c.get("raf", True),
        optimize_backward_concat=c.get("obc", False),
        zero2_process_group=zero2 if c.get("zero2") else None,
        forward_prefetch=prefetch if forward == SAME else forward,
        backward_prefetch=prefetch,
    )
    if c.get("prec") == "fp16":
        kwargs["mixed_precision"] = True
    elif c.get("prec") == "bf16":
        kwargs.update(mixed_precision=True, compute_dtype=torch.bfloat16)
    ckpt = c.get("ckpt")
    for i in range(len(net.blocks)):
        block = net.blocks[i]
        if ckpt == "fsdp(ckpt)":
            net.blocks[i] = FSDP(checkpoint_wrapper(block), **kwargs)
        elif ckpt == "ckpt(fsdp)":
            net.blocks[i] = checkpoint_wrapper(FSDP(block, **kwargs))
        else:
            net.blocks[i] = FSDP(block, **kwargs)
    return FSDP(net, **kwargs)


def batch(step: int, mb: int, rank: int) -> Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + 10 * mb + rank))


def train(c: Dict[str, Any], prefetch: bool, zero2: Any, rank: int, forward: Any = SAME) -> Dict[str, Any]:
    model = build(c, prefetch, zero2, forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses: List[Tensor] = []
    num_mb = 2 if c.get("no_sync") else 1
    with count_collectives() as counter:
        for step in range(3):
            for mb in range(num_mb):
                ctx = model.no_sync() if mb < num_mb - 1 else contextlib.nullcontext()
                with ctx:  # type: ignore[attr-defined]
                    loss = model(batch(step, mb, rank)).float().pow(2).sum()
                    loss.backward()
                losses.append(loss.detach())
            grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad(set_to_none=True)
    kinds = [(r.kind, r.numel, r.ranks) for r in counter.records]
    return {
        "losses": losses,
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "kinds": kinds,
    }


MATRIX: List[Tuple[str, Dict[str, Any]]] = [
    ("default", {}),
    ("raf=False", {"raf": False}),
    ("zero2", {"zero2": True}),
    ("fp16", {"prec": "fp16"}),
    ("bf16+zero2", {"prec": "bf16", "zero2": True}),
    ("no_sync", {"no_sync": True}),
    ("no_sync+obc+raf=False", {"no_sync": True, "obc": True, "raf": False}),
    ("fsdp(ckpt)", {"ckpt": "fsdp(ckpt)"}),
    ("ckpt(fsdp)+zero2", {"ckpt": "ckpt(fsdp)", "zero2": True}),
    ("tied+twice", {"tie": True, "twice": True}),
]


def _parity_case(c: Dict[str, Any], zero2: Any, rank: int) -> None:
    off, on = train(c, False, zero2, rank), train(c, True, zero2, rank)
    for key in ("losses", "grads", "params"):
        for a, b in zip(off[key], on[key]):
            assert torch.equal(a, b), key  # bitwise
    # Prefetch moves gathers earlier; in steady state it never adds or drops one.
    assert sorted(off["kinds"]) == sorted(on["kinds"])


def _parity_body(rank: int, ws: int) -> None:
    zero2 = dist.new_group(list(range(ws)))
    run_cases([(name, lambda c=c: _parity_case(c, zero2, rank)) for name, c in MATRIX])


def test_prefetch_bitwise_parity() -> None:
    run_distributed(_parity_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ ordering


def _gathers_so_far(counter: Any, phase: str) -> List[int]:
    return [r.numel for r in counter.records if r.kind == "all_gather" and r.phase == phase]


def _full_units(model: nn.Module) -> int:
    return sum(any(h.state == HandleState.FULL for h in m._handles) for m in get_fsdp_instances(model))


def _ordering_run(prefetch: bool, rank: int) -> Dict[str, Any]:
    model = build({}, prefetch, None)
    blocks = [m for m in get_fsdp_instances(model) if m is not model]
    numel = {f"b{i}": m._handles[0].shard_numel * WS for i, m in enumerate(blocks)}
    seen: Dict[Tuple[str, str], Tuple[List[int], int]] = {}
    for step in range(2):  # the first step records the order, the second prefetches
        with count_collectives() as counter:
            if step == 1:
                PROBE[0] = lambda name, where: seen.__setitem__(
                    (name, where),
                    (_gathers_so_far(counter, "forward" if where == "fwd" else "backward"), _full_units(model)),
                )
            try:
                model(batch(step, 0, rank)).sum().backward()
            finally:
                PROBE[0] = None
    return {"numel": numel, "seen": seen}


def _ordering_body(rank: int, ws: int) -> None:
    off, on = _ordering_run(False, rank), _ordering_run(True, rank)
    numel = on["numel"]
    names = sorted(numel)
    for i, name in enumerate(names):
        nxt = names[i + 1] if i + 1 < len(names) else None
        # Forward: when block i computes, block i+1's gather is issued with prefetch, not without.
        gathered_on, full_on = on["seen"][(name, "fwd")]
        gathered_off, full_off = off["seen"][(name, "fwd")]
        assert numel[name] in gathered_on and numel[name] in gathered_off
        if nxt is not None:
            assert numel[nxt] in gathered_on, (name, gathered_on)
            assert numel[nxt] not in gathered_off, (name, gathered_off)
        assert full_on <= full_off + 1, (name, full_on, full_off)  # at most one unit gathered ahead
        # Backward runs b2, b1, b0: when block i's backward computes, block i-1's gather is already issued.
        prev = names[i - 1] if i > 0 else None
        gathered_on, full_on = on["seen"][(name, "bwd")]
        gathered_off, full_off = off["seen"][(name, "bwd")]
        assert numel[name] in gathered_on and numel[name] in gathered_off
        if prev is not None:
            assert numel[prev] in gathered_on, (name, gathered_on)
            assert numel[prev] not in gathered_off, (name, gathered_off)
        assert full_on <= full_off + 1, (name, full_on, full_off)


def test_prefetch_issues_next_gather_first() -> None:
    run_distributed(_ordering_body, WS, timeout=TIMEOUT)


def _early_exit_evaluation_body(rank: int, ws: int) -> None:
    """An evaluation forward that stops after the first block (an early exit, a draft model's first layers): what
    forward prefetch gathered for the second block stayed gathered until that block's next forward."""
    model = build({}, True, None)
    for evaluation in (torch.no_grad, torch.inference_mode):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the order changes with each exit, as it should
            model(batch(0, 0, rank)).sum().backward()  # records the whole order, which the next forward follows
            with count_collectives() as counter, evaluation():
                model(batch(1, 0, rank), stop=1)
        assert len(_gathers_so_far(counter, "forward")) == 3, counter.summary()  # the root, b0, and b1 ahead
        assert _full_units(model) == 0, evaluation


def test_early_exit_evaluation_frees_the_unit_prefetched_ahead() -> None:
    run_distributed(_early_exit_evaluation_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ bucket


def _bucket_body(rank: int, ws: int) -> None:
    results = {}
    for cap in (25, 0):
        model = build({}, True, None)
        if cap == 0:
            for m in get_fsdp_instances(model):
                m.bucket_cap_mb = 0
        sizes: List[Tuple[int, int]] = []
        with count_collectives() as counter:
            for step in range(3):
                tree = model._tree
                if tree is not None and step == 2:
                    for bucket in tree.bucketer.buckets.values():
                        issue = bucket.issue  # what the bucketer calls to send a fill

                        def spy(async_op: bool, issue: Callable[[bool], Any] = issue, bucket: Any = bucket) -> Any:
                            if bucket.offset:
                                sizes.append((bucket.data.size(1), bucket.offset))
                            return issue(async_op)

                        bucket.issue = spy
                model(batch(step, 0, rank)).sum().backward()
                buckets = list(model._tree.bucketer.buckets.values())
                assert all(b.data.untyped_storage().size() == 0 for b in buckets)  # nothing held between backwards
        results[cap] = ([p.grad.clone() for p in model.parameters()], counter.count("reduce_scatter"))
        if cap:
            # Steady state: the bucket was exactly as large as what it held when it was sent.
            assert sizes and all(allocated == used for allocated, used in sizes), sizes
    (grads_b, count_b), (grads_0, count_0) = results[25], results[0]
    assert all(torch.equal(a, b) for a, b in zip(grads_b, grads_0))
    assert count_b == 3 and count_0 == 3 * 4  # one bucketed reduce-scatter per backward vs one per unit


def test_bucket_holds_memory_only_while_in_use() -> None:
    run_distributed(_bucket_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ order change


class Reorderable(Net):
    """Runs its blocks in the order of ``self.order`` (changed between steps by the test)."""

    order = (0, 1, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for i in self.order:
            h = self.blocks[i](h)
        return self.head(h)


def _order_change_run(prefetch: bool, rank: int) -> Tuple[List[Tensor], List[str]]:
    torch.manual_seed(0)
    net = Reorderable()
    for i in range(len(net.blocks)):
        net.blocks[i] = FSDP(net.blocks[i], forward_prefetch=prefetch, backward_prefetch=prefetch)
    model = FSDP(net, forward_prefetch=prefetch, backward_prefetch=prefetch)
    grads: List[Tensor] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, order in enumerate([(0, 1, 2), (0, 1, 2), (2, 0, 1), (2, 0, 1)]):
            net.order = order
            model(batch(step, 0, rank)).sum().backward()
            grads += [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            model.zero_grad(set_to_none=True)
    return grads, [str(w.message) for w in caught if "order of the FSDP units changed" in str(w.message)]


def _order_change_body(rank: int, ws: int) -> None:
    off, quiet = _order_change_run(False, rank)
    on, warned = _order_change_run(True, rank)
    assert quiet == []  # without prefetch an order change is nothing to warn about
    assert all(torch.equal(a, b) for a, b in zip(off, on))  # a stale order costs time, never results
    assert len(warned) == 2 and "forward" in warned[0] and "backward" in warned[1], warned  # once per kind


def test_prefetch_order_change_warns_and_stays_exact() -> None:
    run_distributed(_order_change_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ auto


def _auto_forward_probe(backward_prefetch: bool, grad: bool, rank: int) -> Dict[str, Any]:
    """Build with the default ``forward_prefetch`` (auto), train one step (it records the order), then probe the next
    forward: the forward gathers issued and the units gathered when each block starts, and the units left gathered."""
    model = build({}, backward_prefetch, None, forward=None)
    assert model.forward_prefetch is None  # the default is auto
    blocks = [m for m in get_fsdp_instances(model) if m is not model]
    numel = {f"b{i}": m._handles[0].shard_numel * WS for i, m in enumerate(blocks)}
    model(batch(0, 0, rank)).sum().backward()
    seen: Dict[str, Tuple[List[int], int]] = {}
    with count_collectives() as counter:
        PROBE[0] = lambda name, where: (
            seen.__setitem__(name, (_gathers_so_far(counter, "forward"), _full_units(model)))
            if where == "fwd"
            else None
        )
        try:
            with torch.set_grad_enabled(grad):
                out = model(batch(1, 0, rank))
        finally:
            PROBE[0] = None
    left_gathered = _full_units(model)
    if grad:
        out.sum().backward()
    return {"numel": numel, "seen": seen, "left_gathered": left_gathered}


def _auto_body(rank: int, ws: int) -> None:
    names = [f"b{i}" for i in range(len(HIDDEN))]
    # Training forward with backward prefetch on (the defaults): block i's forward starts with block i+1's gather
    # issued, and never more than one block gathered ahead of the no-prefetch run.
    on = _auto_forward_probe(True, True, rank)
    for name, nxt in zip(names, names[1:]):
        gathered, full = on["seen"][name]
        assert on["numel"][nxt] in gathered, (name, gathered)
        assert full <= 3, (name, full)  # root + this block + the next one
    # The same forward without autograd (evaluation), or with backward prefetch off: nothing ahead.
    for backward_prefetch, grad in ((True, False), (False, True)):
        off = _auto_forward_probe(backward_prefetch, grad, rank)
        for name, nxt in zip(names, names[1:]):
            gathered, _ = off["seen"][name]
            assert off["numel"][nxt] not in gathered, (backward_prefetch, grad, name, gathered)
    assert _auto_forward_probe(True, False, rank)["left_gathered"] == 0  # an evaluation forward keeps nothing
    # Results and collectives are those of forward_prefetch=False (bitwise), with and without no_sync.
    for c in ({}, {"no_sync": True}, {"raf": False}):
        auto, never = train(c, True, None, rank, forward=None), train(c, True, None, rank, forward=False)
        for key in ("losses", "grads", "params"):
            assert all(torch.equal(a, b) for a, b in zip(auto[key], never[key])), (c, key)
        assert sorted(auto["kinds"]) == sorted(never["kinds"]), c


def test_forward_prefetch_auto_on_cpu_training_forwards_only() -> None:
    run_distributed(_auto_body, WS, timeout=TIMEOUT)
