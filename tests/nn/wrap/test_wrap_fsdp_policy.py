# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``default_auto_wrap_policy`` with ``FullyShardedDataParallel`` as the wrapper class, on a real 2-rank gloo group.

What is checked: which modules the size policy turns into FSDP instances (and how many parameters each owns), the
force-leaf and exclude sets, ``skip_params_check_for_root``, that the ``enable_wrap`` arguments and per-module
``wrapper_config`` reach the instances, that the auto-wrapped model trains like the unwrapped one, and that the
example of ``docs/wrap_and_checkpoint.rst`` runs and trains like its unwrapped model.
"""

import copy
import functools
import os
import re
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.nn import FullyShardedDataParallel as FSDP
from fairscale.nn import auto_wrap, default_auto_wrap_policy, enable_wrap
from fairscale.nn.checkpoint import is_recomputing
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances

WS = 2
TIMEOUT = 150.0
VOCAB, DIM, FF, DEPTH = 13, 8, 16, 3
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "wrap_and_checkpoint.rst")


class Block(nn.Module):
    """attention (288 params) + 2 LayerNorms (16 each) + MLP (144 + 136): 600 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, FF), nn.GELU(), nn.Linear(FF, DIM))

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class TinyLM(nn.Module):
    """embedding (104) -> 3 blocks (1800, in a ModuleList) -> LayerNorm (16) -> head (117): 2037 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _owned_numel(inst: FSDP) -> int:
    return sum(p._orig_size.numel() for p in inst.params)


def _clean(path: str) -> str:
    return ".".join(c for c in path.split(".") if c not in ("_fsdp_wrapped_module", "_fpw_module"))


def _instances_by_path(model: nn.Module) -> Dict[str, FSDP]:
    return {_clean(name): m for name, m in model.named_modules() if isinstance(m, FSDP)}


def _auto_wrap(model: nn.Module, min_num_params: int, **kwargs: Any) -> nn.Module:
    policy_kwargs = {
        k: kwargs.pop(k) for k in list(kwargs) if k in ("skip_params_check_for_root", "force_leaf_modules")
    }
    policy = functools.partial(default_auto_wrap_policy, min_num_params=min_num_params, **policy_kwargs)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        return auto_wrap(model, auto_wrap_policy=policy)


def _tokens(step: int, n: int) -> Tensor:
    return torch.randint(VOCAB, (n, 7), generator=torch.Generator().manual_seed(20 + step))


def _lm_loss(model: nn.Module, tokens: Tensor, global_n: int, scale: int) -> Tensor:
    logits = model(tokens[:, :-1]).float()
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum")
    return per_token * scale / (global_n * (tokens.shape[1] - 1))


def _full_params(model: FSDP) -> Dict[str, Tensor]:
    with model.summon_full_params():
        return {_clean(n): p.detach().float().clone() for n, p in model.named_parameters()}


def _train_and_compare(
    rank: int, model: FSDP, ref: nn.Module, mixed: bool, steps: int = 3, loss_fn: Callable[..., Tensor] = _lm_loss
) -> None:
    """SGD on the local slice vs the reference on the global batch: same losses, same parameters."""
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    n = 2 * WS
    for step in range(steps):
        batch = _tokens(step, n)
        opt.zero_grad()
        loss = loss_fn(model, batch.tensor_split(WS)[rank], n, WS)
        loss.backward()
        for inst in get_fsdp_instances(model):
            assert inst.training_state == TrainingState.IDLE
        opt.step()
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref, batch, n, 1)
        ref_loss.backward()
        ref_opt.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        collectives.all_reduce(total)
        assert abs(total.item() / WS - ref_loss.item()) <= (3e-2 if mixed else 1e-5) * abs(ref_loss.item())
    got = _full_params(model)
    assert sorted(got) == sorted(init)
    for name, p in ref.named_parameters():
        expected = p.detach()
        if mixed:  # bf16 compute: the error stays a small fraction of the reference's update
            moved = (expected - init[name]).norm().item()
            assert (got[name] - expected).norm().item() <= 0.1 * moved + 1e-4, name
        else:
            torch.testing.assert_close(got[name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------------ cases


def _blocks_at_block_size(rank: int) -> None:
    """min_num_params = one block: each block becomes an instance; the root is left to the caller."""
    torch.manual_seed(0)
    ref = TinyLM()
    block = ref.layers[0]
    assert isinstance(block, Block)
    assert [_numel(ref), _numel(block), _numel(block.attn)] == [2037, 600, 288]
    model = _auto_wrap(copy.deepcopy(ref), min_num_params=600)
    assert isinstance(model, TinyLM), "the root's remainder (237) is under the threshold"
    instances = _instances_by_path(model)
    assert sorted(instances) == ["layers.0", "layers.1", "layers.2"], sorted(instances)
    for inst in instances.values():
        assert _owned_numel(inst) == 600 and inst.world_size == WS
        assert all(p._is_sharded for p in inst.params)
    root = FSDP(model)
    assert _owned_numel(root) == 2037 - 3 * 600
    _train_and_compare(rank, root, ref, mixed=False)


def _attention_is_a_leaf(rank: int) -> None:
    """Below block size: the MLP (280) becomes its own instance; attention (288, a force-leaf module) is not descended
    into, hence never wrapped on its own, and stays whole in its block's instance; the ModuleList is never wrapped."""
    torch.manual_seed(0)
    ref = TinyLM()
    model = _auto_wrap(copy.deepcopy(ref), min_num_params=250, skip_params_check_for_root=True)
    assert isinstance(model, FSDP), "skip_params_check_for_root wraps the root whatever its remainder"
    instances = _instances_by_path(model)
    expected = [""] + [f"layers.{i}{part}" for i in range(DEPTH) for part in ("", ".ff")]
    assert sorted(instances) == sorted(expected), sorted(instances)
    for i in range(DEPTH):
        assert _owned_numel(instances[f"layers.{i}.ff"]) == 280
        # The rest of the block: attention (in_proj_weight and out_proj.* together) and the two LayerNorms.
        assert _owned_numel(instances[f"layers.{i}"]) == 600 - 280
    assert _owned_numel(instances[""]) == 2037 - DEPTH * 600
    _train_and_compare(rank, model, ref, mixed=False)


