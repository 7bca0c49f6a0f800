# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""DCP checkpoints' files as a security review found them (session 50): what a directory from someone else can hold.

* A ``.metadata`` that is not a regular file: a pipe blocked every rank's load, a link to ``/dev/zero`` filled the
  memory, a link to another checkpoint's metadata loaded that checkpoint. Refused as the data files are.
* A caller's own ``storage_reader`` (torch's ``FileSystemReader``) opened the data files the metadata names, ``../x``
  included: the names are checked on the metadata fairscale read, whichever reader loads.
* A save into a directory holding a symlink named like a data file wrote the checkpoint over the link's target.
* The coverage check of a metadata whose keys share one list of chunks took N * N steps for a file of N.

Bodies are module-level functions (the suite also runs with ``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import os
from typing import Any, List

import torch
import torch.distributed as dist
from test_fsdp_dcp_faults import _point_at, _tamper_metadata, assert_unchanged, expect, fresh, snapshot, trained
from torch.distributed.checkpoint import FileSystemReader

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.nn.data_parallel import dcp as fsdp_dcp
from fairscale.nn.data_parallel._fsdp import dcp_metadata


def _case_metadata_that_is_not_a_regular_file(root: str) -> None:
    fsdp, optim = trained()
    path, elsewhere = os.path.join(root, "special"), os.path.join(root, "elsewhere")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    fsdp_dcp.save(fsdp, optim, checkpoint_id=elsewhere)
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    metadata = os.path.join(path, ".metadata")
    for kind in ("fifo", "link to another checkpoint's metadata"):
        dist.barrier()
        if dist.get_rank() == 0:
            os.remove(metadata)
            if kind == "fifo":
                os.mkfifo(metadata)  # opened for reading, it waited for a writer forever
            else:
                os.symlink(os.path.join(elsewhere, ".metadata"), metadata)
        dist.barrier()
        message = expect(
            fsdp_dcp.UntrustedCheckpointError,
            "not a regular file",
            fsdp_dcp.load,
            other,
            other_optim,
            checkpoint_id=path,
        )
        assert "nothing was loaded" in message.lower(), message
        assert_unchanged(other, other_optim, before, kind)


def _case_caller_reader_and_paths_out_of_the_checkpoint(root: str) -> None:
    fsdp, optim = trained()
    path = os.path.join(root, "reader")
    outside = os.path.join(root, "outside.distcp")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    if dist.get_rank() == 0:
        with open(outside, "wb") as f:
            f.write(b"\1" * 4096)
    other, other_optim = fresh()
    before = snapshot(other, other_optim)
    for name in ("../outside.distcp", outside):
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=True)
        _tamper_metadata(path, _point_at("model.", name))
        message = expect(
            fsdp_dcp.UntrustedCheckpointError,
            "plain file names inside the checkpoint directory",
            fsdp_dcp.load,
            other,
            other_optim,
            checkpoint_id=path,
            storage_reader=FileSystemReader(path),
        )
        assert "nothing was loaded" in message.lower(), message
        assert_unchanged(other, other_optim, before, name)


def _case_save_over_planted_links(root: str) -> None:
    fsdp, optim = trained()
    victim = os.path.join(root, f"victim{dist.get_rank()}.txt")
    with open(victim, "w") as f:
        f.write("precious\n")
    for overwrite in (True, False):
        path = os.path.join(root, f"planted_{overwrite}")
        if overwrite:
            fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
        else:
            os.makedirs(path, exist_ok=True)  # a received directory without a checkpoint yet
        dist.barrier()
        name = os.path.join(path, f"__{dist.get_rank()}_0.distcp")
        if os.path.lexists(name):
            os.remove(name)
        os.symlink(victim, name)
        dist.barrier()
        fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=overwrite)
        with open(victim) as f:
            assert f.read() == "precious\n", f"the save wrote through the link (overwrite={overwrite})"
        assert not os.path.islink(name)
        # And the checkpoint it wrote in its place loads.
        other, other_optim = fresh(mode="nested")
        fsdp_dcp.load(other, other_optim, checkpoint_id=path)
        for key, value in fsdp.local_state_dict().items():
            assert torch.equal(other.local_state_dict()[key], value), key


