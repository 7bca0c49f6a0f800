# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP checkpoints of FSDP (:mod:`fairscale.nn.data_parallel.dcp`): FSDP2's layout, resharding across world sizes and
wrappings, torch FSDP2 interop both ways, training continued bit-exactly, and the plain module.

One 2-rank world (the module fixture) trains a fairscale model with Adam for two steps, saves a DCP checkpoint and
goes on for three more steps uninterrupted: the reference. Every other world loads that checkpoint (or one derived
from it) and continues; where the math is the same as the reference's (2 ranks: any wrapping, fairscale or FSDP2)
the parameters must be bit-exact, elsewhere (1 or 4 ranks: another reduction order) close. Error cases are in
``test_fsdp_dcp_faults.py``.
"""

import os
from typing import Any, Dict, Optional, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dcp_harness import Saved, assert_close, assert_same, assert_same_optim, run_named_cases
from _models import ModelWithBatchNorm, NestedWrappedModule, TransformerWithSharedParams, build, local_slice, wrap_model
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.collectives import count_collectives
from fairscale.internal.version import torch_version
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import dcp as fsdp_dcp
from fairscale.nn.data_parallel import get_fsdp_instances

try:
    from torch.distributed.checkpoint import state_dict as torch_dsd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - torch without FSDP2
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None, reason="needs torch with FSDP2 (fully_shard) and DTensor")

MODEL = NestedWrappedModule
GLOBAL_N = 8  # samples per step, split between the ranks
LR = 0.01
SAVED_AT = 2  # the checkpoint holds the state after steps 0 and 1
STEPS = 5  # the reference goes on to step 4


# ------------------------------------------------------------------------------------------------------ helpers


def batch(step: int, rank: int, world_size: int) -> Tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + step)
    return local_slice(MODEL.sample(GLOBAL_N, gen), rank, world_size)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int, world_size: int) -> None:
    """Data-parallel steps: every rank its slice of the global batch, the loss scaled to the global mean."""
    for step in steps:
        optim.zero_grad()
        out = model(*batch(step, rank, world_size))
        (MODEL.per_sample_loss(out).sum() * (world_size / GLOBAL_N)).backward()
        optim.step()


def fairscale_model(seed: int, mode: str, **kwargs: Any) -> Tuple[FSDP, torch.optim.Optimizer]:
    model, _ = build(MODEL, seed)
    fsdp = wrap_model(model, dict(kwargs), mode)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.5)  # lr and state come from the checkpoint


def skip_unless_fsdp2_runs_on_cpu() -> None:
    """Skip the case unless torch's FSDP2 can run a forward on the CPU: its streams there must record events (torch
    2.6's ``torch.cpu.Stream`` has no ``record_event``; FSDP2's first all-gather fails on it). The same answer on
    every rank: each skips the case."""
    if fully_shard is None or not hasattr(torch.cpu.Stream, "record_event"):
        pytest.skip(f"torch {torch.__version__}'s FSDP2 cannot run on the CPU (torch.cpu.Stream has no record_event)")
    if torch_version() < (2, 9) and not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        # torch 2.7: gloo sums for AVG (pytorch/pytorch#162338), gloo's all-reduce refuses AVG (HSDP), and FSDP2 has
        # no switch to SUM (set_reduce_scatter_divide_factor is NCCL's PreMulSum): no correct FSDP2 on gloo.
        pytest.skip(f"torch {torch.__version__}'s FSDP2 cannot average gradients on gloo (no SUM switch before 2.8)")


def shard_like_fairscale(model: nn.Module, mesh: Any) -> None:
    """``fully_shard`` each of ``MODEL.NESTED``, then the root. Before torch 2.9 gloo's reduce-scatter sums for
    ``ReduceOp.AVG`` (pytorch/pytorch#162338), FSDP2's op for fp32 gradients, so its gradients came out world-size
    times too large; there FSDP2 is told to reduce with SUM and divide by the data-parallel size itself, which gives
    the same bits as AVG (SUM, then a division by a power of two)."""
    for path in MODEL.NESTED:
        fully_shard(model.get_submodule(path), mesh=mesh)
    fully_shard(model, mesh=mesh)
    if torch_version() < (2, 9):
        for module in model.modules():
            if isinstance(module, FSDPModule) and hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def fsdp2_model(seed: int, world_size: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    skip_unless_fsdp2_runs_on_cpu()
    torch.manual_seed(seed)
    model = MODEL()
    shard_like_fairscale(model, init_device_mesh("cpu", (world_size,)))
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def full(value: Any) -> Any:
    """A DTensor's full tensor (collective), anything else as is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_model(sd: Dict[str, Any]) -> Dict[str, Tensor]:
    return {k: full(v).detach().clone() for k, v in sd.items()}


def full_optim(osd: Dict[str, Any]) -> Dict[str, Any]:
    """``{name: {key: full value}}`` plus the hyperparameters of each name's group."""
    out: Dict[str, Any] = {name: {k: full(v) for k, v in entry.items()} for name, entry in osd["state"].items()}
    for group in osd["param_groups"]:
        for name in group["params"]:
            out.setdefault(name, {})["group"] = {k: v for k, v in group.items() if k != "params"}
    return out


def fsdp2_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    return {
        "model": torch_dsd.get_model_state_dict(model),
        "optimizer": torch_dsd.get_optimizer_state_dict(model, optim),
    }


def fsdp2_load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """torch's own path (FSDP2 or a plain module): torch's state-dict functions and dcp.load."""
    state = fsdp2_state(model, optim)
    dcp.load(state, checkpoint_id=path)
    torch_dsd.set_model_state_dict(model, state["model"])
    torch_dsd.set_optimizer_state_dict(model, optim, state["optimizer"])


def plain_model(seed: int) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The unwrapped model (the same on every rank) and its Adam, whose lr and state come from the checkpoint."""
    torch.manual_seed(seed)
    model = MODEL()
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def load_plain_module(saved: Saved, name: str) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The plain module resumes the checkpoint ``name`` through torch's own functions (DTensor-free: full tensors)."""
    plain, plain_optim = plain_model(5)
    fsdp2_load(plain, plain_optim, saved.path(name))
    assert_same(plain.state_dict(), saved.model, "plain module: loaded")
    assert_same_optim(full_optim(torch_dsd.get_optimizer_state_dict(plain, plain_optim)), saved.optim, "plain optim")
    return plain, plain_optim


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


# ------------------------------------------------------------------------------------------------------ reference


def record_reference(fsdp: FSDP, path: str, rank: int, world_size: int) -> Dict[str, Any]:
    """The reference run: Adam at ``LR`` for ``SAVED_AT`` steps, a DCP checkpoint at ``path``, on to ``STEPS``.

    Returns the fields of :class:`Saved` but the root: the full model and optimizer state at the checkpoint, and the
    full model after the uninterrupted run.
    """
    optim = torch.optim.Adam(fsdp.parameters(), lr=LR)
    train(fsdp, optim, range(SAVED_AT), rank, world_size)
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    model = fsdp.state_dict()
    optim_full = full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim))
    train(fsdp, optim, range(SAVED_AT, STEPS), rank, world_size)
    return {"model": model, "optim": optim_full, "after": fsdp.state_dict()}


