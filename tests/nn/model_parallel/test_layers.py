# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Parallel layers equal the single-process layer built from the same master weight.

One gloo world per world size (1, 2, 4); the 4-rank world runs every case at model-parallel size 4, 2 (2 x 2
model x data, each data-parallel replica with its own batch) and 1. Each case builds the parallel layer and the
dense reference under the same seed and compares outputs, input gradients and the weight/bias gradient slices.
"""

from typing import Callable, List, Tuple

import pytest
import torch
import torch._dynamo  # noqa: F401  # torch optimizers import it on first use: once here, not once per forked rank
import torch.nn.functional as F
import torch.nn.init as init
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.model_parallel import initialize as mpu
from fairscale.nn.model_parallel import layers, mappings
from fairscale.nn.model_parallel.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)

SEED = 12345
BATCH, IN_PER, OUT_PER = 7, 3, 5  # per-partition sizes: every dimension divides by the model-parallel size
TOL = dict(atol=1e-5, rtol=1e-5)


def _master(out_features: int, in_features: int, init_method: Callable[[Tensor], Tensor]) -> Tensor:
    torch.manual_seed(SEED)
    w = torch.empty(out_features, in_features)
    init_method(w)
    return w


def _data(*shape: int, salt: int = 0) -> Tensor:
    """Same on the ranks of a model-parallel group, different between data-parallel replicas."""
    g = torch.Generator().manual_seed(1000 * salt + mpu.get_data_parallel_rank())
    return torch.randn(*shape, generator=g)


def _part(t: Tensor, dim: int) -> Tensor:
    p, r = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    return t.chunk(p, dim=dim)[r]


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    # Not torch.testing.assert_close: its one-time import costs about 2 s in every forked rank.
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.allclose(actual, expected, **TOL), f"{what}: max abs diff {(actual - expected).abs().max().item()}"


def _column(gather_output: bool) -> None:
    p = mpu.get_model_parallel_world_size()
    in_f, out_f = IN_PER * p, OUT_PER * p
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(in_f, out_f, gather_output=gather_output)
    w = _master(out_f, in_f, init.xavier_normal_).requires_grad_()
    b = torch.zeros(out_f, requires_grad=True)
    x, target = _data(BATCH, in_f).requires_grad_(), _data(BATCH, out_f, salt=1)
    xr = x.detach().clone().requires_grad_()
    ref = F.linear(xr, w, b)
    (ref * target).sum().backward()
    out = layer(x)
    if gather_output:
        _close(out, ref, "output")
        (out * target).sum().backward()
    else:
        _close(out, _part(ref, -1), "local output")
        (out * _part(target, -1)).sum().backward()  # the input grad is summed over the group by the copy
    _close(x.grad, xr.grad, "input grad")
    _close(layer.weight.grad, _part(w.grad, 0), "weight grad slice")
    _close(layer.bias.grad, _part(b.grad, 0), "bias grad slice")


def _row(input_is_parallel: bool) -> None:
    p = mpu.get_model_parallel_world_size()
    in_f, out_f = IN_PER * p, OUT_PER * p
    torch.manual_seed(SEED)
    layer = RowParallelLinear(in_f, out_f, input_is_parallel=input_is_parallel)
    w = _master(out_f, in_f, init.xavier_normal_).requires_grad_()
    b = torch.zeros(out_f, requires_grad=True)
    x_full, target = _data(BATCH, in_f), _data(BATCH, out_f, salt=1)
    xr = x_full.clone().requires_grad_()
    ref = F.linear(xr, w, b)
    (ref * target).sum().backward()
    x = (_part(x_full, -1) if input_is_parallel else x_full).clone().requires_grad_()
    out = layer(x)
    _close(out, ref, "output")
    (out * target).sum().backward()
    _close(x.grad, _part(xr.grad, -1) if input_is_parallel else xr.grad, "input grad")
    _close(layer.weight.grad, _part(w.grad, 1), "weight grad slice")
    _close(layer.bias.grad, b.grad, "bias grad (replicated)")


def _mlp() -> None:
    """Megatron's MLP: column (not gathered) -> gelu -> row (parallel input), one all-reduce each way."""
    p = mpu.get_model_parallel_world_size()
    d, h = IN_PER * p, OUT_PER * p
    torch.manual_seed(SEED)
    fc1 = ColumnParallelLinear(d, h, gather_output=False)
    fc2 = RowParallelLinear(h, d, input_is_parallel=True)
    torch.manual_seed(SEED)
    w1, w2 = torch.empty(h, d), torch.empty(d, h)
    init.xavier_normal_(w1)
    init.xavier_normal_(w2)
    w1.requires_grad_(), w2.requires_grad_()
    x = _data(BATCH, d).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    ref = F.linear(F.gelu(F.linear(xr, w1)), w2)
    ref.square().sum().backward()
    out = fc2(F.gelu(fc1(x)))
    _close(out, ref, "output")
    out.square().sum().backward()
    _close(x.grad, xr.grad, "input grad")
    _close(fc1.weight.grad, _part(w1.grad, 0), "fc1 weight grad")
    _close(fc2.weight.grad, _part(w2.grad, 1), "fc2 weight grad")


