# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP checkpoints of hybrid sharding (:mod:`fairscale.nn.data_parallel.dcp` with ``replicate_process_group``).

The layout is FSDP2 HSDP's: ``(Replicate(), Shard(0))`` DTensors over a 2-D ``("replicate", "shard")`` mesh. World 4
= shard groups {0, 1}, {2, 3} x replicate groups {0, 2}, {1, 3} (``hybrid_groups(2)``), on CPU with gloo and Adam.

One 4-rank world (the module fixture) trains a hybrid model for two steps, saves a DCP checkpoint and goes on for
three more steps uninterrupted: the reference. Other worlds load that checkpoint into a hybrid model (another
wrapping), full sharding over 4 and over 2 ranks, FSDP2 HSDP, plain FSDP2 over 4 and the plain module, and continue.
A 2 x 2 hybrid model sums every gradient element over two ranks twice (commutative, so exact in any order), as FSDP2
HSDP does: those continue bit-exactly; full sharding over 4 ranks and the plain module sum in another order (close).
Also: an FSDP2 HSDP checkpoint resumes here, the checkpoint holds one replica's chunks (DCP deduplicates the
replicas), and a bad dict on one replica raises on every rank and changes nothing.
"""

import os
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dcp_harness import Saved, assert_close, assert_same, assert_same_optim, run_named_cases
from _models import build, wrap_model
from test_fsdp_dcp import (
    MODEL,
    SAVED_AT,
    STEPS,
    check_scalar_parameter,
    directory_bytes,
    fsdp2_load,
    fsdp2_state,
    full_model,
    full_optim,
    load_plain_module,
    record_reference,
    shard_like_fairscale,
    skip_unless_fsdp2_runs_on_cpu,
    train,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import dcp as fsdp_dcp
from fairscale.nn.data_parallel import hybrid_groups

try:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import state_dict as torch_dsd
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without FSDP2
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None, reason="needs torch with FSDP2 (fully_shard) and DTensor")

TIMEOUT = 420.0  # 4 processes on a small shared CI machine
RANKS_PER_NODE = 2
MESH_DIMS = ("replicate", "shard")
GRID = [[0, 1], [2, 3]]  # hybrid_groups(2): mesh[i][j] = the rank with replicate index i and shard index j


# ------------------------------------------------------------------------------------------------------ helpers

Groups = Tuple[Any, Any]  # (shard group, replicate group); (None, None): full sharding over the world


def fairscale_model(seed: int, mode: str, groups: Groups, **kwargs: Any) -> Tuple[FSDP, torch.optim.Optimizer]:
    model, _ = build(MODEL, seed)
    fsdp = wrap_model(model, dict(kwargs, process_group=groups[0], replicate_process_group=groups[1]), mode)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.5)  # lr and state come from the checkpoint


def fsdp2_model(seed: int, mesh: Any) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 over ``mesh``: 1-D (full sharding) or 2-D ``("replicate", "shard")`` (HSDP)."""
    skip_unless_fsdp2_runs_on_cpu()
    torch.manual_seed(seed)
    model = MODEL()
    shard_like_fairscale(model, mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def fsdp2_full(model: nn.Module) -> Dict[str, Tensor]:
    return full_model(torch_dsd.get_model_state_dict(model))


def data_bytes(path: str) -> int:
    """The bytes of a DCP checkpoint's data files (without its ``.metadata``)."""
    return directory_bytes(path) - os.path.getsize(os.path.join(path, ".metadata"))


def optimizer_state(optim: torch.optim.Optimizer) -> Dict[Any, Dict[str, Tensor]]:
    """A copy of the optimizer's local (flat) state."""
    return {i: {k: v.clone() for k, v in entry.items()} for i, entry in optim.state_dict()["state"].items()}


# ------------------------------------------------------------------------------------------------------ reference


def _save_reference(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    fsdp, _ = fairscale_model(1, "nested", hybrid_groups(RANKS_PER_NODE))
    return record_reference(fsdp, os.path.join(root, "hybrid"), rank, world_size)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    root = str(tmp_path_factory.mktemp("dcp_hybrid"))
    return Saved(root, **run_distributed(_save_reference, 4, root, timeout=TIMEOUT)[0])


# ------------------------------------------------------------------------------------------------------ 4 ranks


@dataclass
class World:
    """What the cases of one 4-rank world share: its groups and meshes (each created once, on every rank)."""

    saved: Saved
    rank: int
    world_size: int
    hybrid: Groups
    hsdp_mesh: Any
    flat_mesh: Any


def _case_layout(w: World) -> None:
    """FSDP2 HSDP's layout: (Replicate(), Shard(0)) over the (replicate, shard) grid; values as the full state."""
    fsdp, optim = fairscale_model(3, "nested", w.hybrid)
    fsdp_dcp.load(fsdp, optim, checkpoint_id=w.saved.path("hybrid"))
    msd = fsdp_dcp.get_model_state_dict(fsdp)
    assert list(msd) == list(fsdp.state_dict())
    shard_rank = w.rank % RANKS_PER_NODE
    for name, value in msd.items():
        assert isinstance(value, DTensor) and value.placements == (Replicate(), Shard(0)), (name, value)
        assert value.device_mesh.mesh.tolist() == GRID, (name, value.device_mesh)
        assert value.device_mesh.mesh_dim_names == MESH_DIMS, name
        rows = value.shape[0]
        chunk = -(-rows // RANKS_PER_NODE)
        expected_rows = max(0, min(rows, (shard_rank + 1) * chunk) - min(rows, shard_rank * chunk))
        assert value.to_local().shape == (expected_rows,) + tuple(value.shape[1:]), (name, value.to_local().shape)
    assert_same(full_model(msd), w.saved.model, "model state dict")
    osd = fsdp_dcp.get_optimizer_state_dict(fsdp, optim)
    for name, entry in osd["state"].items():
        assert isinstance(entry["exp_avg"], DTensor) and entry["exp_avg"].placements == (Replicate(), Shard(0)), name
        assert isinstance(entry["step"], Tensor) and not isinstance(entry["step"], DTensor), name
    assert_same_optim(full_optim(osd), w.saved.optim, "optimizer state dict")


def _case_one_copy_on_disk(w: World) -> None:
    """DCP writes every chunk once: one replica's pieces of its flat shards (at most 2 * ndim - 1 boxes per shard-group
    rank) tile each tensor without overlap, and the data files hold exactly the items of the metadata, once each (a
    replica's duplicate would add its bytes)."""
    path = w.saved.path("hybrid")
    metadata = FileSystemReader(path).read_metadata()
    tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    for key, meta in tensors.items():
        assert sum(c.sizes.numel() for c in meta.chunks) == meta.size.numel(), (key, meta.chunks)
        if key.startswith("model.") or key.endswith(("exp_avg", "exp_avg_sq")):
            assert 1 <= len(meta.chunks) <= RANKS_PER_NODE * max(1, 2 * len(meta.size) - 1), (key, meta.chunks)
    written = {(index.fqn, tuple(index.offset or ())) for index in metadata.storage_data}
    assert {(key, tuple(c.offsets)) for key, meta in tensors.items() for c in meta.chunks} <= written
    payload = sum(int(info.length) for info in metadata.storage_data.values())
    assert data_bytes(path) == payload, (data_bytes(path), payload)


def _case_hybrid_rewrapped_continues(w: World) -> None:
    """Hybrid, another wrapping (flat parameters cut elsewhere): resumes and trains exactly as the reference."""
    fsdp, optim = fairscale_model(4, "leaf", w.hybrid)
    fsdp_dcp.load(fsdp, optim, checkpoint_id=w.saved.path("hybrid"))
    assert_same(fsdp.state_dict(), w.saved.model, "hybrid leaf: loaded")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim)), w.saved.optim, "hybrid optim")
    train(fsdp, optim, range(SAVED_AT, STEPS), w.rank, w.world_size)
    assert_same(fsdp.state_dict(), w.saved.after, "hybrid leaf: after training on")


