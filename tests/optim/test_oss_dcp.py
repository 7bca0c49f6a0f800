# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP checkpoints of OSS optimizer state (:mod:`fairscale.optim.oss_dcp`): saved at 2 ranks, resumed at 1, 2 and
4 ranks, with torch's helpers and a plain optimizer both ways, each state written once, bad dicts refused everywhere.

One 2-rank world (the module fixture) trains a DDP model with OSS (Adam, and SGD with momentum) for two steps, saves
a DCP checkpoint and goes on uninterrupted: the reference. The other worlds load it into a fresh OSS (no state yet,
another learning rate) and go on; at 2 ranks the parameters must be bit-exact, at 1 and 4 ranks (DDP sums the
gradients in another order) close. The examples of docs/checkpointing.rst's OSS subsection run here too.
"""

import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal import collectives, torch_version
from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS, oss_dcp

# The frame shared by the DCP tests lives next to FSDP's; that folder is on sys.path however this file is run.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "nn", "data_parallel"))
import _dcp_harness  # noqa: E402
from _dcp_harness import assert_close, assert_same, assert_same_optim, run_named_cases  # noqa: E402

try:
    from torch.distributed.checkpoint import state_dict as torch_dsd
    from torch.distributed.checkpoint.filesystem import FileSystemReader
except ImportError:  # pragma: no cover - old torch
    torch_dsd = None

_DCP_SAVE = getattr(dcp, "save", None)  # torch 2.1 has only save_state_dict

pytestmark = [
    pytest.mark.skipif(torch_dsd is None, reason="needs torch.distributed.checkpoint.state_dict"),
    # torch 2.2's dcp.save/load take a storage_writer/storage_reader and no checkpoint_id (torch >= 2.3), which the
    # tests and the documented examples they run use.
    pytest.mark.skipif(
        _DCP_SAVE is None or "checkpoint_id" not in inspect.signature(_DCP_SAVE).parameters,
        reason=f"torch {torch.__version__}'s dcp.save has no checkpoint_id (torch >= 2.3)",
    ),
]

KINDS = ("adam", "sgd")
GLOBAL_N = 8
LR = 0.01
SAVED_AT = 2
STEPS = 5
DOC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "checkpointing.rst"
)
SECTION = "OSS optimizer state"


# ------------------------------------------------------------------------------------------------------ helpers


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def make_oss(params: Any, kind: str, lr: float) -> OSS:
    if kind == "adam":
        return OSS(params, optim=torch.optim.Adam, lr=lr)
    return OSS(params, optim=torch.optim.SGD, lr=lr, momentum=0.9)


def make_plain(params: Any, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def build(kind: str, seed: int, lr: float = 0.5, wrapper: str = "ddp") -> Tuple[nn.Module, OSS]:
    """A wrapped model and a fresh OSS (no state; its lr must come from the checkpoint)."""
    net = make_net(seed)
    if wrapper == "ddp":
        model: nn.Module = DDP(net)
        return model, make_oss(model.parameters(), kind, lr)
    optim = make_oss(net.parameters(), kind, lr)
    return ShardedDataParallel(net, optim), optim


def batch(step: int, rank: int, world_size: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_N, 6, generator=gen), torch.randn(GLOBAL_N, 3, generator=gen)
    return x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int, world_size: int) -> None:
    """Data-parallel steps: every rank its slice, the loss scaled so that the averaged gradient is the global mean."""
    for step in steps:
        optim.zero_grad()
        x, y = batch(step, rank, world_size)
        ((model(x) - y).pow(2).sum() * (world_size / GLOBAL_N)).backward()
        optim.step()


def weights(model: nn.Module) -> Dict[str, Tensor]:
    inner = model.module if isinstance(model, (DDP, ShardedDataParallel)) else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def gathered(osd: Dict[str, Any]) -> Dict[str, Any]:
    """Every rank's ``state`` entries together (collective), with each name's group hyper-parameters."""
    parts = collectives.all_gather_object({n: {k: v for k, v in e.items()} for n, e in osd["state"].items()})
    out: Dict[str, Any] = {}
    for part in parts:
        for name, entry in part.items():
            assert name not in out, f"{name} is in two ranks' dicts"
            out[name] = dict(entry)
    for group in osd["param_groups"]:
        for name in group["params"]:
            out.setdefault(name, {})["group"] = {k: v for k, v in group.items() if k != "params"}
    return out


def load_into(model: nn.Module, optim: OSS, path: str) -> None:
    """The documented recipe: the model's own state dicts as templates, dcp.load, then set."""
    model_sd, optim_sd = oss_dcp.get_state_dict(model, optim)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    oss_dcp.set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# ------------------------------------------------------------------------------------------------------ reference