def _affine_weight() -> None:
    p = mpu.get_model_parallel_world_size()
    in_f, out_f = 13 * p, 17 * p
    master = _master(out_f, in_f, init.normal_)
    for dim, size in ((0, 17), (1, 13)):
        shape = (17, in_f) if dim == 0 else (out_f, 13)
        weight = torch.empty(shape)
        torch.manual_seed(SEED)
        returned = layers._initialize_affine_weight(weight, out_f, in_f, size, dim, init.normal_, 1, True)
        assert torch.equal(weight, _part(master, dim))
        assert returned is not None and torch.equal(returned, master)


def _stride() -> None:
    p = mpu.get_model_parallel_world_size()
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(3, 4 * p, stride=2, keep_master_weight_for_test=True)
    master = _master(4 * p, 3, init.xavier_normal_)
    chunks = master.split(2, dim=0)
    r = mpu.get_model_parallel_rank()
    assert torch.equal(layer.weight.data, torch.cat([chunks[r], chunks[r + p]]))
    assert torch.equal(layer.master_weight, master)
    # Fixed here (upstream returned the rank-blocked order for stride > 1).
    assert torch.equal(layer.get_master_weight(), master)
    row = RowParallelLinear(2 * p, 3, keep_master_weight_for_test=True)
    assert torch.equal(row.get_master_weight(), row.master_weight)
    # The forward is upstream's (checkpoints trained with it give the same outputs): gather_output=True concatenates
    # the ranks' slices rank by rank, and input_is_parallel=False splits the input contiguously, so the dense
    # weight they apply is the rank-blocked one, not get_master_weight()'s (docs/model_parallel.rst).
    x = _data(2, 3, salt=5)
    blocked = torch.cat([chunks[q] for rank in range(p) for q in (rank, rank + p)])
    _close(layer(x), F.linear(x, blocked), "stride-2 gathered output")  # the bias starts at zero
    torch.manual_seed(SEED)
    row = RowParallelLinear(4 * p, 3, bias=False, stride=2, keep_master_weight_for_test=True)
    row_chunks = row.master_weight.split(2, dim=1)
    row_blocked = torch.cat([row_chunks[q] for rank in range(p) for q in (rank, rank + p)], dim=1)
    h = _data(2, 4 * p, salt=6)
    _close(row(h), F.linear(h, row_blocked), "stride-2 row output")


def _embeddings() -> None:
    p = mpu.get_model_parallel_world_size()
    vocab, dim = 48, 16
    ids = torch.randint(0, vocab, (5, 7), generator=torch.Generator().manual_seed(mpu.get_data_parallel_rank()))
    target = _data(5, 7, dim, salt=2)
    ref_weight = _master(vocab, dim, init.normal_).requires_grad_()
    (F.embedding(ids, ref_weight) * target).sum().backward()
    ref_out = F.embedding(ids, ref_weight)
    for cls, dim_split in ((VocabParallelEmbedding, 0), (ParallelEmbedding, 1)):
        torch.manual_seed(SEED)
        emb = cls(vocab, dim, init_method=init.normal_)
        out = emb(ids)
        _close(out, ref_out, f"{cls.__name__} output")
        (out * target).sum().backward()
        _close(emb.weight.grad, _part(ref_weight.grad, dim_split), f"{cls.__name__} weight grad slice")
    # Ids outside the vocabulary are owned by no rank: zero vectors (upstream's behaviour, no error).
    torch.manual_seed(SEED)
    emb = VocabParallelEmbedding(vocab, dim * p)
    assert torch.equal(emb(torch.tensor([[-1, vocab]])), torch.zeros(1, 2, dim * p))


def _wide_normal(weight: Tensor) -> Tensor:
    return init.normal_(weight, std=3.0)


