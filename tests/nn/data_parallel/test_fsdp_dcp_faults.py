# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP checkpoints of FSDP that must not load, and loads that must change nothing.

* A save that fails half-way (a rank's writer raises after writing its data files, or the rank is killed there)
  leaves a directory without ``.metadata`` (DCP writes it last): ``load`` raises ``CheckpointNotFoundError`` on
  every rank. An interrupted ``overwrite=True`` save does not leave the old checkpoint's ``.metadata`` pointing into
  half-rewritten files either.
* A checkpoint of another model, a dict of the wrong shape on one rank only, missing keys, an optimizer dict that
  does not fit, ranks holding different kinds of values: every rank raises the same clear error, and the model and
  the optimizer are left exactly as they were on every rank.
* A ``.metadata`` that would run code when unpickled: ``load`` raises ``UntrustedCheckpointError`` on every rank and
  nothing runs (torch's reader would run it).
"""

import dataclasses
import os
import pathlib
import pickle
from typing import Any, Dict, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _models import ModelWithBatchNorm, NestedWrappedModule, build, wrap_model
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import DistributedTestError, run_cases, run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import dcp as fsdp_dcp

try:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - old torch
    DTensor = None

pytestmark = pytest.mark.skipif(DTensor is None, reason="needs torch with DTensor and torch.distributed.checkpoint")


class FailingWriter(dcp.FileSystemWriter):
    """DCP's file-system writer, whose rank 1 fails once its data files are written (a full disk, a lost mount)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            written.wait()
            raise OSError("injected: no space left on device")
        return written


class KillingWriter(dcp.FileSystemWriter):
    """DCP's file-system writer, whose rank 1 process dies once its data files are written."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            written.wait()
            os._exit(17)
        return written


class OtherShapes(NestedWrappedModule):
    """The same parameter names as NestedWrappedModule, but the last layer has 4 outputs instead of 3."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[3] = nn.Linear(5, 4)


class WithExtraLayer(NestedWrappedModule):
    """NestedWrappedModule and one more layer, which a checkpoint of NestedWrappedModule does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(3, 2)


def trained(seed: int = 1, mode: str = "nested") -> Tuple[FSDP, torch.optim.Optimizer]:
    model, _ = build(NestedWrappedModule, seed)
    fsdp = wrap_model(model, {}, mode)
    optim = torch.optim.Adam(fsdp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed)
    optim.zero_grad()
    NestedWrappedModule.per_sample_loss(fsdp(*NestedWrappedModule.sample(4, gen))).mean().backward()
    optim.step()
    return fsdp, optim


def fresh(seed: int = 2, mode: str = "leaf", cls: Any = NestedWrappedModule) -> Tuple[FSDP, torch.optim.Optimizer]:
    model, _ = build(cls, seed)
    fsdp = wrap_model(model, {}, mode)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.5)


def snapshot(fsdp: FSDP, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """Every local shard and buffer, the optimizer's state and hyperparameters, copied."""
    osd = optim.state_dict()
    return {
        "weights": {k: v.clone() for k, v in fsdp.local_state_dict().items()},
        "state": {
            i: {k: v.clone() if isinstance(v, Tensor) else v for k, v in s.items()} for i, s in osd["state"].items()
        },
        "groups": osd["param_groups"],
    }


def assert_unchanged(fsdp: FSDP, optim: torch.optim.Optimizer, before: Dict[str, Any], what: str) -> None:
    now = snapshot(fsdp, optim)
    assert list(now["weights"]) == list(before["weights"]), what
    for key, value in before["weights"].items():
        assert torch.equal(now["weights"][key], value), f"{what}: {key} changed"
    assert sorted(now["state"]) == sorted(before["state"]), f"{what}: optimizer state entries changed"
    for i, entry in before["state"].items():
        for key, value in entry.items():
            got = now["state"][i][key]
            assert torch.equal(got, value) if isinstance(value, Tensor) else got == value, f"{what}: state {i} {key}"
    assert now["groups"] == before["groups"], f"{what}: hyperparameters changed"


def expect(error: Any, match: str, fn: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(error, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------------------------------------------ cases


def _case_interrupted_save(root: str) -> None:
    fsdp, optim = trained()
    path = os.path.join(root, "interrupted")
    failing = {"checkpoint_id": path, "storage_writer": FailingWriter(path)}
    message = expect(RuntimeError, "injected: no space left", fsdp_dcp.save, fsdp, optim, **failing)
    assert "does not load" in message, message
    files = os.listdir(path)
    assert "__0_0.distcp" in files and ".metadata" not in files, files  # data written, never completed
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    expect(
        fsdp_dcp.CheckpointNotFoundError,
        r"\.metadata is missing",
        fsdp_dcp.load,
        other,
        other_optim,
        checkpoint_id=path,
    )
    assert_unchanged(other, other_optim, before, "after loading an interrupted save")
    with pytest.raises(CheckpointException):  # torch's own load refuses it too
        dcp.load(fsdp_dcp.get_model_state_dict(other), checkpoint_id=path)


def _case_interrupted_overwrite(root: str) -> None:
    fsdp, optim = trained()
    path = os.path.join(root, "overwritten")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    expect(FileExistsError, "already holds a checkpoint", fsdp_dcp.save, fsdp, optim, checkpoint_id=path)
    failing = {"checkpoint_id": path, "storage_writer": FailingWriter(path), "overwrite": True}
    expect(RuntimeError, "injected", fsdp_dcp.save, fsdp, optim, **failing)
    # The old checkpoint's .metadata went first: half-rewritten data files can never load as the old checkpoint.
    other, other_optim = fresh()
    expect(fsdp_dcp.CheckpointNotFoundError, "interrupted", fsdp_dcp.load, other, other_optim, checkpoint_id=path)
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=True)
    fsdp_dcp.load(other, other_optim, checkpoint_id=path)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), fsdp.state_dict().values()))