@dataclass
class Saved(_dcp_harness.Saved):
    """The shared record, per optimizer kind (``model``, ``optim`` and ``after`` are keyed by kind first)."""

    keys: Dict[str, List[List[str]]]  # per kind: each rank's state names


def _save_reference(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {"model": {}, "optim": {}, "after": {}, "keys": {}}
    for kind in KINDS:
        model, optim = build(kind, 1, lr=LR)
        train(model, optim, range(SAVED_AT), rank, world_size)
        model_sd, optim_sd = oss_dcp.get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(root, f"{kind}-ws2"))
        out["model"][kind] = weights(model)
        out["optim"][kind] = gathered(optim_sd)
        out["keys"][kind] = collectives.all_gather_object(sorted(optim_sd["state"]))
        train(model, optim, range(SAVED_AT, STEPS), rank, world_size)
        out["after"][kind] = weights(model)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    root = str(tmp_path_factory.mktemp("oss_dcp"))
    return Saved(root, **run_distributed(_save_reference, 2, root)[0])


def _resume(saved: Saved, rank: int, world_size: int, exact: bool) -> None:
    """A fresh OSS (no state, lr 0.5) loads the 2-rank checkpoint and continues as the uninterrupted run."""
    for kind in KINDS:
        model, optim = build(kind, 3)
        assert not optim.optim.state
        load_into(model, optim, saved.path(f"{kind}-ws2"))
        assert_same(weights(model), saved.model[kind], f"{kind} at {world_size}: loaded model")
        osd = oss_dcp.get_optimizer_state_dict(model, optim)
        assert_same_optim(gathered(osd), saved.optim[kind], f"{kind} at {world_size}: loaded optimizer")
        assert optim.param_groups[0]["lr"] == LR and optim.optim.param_groups[0]["lr"] == LR
        train(model, optim, range(SAVED_AT, STEPS), rank, world_size)
        (assert_same if exact else assert_close)(weights(model), saved.after[kind], f"{kind} at {world_size}: after")


# ------------------------------------------------------------------------------------------------------ 2 ranks


def _case_resumes_bit_exactly(saved: Saved, rank: int, world_size: int) -> None:
    _resume(saved, rank, world_size, exact=True)


def _case_format_and_each_state_once(saved: Saved, rank: int, world_size: int) -> None:
    """Torch's format, names without DDP's ``module.``, each rank its own parameters: DCP stores every state once."""
    names = sorted(n for n, _ in make_net(0).named_parameters())
    for kind in KINDS:
        per_rank = saved.keys[kind]
        assert all(per_rank) and sorted(sum(per_rank, [])) == names, per_rank  # disjoint, complete
        assert sorted(saved.optim[kind]) == names
        metadata = FileSystemReader(saved.path(f"{kind}-ws2")).read_metadata().state_dict_metadata
        state_keys = sorted(k for k in metadata if k.startswith("optimizer.state."))
        expected_states = ["exp_avg", "exp_avg_sq", "step"] if kind == "adam" else ["momentum_buffer"]
        assert state_keys == sorted(f"optimizer.state.{n}.{s}" for n in names for s in expected_states), state_keys
        for key in state_keys:  # one chunk each, the whole tensor: written by one rank
            chunks = metadata[key].chunks
            assert len(chunks) == 1 and list(chunks[0].sizes) == list(metadata[key].size), (key, chunks)
        assert sorted(k for k in metadata if k.startswith("model.")) == [f"model.{n}" for n in names]