def _save_reference(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    fsdp, _ = fairscale_model(1, "nested")
    return record_reference(fsdp, os.path.join(root, "fairscale-ws2"), rank, world_size)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    root = str(tmp_path_factory.mktemp("dcp"))
    return Saved(root, **run_distributed(_save_reference, 2, root)[0])


# ------------------------------------------------------------------------------------------------------ 2 ranks


def _case_layout(saved: Saved, rank: int, world_size: int) -> None:
    """FSDP2's layout: Shard(0) DTensors over the group's ranks, state_dict()'s keys, values as the full state."""
    fsdp, optim = fairscale_model(3, "nested")
    fsdp_dcp.load(fsdp, optim, checkpoint_id=saved.path("fairscale-ws2"))
    msd = fsdp_dcp.get_model_state_dict(fsdp)
    assert list(msd) == list(fsdp.state_dict()), f"keys {list(msd)} are not state_dict()'s {list(fsdp.state_dict())}"
    for name, value in msd.items():
        assert isinstance(value, DTensor) and value.placements == (Shard(0),), (name, value)
        assert value.device_mesh.mesh.tolist() == list(range(world_size)), name
        rows = value.shape[0]
        chunk = -(-rows // world_size)
        expected_rows = max(0, min(rows, (rank + 1) * chunk) - min(rows, rank * chunk))
        assert value.to_local().shape == (expected_rows,) + tuple(value.shape[1:]), (name, value.to_local().shape)
    assert_same(full_model(msd), saved.model, "model state dict")
    osd = fsdp_dcp.get_optimizer_state_dict(fsdp, optim)
    # One group, as the optimizer has; its parameters in the optimizer's (flat parameter) order.
    assert [sorted(g["params"]) for g in osd["param_groups"]] == [sorted(msd)], osd["param_groups"]
    for name, entry in osd["state"].items():
        assert isinstance(entry["exp_avg"], DTensor) and entry["exp_avg"].placements == (Shard(0),), name
        assert isinstance(entry["step"], Tensor) and not isinstance(entry["step"], DTensor), name
    assert_same_optim(full_optim(osd), saved.optim, "optimizer state dict")


def _case_rewrapped_fairscale_continues(saved: Saved, rank: int, world_size: int) -> None:
    """Any wrapping (flat parameters cut elsewhere, or none) resumes and trains exactly as the uninterrupted run."""
    for mode, kwargs in (("leaf", {}), ("one", {"flatten_parameters": False})):
        fsdp, optim = fairscale_model(4, mode, **kwargs)
        fsdp_dcp.load(fsdp, optim, checkpoint_id=saved.path("fairscale-ws2"))
        assert_same(fsdp.state_dict(), saved.model, f"{mode} {kwargs}: loaded")
        train(fsdp, optim, range(SAVED_AT, STEPS), rank, world_size)
        assert_same(fsdp.state_dict(), saved.after, f"{mode} {kwargs}: after training on")


def _case_fsdp2_loads_and_continues(saved: Saved, rank: int, world_size: int) -> None:
    """torch FSDP2, with torch's own state-dict functions, resumes fairscale's checkpoint bit-exactly."""
    model, optim = fsdp2_model(5, world_size)
    fsdp2_load(model, optim, saved.path("fairscale-ws2"))
    assert_same(full_model(torch_dsd.get_model_state_dict(model)), saved.model, "FSDP2 loaded")
    assert_same_optim(full_optim(torch_dsd.get_optimizer_state_dict(model, optim)), saved.optim, "FSDP2 optimizer")
    train(model, optim, range(SAVED_AT, STEPS), rank, world_size)
    assert_same(full_model(torch_dsd.get_model_state_dict(model)), saved.after, "FSDP2 after training on")


def _case_fsdp2_checkpoint_loads_into_fairscale(saved: Saved, rank: int, world_size: int) -> None:
    """A checkpoint written by FSDP2 (one more step) resumes in fairscale (another wrapping) bit-exactly."""
    model, optim = fsdp2_model(5, world_size)
    fsdp2_load(model, optim, saved.path("fairscale-ws2"))
    train(model, optim, range(SAVED_AT, SAVED_AT + 1), rank, world_size)
    path = saved.path("fsdp2-ws2")
    dcp.save(fsdp2_state(model, optim), checkpoint_id=path)
    train(model, optim, range(SAVED_AT + 1, STEPS), rank, world_size)
    expected = full_model(torch_dsd.get_model_state_dict(model))
    fsdp, fsdp_optim = fairscale_model(6, "leaf")
    fsdp_dcp.load(fsdp, fsdp_optim, checkpoint_id=path)
    train(fsdp, fsdp_optim, range(SAVED_AT + 1, STEPS), rank, world_size)
    assert_same(fsdp.state_dict(), expected, "fairscale after FSDP2's checkpoint")


def _case_round_trip_through_fsdp2(saved: Saved, rank: int, world_size: int) -> None:
    """fairscale -> FSDP2 -> fairscale changes no bit of the parameters or the optimizer state."""
    model, optim = fsdp2_model(5, world_size)
    fsdp2_load(model, optim, saved.path("fairscale-ws2"))
    path = saved.path("round-trip")
    dcp.save(fsdp2_state(model, optim), checkpoint_id=path)
    fsdp, fsdp_optim = fairscale_model(7, "one")
    fsdp_dcp.load(fsdp, fsdp_optim, checkpoint_id=path)
    assert_same(fsdp.state_dict(), saved.model, "round trip: model")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, fsdp_optim)), saved.optim, "round trip")
    # The same state takes no more room on disk in fairscale's save (no view drags its shard's storage into the file;
    # fairscale's pieces of the flat shards are other chunks than FSDP2's Shard(0) ones, in this tiny model fewer,
    # and each item carries a fixed overhead of its own, hence no lower bound).
    ours, theirs = directory_bytes(saved.path("fairscale-ws2")), directory_bytes(path)
    assert ours <= 1.05 * theirs, (ours, theirs)