def _case_checkpoint_of_another_model(root: str) -> None:
    fsdp, optim = trained()
    path = os.path.join(root, "nested")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    for cls, match in ((OtherShapes, "layers.3.weight"), (ModelWithBatchNorm, "fc1")):
        other, other_optim = fresh(cls=cls, mode="one")
        before = snapshot(other, other_optim)
        message = expect(RuntimeError, "(?i)nothing was loaded", fsdp_dcp.load, other, other_optim, checkpoint_id=path)
        assert match in message, message
        assert_unchanged(other, other_optim, before, f"{cls.__name__}: after a failed load")
        assert not other_optim.state, "the placeholder optimizer state stayed"
    # strict=False loads the keys both have and reports the others.
    other, other_optim = fresh(cls=WithExtraLayer, mode="one")
    expect(
        RuntimeError, r"missing key\(s\): \['extra.weight', 'extra.bias'\]", fsdp_dcp.load, other, checkpoint_id=path
    )
    extra = other.state_dict()["extra.weight"]
    result = fsdp_dcp.load(other, checkpoint_id=path, strict=False)
    assert result.missing_keys == ["extra.weight", "extra.bias"] and not result.unexpected_keys, result
    loaded = other.state_dict()
    assert torch.equal(loaded["extra.weight"], extra)
    assert all(torch.equal(loaded[k], v) for k, v in fsdp.state_dict().items())
    # A checkpoint of the model alone does not resume optimizers.
    model_only = os.path.join(root, "model-only")
    fsdp_dcp.save(fsdp, checkpoint_id=model_only)
    other, other_optim = fresh()
    expect(RuntimeError, "holds no optimizer state", fsdp_dcp.load, other, other_optim, checkpoint_id=model_only)
    assert not other_optim.state
    # An optimizer with gradients but no step yet has no state to load into: said, not silently skipped.
    NestedWrappedModule.per_sample_loss(other(torch.randn(2, 7))).sum().backward()
    expect(RuntimeError, "zero_grad", fsdp_dcp.load, other, other_optim, checkpoint_id=path)
    other_optim.zero_grad(set_to_none=True)
    fsdp_dcp.load(other, other_optim, checkpoint_id=path)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), fsdp.state_dict().values()))


def _case_checkpoint_of_another_optimizer(root: str) -> None:
    fsdp, optim = trained()  # Adam
    path = os.path.join(root, "adam")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    amsgrad = os.path.join(root, "amsgrad")
    fsdp2, optim2 = trained()
    optim2.param_groups[0]["amsgrad"] = True  # its next step keeps max_exp_avg_sq too
    optim2.state.clear()
    fsdp2.zero_grad(set_to_none=True)
    NestedWrappedModule.per_sample_loss(fsdp2(torch.randn(2, 7))).sum().backward()
    optim2.step()
    fsdp_dcp.save(fsdp2, optim2, checkpoint_id=amsgrad)
    cases = (
        (
            path,
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            r"holds \['exp_avg', 'exp_avg_sq', 'step'\] but this optimizer \(SGD\) keeps \['momentum_buffer'\]",
        ),
        (path, lambda ps: torch.optim.SGD(ps, lr=0.1), r"this optimizer \(SGD\) keeps no state for them after a step"),
        (
            amsgrad,
            lambda ps: torch.optim.Adam(ps, lr=0.1),
            r"'max_exp_avg_sq'.*keeps \['exp_avg', 'exp_avg_sq', 'step'\]",
        ),
    )
    for where, make, match in cases:
        other, _ = fresh(mode="one")
        other_optim = make(other.parameters())
        before = snapshot(other, other_optim)
        message = expect(RuntimeError, match, fsdp_dcp.load, other, other_optim, checkpoint_id=where)
        assert "another optimizer type" in message and "Nothing was loaded" in message, message
        assert_unchanged(other, other_optim, before, "after loading another optimizer's checkpoint")
        assert not other_optim.state, "the placeholder optimizer state stayed"
    # The model alone still loads from such a checkpoint.
    other, _ = fresh(mode="one")
    fsdp_dcp.load(other, checkpoint_id=path)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), fsdp.state_dict().values()))