def _case_sharded_ddp_resumes(saved: Saved, rank: int, world_size: int) -> None:
    """ShardedDataParallel's ``module.`` is not in the names either; it resumes the DDP checkpoint."""
    for kind in KINDS:
        model, optim = build(kind, 4, wrapper="sdp")
        load_into(model, optim, saved.path(f"{kind}-ws2"))
        assert_same(weights(model), saved.model[kind], f"{kind} ShardedDDP: loaded")
        train(model, optim, range(SAVED_AT, STEPS), rank, world_size)
        assert_close(weights(model), saved.after[kind], f"{kind} ShardedDDP: after")


def _case_torch_helpers_interoperate(saved: Saved, rank: int, world_size: int) -> None:
    """torch's helpers with a plain optimizer load OSS's checkpoint; OSS loads theirs; both continue bit-exactly."""
    if (2, 3, 0) <= torch_version() < (2, 4, 0):
        pytest.skip(
            f"torch {torch.__version__}'s dcp.load drops the non-tensor values of its own helpers' optimizer state "
            "dict (the groups' lr; pytorch/pytorch#129079, fixed in 2.4)"
        )
    for kind in KINDS:
        model = DDP(make_net(5))
        plain = make_plain(model.parameters(), kind, 0.5)
        model_sd, optim_sd = torch_dsd.get_state_dict(model, plain)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=saved.path(f"{kind}-ws2"))
        torch_dsd.set_state_dict(model, plain, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        assert_same(weights(model), saved.model[kind], f"{kind}: torch loaded")
        train(model, plain, range(SAVED_AT, SAVED_AT + 1), rank, world_size)
        path = saved.path(f"{kind}-torch")
        model_sd, optim_sd = torch_dsd.get_state_dict(model, plain)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
        train(model, plain, range(SAVED_AT + 1, STEPS), rank, world_size)
        assert_same(weights(model), saved.after[kind], f"{kind}: torch after OSS's checkpoint")
        other, optim = build(kind, 6)
        load_into(other, optim, path)
        train(other, optim, range(SAVED_AT + 1, STEPS), rank, world_size)
        assert_same(weights(other), saved.after[kind], f"{kind}: OSS after torch's checkpoint")


def _spoil(osd: Dict[str, Any], how: str, owned: List[str]) -> None:
    if how == "missing state":
        del osd["state"][owned[0]]
    elif how == "wrong shape":
        entry = osd["state"][owned[0]]
        key = "exp_avg" if "exp_avg" in entry else "momentum_buffer"
        entry[key] = torch.zeros(entry[key].numel() + 1)
    elif how == "unknown name":
        osd["state"]["no.such.weight"] = {}
    elif how == "other groups":
        osd["param_groups"][0]["params"] = osd["param_groups"][0]["params"][1:]
    elif how == "other lr":
        osd["param_groups"][0]["lr"] = 123.0
    elif how == "lr not a number":  # taken as it came: the next step failed in torch
        osd["param_groups"][0]["lr"] = {"lr": 0.1}
    elif how == "tuple tower":  # a few bytes in a file; the ranks' comparison (a repr) walked 2**30 tuples
        tower: Any = ()
        for _ in range(30):
            tower = (tower, tower)
        osd["param_groups"][0]["betas" if "betas" in osd["param_groups"][0] else "momentum"] = tower
    else:
        raise AssertionError(how)


def _case_bad_dict_on_one_rank(saved: Saved, rank: int, world_size: int) -> None:
    """A bad dict on rank 1 only: every rank raises the same error, nothing changes anywhere."""
    for kind in KINDS:
        model, optim = build(kind, 7)
        load_into(model, optim, saved.path(f"{kind}-ws2"))
        good = oss_dcp.get_optimizer_state_dict(model, optim)
        before = gathered(good)
        model_before = weights(model)
        for how in (
            "missing state",
            "wrong shape",
            "unknown name",
            "other groups",
            "other lr",
            "lr not a number",
            "tuple tower",
        ):
            osd = oss_dcp.get_optimizer_state_dict(model, optim)
            msd = {k: v.detach() + 1.0 for k, v in oss_dcp.get_model_state_dict(model).items()}  # would change it
            if rank == 1:
                _spoil(osd, how, sorted(osd["state"]))
            error: Any = None
            try:
                oss_dcp.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            except (ValueError, TypeError, RuntimeError) as e:
                error = (type(e).__name__, str(e))
            errors = collectives.all_gather_object(error)
            assert errors[0] is not None and all(e == errors[0] for e in errors), (how, errors)
            assert errors[0][0] == "ValueError", (how, errors[0])
            assert_same_optim(gathered(oss_dcp.get_optimizer_state_dict(model, optim)), before, f"{kind} {how}")
            assert optim.param_groups[0]["lr"] == LR, how
        # A model dict of another model (a wrong shape) leaves the optimizer unchanged too.
        msd = {k: v.clone() for k, v in oss_dcp.get_model_state_dict(model).items()}
        if rank == 0:
            msd["0.weight"] = torch.zeros(2, 2)
        with pytest.raises(ValueError, match="rank\\(s\\) \\[0\\]"):
            oss_dcp.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=good)
        assert_same(weights(model), model_before, f"{kind}: model unchanged")