def _case_save_over_a_metadata_tmp_link_and_hard_links(root: str) -> None:
    """torch writes ``.metadata.tmp`` then renames it: a link of that name was written through (and the checkpoint
    then refused its own .metadata). A snapshot made with hard links (``cp -al``) was rewritten by an overwrite of
    the copy, silently (a review, session 50)."""
    fsdp, optim = trained()
    victim = os.path.join(root, "victim_tmp.txt")
    path, snapshot_dir = os.path.join(root, "tmp_link"), os.path.join(root, "snapshot")
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(victim, "w") as f:
            f.write("precious\n")
        os.symlink(victim, os.path.join(path, ".metadata.tmp"))
        os.makedirs(snapshot_dir)
        for name in os.listdir(path):
            if not name.endswith(".tmp"):
                os.link(os.path.join(path, name), os.path.join(snapshot_dir, name))
    dist.barrier()
    saved = {k: v.clone() for k, v in fsdp.local_state_dict().items()}
    with torch.no_grad():
        for p in fsdp.parameters():
            p.add_(1.0)
    fsdp_dcp.save(fsdp, optim, checkpoint_id=path, overwrite=True)
    with open(victim) as f:
        assert f.read() == "precious\n", "the save wrote through the .metadata.tmp link"
    other, other_optim = fresh(mode="nested")
    fsdp_dcp.load(other, other_optim, checkpoint_id=path)  # its own metadata loads
    for key, value in fsdp.local_state_dict().items():
        assert torch.equal(other.local_state_dict()[key], value), key
    fsdp_dcp.load(other, other_optim, checkpoint_id=snapshot_dir)  # the snapshot kept the old values
    for key, value in saved.items():
        assert torch.equal(other.local_state_dict()[key], value), f"the snapshot changed: {key}"


def _files(rank: int, world_size: int, root: str) -> None:
    cases = [
        _case_metadata_that_is_not_a_regular_file,
        _case_caller_reader_and_paths_out_of_the_checkpoint,
        _case_save_over_planted_links,
        _case_save_over_a_metadata_tmp_link_and_hard_links,
    ]
    run_cases([(case.__name__[len("_case_") :], _bind(case, root)) for case in cases])


def _bind(case: Any, root: str) -> Any:
    return lambda: case(root)


def test_checkpoint_files(tmp_path: Any) -> None:
    run_distributed(_files, 2, str(tmp_path))


def test_coverage_of_a_shared_chunk_list_is_checked_once(monkeypatch: Any) -> None:
    """N keys on one list of N chunks (a few bytes per key in the file): one tiling check, not N."""
    from types import SimpleNamespace

    n = 200
    chunks = [SimpleNamespace(offsets=(i,), sizes=(1,)) for i in range(n)]
    entry = SimpleNamespace(size=torch.Size([n]), chunks=chunks)
    metadata = SimpleNamespace(state_dict_metadata={f"model.k{i}": entry for i in range(n)})
    calls: List[int] = []
    real = dcp_metadata._tiling_problem

    def counting(shape: Any, chunks: Any) -> Any:
        calls.append(1)
        return real(shape, chunks)

    monkeypatch.setattr(dcp_metadata, "_tiling_problem", counting)
    assert dcp_metadata.coverage_problem(metadata) is None
    assert len(calls) == 1, len(calls)
    # A key whose shape differs is still checked (and its chunks do not tile it).
    metadata.state_dict_metadata["model.other"] = SimpleNamespace(size=torch.Size([n + 1]), chunks=chunks)
    assert "never saved" in str(dcp_metadata.coverage_problem(metadata))