def _case_bad_value_on_one_rank(root: str) -> None:
    fsdp, optim = trained()
    msd = fsdp_dcp.get_model_state_dict(fsdp)
    if dist.get_rank() == 1:
        msd["layers.3.weight"] = torch.zeros(4, 5)
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    message = expect(ValueError, r"rank\(s\) \[1\]", fsdp_dcp.set_model_state_dict, other, msd)
    assert "layers.3.weight" in message and "(4, 5)" in message, message
    assert_unchanged(other, other_optim, before, "after one rank's bad value")
    # The pair is all-or-nothing too: a good optimizer dict is not loaded beside a bad model dict.
    osd = fsdp_dcp.get_optimizer_state_dict(fsdp, optim)
    pair = {"model_state_dict": msd, "optim_state_dict": osd}
    expect(ValueError, "layers.3.weight", fsdp_dcp.set_state_dict, other, other_optim, **pair)
    assert_unchanged(other, other_optim, before, "after a bad model dict with a good optimizer dict")


def _case_other_hyper_parameters_on_one_rank(root: str) -> None:
    # Before: accepted, and the ranks' shards went on training at other learning rates.
    fsdp, optim = trained()
    osd = fsdp_dcp.get_optimizer_state_dict(fsdp, optim)
    if dist.get_rank() == 1:
        osd["param_groups"][0]["lr"] = 0.5
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    message = expect(
        RanksDisagreeError, "optimizer hyper-parameters", fsdp_dcp.set_optimizer_state_dict, other, other_optim, osd
    )
    assert "('optimizer 0, param group 0, lr', '0.01') vs ('optimizer 0, param group 0, lr', '0.5')" in message, message
    assert_unchanged(other, other_optim, before, "after a load with another lr on one rank")


def _case_hyper_parameters_of_another_kind(root: str) -> None:
    """A saved lr that is not a number was taken as it came (the next step failed in torch), and a tuple tower (a few
    bytes in a file) made the copy and the ranks' comparison walk 2**30 tuples: refused before either (a security
    review, session 50)."""
    fsdp, optim = trained()
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    tower: Any = ()
    for _ in range(30):
        tower = (tower, tower)
    for key, value, match in (
        ("lr", {"lr": 0.1}, "'lr' is a dict .* but the optimizer's is a number"),
        ("betas", (0.9,), "'betas' is \\(0.9,\\), but the optimizer's is 2 numbers"),
        ("betas", tower, "'betas' nests more than 8 levels deep"),
    ):
        osd = fsdp_dcp.get_optimizer_state_dict(fsdp, optim)
        osd["param_groups"][0][key] = value
        expect(ValueError, match, fsdp_dcp.set_optimizer_state_dict, other, other_optim, osd)
        assert_unchanged(other, other_optim, before, f"after a saved {key} of another kind")


def _case_other_directory_on_one_rank(root: str) -> None:
    # Before: a save wrote each rank's shards into its own directory and .metadata into rank 0's only (a checkpoint
    # that cannot load), and a load read part of the model from each checkpoint, both without an error.
    fsdp, optim = trained()
    for step in ("step1", "step2"):
        fsdp_dcp.save(fsdp, optim, checkpoint_id=os.path.join(root, "dirs", step))
    mine = os.path.join(root, "dirs", f"step{dist.get_rank() + 1}")
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    message = expect(
        RanksDisagreeError, "load: the checkpoint_id differ", fsdp_dcp.load, other, other_optim, checkpoint_id=mine
    )
    assert "global rank 1" in message and "step2" in message, message
    assert_unchanged(other, other_optim, before, "after a load of other directories")
    target = os.path.join(root, "dirs", f"new{dist.get_rank()}")
    expect(RanksDisagreeError, "save: the checkpoint_id differ", fsdp_dcp.save, fsdp, optim, checkpoint_id=target)
    assert not os.path.exists(target), "a refused save created its directory"


