# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""How :func:`fairscale.nn.data_parallel.dcp.load` reads: into staging views of the flat shards, then local copies.

* A checkpoint of the same world size and wrapping is read chunk for chunk: every tensor read is a whole saved chunk
  into a whole local box, each rank reads its own data file only, and no rank exchanges anything (no all_to_all).
* Checkpoints of another layout (FSDP2's ``Shard(0)`` chunks, another world size) are resharded by DCP into the same
  views, still without an exchange, and load bit-exactly; so do mixed precision and CPU-offloaded models.
* Zero-size parameters (an empty chunk) load too.
* A read that fails (a truncated data file, a reader failing on one rank after it read everything) leaves the
  parameters and the optimizer state bit-identical on every rank: nothing live is written before every rank read.
"""

import os
import shutil
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models import NestedWrappedModule, build, wrap_model
from test_fsdp_dcp import assert_same, assert_same_optim, fsdp2_model, fsdp2_state, full_model, full_optim, train
from test_fsdp_dcp_faults import assert_unchanged, fresh, snapshot, trained
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import dcp as fsdp_dcp

try:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed.checkpoint import state_dict as torch_dsd
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - torch without FSDP2
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None, reason="needs torch with FSDP2 (fully_shard) and DTensor")


class RecordingReader(dcp.FileSystemReader):
    """DCP's file-system reader, which records every tensor read: (key, file, storage offsets, destination offsets,
    lengths, the saved chunk's sizes)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.reads: List[Tuple[str, str, List[int], List[int], List[int], List[int]]] = []

    def read_data(self, plan: Any, planner: Any) -> Any:
        chunks = self.read_metadata().state_dict_metadata
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                continue
            fqn = item.storage_index.fqn
            saved = chunks[fqn].chunks[item.storage_index.index]  # type: ignore[union-attr]
            path = self.storage_data[item.storage_index].relative_path
            self.reads.append(
                (fqn, path, list(item.storage_offsets), list(item.dest_offsets), list(item.lengths), list(saved.sizes))
            )
        return super().read_data(plan, planner)


class FailingAfterReadReader(dcp.FileSystemReader):
    """DCP's file-system reader, whose rank 1 fails once it has read all its data (a lost mount, a bad checksum)."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        done = super().read_data(plan, planner)
        if dist.get_rank() == 1:
            done.wait()
            raise OSError("injected: the checkpoint's storage went away")
        return done


class WithEmpty(nn.Module):
    """A parameter without elements between two linears: one empty chunk in the checkpoint, nothing to read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.b = nn.Linear(5, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x)) + self.empty.sum()


def sharded_keys(fsdp: Any) -> List[str]:
    """The checkpoint keys of the parameters and of their element-wise optimizer states (DCP's flattened names)."""
    names = list(fsdp_dcp.get_model_state_dict(fsdp))
    return [f"model.{n}" for n in names] + [
        f"optimizer.state.{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq")
    ]


def expect_failed_load(fsdp: Any, optim: Any, match: str, **kwargs: Any) -> None:
    before = snapshot(fsdp, optim)
    had_state = bool(optim.state)
    with pytest.raises(RuntimeError, match=match) as info:
        fsdp_dcp.load(fsdp, optim, **kwargs)
    assert "nothing was loaded" in str(info.value), str(info.value)
    assert_unchanged(fsdp, optim, before, f"after a failed read ({match})")
    assert bool(optim.state) == had_state, "the optimizer state created for the read stayed"


# ------------------------------------------------------------------------------------------------------ cases


def _case_same_layout_reads_whole_chunks(root: str, rank: int) -> None:
    fsdp, optim = trained(seed=1, mode="nested")
    path = os.path.join(root, "same-layout")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    expected = full_model(fsdp_dcp.get_model_state_dict(fsdp))
    expected_optim = full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim))
    other, other_optim = fresh(seed=2, mode="nested")
    reader = RecordingReader(path)
    with count_collectives() as counter:
        fsdp_dcp.load(other, other_optim, checkpoint_id=path, storage_reader=reader)
    assert counter.count("all_to_all") == 0, counter.summary()
    keys = set(sharded_keys(other))
    reads = [r for r in reader.reads if r[0] in keys]
    assert reads, reader.reads
    for fqn, file, storage_offsets, dest_offsets, lengths, saved_sizes in reads:
        assert lengths == saved_sizes and not any(storage_offsets), f"{fqn}: part of a saved chunk read"
        assert not any(dest_offsets), f"{fqn}: read into part of a local box"
        assert file.startswith(f"__{rank}_"), f"{fqn}: rank {rank} read another rank's file {file}"
    assert_same(full_model(fsdp_dcp.get_model_state_dict(other)), expected, "same layout: model")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(other, other_optim)), expected_optim, "optimizer")