def _case_fsdp2_dicts_in_memory(saved: Saved, rank: int, world_size: int) -> None:
    """FSDP2's state dicts load directly (no file) at the same world size: same layout, same ranks."""
    model, optim = fsdp2_model(5, world_size)
    fsdp2_load(model, optim, saved.path("fairscale-ws2"))
    fsdp, fsdp_optim = fairscale_model(8, "nested")
    state = fsdp2_state(model, optim)
    fsdp_dcp.set_model_state_dict(fsdp, state["model"])
    fsdp_dcp.set_optimizer_state_dict(fsdp, fsdp_optim, state["optimizer"])
    assert_same(fsdp.state_dict(), saved.model, "in memory: model")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, fsdp_optim)), saved.optim, "in memory")


def _case_async_save(saved: Saved, rank: int, world_size: int) -> None:
    """async_save: the state is a snapshot (views of a CPU copy of the shards), so training may go on while the files
    are written."""
    fsdp, optim = fairscale_model(3, "nested")
    fsdp_dcp.load(fsdp, optim, checkpoint_id=saved.path("fairscale-ws2"))
    path = saved.path("async")
    pending = fsdp_dcp.async_save(fsdp, optim, checkpoint_id=path)
    train(fsdp, optim, range(SAVED_AT, STEPS), rank, world_size)  # changes the model while the save runs
    pending.result()
    assert_same(fsdp.state_dict(), saved.after, "trained during the save")
    other, other_optim = fairscale_model(4, "leaf")
    fsdp_dcp.load(other, other_optim, checkpoint_id=path)
    assert_same(other.state_dict(), saved.model, "loaded from the async checkpoint")


