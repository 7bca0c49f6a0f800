# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``fsdp_dcp.save``/``load`` of models sharded over a data-parallel group of tensor parallelism (``process_group``).

Four ranks as two tensor-parallel ranks times two data-parallel ranks (Megatron's numbering: the model-parallel rank
is ``rank % 2``, the data-parallel groups are ``{0, 2}`` and ``{1, 3}``). Each model-parallel rank has its own weights
(its slice of the model), sharded over its data-parallel group; each group writes its own directory at the same time.
Reference: the models' full ``state_dict()`` and optimizer states before the save. Without ``process_group`` the world
is the checkpoint's group, and such a model is refused (the groups' shards would overwrite each other).
"""

import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from _models import NestedWrappedModule, build, wrap_model

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import dcp as fsdp_dcp
from fairscale.nn.data_parallel._fsdp import dcp_layout

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - old torch
    DTensor = None

pytestmark = pytest.mark.skipif(DTensor is None, reason="needs torch with DTensor and torch.distributed.checkpoint")
# Before torch 2.7, DCP cannot work over the group {1, 3} (pytorch/pytorch#141825): save and load refuse it there
# (_case_torch_without_subgroup_coordinators), and the round trips need a newer torch.
needs_dcp_subgroups = pytest.mark.skipif(
    DTensor is not None and not dcp_layout._dcp_takes_subgroups(),
    reason="this torch's DCP cannot save over a group without global rank 0 (pytorch/pytorch#141825)",
)


def _groups() -> Tuple[int, Any, Any]:
    """This rank's model-parallel rank, its data-parallel group, and the other data-parallel group (every rank
    creates both, in the same order: ``new_group`` is collective)."""
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mp_rank = dist.get_rank() % 2
    return mp_rank, dp[mp_rank], dp[1 - mp_rank]


def _trained(mp_rank: int, group: Any, seed: int) -> Tuple[FSDP, torch.optim.Optimizer]:
    """A model of this model-parallel rank's own weights (seed and data depend on it), one Adam step taken."""
    model, _ = build(NestedWrappedModule, seed + 10 * mp_rank)
    fsdp = wrap_model(model, {"process_group": group}, "nested")
    optim = torch.optim.Adam(fsdp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed + 10 * mp_rank + dist.get_rank())
    NestedWrappedModule.per_sample_loss(fsdp(*NestedWrappedModule.sample(4, gen))).mean().backward()
    optim.step()
    return fsdp, optim


def _step(fsdp: FSDP, optim: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    optim.zero_grad()
    NestedWrappedModule.per_sample_loss(fsdp(*NestedWrappedModule.sample(4, gen))).mean().backward()
    optim.step()


def _fresh(mp_rank: int, group: Any, mode: str = "leaf") -> Tuple[FSDP, torch.optim.Optimizer]:
    model, _ = build(NestedWrappedModule, 99 + mp_rank)
    fsdp = wrap_model(model, {"process_group": group}, mode)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.5)