def _force_leaf_override(rank: int) -> None:
    """An empty force-leaf set lets the policy descend into attention and wrap its out_proj apart. (Structure only:
    attention reads out_proj.weight directly, bypassing that instance's forward, which is why it is a default leaf.)"""
    model = _auto_wrap(TinyLM(), min_num_params=70, force_leaf_modules=set())
    paths = set(_instances_by_path(model))
    assert {"layers.0.attn.out_proj", "layers.0.attn"} <= paths, sorted(paths)
    assert not any(p == "layers" for p in paths), "ModuleList is excluded even when large"


def _module_list_excluded_root_wrapped(rank: int) -> None:
    """Threshold above a block: nothing inside is wrapped, the ModuleList (1800) is excluded, the root is wrapped."""
    model = _auto_wrap(TinyLM(), min_num_params=1000)
    assert sorted(_instances_by_path(model)) == [""]
    assert isinstance(model, FSDP) and _owned_numel(model) == 2037


def _kwargs_and_wrapper_config(rank: int) -> None:
    """enable_wrap arguments reach every instance; a module's wrapper_config overrides them; bf16 trains."""
    torch.manual_seed(1)
    ref = TinyLM()
    unwrapped = copy.deepcopy(ref)
    setattr(unwrapped.layers[1], "wrapper_config", {"reshard_after_forward": False, "flatten_parameters": False})
    mixed = dict(mixed_precision=True, compute_dtype=torch.bfloat16)
    model = _auto_wrap(unwrapped, min_num_params=600, skip_params_check_for_root=True, **mixed)
    assert isinstance(model, FSDP)
    instances = _instances_by_path(model)
    assert sorted(instances) == ["", "layers.0", "layers.1", "layers.2"]
    for path, inst in instances.items():
        assert inst.mixed_precision and inst.compute_dtype == torch.bfloat16, path
        assert inst.flatten_parameters is (path != "layers.1"), path
    assert instances["layers.1"]._orig_reshard_after_forward is False
    assert instances["layers.0"]._orig_reshard_after_forward is True
    _train_and_compare(rank, model, ref, mixed=True)


