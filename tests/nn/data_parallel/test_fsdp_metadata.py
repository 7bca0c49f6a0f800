# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""local_metadata_dict / consolidate_shard_weights (upstream's format) and the offline consolidate/reshard tool.

Consolidation always runs here in the test process, which has no process group: that is the point of it.
"""

import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from _models import (
    ModelWithBatchNorm,
    NestedWrappedModule,
    TransformerWithSharedParams,
    build,
    global_batch,
    wrap_model,
)
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel.consolidate import (
    consolidate_checkpoint_dir,
    find_rank_files,
    main,
    reshard_checkpoint,
)

Size = torch.Size


class _Part(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layer = nn.Linear(6, 5)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.layer(self.embed_tokens(tokens))


class SharedSubmoduleModel(nn.Module):
    """An encoder and a decoder holding one embedding module under two names (torchscale's
    ``share_all_embeddings``): a state dict names its weight twice, ``named_modules()`` lists the module once."""

    NESTED = ("encoder.layer", "decoder.layer")
    LEAF = NESTED
    BATCH_DEPENDENT = False
    VOCAB = 9

    def __init__(self) -> None:
        super().__init__()
        embed = nn.Embedding(self.VOCAB, 6)
        self.encoder = _Part(embed)
        self.decoder = _Part(embed)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.encoder(tokens) * self.decoder(tokens.flip(-1))

    @classmethod
    def sample(cls, n: int, gen: torch.Generator) -> Tuple[Tensor]:
        return (torch.randint(cls.VOCAB, (n, 4), generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).mean((-1, -2))


# name -> (model class, wrap mode, extra FSDP kwargs)
CASES: Dict[str, Tuple[Callable[[], nn.Module], str, Dict[str, Any]]] = {
    "nested-flat": (NestedWrappedModule, "nested", {}),
    "nested-nonflat": (NestedWrappedModule, "nested", {"flatten_parameters": False}),
    "one-flat": (NestedWrappedModule, "one", {}),
    "leaf-nonflat": (NestedWrappedModule, "leaf", {"flatten_parameters": False}),
    "shared-flat": (TransformerWithSharedParams, "nested", {}),
    "shared-nonflat": (TransformerWithSharedParams, "nested", {"flatten_parameters": False}),
    "bn-mixed": (ModelWithBatchNorm, "nested", {"mixed_precision": True}),
    "shared-module-flat": (SharedSubmoduleModel, "nested", {}),
    "shared-module-nonflat": (SharedSubmoduleModel, "one", {"flatten_parameters": False}),
    # Sharded instances with the flag (meant for unsharded MoE experts): consolidation stopped at rank 0's shard with
    # an error saying to pass every rank's files, which the caller had (found by a fuzz).
    "nested-no-broadcast": (NestedWrappedModule, "nested", {"no_broadcast_optim_state": True}),
}
CASES_BY_WORLD = {
    1: ["nested-flat", "nested-nonflat", "shared-flat"],
    2: list(CASES),
    3: ["nested-flat", "leaf-nonflat", "shared-nonflat", "bn-mixed", "shared-module-flat", "nested-no-broadcast"],
    4: ["nested-flat", "nested-nonflat"],
}


def _trained(name: str, seed: int = 1) -> FSDP:
    """The case's model, wrapped, after one SGD step on a batch replicated on every rank."""
    model_cls, mode, kwargs = CASES[name]
    model, _ = build(model_cls, seed)
    fsdp = wrap_model(model, {"bucket_cap_mb": 0, **kwargs}, mode)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    batch = global_batch(model, 0, 4)
    type(model).per_sample_loss(fsdp(*batch)).mean().backward()  # type: ignore[attr-defined]
    opt.step()
    return fsdp


def _assert_same_values(actual: Dict[str, Any], expected: Dict[str, Any], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: keys differ: {sorted(actual)} vs {sorted(expected)}"
    for key, value in expected.items():
        # Buffers of the local dicts stay in buffer dtype (fp16 in mixed precision); the full dict casts them.
        got = actual[key].to(value.dtype)
        assert torch.equal(got, value), f"{what}: {key} differs"


# ------------------------------------------------------------------------------------------------------ format


def _spec_model() -> nn.Module:
    """Upstream's documented example: the root owns ``0.*``, a nested instance sits at ``2``."""
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 7))