def _vocab_embedding_options() -> None:
    # The other ranks' ids were looked up as local row 0: scale_grad_by_freq counted them as uses of that row (its
    # gradient 0.25 where 1.0 is right) and max_norm renormalised that row although no token used it.
    vocab, dim = 16, 4
    ids = torch.tensor([[0, 5, 9, 13], [13, 0, 2, 2]])
    target = _data(2, 4, dim, salt=3)
    for options in ({"scale_grad_by_freq": True}, {"max_norm": 1.0}, {"max_norm": 1.0, "scale_grad_by_freq": True}):
        ref_weight = _master(vocab, dim, _wide_normal).requires_grad_()  # rows above max_norm: renormalised
        ref_out = F.embedding(ids, ref_weight, **options)  # type: ignore[arg-type]
        (ref_out * target).sum().backward()
        torch.manual_seed(SEED)
        emb = VocabParallelEmbedding(vocab, dim, init_method=_wide_normal, **options)
        before = emb.weight.detach().clone()
        out = emb(ids)
        _close(out, ref_out, f"output with {options}")
        (out * target).sum().backward()
        _close(emb.weight.grad, _part(ref_weight.grad, 0), f"weight grad with {options}")
        used = {int(i) - emb.vocab_start_index for i in ids.flatten()}
        for row in range(emb.weight.shape[0]):
            if row not in used:
                assert torch.equal(emb.weight[row], before[row]), f"row {row} renormalised without a lookup"


def _failed_load_changes_nothing() -> None:
    # A checkpoint of another model-parallel size: torch copied the replicated bias, then raised on the weight.
    p = mpu.get_model_parallel_world_size()
    torch.manual_seed(SEED)
    row = RowParallelLinear(8 * p, 6)
    before = {k: v.clone() for k, v in row.state_dict().items()}
    other = {"weight": torch.ones(6, 8 * p + 1), "bias": torch.ones(6)}
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        row.load_state_dict(other)
    assert all(torch.equal(v, before[k]) for k, v in row.state_dict().items()), "the failed load changed the layer"
    row.load_state_dict({"weight": torch.ones(6, 8), "bias": torch.ones(6)})
    assert torch.equal(row.bias, torch.ones(6))
    if p == 1:
        return
    # A checkpoint of another model-parallel size says so (torch's message alone only said "size mismatch"), also
    # when a parent module loads it.
    column = ColumnParallelLinear(4, 4 * p)
    parent = torch.nn.Sequential(column)
    full = {"weight": torch.ones(4 * p, 4), "bias": torch.ones(4 * p)}
    of_size = {"weight": torch.ones(2, 4), "bias": torch.ones(2)}  # a partition of model-parallel size 2p
    for state, match in ((full, "the full weight"), (of_size, f"the partition of model-parallel size {2 * p}")):
        for load, prefix in ((column.load_state_dict, ""), (parent.load_state_dict, "0.")):
            with pytest.raises(RuntimeError, match=f"looks like {match}"):
                load({prefix + k: v for k, v in state.items()})
    with pytest.raises(RuntimeError, match=r"the checkpoint's \(3, 4\) is of another model"):
        column.load_state_dict({"weight": torch.ones(3, 4), "bias": torch.ones(4)})


def _mappings() -> None:
    p, r = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    h = torch.full((2, 3), float(r + 1))
    y = mappings.reduce_from_model_parallel_region(h)
    assert y is h and torch.all(h == p * (p + 1) / 2)  # in place, as upstream
    x = torch.arange(4.0 * p).reshape(1, 4 * p).requires_grad_()
    part = mappings.scatter_to_model_parallel_region(x)
    assert torch.equal(part, x.detach()[:, 4 * r : 4 * r + 4])
    full = mappings.gather_from_model_parallel_region(part * (r + 1))
    expected = torch.cat([x.detach()[:, 4 * q : 4 * q + 4] * (q + 1) for q in range(p)], dim=-1)
    assert torch.equal(full, expected)
    full.sum().backward()
    # Each rank's slice gets that rank's gradient, gathered back by the scatter's backward.
    assert torch.equal(x.grad, torch.arange(1.0, p + 1).repeat_interleave(4).reshape(1, 4 * p))
    z = torch.ones(3, requires_grad=True)
    grad = torch.ones(3)
    mappings.copy_to_model_parallel_region(z).backward(grad)
    assert torch.all(z.grad == p)
    z.grad = None
    mappings.copy_to_model_parallel_region(z).sum().backward()  # sum()'s gradient is expanded (stride 0)
    assert torch.all(z.grad == p)
    # Transposed (non-contiguous) tensors: summed in place forward, and a transposed input's gradient (torch hands it
    # back in that layout) summed in backward; the in-place all-reduce refused them ("must be contiguous").
    t = torch.full((3, 2), float(r + 1)).t()
    assert mappings.reduce_from_model_parallel_region(t) is t and torch.all(t == p * (p + 1) / 2)
    x_t = torch.arange(6.0).reshape(3, 2).t().requires_grad_()
    column = ColumnParallelLinear(3, 2 * p, gather_output=True)
    column(x_t).sum().backward()
    x_c = x_t.detach().contiguous().requires_grad_()
    column(x_c).sum().backward()
    assert torch.equal(x_t.grad, x_c.grad)