def _failed_auto_wrap_names_what_it_wrapped(rank: int) -> None:
    """FSDP refuses the second child (mixed requires_grad in one flat parameter) after wrapping the first: the
    error says which submodules stay wrapped and to build the model anew (before: nothing said so, and the retry
    was refused as "already wrapped" with no hint why)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight.requires_grad_(False)
    policy = functools.partial(default_auto_wrap_policy, min_num_params=1)
    with warnings.catch_warnings(record=True) as caught:  # Python < 3.11 has no exception notes: a warning
        warnings.simplefilter("always")
        with enable_wrap(wrapper_cls=FSDP):
            with pytest.raises(ValueError, match="mixes requires_grad") as error:
                auto_wrap(model, auto_wrap_policy=policy)
    said = "\n".join(getattr(error.value, "__notes__", []) + [str(w.message) for w in caught])
    assert "auto_wrap failed after wrapping '0' in FullyShardedDataParallel" in said, said
    assert "Build the model anew" in said
    model[1].weight.requires_grad_(True)
    with enable_wrap(wrapper_cls=FSDP):
        with pytest.raises(ValueError, match="after a failed auto_wrap, build it anew"):
            auto_wrap(model, auto_wrap_policy=policy)


class TiedLM(TinyLM):
    """TinyLM whose output layer reuses the embedding's weight (GPT-2's tie): 2037 - 104 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.embed.weight


class MixedLM(TinyLM):
    """TinyLM with two mixing matrices in an nn.ParameterList, read by the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.ParameterList([nn.Parameter(torch.eye(DIM) + 0.1 * torch.randn(DIM, DIM)) for _ in range(2)])

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) @ self.mix[0] @ self.mix[1]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _tied_weights_stay_with_their_users(rank: int) -> None:
    """The embedding (104) and the output layer share a weight: neither is wrapped alone, though each is above the
    threshold (before, the embedding was, and FSDP refused the tie across instances); the root holds both."""
    torch.manual_seed(0)
    ref = TiedLM()
    model = _auto_wrap(copy.deepcopy(ref), min_num_params=100, skip_params_check_for_root=True)
    paths = set(_instances_by_path(model))
    assert "" in paths and not {"embed", "head"} & paths, sorted(paths)
    assert {"layers.0", "layers.0.ff.0"} <= paths, sorted(paths)
    _train_and_compare(rank, model, ref, mixed=False)


class _SharedLayer(nn.Module):
    """One layer registered in two subtrees (``a`` and ``b``), 272 parameters each plus the shared 272."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(16, 16)
        self.a = nn.Sequential(nn.Linear(16, 16), shared)
        self.b = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), shared)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def _layer_registered_twice_stays_with_its_users(rank: int) -> None:
    """A layer registered in two subtrees ties them: neither subtree is wrapped alone (before, ``a`` was, and FSDP
    refused the tie at the first forward); the root holds both, and trains as the plain module."""
    torch.manual_seed(0)
    ref = _SharedLayer()
    model = _auto_wrap(copy.deepcopy(ref), min_num_params=300, skip_params_check_for_root=True)
    assert sorted(_instances_by_path(model)) == [""], sorted(_instances_by_path(model))
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    _train_and_compare(rank, model, ref, mixed=False, loss_fn=lambda m, _t, n, scale: m(batch).pow(2).sum() / n)