def _spec_metadata(padding: Tuple[int, int] = (0, 0), nested_flat: bool = True) -> Dict[str, Any]:
    nested = (
        {
            "flat_param_0": {
                "names": ["weight", "bias"],
                "shapes": [Size([7, 5]), Size([7])],
                "numels": [35, 7],
                "padding": padding[1],
            }
        }
        if nested_flat
        else {
            "weight": {"names": ["weight"], "shapes": [Size([7, 5])], "numels": [35], "padding": padding[1]},
            "bias": {"names": ["bias"], "shapes": [Size([7])], "numels": [7], "padding": padding[1] % 2},
        }
    )
    return {
        "param_metadata": [
            {
                "fsdp_path": "",
                "params": {
                    "flat_param_0": {
                        "names": ["0.weight", "0.bias"],
                        "shapes": [Size([5, 3]), Size([5])],
                        "numels": [15, 5],
                        "padding": padding[0],
                    }
                },
                "no_broadcast_optim_state": False,
                "shared_param_info": [],
            },
            {"fsdp_path": "2", "params": nested, "no_broadcast_optim_state": False, "shared_param_info": []},
        ],
        "buffer_names": [],
    }


def _format_body(rank: int, world_size: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = _spec_model()
    model[2] = FSDP(model[2])
    meta = FSDP(model).local_metadata_dict()
    # The same model with a non-flattened nested instance: one backing entry per parameter, padded per rank
    # (35 -> 18 + 17 + 1 padding, 7 -> 4 + 3 + 1 padding).
    model = _spec_model()
    model[2] = FSDP(model[2], flatten_parameters=False)
    meta_nonflat = FSDP(model).local_metadata_dict()
    # Empty instances get an entry; tied weights list (src, dst) relative to their instance.
    model = nn.Sequential(nn.Linear(2, 2), FSDP(nn.ReLU()), nn.Linear(2, 2))
    meta_empty = FSDP(model).local_metadata_dict()
    tied = TransformerWithSharedParams()
    meta_tied = wrap_model(tied, {}, "nested").local_metadata_dict()
    tied = TransformerWithSharedParams()
    meta_tied_nonflat = wrap_model(tied, {"flatten_parameters": False}, "nested").local_metadata_dict()
    return {
        "meta": meta,
        "nonflat": meta_nonflat,
        "empty": meta_empty,
        "tied": meta_tied,
        "tied_nonflat": meta_tied_nonflat,
    }


def _upstream_part(meta: Dict[str, Any], rank: int, world_size: int) -> Dict[str, Any]:
    """The metadata without this distribution's extra ``checkpoint_identity`` key (checked here), i.e. upstream's."""
    rest = dict(meta)
    ident = rest.pop("checkpoint_identity")
    assert sorted(ident) == ["id", "rank", "step", "world_size"], ident
    assert (ident["rank"], ident["world_size"]) == (rank, world_size), ident
    return rest


def test_metadata_format_is_upstreams() -> None:
    results = run_distributed(_format_body, 2)
    for rank, res in enumerate(results):
        assert _upstream_part(res["meta"], rank, 2) == _spec_metadata()
        for entry in res["meta"]["param_metadata"]:
            for info in entry["params"].values():
                assert list(info) == ["names", "shapes", "numels", "padding"]  # consumers unpack positionally
                assert all(type(s) is torch.Size for s in info["shapes"])
        assert _upstream_part(res["nonflat"], rank, 2) == _spec_metadata(padding=(0, rank), nested_flat=False)
        empty = res["empty"]["param_metadata"]
        assert [e["fsdp_path"] for e in empty] == ["", "1"] and empty[1]["params"] == {}
        for key in ("tied", "tied_nonflat"):
            root = res[key]["param_metadata"][0]
            assert root["fsdp_path"] == ""
            assert root["shared_param_info"] == [("embed_tokens.weight", "output_proj.weight")], key
            names = [n for info in root["params"].values() for n in info["names"]]
            assert "output_proj.weight" not in names and "embed_tokens.weight" in names


# ------------------------------------------------------------------------------------------------------ consolidate


def _consolidate_body(rank: int, world_size: int, names: List[str]) -> Dict[str, Any]:
    out = {}
    for name in names:
        fsdp = _trained(name)
        out[name] = (fsdp.state_dict(), fsdp.local_state_dict(), fsdp.local_metadata_dict())
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_consolidate_equals_full_state_dict(world_size: int) -> None:
    names = CASES_BY_WORLD[world_size]
    results = run_distributed(_consolidate_body, world_size, names)
    for name in names:
        full = results[0][name][0]
        consolidated = FSDP.consolidate_shard_weights([r[name][1] for r in results], [r[name][2] for r in results])
        _assert_same_values(consolidated, full, name)
        # It is an ordinary state dict of the unwrapped module.
        plain = CASES[name][0]()
        plain.load_state_dict(consolidated, strict=True)
        _assert_same_values(plain.state_dict(), full, f"{name} (plain module)")
        if name.startswith("shared-module"):
            assert consolidated["decoder.embed_tokens.weight"] is consolidated["encoder.embed_tokens.weight"]
        elif name.startswith("shared"):
            assert consolidated["output_proj.weight"] is consolidated["embed_tokens.weight"]
        without_buffers = FSDP.consolidate_shard_weights(
            [r[name][1] for r in results], [r[name][2] for r in results], with_module_buffers=False
        )
        assert sorted(without_buffers) == sorted(k for k in full if "running" not in k and "num_batches" not in k)


# ------------------------------------------------------------------------------------------------------ fixtures


def _spec_values() -> Dict[str, Tensor]:
    gen = torch.Generator().manual_seed(7)
    shapes = {"0.weight": (5, 3), "0.bias": (5,), "2.weight": (7, 5), "2.bias": (7,)}
    return {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}


def _spec_local_dicts(world_size: int = 2) -> Tuple[List[Dict[str, Tensor]], List[Dict[str, Any]]]:
    """Per-rank local dicts and metadata of the spec model, written from the documented format (not by FSDP)."""
    values = _spec_values()
    flats = {"flat_param_0": ("0.weight", "0.bias"), "2.flat_param_0": ("2.weight", "2.bias")}
    weights: List[Dict[str, Tensor]] = [{} for _ in range(world_size)]
    paddings: List[List[int]] = [[] for _ in range(world_size)]
    for key, names in flats.items():
        flat = torch.cat([values[n].reshape(-1) for n in names])
        shard = -(-flat.numel() // world_size)  # ceil: every rank holds this many, the tail ranks zero-padded
        for r in range(world_size):
            piece = flat[r * shard : (r + 1) * shard]
            weights[r][key] = torch.cat([piece, piece.new_zeros(shard - piece.numel())])
            paddings[r].append(shard - piece.numel())
    metas = []
    for r in range(world_size):
        meta = _spec_metadata()
        for entry, pad in zip(meta["param_metadata"], paddings[r]):
            entry["params"]["flat_param_0"]["padding"] = pad
        metas.append(meta)
    return weights, metas


def test_upstream_format_fixture_consolidates_on_cpu() -> None:
    for world_size in (2, 3):  # 3 ranks: 20 -> 7+7+6 (+1 padding), 42 -> 14 each
        weights, metas = _spec_local_dicts(world_size)
        full = FSDP.consolidate_shard_weights(weights, metas)
        plain = _spec_model()
        plain.load_state_dict(full, strict=True)
        for key, value in _spec_values().items():
            assert torch.equal(plain.state_dict()[key], value), key


def _fixture_load_body(rank: int, world_size: int) -> Dict[str, Tensor]:
    model = _spec_model()
    model[2] = FSDP(model[2])
    fsdp = FSDP(model)
    weights, metas = _spec_local_dicts(world_size)
    assert _upstream_part(fsdp.local_metadata_dict(), rank, world_size) == metas[rank]
    fsdp.load_local_state_dict(weights[rank])
    return fsdp.state_dict()


def test_upstream_format_fixture_loads_as_local_state_dict() -> None:
    for sd in run_distributed(_fixture_load_body, 3):
        assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        for key, value in _spec_values().items():
            assert torch.equal(sd[key], value), key


# ------------------------------------------------------------------------------------------------------ bad input


def test_consolidate_missing_params_non_strict() -> None:
    weights, metas = _spec_local_dicts()
    for w in weights:
        del w["2.flat_param_0"]
    with pytest.raises(KeyError, match=r"rank 0's weights have no '2\.flat_param_0'"):
        FSDP.consolidate_shard_weights(weights, metas)
    full = FSDP.consolidate_shard_weights(weights, metas, strict=False)
    assert sorted(full) == ["0.bias", "0.weight"]
    assert torch.equal(full["0.weight"], _spec_values()["0.weight"])
    weights, metas = _spec_local_dicts()
    metas[0]["buffer_names"] = ["1.running_mean"]
    with pytest.raises(KeyError, match="no buffer '1.running_mean'"):
        FSDP.consolidate_shard_weights(weights, metas)
    assert "1.running_mean" not in FSDP.consolidate_shard_weights(weights, metas, strict=False)


def test_consolidate_bad_input_names_key_and_rank() -> None:
    weights, metas = _spec_local_dicts()
    with pytest.raises(ValueError, match="2 state dicts and 1 metadata"):
        FSDP.consolidate_shard_weights(weights, metas[:1])
    with pytest.raises(ValueError, match="0 state dicts"):
        FSDP.consolidate_shard_weights([], [])
    # Only some ranks' shards: the sizes do not add up.
    with pytest.raises(ValueError, match=r"'flat_param_0' given hold 10 elements.*need 20"):
        FSDP.consolidate_shard_weights(weights[:1], metas[:1])
    # A rank lacks a shard that rank 0 has.
    broken = [dict(weights[0]), {k: v for k, v in weights[1].items() if k != "flat_param_0"}]
    with pytest.raises(KeyError, match="rank 1's weights have no 'flat_param_0'"):
        FSDP.consolidate_shard_weights(broken, metas)
    # Metadata of another model: other shapes for the same keys, or ranks disagreeing.
    other = _spec_metadata()
    other["param_metadata"][1]["params"]["flat_param_0"].update(shapes=[Size([6, 5]), Size([6])], numels=[30, 6])
    with pytest.raises(ValueError, match=r"'2\.flat_param_0'.*need 36"):
        FSDP.consolidate_shard_weights(weights, [other, other])
    with pytest.raises(ValueError, match="metadata of rank 1 describes other"):
        FSDP.consolidate_shard_weights(weights, [metas[0], other])
    bad_padding = _spec_metadata(padding=(0, 99))
    with pytest.raises(ValueError, match="rank 0's metadata says '2.flat_param_0' has 99 padding"):
        FSDP.consolidate_shard_weights(weights, [bad_padding, metas[1]])
    with pytest.raises(ValueError, match=r"shard_metadata\[1\] is not a local_metadata_dict"):
        FSDP.consolidate_shard_weights(weights, [metas[0], {"weights": 1}])


def test_consolidate_refuses_paddings_moved_between_ranks() -> None:
    """3 ranks: 20 elements are 7 + 7 + 6 (+1 padding). Metadata moving that padding to rank 0 still adds up to 20,
    and consolidated a padding zero as a weight and dropped one (now refused, naming the rank)."""
    weights, metas = _spec_local_dicts(3)
    assert [m["param_metadata"][0]["params"]["flat_param_0"]["padding"] for m in metas] == [0, 0, 1]
    metas[0]["param_metadata"][0]["params"]["flat_param_0"]["padding"] = 1
    metas[2]["param_metadata"][0]["params"]["flat_param_0"]["padding"] = 0
    with pytest.raises(ValueError, match=r"rank 0's shard of 'flat_param_0' keeps 6 of its 7 elements.*keep 7 there"):
        FSDP.consolidate_shard_weights(weights, metas)


# ------------------------------------------------------------------------------------------------------ the tool


def _save_body(rank: int, world_size: int, directory: str, name: str) -> Dict[str, Tensor]:
    fsdp = _trained(name)
    torch.save(
        {"weights": fsdp.local_state_dict(), "meta": fsdp.local_metadata_dict()},
        os.path.join(directory, f"ckpt-rank-{rank}.pt"),
    )
    return fsdp.state_dict()


def _load_resharded_body(rank: int, world_size: int, directory: str, expected: Dict[str, Tensor], name: str) -> None:
    _, mode, kwargs = CASES[name]
    fsdp = wrap_model(TransformerWithSharedParams(), kwargs, mode)  # another init than the checkpoint's
    ckpt = torch.load(os.path.join(directory, f"checkpoint-rank-{rank}.pt"), weights_only=True)
    # Paddings recomputed for this world size; a new checkpoint identity for each rank.
    expected_meta = _upstream_part(fsdp.local_metadata_dict(), rank, world_size)
    assert _upstream_part(ckpt["meta"], rank, world_size) == expected_meta
    fsdp.load_local_state_dict(ckpt["weights"])
    _assert_same_values(fsdp.state_dict(), expected, f"resharded for {world_size} ranks")


# Not flattened, the tied weights are keys of the local dicts under each name: the resharded ones lacked the second,
# and every rank refused them (a fuzz of checkpoints, session 45).
@pytest.mark.parametrize("name", ["shared-flat", "shared-nonflat"])
def test_offline_consolidate_and_reshard_tool(tmp_path: Any, name: str) -> None:
    saved, full_path = str(tmp_path / "ws2"), str(tmp_path / "full.pt")
    os.makedirs(saved)
    expected = run_distributed(_save_body, 2, saved, name)[0]
    assert [os.path.basename(p) for p in find_rank_files(saved)] == ["ckpt-rank-0.pt", "ckpt-rank-1.pt"]
    assert main(["consolidate", saved, full_path]) == 0
    _assert_same_values(torch.load(full_path, weights_only=True), expected, "consolidated by the CLI")
    _assert_same_values(consolidate_checkpoint_dir(saved), expected, "consolidate_checkpoint_dir")
    for world_size in (3, 1):
        out_dir = str(tmp_path / f"ws{world_size}")
        meta_file = os.path.join(saved, "ckpt-rank-1.pt")
        argv = ["reshard", full_path, "--meta", meta_file, "--world-size", str(world_size), "--out-dir", out_dir]
        assert main(argv) == 0
        run_distributed(_load_resharded_body, world_size, out_dir, expected, name)
        # And back: the resharded files consolidate to the same full state dict.
        _assert_same_values(consolidate_checkpoint_dir(out_dir), expected, f"re-consolidated from {world_size}")


def test_tool_rejects_unclear_inputs(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="no file matches"):
        find_rank_files(str(tmp_path))
    for name in ("a-rank-0.pt", "a-rank-2.pt"):
        torch.save({}, str(tmp_path / name))
    with pytest.raises(ValueError, match=r"found ranks \[0, 2\], missing \[1\]"):
        find_rank_files(str(tmp_path))
    os.rename(str(tmp_path / "a-rank-0.pt"), str(tmp_path / "b-rank-1.pt"))  # rank 0 lost: named, not "0..0"
    with pytest.raises(ValueError, match=r"found ranks \[1, 2\], missing \[0\]"):
        find_rank_files(str(tmp_path))
    os.rename(str(tmp_path / "b-rank-1.pt"), str(tmp_path / "a-rank-0.pt"))
    torch.save({}, str(tmp_path / "notes.pt"))
    with pytest.raises(ValueError, match="cannot tell the rank of"):
        find_rank_files(str(tmp_path))
    os.remove(str(tmp_path / "notes.pt"))
    os.rename(str(tmp_path / "a-rank-2.pt"), str(tmp_path / "a-rank-1.pt"))
    with pytest.raises(ValueError, match="expected a dict with 'weights'"):
        consolidate_checkpoint_dir(str(tmp_path))
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        reshard_checkpoint({}, _spec_metadata(), 0)
    with pytest.raises(KeyError, match="no '0.weight'"):
        reshard_checkpoint({}, _spec_metadata(), 2)