def _case_other_settings_on_one_rank(root: str) -> None:
    """A setting of the call that differs on rank 1 (found by a rank-disagreement review): only one rank raised (a
    FileExistsError for overwrite=False, a ValueError for its own process_group) or none did, and the others waited in
    DCP's collectives until the group's timeout. Every rank raises the same error now, before anything is written."""
    fsdp, optim = trained()
    other_rank = dist.get_rank() == 1
    path = os.path.join(root, "settings")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    before = snapshot(fsdp, optim)
    target = os.path.join(root, "settings-new")
    refusals = [
        ("save: the overwrite differ", fsdp_dcp.save, (fsdp, optim), {"overwrite": other_rank, "checkpoint_id": path}),
        (
            "save: the optimizers differ",
            fsdp_dcp.save,
            (fsdp, optim if other_rank else None),
            {"checkpoint_id": target},
        ),
        ("load: the optimizers differ", fsdp_dcp.load, (fsdp, None if other_rank else optim), {"checkpoint_id": path}),
        ("load: the strict differ", fsdp_dcp.load, (fsdp, optim), {"strict": other_rank, "checkpoint_id": path}),
    ]
    for match, fn, args, kwargs in refusals:
        message = expect(RanksDisagreeError, match, fn, *args, **kwargs)
        assert "global rank 1" in message, message
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]
    world = dist.new_group([0, 1])  # the world's ranks, but another communicator than the default group
    message = expect(
        ValueError,
        r"rank 1: save: process_group holds ranks \[1\]",
        fsdp_dcp.save,
        fsdp,
        optim,
        checkpoint_id=target,
        process_group=solo[1] if other_rank else None,
    )
    assert "rank 0" not in message, message
    expect(
        RanksDisagreeError,
        "load: the process_group differ",
        fsdp_dcp.load,
        fsdp,
        optim,
        checkpoint_id=path,
        process_group=world if other_rank else None,
    )
    assert not os.path.exists(target), "a refused save created its directory"
    assert_unchanged(fsdp, optim, before, "after refused loads")
    assert os.path.exists(os.path.join(path, ".metadata")), "a refused overwrite removed the checkpoint"


def _case_missing_keys(root: str) -> None:
    fsdp, optim = trained()
    msd = fsdp_dcp.get_model_state_dict(fsdp)
    del msd["layers.1.2.bias"]
    msd["extra.weight"] = torch.zeros(1)
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    message = expect(RuntimeError, "missing key", fsdp_dcp.set_model_state_dict, other, msd)
    assert "'layers.1.2.bias'" in message and "'extra.weight'" in message, message
    assert_unchanged(other, other_optim, before, "after a strict load with missing keys")
    old_bias = other.state_dict()["layers.1.2.bias"]
    result = fsdp_dcp.set_model_state_dict(other, msd, options=StateDictOptions(strict=False))
    assert result.missing_keys == ["layers.1.2.bias"] and result.unexpected_keys == ["extra.weight"], result
    loaded, expected = other.state_dict(), fsdp.state_dict()
    assert torch.equal(loaded["layers.1.2.bias"], old_bias), "a missing key changed"
    assert all(torch.equal(loaded[k], v) for k, v in expected.items() if k != "layers.1.2.bias")


def _case_optimizer_dict_that_does_not_fit(root: str) -> None:
    fsdp, optim = trained()
    osd = fsdp_dcp.get_optimizer_state_dict(fsdp, optim)
    other, other_optim = trained(seed=3, mode="nested")
    before = snapshot(other, other_optim)
    partial = {"state": dict(osd["state"]), "param_groups": osd["param_groups"]}
    del partial["state"]["layers.1.0.bias"]  # shares a flat parameter with layers.1.0.weight, 1.2.*
    message = expect(ValueError, "needs state, or none", fsdp_dcp.set_optimizer_state_dict, other, other_optim, partial)
    assert "layers.1.0.bias" in message, message
    wrong = {"state": dict(osd["state"]), "param_groups": osd["param_groups"]}
    wrong["state"]["layers.3.weight"] = dict(wrong["state"]["layers.3.weight"], exp_avg=torch.zeros(3, 6))
    expect(ValueError, r"layers.3.weight.*exp_avg", fsdp_dcp.set_optimizer_state_dict, other, other_optim, wrong)
    regrouped = {"state": osd["state"], "param_groups": [dict(osd["param_groups"][0], params=["layers.0.weight"])]}
    expect(ValueError, "grouped differently", fsdp_dcp.set_optimizer_state_dict, other, other_optim, regrouped)
    assert_unchanged(other, other_optim, before, "after optimizer dicts that do not fit")
    fsdp_dcp.set_optimizer_state_dict(other, other_optim, osd)  # the right one still loads