def _case_default_reader_alternates_chunk_sizes(root: str, rank: int) -> None:
    """DCP's reader holds the chunk it read last while it reads the next: load's own reader never puts two large ones
    in a row (each tensor read pairs one of the larger half of a file's chunks with one of the smaller half)."""
    fsdp, optim = trained(seed=1, mode="nested")
    path = os.path.join(root, "order")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    orders: List[Tuple[str, List[int]]] = []
    original = dcp.FileSystemReader.read_data

    def spy(self: Any, plan: Any, planner: Any) -> Any:
        per_file: Dict[str, List[int]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.TENSOR:
                per_file.setdefault(info.relative_path, []).append(info.length)
        orders.extend(per_file.items())
        return original(self, plan, planner)

    other, other_optim = fresh(seed=2, mode="nested")
    dcp.FileSystemReader.read_data = spy  # type: ignore[method-assign]
    try:
        fsdp_dcp.load(other, other_optim, checkpoint_id=path)
    finally:
        dcp.FileSystemReader.read_data = original  # type: ignore[method-assign]
    assert orders, "the default reader was not used"
    for file, lengths in orders:
        by_size = sorted(lengths, reverse=True)
        bound = by_size[0] + (by_size[(len(by_size) + 1) // 2] if len(by_size) > 1 else 0)
        pairs = list(zip(lengths, lengths[1:]))
        assert all(a + b <= bound for a, b in pairs), (file, lengths)
    assert_same(other.state_dict(), fsdp.state_dict(), "loaded with the reordered reads")


def _case_fsdp2_checkpoint(root: str, rank: int) -> None:
    """FSDP2's Shard(0) chunks are resharded by DCP into the boxes: no exchange, bit-exact."""
    world_size = dist.get_world_size()
    model, optim = fsdp2_model(5, world_size)
    train(model, optim, range(1), rank, world_size)
    path = os.path.join(root, "fsdp2")
    dcp.save(fsdp2_state(model, optim), checkpoint_id=path)
    expected = full_model(torch_dsd.get_model_state_dict(model))
    expected_optim = full_optim(torch_dsd.get_optimizer_state_dict(model, optim))
    fsdp, fsdp_optim = fresh(seed=6, mode="leaf")
    with count_collectives() as counter:
        fsdp_dcp.load(fsdp, fsdp_optim, checkpoint_id=path)
    assert counter.count("all_to_all") == 0, counter.summary()
    assert_same(full_model(fsdp_dcp.get_model_state_dict(fsdp)), expected, "FSDP2 checkpoint: model")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, fsdp_optim)), expected_optim, "FSDP2 optim")