def _full(fsdp: FSDP, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """The full model state and the per-parameter optimizer states by name (collective over the model's group)."""
    osd = fsdp_dcp.get_optimizer_state_dict(fsdp, optim)
    return {
        "model": {k: v.clone() for k, v in fsdp.state_dict().items()},
        "optim": {name: {k: _full_tensor(v) for k, v in s.items()} for name, s in osd["state"].items()},
        "lr": [g["lr"] for g in osd["param_groups"]],
    }


def _full_tensor(value: Any) -> Any:
    """A DTensor state gathered over its mesh (collective), a plain one copied."""
    return value.full_tensor() if isinstance(value, DTensor) else value.clone()


def _assert_equal(got: Dict[str, Any], want: Dict[str, Any], what: str) -> None:
    assert list(got["model"]) == list(want["model"]), what
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"{what}: {key}"
    assert sorted(got["optim"]) == sorted(want["optim"]), what
    for name, entry in want["optim"].items():
        for key, value in entry.items():
            assert torch.equal(got["optim"][name][key], value), f"{what}: optimizer state {name}.{key}"
    assert got["lr"] == want["lr"], what


def _save_per_group(rank: int, world_size: int, root: str) -> None:
    mp_rank, group, _ = _groups()
    fsdp, optim = _trained(mp_rank, group, seed=1)
    want = _full(fsdp, optim)
    path = os.path.join(root, f"mp-{mp_rank}")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path, process_group=group)
    if dist.get_rank(group) == 0:
        torch.save(want, os.path.join(root, f"want-{mp_rank}.pt"))
    # Loaded into another wrapping of the same ranks: each group gets its own weights back, not the other's.
    other, other_optim = _fresh(mp_rank, group)
    assert not torch.equal(other.state_dict()["layers.0.weight"], want["model"]["layers.0.weight"])
    result = fsdp_dcp.load(other, other_optim, checkpoint_id=path, process_group=group)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == [], result
    _assert_equal(_full(other, other_optim), want, f"mp rank {mp_rank}, group {dist.get_process_group_ranks(group)}")
    # An async save over the old checkpoint (overwrite: the group's rank 0, global rank 0 or 1, removes .metadata).
    _step(other, other_optim, seed=2)
    want_after = _full(other, other_optim)
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        fsdp_dcp.save(other, other_optim, checkpoint_id=path, process_group=group)
    fsdp_dcp.async_save(other, other_optim, checkpoint_id=path, overwrite=True, process_group=group).result()
    third, third_optim = _fresh(mp_rank, group, mode="nested")
    fsdp_dcp.load(third, third_optim, checkpoint_id=path, process_group=group)
    _assert_equal(_full(third, third_optim), want_after, f"mp rank {mp_rank}: async_save with overwrite")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=True, process_group=group)  # for _load_on_one_rank
    dist.barrier()


def _load_on_one_rank(rank: int, world_size: int, root: str) -> None:
    """Each group's checkpoint at another world size (one rank, the world as the group)."""
    for mp_rank in (0, 1):
        fsdp, optim = _fresh(mp_rank, None, mode="nested")
        fsdp_dcp.load(fsdp, optim, checkpoint_id=os.path.join(root, f"mp-{mp_rank}"))
        want = torch.load(os.path.join(root, f"want-{mp_rank}.pt"), weights_only=True)
        _assert_equal(_full(fsdp, optim), want, f"mp rank {mp_rank} on one rank")


@needs_dcp_subgroups
def test_a_checkpoint_per_data_parallel_group(tmp_path: Any) -> None:
    run_distributed(_save_per_group, 4, str(tmp_path))
    files: List[str] = sorted(os.listdir(tmp_path))
    assert [f for f in files if f.startswith("mp-")] == ["mp-0", "mp-1"], files
    run_distributed(_load_on_one_rank, 1, str(tmp_path))


# ------------------------------------------------------------------------------------------------------ misuse


def _case_world_for_a_subgroup_model(root: str) -> None:
    """Without process_group the checkpoint is the world's: a model on a subgroup is refused, before anything is
    written, with the way out in the message."""
    mp_rank, group, _ = _groups()
    fsdp, optim = _trained(mp_rank, group, seed=3)
    path = os.path.join(root, "world")
    for fn in (fsdp_dcp.save, fsdp_dcp.async_save, fsdp_dcp.load):
        with pytest.raises(ValueError, match="do not make up the world's 4 ranks.*Pass process_group="):
            fn(fsdp, optim, checkpoint_id=path)
    assert not os.path.exists(path)