def _case_checkpoint_with_other_parameter_groups(root: str) -> None:
    # One saved group into an optimizer with two failed in DCP's planner ("Missing key in checkpoint state_dict:
    # optimizer.param_groups.1.lr"); both directions say so now (a fuzz of DCP, session 45).
    fsdp, optim = trained()
    path = os.path.join(root, "one-group")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    other, _ = trained(seed=3, mode="nested")
    params = list(other.parameters())
    two_groups = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}], lr=0.01)
    before = snapshot(other, two_groups)
    match = r"the checkpoint's optimizer has 1 parameter group\(s\) but this optimizer \(Adam\) has 2"
    expect(RuntimeError, match, fsdp_dcp.load, other, two_groups, checkpoint_id=path)
    assert_unchanged(other, two_groups, before, "after a checkpoint with fewer parameter groups")


def _case_ranks_hold_different_kinds(root: str) -> None:
    fsdp, optim = trained()
    msd, full = fsdp_dcp.get_model_state_dict(fsdp), fsdp.state_dict()
    mixed = full if dist.get_rank() == 1 else msd  # full tensors on rank 1, DTensor chunks on rank 0
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    expect(ValueError, "differ between ranks", fsdp_dcp.set_model_state_dict, other, mixed)
    assert_unchanged(other, other_optim, before, "after ranks with different kinds of values")
    fsdp_dcp.set_model_state_dict(other, full)  # full tensors on every rank load without exchanges
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), full.values()))


def _case_misuse(root: str) -> None:
    fsdp, optim = trained()
    nested = fsdp.module.layers[1]
    expect(ValueError, "root FullyShardedDataParallel", fsdp_dcp.get_model_state_dict, nested)
    plain = NestedWrappedModule()
    expect(
        TypeError, "FullyShardedDataParallel instance, got NestedWrappedModule", fsdp_dcp.get_model_state_dict, plain
    )
    options = StateDictOptions(full_state_dict=True)
    expect(NotImplementedError, "full_state_dict=True", fsdp_dcp.get_model_state_dict, fsdp, options=options)
    stranger = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    expect(ValueError, "not a parameter of this FSDP model", fsdp_dcp.get_optimizer_state_dict, fsdp, stranger)
    # Loading between a forward and its backward would leave the pending backward without its weights.
    loss = NestedWrappedModule.per_sample_loss(fsdp(torch.randn(2, 7))).sum()
    msd = fsdp_dcp.get_model_state_dict(fsdp)  # saving is fine there
    expect(RuntimeError, "between a forward and its backward", fsdp_dcp.set_model_state_dict, fsdp, msd)
    loss.backward()
    fsdp_dcp.set_model_state_dict(fsdp, msd)


class _RunsCode:
    """Unpickles into a call of ``os.mkdir(path)``: what a checkpoint from someone else could run instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.path,))


def _case_metadata_that_runs_code(root: str) -> None:
    fsdp, optim = trained()
    path = os.path.join(root, "untrusted")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    marker = os.path.join(root, "code_ran")
    if dist.get_rank() == 0:
        control = os.path.join(root, "control")
        pickle.loads(pickle.dumps(_RunsCode(control)))  # plain pickle (torch's reader) runs it
        assert os.path.isdir(control)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(_RunsCode(marker), f)
    dist.barrier()
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    message = expect(
        fsdp_dcp.UntrustedCheckpointError, "names posix.mkdir", fsdp_dcp.load, other, other_optim, checkpoint_id=path
    )
    assert "Nothing was loaded" in message and "rank 0" in message and "rank 1" in message, message
    assert not os.path.exists(marker)
    assert_unchanged(other, other_optim, before, "untrusted metadata")
    # A user's own storage reader is used for the load; the keys are still read with the restricted unpickler.
    expect(
        fsdp_dcp.UntrustedCheckpointError,
        "names posix.mkdir",
        fsdp_dcp.load,
        other,
        other_optim,
        checkpoint_id=path,
        storage_reader=dcp.FileSystemReader(path),
    )
    assert not os.path.exists(marker)


def _case_metadata_with_uncovered_elements(root: str) -> None:
    """Chunks missing from a (tampered or badly merged) .metadata: the load read into uninitialised staging tensors
    and copied whatever memory held into the model and optimizer (off by 1e31), silently."""
    fsdp, optim = trained()
    path = os.path.join(root, "uncovered")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    for what, change, match in (
        ("a chunk dropped", lambda chunks: chunks.pop(), "part of it was never saved"),
        ("a chunk repeated", lambda chunks: chunks.append(chunks[0]), "overlap"),
    ):
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(path, ".metadata"), "rb") as f:
                metadata = pickle.load(f)  # the test's own checkpoint
            entries = [e for k, e in metadata.state_dict_metadata.items() if k.startswith("optimizer.state.")]
            entry = next(e for e in entries if getattr(e, "chunks", None) and len(e.chunks) > 1)
            change(entry.chunks)
            with open(os.path.join(path, ".metadata.tampered"), "wb") as f:
                pickle.dump(metadata, f)
            os.replace(os.path.join(path, ".metadata.tampered"), os.path.join(path, ".metadata"))
        dist.barrier()
        other, other_optim = fresh()
        before = snapshot(other, other_optim)
        message = expect(RuntimeError, match, fsdp_dcp.load, other, other_optim, checkpoint_id=path)
        assert "Nothing was loaded" in message and "rank 1" in message, (what, message)
        assert_unchanged(other, other_optim, before, what)
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=True)


def _tamper_metadata(path: str, change: Any) -> None:
    """On rank 0, rewrite ``path``'s ``.metadata`` with ``change(metadata)`` applied; every rank waits for it."""
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = pickle.load(f)  # the test's own checkpoint
        change(metadata)
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
    dist.barrier()