def _case_buffers_in_mixed_precision(saved: Saved, rank: int, world_size: int) -> None:
    """Buffers are saved (fp32, as state_dict() gives them) and loaded back into their fp16 buffers."""
    torch.manual_seed(11)
    model = ModelWithBatchNorm()
    fsdp = wrap_model(model, {"mixed_precision": True}, "nested")
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):  # every rank the same batch: the batch-norm statistics agree between ranks
        optim.zero_grad()
        ModelWithBatchNorm.per_sample_loss(fsdp(*ModelWithBatchNorm.sample(4, gen))).mean().backward()
        optim.step()
    msd = fsdp_dcp.get_model_state_dict(fsdp)
    assert msd["bn.running_mean"].dtype == torch.float32 and not isinstance(msd["bn.running_mean"], DTensor)
    expected = fsdp.state_dict()
    path = saved.path("batchnorm")
    fsdp_dcp.save(fsdp, checkpoint_id=path)
    torch.manual_seed(12)
    other = wrap_model(ModelWithBatchNorm(), {"mixed_precision": True}, "leaf")
    fsdp_dcp.load(other, checkpoint_id=path)
    assert_same(other.state_dict(), expected, "batch norm, mixed precision")


def _case_tied_weights(saved: Saved, rank: int, world_size: int) -> None:
    """A tied weight appears under each of its names, as in state_dict(), and loads into another wrapping."""
    model, _ = build(TransformerWithSharedParams, 13)
    fsdp = wrap_model(model, {}, "nested")
    msd = fsdp_dcp.get_model_state_dict(fsdp)
    expected = fsdp.state_dict()
    assert sorted(msd) == sorted(expected) and "output_proj.weight" in msd
    assert_same(full_model(msd), expected, "tied weights")
    path = saved.path("tied")
    fsdp_dcp.save(fsdp, checkpoint_id=path)
    other_model, _ = build(TransformerWithSharedParams, 14)
    other = wrap_model(other_model, {}, "one")
    fsdp_dcp.load(other, checkpoint_id=path)
    assert_same(other.state_dict(), expected, "tied weights loaded")


class WithScalar(nn.Module):
    """A 0-dim parameter between two linears: it cannot be cut along dim 0 (Replicate)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.b = nn.Linear(5, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) * self.scale)


def check_scalar_parameter(
    path: str, placements: Tuple[Any, ...], gen: Optional[torch.Generator], **kwargs: Any
) -> None:
    """A 0-dim parameter is a DTensor of ``placements``; it and its optimizer state round-trip through the
    checkpoint ``path``, flattened or not. ``kwargs``: of both FSDP instances; ``gen``: of the training batch (None:
    torch's default generator)."""
    torch.manual_seed(21)
    fsdp = FSDP(WithScalar(), **kwargs)
    optim = torch.optim.Adam(fsdp.parameters(), lr=0.1)
    optim.zero_grad()
    fsdp(torch.randn(4, 3, generator=gen)).sum().backward()
    optim.step()
    msd = fsdp_dcp.get_model_state_dict(fsdp)
    assert msd["scale"].placements == placements and msd["scale"].to_local().shape == ()
    expected, expected_optim = fsdp.state_dict(), full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim))
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    torch.manual_seed(22)
    other = FSDP(WithScalar(), flatten_parameters=False, **kwargs)
    other_optim = torch.optim.Adam(other.parameters(), lr=0.5)
    fsdp_dcp.load(other, other_optim, checkpoint_id=path)
    assert_same(other.state_dict(), expected, "0-dim parameter")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(other, other_optim)), expected_optim, "0-dim")