def _case_full_sharding_over_4(w: World) -> None:
    """Full sharding over the 4 ranks: loads exactly, continues to rounding (the gradients sum in another order)."""
    fsdp, optim = fairscale_model(5, "nested", (None, None))
    fsdp_dcp.load(fsdp, optim, checkpoint_id=w.saved.path("hybrid"))
    assert_same(fsdp.state_dict(), w.saved.model, "full sharding at 4: loaded")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim)), w.saved.optim, "full at 4: optim")
    train(fsdp, optim, range(SAVED_AT, STEPS), w.rank, w.world_size)
    assert_close(fsdp.state_dict(), w.saved.after, "full sharding at 4 vs the hybrid run")


def _case_fsdp2_hsdp_loads_and_continues(w: World) -> None:
    """torch FSDP2 HSDP, with torch's own functions, resumes the hybrid checkpoint bit-exactly."""
    model, optim = fsdp2_model(6, w.hsdp_mesh)
    fsdp2_load(model, optim, w.saved.path("hybrid"))
    assert_same(fsdp2_full(model), w.saved.model, "FSDP2 HSDP loaded")
    assert_same_optim(full_optim(torch_dsd.get_optimizer_state_dict(model, optim)), w.saved.optim, "HSDP optimizer")
    train(model, optim, range(SAVED_AT, STEPS), w.rank, w.world_size)
    assert_same(fsdp2_full(model), w.saved.after, "FSDP2 HSDP after training on")