def _case_mixed_precision_and_cpu_offload(root: str, rank: int) -> None:
    """The staging tensors are the fp32 master shards' (on the CPU when offloaded)."""
    for kwargs in ({"mixed_precision": True}, {"mixed_precision": True, "move_params_to_cpu": True}):
        model, _ = build(NestedWrappedModule, 7)
        fsdp = wrap_model(model, dict(kwargs), "nested")
        optim = torch.optim.Adam(fsdp.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        optim.zero_grad()
        NestedWrappedModule.per_sample_loss(fsdp(*NestedWrappedModule.sample(4, gen))).mean().backward()
        optim.step()
        path = os.path.join(root, "mixed" + ("-offload" if "move_params_to_cpu" in kwargs else ""))
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
        expected = {k: v.clone() for k, v in fsdp.local_state_dict().items()}
        expected_state = snapshot(fsdp, optim)["state"]
        model, _ = build(NestedWrappedModule, 8)
        other = wrap_model(model, dict(kwargs), "nested")
        other_optim = torch.optim.Adam(other.parameters(), lr=0.5)
        fsdp_dcp.load(other, other_optim, checkpoint_id=path)
        got = other.local_state_dict()
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{kwargs}: {key}"
        state = snapshot(other, other_optim)["state"]
        for i, entry in expected_state.items():
            for key, value in entry.items():
                assert torch.equal(state[i][key], value), f"{kwargs}: optimizer state {i} {key}"


def _case_failed_read_changes_nothing(root: str, rank: int) -> None:
    fsdp, optim = trained(seed=1, mode="nested")
    path = os.path.join(root, "good")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    truncated = os.path.join(root, "truncated")
    if rank == 0:
        shutil.copytree(path, truncated)
        data = os.path.join(truncated, "__1_0.distcp")
        os.truncate(data, os.path.getsize(data) // 2)
    dist.barrier()
    for mode in ("nested", "leaf"):  # the same layout (whole chunks) and another one (resharded by DCP)
        other, other_optim = trained(seed=3, mode=mode)  # a trained optimizer: its state must stay bit-identical
        expect_failed_load(other, other_optim, "reading the checkpoint", checkpoint_id=truncated)
        expect_failed_load(
            other, other_optim, "injected", checkpoint_id=path, storage_reader=FailingAfterReadReader(path)
        )
        other, other_optim = fresh(seed=4, mode=mode)  # a fresh optimizer: no state after the failure either
        expect_failed_load(
            other, other_optim, "injected", checkpoint_id=path, storage_reader=FailingAfterReadReader(path)
        )
        fsdp_dcp.load(other, other_optim, checkpoint_id=path)  # the good checkpoint still loads afterwards
        assert_same(other.state_dict(), fsdp.state_dict(), f"{mode}: loaded after the failures")


def _case_zero_size_parameter(root: str, rank: int) -> None:
    for flatten in (True, False):
        torch.manual_seed(1)
        fsdp = FSDP(WithEmpty(), flatten_parameters=flatten)
        optim = torch.optim.Adam(fsdp.parameters(), lr=0.1)
        fsdp(torch.randn(2, 3, generator=torch.Generator().manual_seed(0))).sum().backward()
        optim.step()
        path = os.path.join(root, f"empty-{flatten}")
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
        torch.manual_seed(2)
        other = FSDP(WithEmpty(), flatten_parameters=flatten)
        other_optim = torch.optim.Adam(other.parameters(), lr=0.5)
        fsdp_dcp.load(other, other_optim, checkpoint_id=path)
        assert_same(other.state_dict(), fsdp.state_dict(), f"flatten_parameters={flatten}")
        expected = full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim))
        assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(other, other_optim)), expected, "optimizer")


class WithUnused(nn.Module):
    """A nested instance that never gets a gradient, so its optimizer has no state for it when the model is saved."""

    def __init__(self, flatten: bool) -> None:
        super().__init__()
        self.used = FSDP(nn.Linear(3, 3), flatten_parameters=flatten)
        self.unused = FSDP(nn.Linear(3, 3), flatten_parameters=flatten)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def _unused_model(seed: int, flatten: bool) -> Tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    fsdp = FSDP(WithUnused(flatten), flatten_parameters=flatten)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.1)


def _unused_steps(fsdp: Any, optim: Any, steps: range, rank: int) -> None:
    for step in steps:
        optim.zero_grad()
        fsdp(torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + rank))).pow(2).sum().backward()
        optim.step()


def _case_parameters_without_saved_optimizer_state(root: str, rank: int) -> None:
    # A fresh optimizer gets state for every parameter at the load (a step over zero gradients): DCP then looked for
    # the unused instance's state in the checkpoint and refused the whole load ("Missing key in checkpoint
    # state_dict: optimizer.state.unused.weight.step"). They are left without state, as in the saved run.
    for flatten in (True, False):
        fsdp, optim = _unused_model(0, flatten)
        _unused_steps(fsdp, optim, range(2), rank)
        path = os.path.join(root, f"unused-{flatten}")
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
        _unused_steps(fsdp, optim, range(2, 4), rank)
        for trained_first in (False, True):  # a fresh optimizer, and one that has stepped the unused one since
            other, other_optim = _unused_model(5, flatten)
            if trained_first:
                other_optim.zero_grad()
                other(torch.randn(2, 3)).sum().backward()
                other.module.unused(torch.randn(2, 3)).sum().backward()
                other_optim.step()
            fsdp_dcp.load(other, other_optim, checkpoint_id=path)
            assert len(other_optim.state) == len([p for p in fsdp.parameters() if p in optim.state]), flatten
            _unused_steps(other, other_optim, range(2, 4), rank)
            assert_same(other.state_dict(), fsdp.state_dict(), f"flatten_parameters={flatten}, resumed")