def _case_fresh_state_changes_nothing(saved: Saved, rank: int, world_size: int) -> None:
    """The template of a fresh OSS: state created by a zero step at lr 0; parameters and lr untouched."""
    for kind in KINDS:
        model, optim = build(kind, 8)
        before = weights(model)
        osd = oss_dcp.get_optimizer_state_dict(model, optim)
        assert osd["state"] and all(p.grad is None for p in model.parameters())
        assert_same(weights(model), before, f"{kind}: template")
        assert optim.param_groups[0]["lr"] == 0.5 and optim.optim.param_groups[0]["lr"] == 0.5
        with pytest.raises(TypeError, match="fairscale.optim.OSS"):
            oss_dcp.get_optimizer_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _case_docs_examples(saved: Saved, rank: int, world_size: int) -> None:
    """docs/checkpointing.rst's OSS subsection: its two blocks save, then resume a fresh OSS."""
    from test_docs_examples import rst_blocks  # tests/ is on sys.path (rootdir conftest)

    start = open(DOC).read().splitlines().index(SECTION) + 1
    blocks = [code for line, code in rst_blocks(DOC) if line > start][:2]
    directory = os.getcwd()
    os.chdir(saved.root)
    try:
        model, oss = build("adam", 9, lr=LR)
        train(model, oss, range(SAVED_AT), rank, world_size)
        ns: Dict[str, Any] = {"model": model, "oss": oss}
        exec(compile(blocks[0], DOC, "exec"), ns)
        expected, expected_optim = weights(model), gathered(oss_dcp.get_optimizer_state_dict(model, oss))
        model, oss = build("adam", 10)
        ns.update(model=model, oss=oss)
        exec(compile(blocks[1], DOC, "exec"), ns)
        assert_same(weights(model), expected, "docs: model")
        assert_same_optim(gathered(oss_dcp.get_optimizer_state_dict(model, oss)), expected_optim, "docs: optimizer")
    finally:
        os.chdir(directory)


def _two_ranks(rank: int, world_size: int, saved: Saved) -> None:
    cases = [
        _case_resumes_bit_exactly,
        _case_format_and_each_state_once,
        _case_sharded_ddp_resumes,
        _case_torch_helpers_interoperate,
        _case_bad_dict_on_one_rank,
        _case_fresh_state_changes_nothing,
        _case_docs_examples,
    ]
    run_named_cases(cases, saved, rank, world_size)


def test_two_ranks(saved: Saved) -> None:
    run_distributed(_two_ranks, 2, saved)


# ------------------------------------------------------------------------------------------------------ 1 and 4 ranks


def _other_world(rank: int, world_size: int, saved: Saved) -> None:
    _resume(saved, rank, world_size, exact=False)


@pytest.mark.parametrize("world_size", [1, 4])
def test_other_world_sizes(saved: Saved, world_size: int) -> None:
    run_distributed(_other_world, world_size, saved)
