# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Checkpoints of hybrid sharding (``replicate_process_group``, issue 29), on CPU with gloo.

World size 4 = shard groups {0, 1}, {2, 3} x replicate groups {0, 2}, {1, 3}. A hybrid model's full state dict is
the one full sharding and DDP reach; its local files carry the shard group's rank and size plus the replicate rank
and size, one replica's files make a whole checkpoint, and both full and local dicts load into plain full sharding
over the 4 ranks as well as into hybrid models. Optimizer state round-trips through the full optimizer state dict.
"""

import copy
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _models import ELEMENTWISE_TOL
from _group_net import DIM_IN, Net, batch, mb_loss
from test_fsdp_hybrid import build, cfg
from torch import Tensor

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import hybrid_groups
from fairscale.nn.data_parallel._fsdp import identity
from fairscale.nn.data_parallel._fsdp.metadata import reshard_full_state_dict
from fairscale.nn.data_parallel.consolidate import consolidate_checkpoint_dir

TIMEOUT = 150.0
STEPS = 2
ATOL, RTOL = ELEMENTWISE_TOL["fp32"]


# ------------------------------------------------------------------------------------------------------ helpers


def make(groups: Tuple[Any, Any], seed: int = 0) -> FSDP:
    """The nested test net; ``groups``: (process_group, replicate_process_group), (None, None) for full sharding."""
    model = build(cfg(), (groups[0], groups[1], None))
    if seed:
        # Other initial values than the trained models', so that a load that does nothing is caught.
        with model.summon_full_params():
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(generator=torch.Generator().manual_seed(seed))
    return model


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int, rank: int) -> float:
    loss = mb_loss(model(batch(i, 0, rank)))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def trained(groups: Tuple[Any, Any], rank: int) -> Tuple[FSDP, torch.optim.Optimizer]:
    model = make(groups)
    opt = adam(model)
    for i in range(STEPS):
        step(model, opt, i, rank)
    return model, opt


def trained_ddp(rank: int) -> Dict[str, Tensor]:
    torch.manual_seed(0)
    net = Net()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = adam(ddp)
    for i in range(STEPS):
        step(ddp, opt, i, rank)
    return copy.deepcopy(net.state_dict())


def assert_sd_equal(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str, exact: bool = True) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)} vs {sorted(expected)}"
    for k, v in expected.items():
        if exact:
            assert torch.equal(actual[k], v), f"{what} {k}: max diff {(actual[k] - v).abs().max()}"
        else:
            torch.testing.assert_close(actual[k], v, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} {k}: {m}")


def everyone(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_local(model: FSDP, path: str) -> None:
    torch.save({"weights": model.local_state_dict(), "meta": model.local_metadata_dict()}, path)


def load_file(path: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    ckpt = torch.load(path, weights_only=True)
    return ckpt["weights"], ckpt["meta"]


# ------------------------------------------------------------------------------------------------------ cases


class Cases:
    """Every case of the world, sharing one trained hybrid model (and its files) and the reference runs."""

    def __init__(self, rank: int, directory: str) -> None:
        self.rank = rank
        self.dir = directory
        self.hybrid = hybrid_groups(2)
        self.model, self.opt = trained(self.hybrid, rank)
        self.sd = self.model.state_dict()

    def path(self, rank: int, tag: str = "a") -> str:
        return os.path.join(self.dir, f"{tag}-ckpt-rank-{rank}.pt")

    def full_state_dict(self) -> None:
        """Equal to full sharding's and DDP's after the same training; bitwise the same on every rank."""
        full, _ = trained((None, None), self.rank)
        assert_sd_equal(self.sd, full.state_dict(), "vs full sharding", exact=False)
        assert_sd_equal(self.sd, trained_ddp(self.rank), "vs DDP", exact=False)
        for other in everyone(self.sd):
            assert_sd_equal(other, self.sd, "state_dict of another rank")

    def load_full_state_dict(self) -> None:
        """The full dict loads into plain full sharding over the 4 ranks and into a fresh hybrid model."""
        x = torch.randn(3, DIM_IN, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            expected = self.model(x)
        for name, groups in (("full sharding", (None, None)), ("hybrid", self.hybrid)):
            fresh = make(groups, seed=3)
            fresh.load_state_dict(self.sd)
            assert_sd_equal(fresh.state_dict(), self.sd, f"loaded into {name}")
            with torch.no_grad():
                assert torch.equal(fresh(x), expected), f"{name}: another output after loading"

    def local_identity(self) -> None:
        """rank / world_size are the shard group's; replicate_rank / replicate_world_size are recorded too."""
        meta = self.model.local_metadata_dict()
        ident = meta["checkpoint_identity"]
        assert ident["rank"] == self.rank % 2 and ident["world_size"] == 2, ident
        assert ident["replicate_rank"] == self.rank // 2 and ident["replicate_world_size"] == 2, ident
        assert identity.of_weights(self.model.local_state_dict()) == ident
        ids = {i["id"] for i in everyone(ident)}
        assert len(ids) == 1, f"the ranks of one checkpoint have different ids: {ids}"
        # Plain full sharding keeps the old format: no replicate fields.
        plain = make((None, None)).local_metadata_dict()["checkpoint_identity"]
        assert "replicate_rank" not in plain and plain["world_size"] == 4, plain

    def consolidate(self) -> None:
        """Either replica's two files make the whole checkpoint; all four files are refused (each shard twice)."""
        save_local(self.model, self.path(self.rank))
        # A directory per replica, named by the rank inside the shard group, as a user would save one replica.
        replica_dir = os.path.join(self.dir, f"replica-{self.rank // 2}")
        os.makedirs(replica_dir, exist_ok=True)
        save_local(self.model, os.path.join(replica_dir, f"ckpt-rank-{self.rank % 2}.pt"))
        dist.barrier()
        files = [load_file(self.path(r)) for r in range(4)]
        for replica in ((0, 1), (2, 3)):
            weights = [files[r][0] for r in replica]
            metas = [files[r][1] for r in replica]
            assert_sd_equal(FSDP.consolidate_shard_weights(weights, metas), self.sd, f"consolidated ranks {replica}")
        for replica in range(2):
            got = consolidate_checkpoint_dir(os.path.join(self.dir, f"replica-{replica}"))
            assert_sd_equal(got, self.sd, f"consolidate_checkpoint_dir of replica {replica}")
        with pytest.raises(
            ValueError, match=r"from replicas \[0, 1\] of a hybrid-sharded checkpoint: pass one replica"
        ):
            FSDP.consolidate_shard_weights([f[0] for f in files], [f[1] for f in files])
        dist.barrier()  # every rank has read the files before the next case writes others

    def reshard(self) -> None:
        """reshard_full_state_dict to 4 ranks loads into plain full sharding; to 2 ranks into hybrid (any replica)."""
        meta = self.model.local_metadata_dict()
        # Offline, once (each call makes a new checkpoint id): rank 0 reshards and every rank takes its file.
        weights4, weights2 = everyone(
            [reshard_full_state_dict(self.sd, meta, n)[0] if self.rank == 0 else None for n in (4, 2)]
        )[0]
        plain = make((None, None), seed=3)
        plain.load_local_state_dict(weights4[self.rank])
        assert_sd_equal(plain.state_dict(), self.sd, "resharded to 4, loaded into full sharding")
        fresh = make(self.hybrid, seed=3)
        fresh.load_local_state_dict(weights2[self.rank % 2])
        assert_sd_equal(fresh.state_dict(), self.sd, "resharded to 2, loaded into hybrid")

    def load_local(self) -> None:
        """Round trip; either replica's files load on both replicas; mismatched loads fail on every rank alike."""
        save_local(self.model, self.path(self.rank, "b"))
        dist.barrier()
        fresh = make(self.hybrid, seed=3)
        fresh.load_local_state_dict(load_file(self.path(self.rank, "b"))[0])
        assert_sd_equal(fresh.state_dict(), self.sd, "own file")
        # Replica 1 loads replica 0's files (the same shard index): the same model.
        for replica in (0, 1):
            fresh = make(self.hybrid, seed=3)
            fresh.load_local_state_dict(load_file(self.path(2 * replica + self.rank % 2, "b"))[0])
            assert_sd_equal(fresh.state_dict(), self.sd, f"replica {replica}'s files")
            with torch.no_grad():  # and the loaded replicas train on as one model
                x = batch(9, 0, self.rank)
                assert torch.equal(fresh(x), self.model(x))
        # Another shard index's file: refused on every rank, nothing changed.
        fresh = make(self.hybrid, seed=3)
        before = fresh.state_dict()
        with pytest.raises(RuntimeError) as err:
            fresh.load_local_state_dict(load_file(self.path(self.rank ^ 1, "b"))[0])
        messages = everyone(str(err.value))
        assert all(m == messages[0] for m in messages), messages
        assert_sd_equal(fresh.state_dict(), before, "after a refused load")
        dist.barrier()

    def load_local_other_checkpoint_on_one_replica(self) -> None:
        """Replica 1 loads a later checkpoint than replica 0: every rank (both replicas) refuses and rolls back."""
        later, later_opt = trained(self.hybrid, self.rank)
        step(later, later_opt, STEPS, self.rank)
        save_local(later, self.path(self.rank, "c"))
        dist.barrier()
        fresh = make(self.hybrid, seed=3)
        before = fresh.state_dict()
        tag = "b" if self.rank < 2 else "c"
        with pytest.raises(RuntimeError, match="different checkpoints"):
            fresh.load_local_state_dict(load_file(self.path(self.rank, tag))[0])
        assert_sd_equal(fresh.state_dict(), before, "after a refused load")
        dist.barrier()

    def optimizer(self) -> None:
        """gather_full_optim_state_dict / get_shard_from_optim_state_dict with Adam: the same as full sharding's,
        resumes a hybrid model exactly and a full-sharding model of 4 ranks within float tolerance."""
        original = copy.deepcopy(self.opt.state_dict())
        full_osd: Optional[Dict[str, Any]] = self.model.gather_full_optim_state_dict(self.opt)
        assert (full_osd is None) == (self.rank != 0), "the full optimizer state dict is returned on rank 0 only"
        plain, plain_opt = trained((None, None), self.rank)
        plain_osd = plain.gather_full_optim_state_dict(plain_opt)
        full_osd = everyone(full_osd)[0]
        if self.rank == 0:
            assert plain_osd is not None and sorted(plain_osd["state"]) == sorted(full_osd["state"])
            for pid, entry in plain_osd["state"].items():
                for key, value in entry.items():
                    if isinstance(value, Tensor):
                        torch.testing.assert_close(full_osd["state"][pid][key], value, atol=ATOL, rtol=RTOL)
        # This rank's shard, cut from the full dict, is bitwise its own optimizer state.
        shard = self.model.get_shard_from_optim_state_dict(full_osd)
        own = self.opt.state_dict()["state"]
        assert sorted(shard["state"]) == sorted(own)
        for pid, entry in own.items():
            for key, value in entry.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    assert torch.equal(shard["state"][pid][key], value), f"{pid} {key}"
        # Resume: a fresh hybrid model and a plain full-sharding one, both from the full dicts.
        resumed = []
        for groups in (self.hybrid, (None, None)):
            fresh = make(groups, seed=3)
            fresh.load_state_dict(self.sd)
            opt = adam(fresh)
            opt.load_state_dict(fresh.get_shard_from_optim_state_dict(full_osd))
            resumed.append((fresh, opt))
        ref, ref_opt = trained(self.hybrid, self.rank)  # the same run, continued without a checkpoint
        for i in range(STEPS, STEPS + 2):
            step(ref, ref_opt, i, self.rank)
            for fresh, opt in resumed:
                step(fresh, opt, i, self.rank)
        assert_sd_equal(resumed[0][0].state_dict(), ref.state_dict(), "hybrid resumed from the full optimizer state")
        assert_sd_equal(resumed[1][0].state_dict(), ref.state_dict(), "full sharding resumed", exact=False)
        for pid, entry in original["state"].items():
            assert_sd_equal(self.opt.state_dict()["state"][pid], entry, f"live optimizer state {pid} after gathering")


def _world(rank: int, world_size: int, directory: str) -> None:
    c = Cases(rank, directory)
    run_cases(
        [
            ("full_state_dict", c.full_state_dict),
            ("load_full_state_dict", c.load_full_state_dict),
            ("local_identity", c.local_identity),
            ("consolidate_one_replica", c.consolidate),
            ("reshard_full_state_dict", c.reshard),
            ("load_local_state_dict", c.load_local),
            ("load_local_other_checkpoint_on_one_replica", c.load_local_other_checkpoint_on_one_replica),
            ("optimizer_state", c.optimizer),
        ]
    )


def test_hybrid_checkpoints(tmp_path: Any) -> None:
    """Full and local state dicts, consolidation, resharding and optimizer state of a 2 x 2 hybrid model."""
    run_distributed(_world, 4, str(tmp_path), timeout=TIMEOUT)
