# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
import time

import pytest
import torch
from torch import nn

from fairscale.nn.pipe.balance import balance_by_size, balance_by_time, blockpartition
from fairscale.nn.pipe.balance.profile import layerwise_sandbox
from fairscale.nn.pipe.skip import pop, skippable, stash

from ._util import NEEDS_CUDA, cuda_devices


def test_blockpartition():
    assert blockpartition.solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]
    assert blockpartition.solve([1, 2, 3, 4, 5, 6], partitions=3) == [[1, 2, 3], [4, 5], [6]]
    assert blockpartition.solve([6, 5, 4, 3, 2, 1], partitions=2) == [[6, 5], [4, 3, 2, 1]]
    assert blockpartition.solve([5, 5, 5, 5], partitions=3) == [[5], [5], [5, 5]]
    assert blockpartition.solve([1] * 7, partitions=3) == [[1, 1], [1, 1], [1, 1, 1]]
    assert blockpartition.solve([100, 1, 1, 1, 1, 1], partitions=2) == [[100, 1, 1], [1, 1, 1]]
    assert blockpartition.solve([1, 1, 1, 1, 1, 100], partitions=2) == [[1, 1, 1], [1, 1, 100]]


def test_blockpartition_zeros():
    assert blockpartition.solve([0, 0], partitions=2) == [[0], [0]]
    assert blockpartition.solve([0, 0, 0], partitions=3) == [[0], [0], [0]]
    assert blockpartition.solve([10, 0, 0, 0, 0, 0, 0, 0, 0, 10], partitions=3) == [
        [10, 0, 0],
        [0, 0, 0],
        [0, 0, 0, 10],
    ]


@pytest.mark.parametrize(
    "costs, partitions, expected",
    [
        # Upstream's heuristic loops forever on these (a few heavy layers among light ones: measured layer times).
        ([1, 1, 1, 1, 1000000, 7], 5, [1, 1, 2, 1, 1]),
        ([1, 7, 7, 1, 1, 1, 7, 7, 1, 7, 7], 9, [1, 1, 1, 3, 1, 1, 1, 1, 1]),
        # ... and ends with an empty block (which Pipe refuses) or boundaries out of order on these.
        ([7, 7, 7, 7, 1000000, 1000000], 4, [2, 2, 1, 1]),
        ([20, 1, 2, 8, 16, 1, 1, 14, 17, 6, 18, 5], 11, [1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1]),
    ],
)
def test_blockpartition_falls_back_to_the_exact_partition(costs, partitions, expected):
    blocks = blockpartition.solve(costs, partitions)
    assert [len(b) for b in blocks] == expected and sum(blocks, []) == costs
    # The exact min-max partition: no split into non-empty blocks has a smaller largest sum.
    assert max(sum(b) for b in blocks) == max(sum(b) for b in blockpartition._min_max_blocks(costs, partitions))


@pytest.mark.parametrize("costs, partitions", [([float("inf"), 1, 1], 2), ([float("inf")] * 2 + [1, 1], 3)])
def test_blockpartition_infinite_costs_keep_blocks_non_empty(costs, partitions):
    # Every split of an infinite cost ties at infinity; none of them may leave a block empty (the first block was).
    blocks = blockpartition.solve(costs, partitions)
    assert len(blocks) == partitions and all(blocks) and sum(blocks, []) == costs


def test_blockpartition_exact_partition_of_negative_costs():
    # No pipeline has one, but the exact partition took 0 as a floor under the first block: [[0], [-0.4, 0, -1]].
    assert max(sum(b) for b in blockpartition._min_max_blocks([0, -0.4, 0, -1], 2)) == -0.4


def test_blockpartition_min_max_blocks_is_optimal():
    import itertools

    costs = [5, 1, 9, 2, 2, 8, 1, 3]
    for partitions in range(1, len(costs) + 1):
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (len(costs),)))
            for cuts in itertools.combinations(range(1, len(costs)), partitions - 1)
        )
        blocks = blockpartition._min_max_blocks(costs, partitions)
        assert len(blocks) == partitions and all(blocks) and sum(blocks, []) == costs
        assert max(sum(b) for b in blocks) == best