def _case_fsdp2_over_4_loads_and_continues(w: World) -> None:
    """Plain FSDP2 over the 4 ranks (1-D mesh) resumes the hybrid checkpoint (to rounding: another reduction)."""
    model, optim = fsdp2_model(7, w.flat_mesh)
    fsdp2_load(model, optim, w.saved.path("hybrid"))
    assert_same(fsdp2_full(model), w.saved.model, "FSDP2 over 4 loaded")
    train(model, optim, range(SAVED_AT, STEPS), w.rank, w.world_size)
    assert_close(fsdp2_full(model), w.saved.after, "FSDP2 over 4 after training on")


def _case_hsdp_checkpoint_loads_into_hybrid(w: World) -> None:
    """A checkpoint written by FSDP2 HSDP (one more step) resumes in fairscale hybrid bit-exactly; HSDP's dicts in
    memory load too (the same 2-D layout over the same shard groups)."""
    model, optim = fsdp2_model(6, w.hsdp_mesh)
    fsdp2_load(model, optim, w.saved.path("hybrid"))
    train(model, optim, range(SAVED_AT, SAVED_AT + 1), w.rank, w.world_size)
    path = w.saved.path("fsdp2-hsdp")
    dcp.save(fsdp2_state(model, optim), checkpoint_id=path)
    # FSDP2's dicts are views of its live parameters and state: load them before it trains on.
    in_memory = fsdp2_state(model, optim)
    other, other_optim = fairscale_model(9, "nested", w.hybrid)
    fsdp_dcp.set_state_dict(
        other, other_optim, model_state_dict=in_memory["model"], optim_state_dict=in_memory["optimizer"]
    )
    assert_same(other.state_dict(), fsdp2_full(model), "FSDP2 HSDP's dicts in memory")
    train(model, optim, range(SAVED_AT + 1, STEPS), w.rank, w.world_size)
    expected = fsdp2_full(model)
    train(other, other_optim, range(SAVED_AT + 1, STEPS), w.rank, w.world_size)
    assert_same(other.state_dict(), expected, "fairscale hybrid after FSDP2 HSDP's dicts in memory")
    fsdp, fsdp_optim = fairscale_model(8, "leaf", w.hybrid)
    fsdp_dcp.load(fsdp, fsdp_optim, checkpoint_id=path)
    train(fsdp, fsdp_optim, range(SAVED_AT + 1, STEPS), w.rank, w.world_size)
    assert_same(fsdp.state_dict(), expected, "fairscale hybrid after FSDP2 HSDP's checkpoint")


def _case_refuses_other_layouts(w: World) -> None:
    """In-memory dicts of another sharding raise on every rank (dcp.load into the model's own dicts reshards):
    FSDP2 over 4 ranks into hybrid, FSDP2 HSDP into full sharding over 4."""
    flat, flat_optim = fsdp2_model(7, w.flat_mesh)
    fsdp2_load(flat, flat_optim, w.saved.path("hybrid"))
    fsdp, _ = fairscale_model(10, "nested", w.hybrid)
    before = fsdp.state_dict()
    with pytest.raises(ValueError, match=r"is sharded over ranks \[0, 1, 2, 3\] but this model shards over"):
        fsdp_dcp.set_model_state_dict(fsdp, torch_dsd.get_model_state_dict(flat))
    assert_same(fsdp.state_dict(), before, "hybrid after a refused FSDP2 dict")
    hsdp, hsdp_optim = fsdp2_model(6, w.hsdp_mesh)
    fsdp2_load(hsdp, hsdp_optim, w.saved.path("hybrid"))
    full, _ = fairscale_model(11, "nested", (None, None))
    with pytest.raises(ValueError, match=r"is sharded over ranks \[[02], [13]\] but this model shards over"):
        fsdp_dcp.set_model_state_dict(full, torch_dsd.get_model_state_dict(hsdp))