def _point_at(fqn_prefix: str, relative_path: str, length: Optional[int] = None) -> Any:
    """A metadata change: the first chunk of the first entry under ``fqn_prefix`` is read from ``relative_path``."""

    def change(metadata: Any) -> None:
        index = next(i for i in metadata.storage_data if i.fqn.startswith(fqn_prefix))
        info = metadata.storage_data[index]
        metadata.storage_data[index] = dataclasses.replace(
            info,
            relative_path=relative_path,
            offset=0 if length is not None else info.offset,
            length=info.length if length is None else length,
        )

    return change


def _case_saved_object_that_runs_code(root: str) -> None:
    """DCP's planner reads a saved object (an optimizer's lr, betas) with torch.load(weights_only=False): a checkpoint
    from someone else ran code on every rank that loaded it, before any check (found by a security review)."""
    fsdp, optim = trained()
    path = os.path.join(root, "object_runs_code")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    marker = os.path.join(root, "object_code_ran")
    if dist.get_rank() == 0:
        with open(os.path.join(path, "evil.distcp"), "wb") as f:
            torch.save(_RunsCode(marker), f)
    size = os.path.getsize(os.path.join(path, "evil.distcp")) if dist.get_rank() == 0 else 0
    sizes = [0, 0]
    dist.all_gather_object(sizes, size)
    _tamper_metadata(path, _point_at("optimizer.param_groups.0.lr", "evil.distcp", sizes[0]))
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    # Refused by the scan of each entry (since session 50), before the planner's weights-only read would refuse it.
    message = expect(RuntimeError, "it calls posix.mkdir", fsdp_dcp.load, other, other_optim, checkpoint_id=path)
    assert "nothing was loaded" in message, message
    assert not os.path.exists(marker)
    assert_unchanged(other, other_optim, before, "saved object that runs code")
    # A tensor entry recorded as a saved object is refused before anything is read.
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=True)

    def as_object(metadata: Any) -> None:
        key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
        metadata.state_dict_metadata[key] = BytesStorageMetadata()

    _tamper_metadata(path, as_object)
    expect(
        RuntimeError,
        "saved .* as an object, but the model's .* is a tensor",
        fsdp_dcp.load,
        other,
        other_optim,
        checkpoint_id=path,
    )
    assert_unchanged(other, other_optim, before, "a tensor saved as an object")


def _case_data_files_outside_the_checkpoint(root: str) -> None:
    """DCP's reader opened whatever path the metadata named: another file's values loaded into the model without a
    word (found by a security review); a pipe or /dev/zero would block it or fill the memory."""
    fsdp, optim = trained()
    path = os.path.join(root, "paths")
    outside = os.path.join(root, "outside.distcp")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(outside, "wb") as f:
            f.write(b"\0" * 4096)
        os.symlink(outside, os.path.join(path, "link.distcp"))
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    for relative_path, length, match in (
        ("../outside.distcp", None, "never a path"),
        (outside, None, "never a path"),
        ("link.distcp", None, "not a regular file"),
        ("missing.distcp", None, "cannot be read"),
        (None, 10**9, "the checkpoint is truncated or damaged"),
    ):
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=True)
        dist.barrier()
        name = relative_path
        if name is None:  # the chunk's own file, read far past its end
            with open(os.path.join(path, ".metadata"), "rb") as f:
                name = next(i for i in pickle.load(f).storage_data.values()).relative_path
        _tamper_metadata(path, _point_at("model.", name, length))
        # A path is refused on the metadata, before DCP's reader starts (UntrustedCheckpointError, a ValueError); the
        # files themselves as the reader opens them (DCP's RuntimeError).
        message = expect(
            (RuntimeError, fsdp_dcp.UntrustedCheckpointError),
            match,
            fsdp_dcp.load,
            other,
            other_optim,
            checkpoint_id=path,
        )
        assert "nothing was loaded" in message.lower(), message
        assert_unchanged(other, other_optim, before, f"data file {relative_path!r}")