def _reference_min_max_bounds(costs, partitions):
    # The plain O(n**2 * partitions) program _min_max_blocks must agree with, tie-break included: over float prefix
    # sums, the last of k blocks ending at i starts at the smallest j with the smallest max(best[k - 1][j], sum(j, i)).
    n = len(costs)
    prefix = [0.0]
    for x in costs:
        prefix.append(prefix[-1] + float(x))
    best = [[float("inf")] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(partitions, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _random_costs(rng, n):
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randint(0, 3) for _ in range(n)]  # ties, zeros
    if kind == 1:
        return [rng.random() for _ in range(n)]
    if kind == 2:
        return [rng.choice([0.1, 0.2, 0.3, 0.7]) for _ in range(n)]  # float sums that round
    if kind == 3:
        return [rng.choice([0, 0, 0, 5]) for _ in range(n)]  # runs of zeros
    costs = [rng.choice([1, 1, 2]) for _ in range(n)]  # a few heavy costs among light ones
    for i in rng.sample(range(n), rng.randint(1, max(1, n // 5))):
        costs[i] = rng.choice([7, 1000, 1000000])
    return costs


def test_blockpartition_min_max_blocks_matches_the_quadratic_program():
    import random

    rng = random.Random(0)
    for _ in range(400):
        costs = _random_costs(rng, rng.randint(1, 24))
        if rng.random() < 0.1:
            costs[rng.randrange(len(costs))] = -2  # a negative cost: the quadratic program itself
        for partitions in range(1, len(costs) + 1):
            bounds = _reference_min_max_bounds(costs, partitions)
            expected = [costs[a:b] for a, b in zip(bounds, bounds[1:])]
            assert blockpartition._min_max_blocks(costs, partitions) == expected, (costs, partitions)


def _reference_solve(sequence, partitions):
    # The heuristic as solve computed it before it kept sums (every block summed at every step, every state kept),
    # with its fallbacks: it ends with blocks out of order or empty, a state repeats, a boundary leaves the sequence,
    # or the budget runs out.
    n = len(sequence)
    minimum = min(sequence)
    spread = max(sequence) - minimum
    normal = [0.0] * n if spread == 0 else [(x - minimum) / spread for x in sequence]
    splits = [n // partitions * (t + 1) for t in range(partitions - 1)] + [n]

    def weights():
        starts = [0] + splits[:-1]
        return [(sum(normal[start:stop]), i) for i, (start, stop) in enumerate(zip(starts, splits))]

    seen = set()
    while True:
        heaviest, p = max(weights())
        while True:
            lightest, q = min(weights())
            if heaviest <= lightest + 1:
                if all(0 < b - a for a, b in zip([0] + splits, splits)):
                    return [list(sequence[a:b]) for a, b in zip([0] + splits[:-1], splits)]
                return blockpartition._min_max_blocks(sequence, partitions)
            state = (tuple(splits), p, heaviest)
            if state in seen or len(seen) > 1000 + 16 * n * partitions or not 0 <= min(splits) <= max(splits) <= n:
                return blockpartition._min_max_blocks(sequence, partitions)
            seen.add(state)
            if p < q:
                h = q - 1
                splits[h] -= 1
            else:
                h = q + 1
                splits[q] += 1
            if h == p:
                break


def test_blockpartition_matches_the_plain_heuristic():
    import random

    rng = random.Random(1)
    cases = [([1, 1, 1, 1, 1000000, 7], 5), ([1, float("nan"), 2, 3], 2), ([3, -1, 2, 5, 0], 3)]
    # A cycle that starts late and is long (found by a search): Brent's method must still find it.
    cycle = [int(c) for c in "11015551151000551500150110550555505111"]  # 30 steps, then a cycle of 14
    cases.append((cycle, 8))
    for _ in range(150):
        costs = _random_costs(rng, rng.randint(1, 30))
        cases.extend((costs, partitions) for partitions in range(1, len(costs) + 1))
    for _ in range(4):
        costs = _random_costs(rng, 300)  # runs of hundreds of steps, in which blocks keep their sums long
        cases.extend((costs, partitions) for partitions in (2, 8, 32))
    for costs, partitions in cases:
        assert repr(blockpartition.solve(costs, partitions)) == repr(_reference_solve(costs, partitions)), (
            costs,
            partitions,
        )


def test_blockpartition_large_fallback(monkeypatch):
    # 3000 layers of cost 1 with 5 of cost 7: the heuristic runs 842 steps and leaves blocks out of order, so the
    # exact partition of all 3000 is computed (each step summed every block, and the partition took O(n**2 * k),
    # 7 seconds, before). No time is asserted: that it ends, and right, is the check.
    costs = [1] * 3000
    for i in (165, 1060, 1577, 1722, 2094):
        costs[i] = 7
    exact = blockpartition._min_max_blocks
    calls = []
    monkeypatch.setattr(blockpartition, "_min_max_blocks", lambda s, k: calls.append(k) or exact(s, k))
    blocks = blockpartition.solve(costs, 8)
    assert calls == [8]
    assert len(blocks) == 8 and all(blocks) and sum(blocks, []) == costs
    # Optimal: no 8 blocks have a largest sum below this one (greedy packing under it needs more than 8).
    largest = max(sum(b) for b in blocks)
    count, total = 1, 0
    for x in costs:
        if total + x > largest - 1:
            count, total = count + 1, 0
        total += x
    assert count > 8


def test_blockpartition_non_positive_partitions():
    with pytest.raises(ValueError, match=r"partitions must be a positive integer \(0 < 1\)"):
        blockpartition.solve([42], partitions=0)
    with pytest.raises(ValueError, match=r"partitions must be a positive integer \(-1 < 1\)"):
        blockpartition.solve([42], partitions=-1)


def test_blockpartition_short_sequence():
    with pytest.raises(ValueError, match=r"sequence is shorter than intended partitions \(0 < 1\)"):
        blockpartition.solve([], partitions=1)
    with pytest.raises(ValueError, match=r"sequence is shorter than intended partitions \(1 < 2\)"):
        blockpartition.solve([42], partitions=2)


@pytest.mark.parametrize("device", cuda_devices())
def test_balance_by_time(device):
    class Delay(nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def forward(self, x):
            time.sleep(self.seconds)
            return x

    model = nn.Sequential(*[Delay(i / 100) for i in [1, 2, 3, 4, 5, 6]])
    sample = torch.rand(1)
    balance = balance_by_time(2, model, sample, timeout=0.3, device=device)
    assert balance == [4, 2]


def test_balance_by_time_loop_resets_input():
    # nn.Flatten was introduced at PyTorch 1.2.0.
    class Flatten(nn.Module):
        def forward(self, x):
            return x.flatten(1)

    model = nn.Sequential(nn.Conv2d(3, 2, 1), Flatten(), nn.Linear(128, 10))
    sample = torch.rand(10, 3, 8, 8)
    balance = balance_by_time(2, model, sample, timeout=0.1, device="cpu")
    assert balance == [1, 2]


class _Triple(nn.Module):
    def forward(self, x):
        return x.mul_(3)  # in place, as an inplace Dropout or scaling layer first in the model


def test_balance_by_time_leaves_the_sample_alone():
    # Each pass started from the caller's storage: the sample was changed once per pass (3 ** passes), and each pass
    # timed the last one's values (a fuzz of Pipe's utilities, session 45).
    sample = torch.randn(8, 4)
    before = sample.clone()
    balance_by_time(2, nn.Sequential(_Triple(), nn.Linear(4, 4)), sample, timeout=0.1, device="cpu")
    assert torch.equal(sample, before)


def test_balance_by_time_accelerator_index_without_one_is_a_clear_error(monkeypatch):
    # torch.device(0) itself failed with torch's "Cannot access accelerator device" (session 45).
    monkeypatch.setenv("FAIRSCALE_CPU_ONLY", "1")
    with pytest.raises(ValueError, match="device 0 is not available on this host; pass device='cpu'"):
        balance_by_time(1, nn.Sequential(nn.Linear(2, 2)), torch.randn(2, 2), device=0)


def test_balance_by_time_tuple():
    class Twin(nn.Module):
        def forward(self, x):
            return x, x.detach()

    class Add(nn.Module):
        def forward(self, a_b):
            a, b = a_b
            return a + b

    model = nn.Sequential(Twin(), Add())
    sample = torch.rand(1, requires_grad=True)
    balance_by_time(1, model, sample, timeout=0.05, device="cpu")


def test_balance_by_time_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FAIRSCALE_CPU_ONLY", "1")
    with pytest.raises(ValueError, match="device='cpu'"):
        balance_by_time(1, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1), timeout=0.01)


def test_balance_by_size_requires_cuda():
    with pytest.raises(ValueError, match="size profiler supports only CUDA device"):
        balance_by_size(1, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1), device="cpu")


def test_balance_by_size_without_gpu_is_a_clear_error(monkeypatch):
    # torch's "Torch not compiled with CUDA enabled" (an AssertionError) came from the first allocation count.
    monkeypatch.setenv("FAIRSCALE_CPU_ONLY", "1")
    with pytest.raises(ValueError, match="balance_by_size: device cuda is not available on this host.*balance_by_time"):
        balance_by_size(1, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1))


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), True])
def test_balance_by_time_timeout_must_be_positive(timeout):
    # 0, a negative number or NaN ran no measurement and returned an even split, silently.
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        balance_by_time(1, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1), timeout=timeout, device="cpu")