def _case_scalar_parameter(saved: Saved, rank: int, world_size: int) -> None:
    """A 0-dim parameter is a Replicate DTensor; it and its optimizer state round-trip, flattened or not."""
    check_scalar_parameter(saved.path("scalar"), (Replicate(),), None)


def _case_one_flat_parameter_at_a_time(saved: Saved, rank: int, world_size: int) -> None:
    """Saving and loading never exchange more at once than the largest flat parameter (one FSDP instance), never
    the whole model: all-to-alls of at most its padded size in all (what an all-gather of it would bring); smaller
    flat parameters may share one."""
    fsdp, _ = fairscale_model(3, "nested")
    handles = [h for m in get_fsdp_instances(fsdp) for h in m._handles]
    total = sum(h.numel for h in handles)
    largest = max(h.padded_numel for h in handles)
    with count_collectives() as counter:
        msd = fsdp_dcp.get_model_state_dict(fsdp)
        fsdp_dcp.set_model_state_dict(fsdp, msd)
    for phase in ("dcp_state_dict", "dcp_load"):
        records = [r for r in counter.records if r.phase == phase and r.kind not in ("all_gather_object",)]
        assert {r.kind for r in records} == {"all_to_all"}, (phase, records)
        sizes = [r.numel for r in records]
        assert 1 <= len(sizes) <= len(handles), (phase, sizes)
        assert all(0 < numel <= largest for numel in sizes) and largest < total, (phase, sizes, largest, total)


def _two_ranks(rank: int, world_size: int, saved: Saved) -> None:
    cases = [
        _case_layout,
        _case_rewrapped_fairscale_continues,
        _case_fsdp2_loads_and_continues,
        _case_fsdp2_checkpoint_loads_into_fairscale,
        _case_round_trip_through_fsdp2,
        _case_fsdp2_dicts_in_memory,
        _case_async_save,
        _case_buffers_in_mixed_precision,
        _case_tied_weights,
        _case_scalar_parameter,
        _case_one_flat_parameter_at_a_time,
    ]
    run_named_cases(cases, saved, rank, world_size)


def test_two_ranks(saved: Saved) -> None:
    run_distributed(_two_ranks, 2, saved)


# ------------------------------------------------------------------------------------------------------ 1 and 4 ranks


def _one_rank(rank: int, world_size: int, saved: Saved) -> None:
    fsdp, optim = fairscale_model(3, "nested")
    fsdp_dcp.load(fsdp, optim, checkpoint_id=saved.path("fairscale-ws2"))
    assert_same(fsdp.state_dict(), saved.model, "fairscale at 1 rank: loaded")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim)), saved.optim, "1 rank: optimizer")
    train(fsdp, optim, range(SAVED_AT, STEPS), rank, world_size)
    plain, plain_optim = load_plain_module(saved, "fairscale-ws2")
    train(plain, plain_optim, range(SAVED_AT, STEPS), rank, world_size)
    # One rank computes the same as the plain module; two ranks summed the gradients in another order.
    assert_same(fsdp.state_dict(), plain.state_dict(), "fairscale at 1 rank vs the plain module")
    assert_close(plain.state_dict(), saved.after, "plain module vs the 2-rank run")


def test_one_rank_and_the_plain_module(saved: Saved) -> None:
    run_distributed(_one_rank, 1, saved)


def _four_ranks(rank: int, world_size: int, saved: Saved) -> None:
    fsdp, optim = fairscale_model(3, "leaf")
    fsdp_dcp.load(fsdp, optim, checkpoint_id=saved.path("fairscale-ws2"))
    assert_same(fsdp.state_dict(), saved.model, "4 ranks: loaded")
    assert_same_optim(full_optim(fsdp_dcp.get_optimizer_state_dict(fsdp, optim)), saved.optim, "4 ranks: optimizer")
    train(fsdp, optim, range(SAVED_AT, STEPS), rank, world_size)
    assert_close(fsdp.state_dict(), saved.after, "4 ranks vs the 2-rank run")


def test_four_ranks(saved: Saved) -> None:
    run_distributed(_four_ranks, 4, saved)