def _bad_sizes() -> None:
    p = mpu.get_model_parallel_world_size()
    if p == 1:
        ColumnParallelLinear(3, 5)  # anything divides by 1
        return
    for build, what in (
        (lambda: ColumnParallelLinear(4, p + 1), "out_features"),
        (lambda: RowParallelLinear(p + 1, 4), "in_features"),
        (lambda: VocabParallelEmbedding(p + 1, 4), "num_embeddings"),
        (lambda: ParallelEmbedding(4, p + 1), "embedding_dim"),
    ):
        with pytest.raises(AssertionError, match=f"{p + 1} is not divisible by {p}: .*{what}"):
            build()


def _keep_master_at_one() -> None:
    if mpu.get_model_parallel_world_size() != 1:
        return
    layer = ColumnParallelLinear(3, 4, keep_master_weight_for_test=True)
    assert layer.master_weight is layer.weight  # upstream: a second registered name at size 1
    assert set(layer.state_dict()) == {"weight", "bias", "master_weight"}


def _autocast_dtypes() -> None:
    """Under autocast every layer returns what nn.Linear returns (bf16): RowParallelLinear added its fp32 bias after
    the all-reduce and returned fp32 (found by a randomized sequence of API calls)."""
    p = mpu.get_model_parallel_world_size()
    torch.manual_seed(SEED)
    dense = torch.nn.Linear(IN_PER * p, OUT_PER * p)
    row = RowParallelLinear(IN_PER * p, OUT_PER * p)
    col = ColumnParallelLinear(IN_PER * p, OUT_PER * p)
    x = _data(BATCH, IN_PER * p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = dense(x).dtype
        for name, layer in (("RowParallelLinear", row), ("ColumnParallelLinear", col)):
            out = layer(x)
            assert out.dtype == want, f"{name} under autocast returned {out.dtype}, nn.Linear {want}"
            out.float().sum().backward()
            assert layer.bias.grad is not None and layer.bias.grad.dtype == torch.float32, name


CASES: List[Tuple[str, Callable[[], None]]] = [
    ("affine_weight", _affine_weight),
    ("column_parallel", lambda: _column(True)),
    ("column_parallel_no_gather", lambda: _column(False)),
    ("row_parallel", lambda: _row(False)),
    ("row_parallel_parallel_input", lambda: _row(True)),
    ("mlp", _mlp),
    ("stride", _stride),
    ("embedding", _embeddings),
    ("mappings", _mappings),
    ("bad_sizes", _bad_sizes),
    ("keep_master_at_one", _keep_master_at_one),
    ("vocab_embedding_options", _vocab_embedding_options),
    ("failed_load_changes_nothing", _failed_load_changes_nothing),
    ("autocast_dtypes", _autocast_dtypes),
]


def _layers_body(rank: int, world_size: int) -> None:
    for mp in [s for s in (4, 2, 1) if s <= world_size]:
        mpu.initialize_model_parallel(mp)
        try:
            run_cases((f"mp={mp}:{name}", case) for name, case in CASES)
        finally:
            mpu.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_layers(world_size: int) -> None:
    run_distributed(_layers_body, world_size)


class _ParallelMLP(torch.nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.fc1 = ColumnParallelLinear(d, h, gather_output=False)
        self.fc2 = RowParallelLinear(h, d, input_is_parallel=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _fsdp_over_data_parallel_body(rank: int, world_size: int) -> None:
    """FSDP over the data-parallel group of a 2 x 2 model-parallel MLP trains like the dense MLP on both batches."""
    mpu.initialize_model_parallel(2)
    p, d, h, lr = 2, 4, 6, 0.1
    model = FSDP(_ParallelMLP(d, h), process_group=mpu.get_data_parallel_group())
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(SEED)
    dense = {"fc1.weight": torch.empty(h, d), "fc2.weight": torch.empty(d, h)}
    init.xavier_normal_(dense["fc1.weight"])
    init.xavier_normal_(dense["fc2.weight"])
    dense.update({"fc1.bias": torch.zeros(h), "fc2.bias": torch.zeros(d)})
    for step in range(2):
        batches = [torch.randn(3, d, generator=torch.Generator().manual_seed(10 * step + q)) for q in range(p)]
        model(batches[mpu.get_data_parallel_rank()]).square().sum().backward()
        optim.step()
        optim.zero_grad()
        ref = {k: v.clone().requires_grad_() for k, v in dense.items()}
        for x in batches:  # the mean over the data-parallel replicas, as FSDP averages
            y = F.linear(F.gelu(F.linear(x, ref["fc1.weight"], ref["fc1.bias"])), ref["fc2.weight"], ref["fc2.bias"])
            (y.square().sum() / p).backward()
        dense = {k: (v - lr * v.grad).detach() for k, v in ref.items()}
    state = model.state_dict()
    expected = {
        "fc1.weight": _part(dense["fc1.weight"], 0),
        "fc1.bias": _part(dense["fc1.bias"], 0),
        "fc2.weight": _part(dense["fc2.weight"], 1),
        "fc2.bias": dense["fc2.bias"],
    }
    assert set(state) == set(expected)
    for key, value in expected.items():
        _close(state[key], value, key)
    # The state dict loads into a fresh wrapped model and gives the same outputs.
    fresh = FSDP(_ParallelMLP(d, h), process_group=mpu.get_data_parallel_group())
    fresh.load_state_dict(state)
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(99))
    _close(fresh(x), model(x), "output after load_state_dict")
    mpu.destroy_model_parallel()


def test_fsdp_over_data_parallel_group() -> None:
    run_distributed(_fsdp_over_data_parallel_body, 4)


def _cuda_body(rank: int, world_size: int) -> None:
    """The Megatron MLP, the vocab-parallel cross entropy and the tracker on CUDA/NCCL against CPU references."""
    from fairscale.nn.model_parallel import model_parallel_cuda_manual_seed, vocab_parallel_cross_entropy
    from fairscale.nn.model_parallel.random import get_cuda_rng_tracker

    dev = torch.device("cuda", torch.cuda.current_device())
    mpu.initialize_model_parallel(world_size)
    p = world_size
    d, h = IN_PER * p, OUT_PER * p
    torch.manual_seed(SEED)
    fc1 = ColumnParallelLinear(d, h, gather_output=False).to(dev)
    fc2 = RowParallelLinear(h, d, input_is_parallel=True).to(dev)
    torch.manual_seed(SEED)
    w1, w2 = torch.empty(h, d), torch.empty(d, h)
    init.xavier_normal_(w1)
    init.xavier_normal_(w2)
    w1.requires_grad_(), w2.requires_grad_()
    x = _data(BATCH, d)
    ref = F.linear(F.gelu(F.linear(x, w1)), w2)
    ref.square().sum().backward()
    xd = x.to(dev).requires_grad_()
    out = fc2(F.gelu(fc1(xd)))
    out.square().sum().backward()
    tol = dict(atol=1e-4, rtol=1e-4)
    assert torch.allclose(out.cpu(), ref, **tol)
    assert torch.allclose(fc1.weight.grad.cpu(), _part(w1.grad, 0), **tol)
    assert torch.allclose(fc2.weight.grad.cpu(), _part(w2.grad, 1), **tol)

    logits = torch.randn(5, 7, 11 * p, generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, 11 * p, (5, 7), generator=torch.Generator().manual_seed(4))
    dense = F.cross_entropy(logits.view(-1, 11 * p), target.view(-1), reduction="none").view_as(target)
    local = _part(logits, -1).contiguous().to(dev)
    assert torch.allclose(vocab_parallel_cross_entropy(local, target.to(dev)).cpu(), dense, **tol)

    model_parallel_cuda_manual_seed(123)
    assert torch.cuda.initial_seed() == 123
    with get_cuda_rng_tracker().fork():
        assert torch.cuda.initial_seed() == 123 + 2718 + mpu.get_model_parallel_rank()
    mpu.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [1, 2])
def test_layers_cuda(world_size: int) -> None:
    """CUDA/NCCL variant (skipped without enough GPUs)."""
    run_distributed(_cuda_body, world_size, device="cuda", timeout=240.0)