def test_balance_by_time_refuses_the_meta_device():
    # Accepted before: the meta device computes nothing, so the "times" were each layer's Python overhead and the
    # balance meaningless, silently (session 37).
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 64), nn.Linear(64, 4))
    with pytest.raises(ValueError, match="meta device runs no computation"):
        balance_by_time(2, model, torch.rand(2, 4), timeout=0.1, device="meta")
    assert sum(balance_by_time(2, model, torch.rand(2, 4), timeout=0.1, device="cpu")) == 3


@pytest.mark.parametrize("balance", [balance_by_time, balance_by_size])
def test_balance_partitions_must_be_an_int(balance):
    # 2.0 failed deep inside the partitioning with a TypeError about range().
    with pytest.raises(TypeError, match="partitions must be an int, got float 2.0"):
        balance(2.0, nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), torch.rand(1, 1), device="cpu")


@pytest.mark.parametrize("balance, kwargs", [(balance_by_time, {"timeout": 30}), (balance_by_size, {})])
def test_balance_more_partitions_than_layers(balance, kwargs):
    # balance_by_time profiled for its whole timeout before the partitioning refused (session 39).
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"sequence is shorter than intended partitions \(2 < 3\)"):
        balance(3, nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), torch.rand(1, 1), device="cpu", **kwargs)
    assert time.monotonic() - started < 20