def _case_group_that_is_not_the_models(root: str) -> None:
    """The other data-parallel group (this rank is not in it), or the world for a subgroup model: refused."""
    mp_rank, group, other = _groups()
    fsdp, optim = _trained(mp_rank, group, seed=4)
    path = os.path.join(root, f"wrong-{mp_rank}")
    with pytest.raises(ValueError, match=r"this rank \(\d\) is not in process_group"):
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path, process_group=other)
    world = dist.new_group([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"process_group holds ranks \[0, 1, 2, 3\] but the model shards over ranks"):
        fsdp_dcp.load(fsdp, optim, checkpoint_id=path, process_group=world)
    assert not os.path.exists(path)


def _case_world_model_with_its_group(root: str) -> None:
    """A model on the world passes the world's group explicitly: the same as without process_group."""
    world = dist.new_group([0, 1, 2, 3])
    model, _ = build(NestedWrappedModule, 7)
    fsdp = wrap_model(model, {}, "nested")
    before = {k: v.clone() for k, v in fsdp.state_dict().items()}
    path = os.path.join(root, "explicit-world")
    fsdp_dcp.save(fsdp, checkpoint_id=path, process_group=world)
    other, _ = _fresh(0, None)
    fsdp_dcp.load(other, checkpoint_id=path)
    for key, value in before.items():
        assert torch.equal(other.state_dict()[key], value), key


def _case_torch_without_subgroup_coordinators(root: str) -> None:
    """A torch whose DCP takes a subgroup's rank 0 for global rank 0 (before 2.7): the group {1, 3} is refused on
    both its ranks before anything is written (its save failed inside DCP, or waited on a rank outside the group);
    the group {0, 2}, whose rank 0 is global rank 0, saves."""
    mp_rank, group, _ = _groups()
    fsdp, optim = _trained(mp_rank, group, seed=8)
    path = os.path.join(root, f"old-torch-{mp_rank}")
    takes_subgroups = dcp_layout._dcp_takes_subgroups
    dcp_layout._dcp_takes_subgroups = lambda: False  # what the check reads from an older torch's DCP source
    try:
        if mp_rank == 1:
            for fn in (fsdp_dcp.save, fsdp_dcp.load):
                with pytest.raises(NotImplementedError, match=r"first rank is not global rank 0 \(here 1\)"):
                    fn(fsdp, optim, checkpoint_id=path, process_group=group)
            assert not os.path.exists(path)
        else:
            fsdp_dcp.save(fsdp, optim, checkpoint_id=path, process_group=group)
            assert os.path.exists(os.path.join(path, ".metadata"))
    finally:
        dcp_layout._dcp_takes_subgroups = takes_subgroups


def _misuse(rank: int, world_size: int, root: str) -> None:
    cases = [_case_world_for_a_subgroup_model, _case_group_that_is_not_the_models, _case_world_model_with_its_group]
    cases.append(_case_torch_without_subgroup_coordinators)
    run_cases([(case.__name__[len("_case_") :], _Bound(case, root)) for case in cases])


class _Bound:
    """A case with its directory (a class, not a closure: spawned ranks pickle it)."""

    def __init__(self, case: Any, root: str) -> None:
        self.case, self.root = case, root

    def __call__(self) -> None:
        self.case(self.root)


def test_misuse(tmp_path: Any) -> None:
    run_distributed(_misuse, 4, str(tmp_path))


# ------------------------------------------------------------------------------------------------------ the docs


def _docs_block(rank: int, world_size: int, root: str) -> None:
    """docs/checkpointing.rst's tensor-parallel example, as written, with fairscale's model-parallel groups (model
    parallel size 2: data-parallel groups {0, 2} and {1, 3}): each group saves its directory and loads it back."""
    from test_fsdp_dcp_docs import _blocks  # tests/nn/data_parallel is on sys.path (its conftest)

    from fairscale.nn.model_parallel import initialize as mpu

    os.chdir(root)
    mpu.initialize_model_parallel(2)
    try:
        mp_rank, group = mpu.get_model_parallel_rank(), mpu.get_data_parallel_group()
        fsdp, optim = _trained(mp_rank, group, seed=6)
        want = _full(fsdp, optim)
        code = _blocks()[5]
        save, load = [line for line in code.splitlines() if "fsdp_dcp.save" in line or "fsdp_dcp.load" in line]
        ns = {
            "model": fsdp,
            "optim": optim,
            "step": 100,
            "fsdp_dcp": fsdp_dcp,
            "get_model_parallel_rank": mpu.get_model_parallel_rank,
            "get_data_parallel_group": mpu.get_data_parallel_group,
        }
        exec(compile(code.replace(load, ""), "docs/checkpointing.rst", "exec"), ns)  # the save
        dist.barrier()  # both groups saved
        assert sorted(os.listdir(os.path.join(root, "ckpt", "step-100"))) == ["mp-0", "mp-1"]
        ns["model"], ns["optim"] = _fresh(mp_rank, group)
        exec(compile(code.replace(save, ""), "docs/checkpointing.rst", "exec"), ns)  # the load
        _assert_equal(_full(ns["model"], ns["optim"]), want, f"the docs example, mp rank {mp_rank}")
    finally:
        mpu.destroy_model_parallel()


@needs_dcp_subgroups
def test_docs_example(tmp_path: Any) -> None:
    run_distributed(_docs_block, 4, str(tmp_path))