def _case_metadata_that_sets_class_attributes(root: str) -> None:
    """pickle's BUILD on a class sets attributes on that class for the whole process: a .metadata could make
    Path.is_symlink answer anything, and every later symlink check with it (found by a security review)."""
    fsdp, optim = trained()
    path = os.path.join(root, "build")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            genuine = f.read()
        # GLOBAL pathlib.Path; (None, {"is_symlink": frozenset}); BUILD; POP; then the genuine metadata.
        patch = b"\x80\x02cpathlib\nPath\nN}X\x0a\x00\x00\x00is_symlinkcbuiltins\nfrozenset\ns\x86b0"
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(patch + genuine)
    dist.barrier()
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    is_symlink = pathlib.Path.is_symlink
    expect(
        fsdp_dcp.UntrustedCheckpointError,
        "sets the state of a builtins.type",
        fsdp_dcp.load,
        other,
        other_optim,
        checkpoint_id=path,
    )
    assert pathlib.Path.is_symlink is is_symlink
    assert_unchanged(other, other_optim, before, "metadata that sets class attributes")


def _case_model_on_a_subgroup(root: str) -> None:
    """A model sharded over a subgroup (FSDP over a data-parallel group of tensor parallelism, here each rank its own):
    DCP wrote one checkpoint from the whole world, the subgroups' shards overwrote each other, and the load brought back
    wrong values without an error (found by a review). Refused before anything is written or read."""
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]
    model, _ = build(NestedWrappedModule, 1 + dist.get_rank())
    fsdp = wrap_model(model, {"process_group": solo[dist.get_rank()]}, "nested")
    path = os.path.join(root, "subgroup")
    expect(ValueError, "do not make up the world's 2 ranks", fsdp_dcp.save, fsdp, checkpoint_id=path)
    assert not os.path.exists(path)
    expect(ValueError, "do not make up the world's 2 ranks", fsdp_dcp.load, fsdp, checkpoint_id=path)


def _case_model_with_experts(root: str) -> None:
    """An expert (an instance sharded over its own rank) inside a model sharded over the world: refused, and the
    message names the call the user made (it named get_model_state_dict, which ``save`` uses inside)."""
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(0)
    expert = FSDP(nn.Linear(4, 4), process_group=solo[dist.get_rank()])
    fsdp = FSDP(nn.Sequential(nn.Linear(4, 4), expert))
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    fsdp(torch.randn(2, 4)).sum().backward()
    optim.step()
    path = os.path.join(root, "experts")
    for optims in (None, optim):
        message = expect(
            ValueError, "shards its parameters over ranks", fsdp_dcp.save, fsdp, optims, checkpoint_id=path
        )
        assert message.startswith("save: "), message
    assert not os.path.exists(path)
    plain = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))  # the same keys, one sharding group
    plain_optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.randn(2, 4)).sum().backward()
    plain_optim.step()
    fsdp_dcp.save(plain, plain_optim, checkpoint_id=path)
    for optims in (None, optim):
        message = expect(
            ValueError, "shards its parameters over ranks", fsdp_dcp.load, fsdp, optims, checkpoint_id=path
        )
        assert message.startswith("load: "), message


def _faults(rank: int, world_size: int, root: str) -> None:
    cases = [
        _case_interrupted_save,
        _case_interrupted_overwrite,
        _case_checkpoint_of_another_model,
        _case_checkpoint_of_another_optimizer,
        _case_bad_value_on_one_rank,
        _case_other_directory_on_one_rank,
        _case_other_settings_on_one_rank,
        _case_other_hyper_parameters_on_one_rank,
        _case_hyper_parameters_of_another_kind,
        _case_missing_keys,
        _case_optimizer_dict_that_does_not_fit,
        _case_checkpoint_with_other_parameter_groups,
        _case_ranks_hold_different_kinds,
        _case_misuse,
        _case_metadata_that_runs_code,
        _case_metadata_with_uncovered_elements,
        _case_saved_object_that_runs_code,
        _case_data_files_outside_the_checkpoint,
        _case_metadata_that_sets_class_attributes,
        _case_model_on_a_subgroup,
        _case_model_with_experts,
    ]
    run_cases([(case.__name__[len("_case_") :], _bind(case, root)) for case in cases])


def _bind(case: Any, root: str) -> Any:
    return lambda: case(root)


def test_faults(tmp_path: Any) -> None:
    run_distributed(_faults, 2, str(tmp_path))


# ------------------------------------------------------------------------------------------------------ a killed rank


def _save_and_die(rank: int, world_size: int, path: str) -> None:
    fsdp, optim = trained()
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path, storage_writer=KillingWriter(path))