def test_balance_by_time_in_place_layers():
    # ReLU(inplace=True) after a Linear (VGG/ResNet style): each layer got a leaf input that requires grad, and the
    # in-place op raised "a leaf Variable that requires grad is being used in an in-place operation" (session 39).
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    assert sum(balance_by_time(2, model, torch.rand(3, 4, requires_grad=True), timeout=0.05, device="cpu")) == 4


@skippable(stash=["skip"])
class _StashComputed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        yield stash("skip", self.lin(x))
        return x


@skippable(pop=["skip"])
class _PopAdd(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        return x + skip


def test_balance_by_time_skip_of_a_computed_tensor():
    # The stash layer's backward freed the graph of its stashed tensor before the pop layer's backward reached it:
    # "Trying to backward through the graph a second time" (a U-Net or residual branch; session 39).
    model = nn.Sequential(_StashComputed(), nn.Linear(4, 4), _PopAdd(), nn.Linear(4, 4))
    assert sum(balance_by_time(2, model, torch.rand(3, 4), timeout=0.05, device="cpu")) == 4
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("chunks", [0, -2, 0.5, True, "x"])
def test_balance_by_size_chunks_must_be_positive(chunks):
    # 0 divided by zero; a negative count made every activation size negative (checked before the device).
    with pytest.raises(ValueError, match=f"chunks must be a positive integer, got {chunks!r}"):
        balance_by_size(1, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1), chunks=chunks)


@NEEDS_CUDA
def test_balance_by_size_latent():
    class Expand(nn.Module):
        def __init__(self, times):
            super().__init__()
            self.times = times

        def forward(self, x):
            for i in range(self.times):
                x = x + torch.rand_like(x, requires_grad=True)
            return x

    sample = torch.rand(10, 100, 100)
    model = nn.Sequential(*[Expand(i) for i in [1, 2, 3, 4, 5, 6]])
    assert balance_by_size(2, model, sample) == [4, 2]
    model = nn.Sequential(*[Expand(i) for i in [6, 5, 4, 3, 2, 1]])
    assert balance_by_size(2, model, sample) == [2, 4]


@pytest.mark.parametrize("device", cuda_devices())
def test_layerwise_sandbox(device):
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    model.eval()
    for layer in layerwise_sandbox(model, torch.device(device)):
        assert layer.training
        assert all(p.device.type == device for p in layer.parameters())
    assert all(not layer.training for layer in model)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("device", cuda_devices())
def test_sandbox_during_profiling(device):
    model = nn.Sequential(nn.BatchNorm2d(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.rand(1, 3, 10, 10)
    balance_by_time(1, model, sample, timeout=0.05, device=device)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.allclose(after[key], value), key


def test_not_training():
    class AssertTraining(nn.Module):
        def forward(self, x):
            if self.training:
                assert self.training
            else:
                raise AssertionError("layer in the sandbox must be training")
            return x

    model = nn.Sequential(AssertTraining())
    model.eval()
    assert not model.training
    balance_by_time(1, model, torch.rand(1), timeout=0.05, device="cpu")
    assert not model.training


def test_already_has_grad():
    model = nn.Sequential(nn.Conv2d(3, 3, 1))
    sample = torch.rand(1, 3, 32, 32)
    model(sample).norm().backward()
    with pytest.raises(ValueError, match="some parameter already has gradient"):
        balance_by_time(1, model, sample, device="cpu")