def _case_bad_dict_on_one_replica(w: World) -> None:
    """A dict that is wrong on one rank of one replica only raises on every rank (both replicas) and changes neither
    the model nor the optimizer anywhere; the same dicts, correct everywhere, then load."""
    fsdp, optim = fairscale_model(3, "nested", w.hybrid)
    fsdp_dcp.load(fsdp, optim, checkpoint_id=w.saved.path("hybrid"))
    model_before, optim_before = fsdp.state_dict(), optimizer_state(optim)
    msd, osd = fsdp_dcp.get_state_dict(fsdp, optim)
    msd = {k: v * 2 for k, v in msd.items()}  # a load that went through would change every parameter
    for entry in osd["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1
    name = "layers.0.weight"
    for bad_rank, broken in ((3, "model"), (2, "optimizer")):
        bad_msd, bad_osd = dict(msd), {"state": dict(osd["state"]), "param_groups": osd["param_groups"]}
        if w.rank == bad_rank and broken == "model":
            bad_msd[name] = torch.zeros(3, 3)
        if w.rank == bad_rank and broken == "optimizer":
            del bad_osd["state"][name]
        with pytest.raises(ValueError, match=rf"failed on rank\(s\) \[{bad_rank}\]"):
            fsdp_dcp.set_state_dict(fsdp, optim, model_state_dict=bad_msd, optim_state_dict=bad_osd)
        assert_same(fsdp.state_dict(), model_before, f"model after a bad {broken} dict on rank {bad_rank}")
        for i, entry in optimizer_state(optim).items():
            assert_same(entry, optim_before[i], f"optimizer after a bad {broken} dict on rank {bad_rank}")
    fsdp_dcp.set_state_dict(fsdp, optim, model_state_dict=msd, optim_state_dict=osd)
    assert_same(fsdp.state_dict(), {k: v * 2 for k, v in model_before.items()}, "the good dicts load")


def _case_scalar_parameter(w: World) -> None:
    """A 0-dim parameter is (Replicate(), Replicate()); it and its optimizer state round-trip, flattened or not."""
    groups = dict(process_group=w.hybrid[0], replicate_process_group=w.hybrid[1])
    check_scalar_parameter(
        w.saved.path("scalar"), (Replicate(), Replicate()), torch.Generator().manual_seed(w.rank), **groups
    )


def _four_ranks(rank: int, world_size: int, saved: Saved) -> None:
    # Every group and mesh is created once, in the same order on every rank (new_group is collective).
    w = World(
        saved,
        rank,
        world_size,
        hybrid_groups(RANKS_PER_NODE),
        init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_DIMS),
        init_device_mesh("cpu", (world_size,)),
    )
    cases = [
        _case_layout,
        _case_one_copy_on_disk,
        _case_hybrid_rewrapped_continues,
        _case_full_sharding_over_4,
        _case_fsdp2_hsdp_loads_and_continues,
        _case_fsdp2_over_4_loads_and_continues,
        _case_hsdp_checkpoint_loads_into_hybrid,
        _case_refuses_other_layouts,
        _case_bad_dict_on_one_replica,
        _case_scalar_parameter,
    ]
    run_named_cases(cases, w)


def test_four_ranks(saved: Saved) -> None:
    run_distributed(_four_ranks, 4, saved, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ 2 ranks


def _two_ranks(rank: int, world_size: int, saved: Saved) -> None:
    """Full sharding over 2 ranks and the plain module resume the 2 x 2 checkpoint (to rounding), which takes the
    room of one replica."""
    fsdp, optim = fairscale_model(3, "nested", (None, None))
    fsdp_dcp.load(fsdp, optim, checkpoint_id=saved.path("hybrid"))
    assert_same(fsdp.state_dict(), saved.model, "full sharding at 2: loaded")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim)), saved.optim, "full at 2: optim")
    # The same state from 2 ranks without replicas (the same Shard(0) chunks) takes the same room as the 2 x 2
    # checkpoint: DCP wrote one replica's chunks.
    path = saved.path("full-ws2")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    ours, one_replica = data_bytes(saved.path("hybrid")), data_bytes(path)
    assert abs(ours - one_replica) <= 0.05 * one_replica, (ours, one_replica)
    train(fsdp, optim, range(SAVED_AT, STEPS), rank, world_size)
    assert_close(fsdp.state_dict(), saved.after, "full sharding at 2 vs the hybrid run")
    # The plain module on every rank.
    plain, plain_optim = load_plain_module(saved, "hybrid")
    train(plain, plain_optim, range(SAVED_AT, STEPS), 0, 1)
    assert_close(plain.state_dict(), saved.after, "plain module vs the hybrid run")


def test_two_ranks_and_the_plain_module(saved: Saved) -> None:
    run_distributed(_two_ranks, 2, saved, timeout=TIMEOUT)