def whole_on_this_rank(value: Tensor) -> Any:
    """A ShardedTensor whose one local shard is the whole tensor (valid for ShardedTensor, not a flat shard's boxes)."""
    md = ShardMetadata([0] * value.dim(), list(value.shape), f"rank:{dist.get_rank()}/cpu")
    props = TensorProperties(dtype=value.dtype, layout=torch.strided, requires_grad=False, pin_memory=False)
    global_md = ShardedTensorMetadata([md], value.shape, props)
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(value.clone(), md)], global_md)


def _case_foreign_sharded_tensors_refused(root: str, rank: int) -> None:
    """Only the boxes of this rank's own shard load as ShardedTensors; other ones raise on every rank, change nothing."""
    fsdp, optim = trained(seed=1, mode="nested")
    other, other_optim = trained(seed=3, mode="leaf")
    before = snapshot(other, other_optim)
    foreign = {k: whole_on_this_rank(v) for k, v in fsdp.state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)failed on rank\(s\) \[0, 1\].*not the pieces of this rank's flat shard"):
        fsdp_dcp.set_model_state_dict(other, foreign)
    assert_unchanged(other, other_optim, before, "after foreign ShardedTensors")


def _frozen_first_layer() -> Tuple[FSDP, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net[0].requires_grad_(False)  # a frozen base (LoRA-style)
    net[1] = FSDP(net[1])
    fsdp = FSDP(net)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.01)


def _case_ignore_frozen_params_round_trip(root: str, rank: int) -> None:
    # The optimizer dict left the frozen names out of its groups (torch keeps them, dropping their state only), and
    # this very model's load refused it: "no saved parameter group holds '0.weight'" (a fuzz of DCP, session 45).
    options = torch_dsd.StateDictOptions(ignore_frozen_params=True, strict=False)
    fsdp, optim = _frozen_first_layer()
    _unused_steps(fsdp, optim, range(2), rank)
    sd, osd = fsdp_dcp.get_state_dict(fsdp, optim, options=options)
    assert osd["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert "0.weight" not in sd and "0.weight" not in osd["state"]
    other, other_optim = _frozen_first_layer()
    _unused_steps(other, other_optim, range(5, 6), rank)
    fsdp_dcp.set_state_dict(other, other_optim, model_state_dict=sd, optim_state_dict=osd, options=options)
    _unused_steps(fsdp, optim, range(2, 4), rank)
    _unused_steps(other, other_optim, range(2, 4), rank)
    assert_same(other.state_dict(), fsdp.state_dict(), "resumed after a load without the frozen parameters")


def _two_ranks(rank: int, world_size: int, root: str) -> None:
    cases = [
        _case_same_layout_reads_whole_chunks,
        _case_default_reader_alternates_chunk_sizes,
        _case_fsdp2_checkpoint,
        _case_mixed_precision_and_cpu_offload,
        _case_failed_read_changes_nothing,
        _case_one_rank_checkpoint,
        _case_zero_size_parameter,
        _case_foreign_sharded_tensors_refused,
        _case_parameters_without_saved_optimizer_state,
        _case_ignore_frozen_params_round_trip,
    ]
    run_cases([(case.__name__[len("_case_") :], _bind(case, root, rank)) for case in cases])


def _bind(case: Any, root: str, rank: int) -> Any:
    return lambda: case(root, rank)


def test_two_ranks(tmp_path: Any) -> None:
    root = str(tmp_path)
    run_distributed(_save_at_one_rank, 1, root)
    run_distributed(_two_ranks, 2, root)


# ------------------------------------------------------------------------------------------------------ world sizes


def _save_at_one_rank(rank: int, world_size: int, root: str) -> None:
    fsdp, optim = trained(seed=9, mode="leaf")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=os.path.join(root, "ws1"))
    torch.save(
        {
            "model": full_model(fsdp_dcp.get_model_state_dict(fsdp)),
            "optim": full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim)),
        },
        os.path.join(root, "ws1.pt"),
    )


def _case_one_rank_checkpoint(root: str, rank: int) -> None:
    """A checkpoint of one rank (one box per parameter) loads at two, resharded by DCP, without an exchange."""
    expected: Dict[str, Any] = torch.load(os.path.join(root, "ws1.pt"), weights_only=False)
    fsdp, optim = fresh(seed=10, mode="nested")
    with count_collectives() as counter:
        fsdp_dcp.load(fsdp, optim, checkpoint_id=os.path.join(root, "ws1"))
    assert counter.count("all_to_all") == 0, counter.summary()
    assert_same(full_model(fsdp_dcp.get_model_state_dict(fsdp)), expected["model"], "1 -> 2 ranks: model")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim)), expected["optim"], "1 -> 2 ranks")