class _SharedDeeper(nn.Module):
    """A layer registered at ``shared`` and again at ``a.1.0``."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.a = nn.Sequential(nn.Linear(16, 16), nn.Sequential(self.shared, nn.Tanh()))
        self.b = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.shared(self.a(x)))


def _layer_registered_deeper_is_wrapped_in_both_places(rank: int) -> None:
    """Wrapped at its first place (``shared``), the layer is put at ``a.1.0`` too, although the policy does not
    descend into ``a.1`` (nothing unwrapped is left there); the bare layer stayed there before and the root's first
    forward refused it as "already wrapped by another instance" (found in review, session 49)."""
    torch.manual_seed(0)
    ref = _SharedDeeper()
    model = _auto_wrap(copy.deepcopy(ref), min_num_params=200, skip_params_check_for_root=True)
    assert model.a[1][0] is model.shared and isinstance(model.shared, FSDP)
    batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    _train_and_compare(rank, model, ref, mixed=False, loss_fn=lambda m, _t, n, scale: m(batch).pow(2).sum() / n)


def _parameter_lists_are_not_wrapped(rank: int) -> None:
    """An nn.ParameterList has no forward: FSDP refuses it at world size 2, so the policy leaves it to its parent
    (before, it wrapped it and auto_wrap failed)."""
    torch.manual_seed(0)
    ref = MixedLM()
    model = _auto_wrap(copy.deepcopy(ref), min_num_params=64, skip_params_check_for_root=True)
    paths = set(_instances_by_path(model))
    assert "" in paths and "mix" not in paths, sorted(paths)
    _train_and_compare(rank, model, ref, mixed=False)


def _size_policy_with_fsdp_on_gloo_body(rank: int, world_size: int) -> None:
    cases: List[Tuple[str, Callable[[], None]]] = [
        ("blocks at block size", lambda: _blocks_at_block_size(rank)),
        ("attention is a leaf", lambda: _attention_is_a_leaf(rank)),
        ("force-leaf override", lambda: _force_leaf_override(rank)),
        ("ModuleList excluded, root wrapped", lambda: _module_list_excluded_root_wrapped(rank)),
        ("kwargs and wrapper_config", lambda: _kwargs_and_wrapper_config(rank)),
        ("failed auto_wrap names what it wrapped", lambda: _failed_auto_wrap_names_what_it_wrapped(rank)),
        ("tied weights stay with their users", lambda: _tied_weights_stay_with_their_users(rank)),
        ("parameter lists are not wrapped", lambda: _parameter_lists_are_not_wrapped(rank)),
        ("a layer registered twice stays with its users", lambda: _layer_registered_twice_stays_with_its_users(rank)),
        (
            "a layer registered deeper is wrapped in both places",
            lambda: _layer_registered_deeper_is_wrapped_in_both_places(rank),
        ),
    ]
    run_cases(cases)


def test_size_policy_with_fsdp_on_gloo() -> None:
    run_distributed(_size_policy_with_fsdp_on_gloo_body, WS, timeout=TIMEOUT)


# ------------------------------------------------------------------------------------------------------ docs example


def _doc_example() -> Dict[str, Any]:
    """Execute the example code block of docs/wrap_and_checkpoint.rst (as a module, not as ``__main__``)."""
    with open(DOC) as f:
        text = f.read()
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?:    .*)?\n)+)", text)
    examples = [b for b in blocks if b.startswith("    # example: wrap_and_checkpoint.py")]
    assert len(examples) == 1, "docs/wrap_and_checkpoint.rst must hold exactly one marked example block"
    code = "\n".join(line[4:] for line in examples[0].splitlines())
    namespace: Dict[str, Any] = {"__name__": "wrap_and_checkpoint_example"}
    exec(compile(code, DOC, "exec"), namespace)
    return namespace


def _doc_example_trains_like_reference(rank: int, mixed: bool) -> None:
    ex = _doc_example()
    torch.manual_seed(0)
    ref = ex["TinyTransformer"]()
    model = ex["shard_and_checkpoint"](copy.deepcopy(ref), mixed_precision=mixed)
    # The structure the docs describe: one instance per block, FSDP outside the checkpoint, plus the root.
    instances = _instances_by_path(model)
    assert sorted(instances) == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], sorted(instances)
    recomputed: List[bool] = []
    for inst in list(instances.values())[1:]:
        block = inst.module.module
        assert type(block).__name__ == "Block" and type(block.forward).__name__ == "_CheckpointedForward"
        block.mlp.register_forward_pre_hook(lambda *_: recomputed.append(is_recomputing()))

    def loss_fn(m: nn.Module, tokens: Tensor, global_n: int, scale: int) -> Tensor:
        return ex["lm_loss"](m, tokens) * scale * tokens.shape[0] / global_n

    _train_and_compare(rank, model, ref, mixed=mixed, steps=2, loss_fn=loss_fn)
    assert recomputed.count(True) == recomputed.count(False) == 2 * 4, "each block checkpointed and recomputed"
    losses = ex["train"](steps=2)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def _docs_example_on_gloo_body(rank: int, world_size: int) -> None:
    run_cases(
        (f"mixed_precision={mixed}", lambda mixed=mixed: _doc_example_trains_like_reference(rank, mixed))
        for mixed in (False, True)
    )


def test_docs_example_on_gloo() -> None:
    run_distributed(_docs_example_on_gloo_body, WS, timeout=TIMEOUT)