def _load_after_kill(rank: int, world_size: int, path: str) -> str:
    fsdp, optim = fresh()
    before = snapshot(fsdp, optim)
    message = expect(fsdp_dcp.CheckpointNotFoundError, "interrupted", fsdp_dcp.load, fsdp, optim, checkpoint_id=path)
    assert_unchanged(fsdp, optim, before, "after loading a killed save")
    return message


def test_killed_save_leaves_no_checkpoint(tmp_path: Any) -> None:
    path = str(tmp_path / "killed")
    with pytest.raises(DistributedTestError, match="exit"):
        run_distributed(_save_and_die, 2, path)
    files = os.listdir(path)
    assert "__1_0.distcp" in files and ".metadata" not in files, files
    run_distributed(_load_after_kill, 1, path)


def test_coverage_check_of_chunk_layouts() -> None:
    """The tiling check on metadata alone: FSDP2's Shard(0) rows, box chunks, empty and 0-d tensors pass; a hole
    hidden by an overlap of the same size, a chunk outside the tensor and a missing chunk are named."""
    from types import SimpleNamespace

    from fairscale.nn.data_parallel._fsdp.dcp_metadata import coverage_problem

    def metadata(shape: Tuple[int, ...], *chunks: Tuple[Tuple[int, ...], Tuple[int, ...]]) -> Any:
        entry = SimpleNamespace(size=torch.Size(shape), chunks=[SimpleNamespace(offsets=o, sizes=s) for o, s in chunks])
        return SimpleNamespace(state_dict_metadata={"w": entry, "blob": SimpleNamespace()})

    assert coverage_problem(metadata((5, 3), ((0, 0), (3, 3)), ((3, 0), (2, 3)))) is None
    assert coverage_problem(metadata((4, 4), ((0, 0), (2, 4)), ((2, 0), (2, 1)), ((2, 1), (2, 3)))) is None
    assert coverage_problem(metadata((0, 3), ((0, 0), (0, 3)))) is None
    assert coverage_problem(metadata((), ((), ()))) is None
    assert "overlap" in str(coverage_problem(metadata((4,), ((0,), (2,)), ((1,), (2,)))))
    # Column chunks (cut along dim 1): swept along that dimension; a duplicate is named whatever the count.
    assert "overlap" in str(coverage_problem(metadata((2, 6), ((0, 0), (2, 2)), ((0, 2), (2, 2)), ((0, 3), (2, 2)))))
    assert "appears twice" in str(coverage_problem(metadata((2, 4), ((0, 0), (2, 2)), ((0, 0), (2, 2)))))
    assert "lies outside" in str(coverage_problem(metadata((4,), ((0,), (2,)), ((3,), (2,)))))
    assert "never saved" in str(coverage_problem(metadata((4, 2), ((0, 0), (3, 2)))))


def test_metadata_paths_of_any_python() -> None:
    """Python 3.13 pickles path objects as ``pathlib._local.PosixPath`` (DCP's metadata holds the checkpoint's path):
    such a file reads on every Python, as ``pathlib``'s class; other names of that module stay refused."""
    import io
    import pathlib

    from fairscale.nn.data_parallel._fsdp.dcp_metadata import UntrustedCheckpointError, unpickle_metadata

    written_by_313 = b"cpathlib._local\nPurePosixPath\n(S'/ckpt/step-10'\ntR."
    path = unpickle_metadata(io.BytesIO(written_by_313), "x/.metadata")
    assert type(path) is pathlib.PurePosixPath and str(path) == "/ckpt/step-10"
    with pytest.raises(UntrustedCheckpointError, match="refusing 'x/.metadata': it names pathlib._local.os"):
        unpickle_metadata(io.BytesIO(b"cpathlib._local\nos\n."), "x/.metadata")


def test_metadata_declaring_more_bytes_than_it_holds_allocates_nothing() -> None:
    """A 28-byte .metadata declaring a 2 GB bytearray (pickle's BYTEARRAY8) made every rank reading the checkpoint
    allocate 2 GB, zero-filled (found by a security review, session 42)."""
    import io
    import resource
    import struct

    from fairscale.nn.data_parallel._fsdp.dcp_metadata import UntrustedCheckpointError, unpickle_metadata

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    crafted = b"\x80\x05\x96" + struct.pack("<Q", 2 * 10**9) + b"x" * 16 + b"."
    with pytest.raises(UntrustedCheckpointError, match="a bytearray of 2000000000 bytes, more than the file holds"):
        unpickle_metadata(io.BytesIO(crafted), "x/.metadata")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB: no 2 GB allocation
    ok = pickle.dumps(bytearray(b"abc"), protocol=5)  # a bytearray the file holds still loads
    assert unpickle_metadata(io.BytesIO(ok), "x/.metadata") == bytearray(b"abc")
