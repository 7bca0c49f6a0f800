# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Shared models and helpers of the FSDP tests.

Every model here knows how to make a deterministic global batch (``sample``), how to score its output per sample
(``per_sample_loss``) and which submodules to wrap in each wrapping mode:

* ``"one"``: a single FSDP instance around the whole model;
* ``"nested"``: one FSDP per block (``NESTED``), plus the root around the rest;
* ``"leaf"``: every leaf module that owns parameters (``LEAF``), plus the root.

The parity helpers follow one pattern: build the same model from the same seed on every rank, keep an unwrapped
copy as the single-process reference, train the reference on the global batch and each rank on its slice, and
compare losses per step and full parameters after the optimizer steps.
"""

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from fairscale.internal import collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import TrainingState, get_fsdp_instances
from fairscale.nn.data_parallel._fsdp.state import HandleState

# The first assert_close imports a lot (about 2 s); do it once here so every forked rank inherits the modules.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

Batch = Tuple[Tensor, ...]
WRAP_MODES = ("one", "nested", "leaf")
MIXED = {
    "fp32": {},
    "fp16": {"mixed_precision": True},
    "bf16": {"mixed_precision": True, "compute_dtype": torch.bfloat16},
}


class FailInBackward(torch.autograd.Function):
    """Identity; its backward raises ``RuntimeError("injected backward failure")`` when ``fail`` is set (a backward
    that fails midway, after the units behind this point finished theirs)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fail: bool) -> Tensor:
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        if ctx.fail:
            raise RuntimeError("injected backward failure")
        return grad, None


def _cpu_half_matmul() -> bool:
    try:
        torch.ones(1, 1, dtype=torch.float16) @ torch.ones(1, 1, dtype=torch.float16)
    except RuntimeError:  # torch 2.1: "addmm_impl_cpu_" not implemented for 'Half'
        return False
    return True


#: Whether this torch multiplies fp16 matrices on the CPU (torch 2.1 does not).
CPU_HALF_MATMUL = _cpu_half_matmul()


# ------------------------------------------------------------------------------------------------------ models


class NestedWrappedModule(nn.Module):
    """Linear(7,5) -> [Linear(5,9), ReLU, Linear(9,5)] -> [Linear(5,5)] -> Linear(5,3).

    Sizes are odd on purpose: every owned tensor (flat or not) needs padding at world sizes 2, 3 and 4.
    Per-instance numels in "nested" mode: root 58 (first and last linear), block 1 104, block 2 30.
    """

    NESTED = ("layers.1", "layers.2")
    LEAF = ("layers.0", "layers.1.0", "layers.1.2", "layers.2.0", "layers.3")
    BATCH_DEPENDENT = False

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(7, 5),
            nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 5)),
            nn.Sequential(nn.Linear(5, 5)),
            nn.Linear(5, 3),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Batch:
        return (torch.randn(n, 7, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


class TransformerWithSharedParams(nn.Module):
    """Token embedding -> nn.Transformer (1 encoder + 1 decoder layer) -> output projection tied to the embedding."""

    NESTED = ("transformer.encoder.layers.0", "transformer.decoder.layers.0")
    LEAF = NESTED  # attention reads its weights as attributes, so smaller units cannot be wrapped
    BATCH_DEPENDENT = False
    VOCAB = 11

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(self.VOCAB, 8)
        self.transformer = nn.Transformer(
            d_model=8,
            nhead=2,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=12,
            dropout=0.0,
            batch_first=True,
        )
        self.output_proj = nn.Linear(8, self.VOCAB)
        self.output_proj.weight = self.embed_tokens.weight  # shared parameter

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        return self.output_proj(self.transformer(self.embed_tokens(src), self.embed_tokens(tgt)))

    @classmethod
    def sample(cls, n: int, gen: torch.Generator) -> Batch:
        return (torch.randint(cls.VOCAB, (n, 5), generator=gen), torch.randint(cls.VOCAB, (n, 4), generator=gen))

    @classmethod
    def per_sample_loss(cls, out: Tensor) -> Tensor:
        target = torch.arange(out.shape[1]).remainder(cls.VOCAB).expand(out.shape[0], -1)
        ce = nn.functional.cross_entropy(out.float().reshape(-1, cls.VOCAB), target.reshape(-1), reduction="none")
        return ce.view(out.shape[0], -1).mean(-1)


class ModelWithBatchNorm(nn.Module):
    """Linear(6,8) -> BatchNorm1d(8) -> ReLU -> Linear(8,3). Batch statistics make the loss depend on the batch."""

    NESTED = ("bn",)
    LEAF = ("fc1", "bn", "fc2")
    BATCH_DEPENDENT = True

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Batch:
        return (torch.randn(n, 6, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


class ModelWithUnusedParams(nn.Module):
    """Two used linears and ``unused``, a linear that forward never calls (its parameters get no gradient)."""

    NESTED = ("unused", "block")
    LEAF = ("first", "unused", "block")
    BATCH_DEPENDENT = False

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 7)
        self.unused = nn.Linear(7, 7)
        self.block = nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(torch.tanh(self.first(x)))

    @staticmethod
    def sample(n: int, gen: torch.Generator) -> Batch:
        return (torch.randn(n, 5, generator=gen),)

    @staticmethod
    def per_sample_loss(out: Tensor) -> Tensor:
        return (out.float() - 0.5).pow(2).sum(-1)


# ------------------------------------------------------------------------------------------------------ wrapping


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def wrap_model(
    model: nn.Module, fsdp_kwargs: Dict[str, Any], mode: str, inner_kwargs: Optional[Dict[str, Any]] = None
) -> FSDP:
    """Wrap ``model`` in place according to ``mode`` and return the root FSDP instance.

    Args:
        model: a model of this file (it declares ``NESTED`` and ``LEAF``).
        fsdp_kwargs: constructor arguments of every instance.
        mode: ``"one"``, ``"nested"`` or ``"leaf"``.
        inner_kwargs: overrides for the non-root instances only.
    """
    if mode not in WRAP_MODES:
        raise ValueError(f"unknown wrap mode {mode!r}")
    targets: Sequence[str] = () if mode == "one" else getattr(type(model), mode.upper())
    inner = dict(fsdp_kwargs, **(inner_kwargs or {}))
    for path in targets:
        _set_submodule(model, path, FSDP(model.get_submodule(path), **inner))
    return FSDP(model, **fsdp_kwargs)


def build(model_cls: Callable[[], nn.Module], seed: int = 1) -> Tuple[nn.Module, nn.Module]:
    """``(model, reference)``: two identical models from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    model = model_cls()
    return model, copy.deepcopy(model)


# ------------------------------------------------------------------------------------------------------ data


def global_batch(model: nn.Module, step: int, n: int) -> Batch:
    """The global batch of ``step``: the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    return type(model).sample(n, gen)  # type: ignore[attr-defined]


def local_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's rows (``tensor_split``: uneven splits and empty slices allowed)."""
    return tuple(t.tensor_split(world_size)[rank] for t in batch)


def scaled_loss(model_cls: type, out: Tensor, global_n: int, world_size: int) -> Tensor:
    """Sum of per-sample losses scaled so that FSDP's gradient average equals the global-batch mean."""
    return model_cls.per_sample_loss(out).sum() * (world_size / global_n)  # type: ignore[attr-defined]


def mean_over_ranks(value: float, group: Any = None) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    collectives.all_reduce(t, group=group)
    return float(t.item()) / collectives.group_size(group)


def make_optim(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(f"unknown optimizer {kind!r}")


# ------------------------------------------------------------------------------------------------------ inspection


def full_params(model: FSDP) -> Dict[str, Tensor]:
    """Full fp32 copies of every parameter, by original (clean) name."""
    with model.summon_full_params():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def ref_params(ref: nn.Module) -> Dict[str, Tensor]:
    return {n: p.detach().float().clone() for n, p in ref.named_parameters()}


def _instance_prefixes(root: FSDP) -> Dict[int, str]:
    """Clean module path of every FSDP instance of the tree, by ``id``."""
    return {id(m): _clean_path(name) for name, m in root.named_modules() if isinstance(m, FSDP)}


def _clean_path(path: str) -> str:
    return ".".join(c for c in path.split(".") if c and c not in ("_fsdp_wrapped_module", "_fpw_module"))


def gather_full_grads(root: FSDP) -> Dict[str, Tensor]:
    """Full gradients (all-gathered from the shards), by original name; parameters without grad are left out."""
    prefixes = _instance_prefixes(root)
    out: Dict[str, Tensor] = {}
    for m in get_fsdp_instances(root):
        for i, p in enumerate(m.params):
            if p.grad is None or i >= len(m._param_name_groups):
                continue  # no gradient, or a parameter borrowed with append_shared_param (its owner reports it)
            grad = p.grad.detach().float().reshape(-1)
            if p._is_sharded:  # type: ignore[attr-defined]
                full = torch.empty(grad.numel() * m.world_size)
                collectives.all_gather_into_flat(full, grad.contiguous(), m.process_group)
            else:
                full = grad
            full = full[: p._orig_size.numel()]  # type: ignore[attr-defined]
            if i < m._num_flatten_params:
                names, shapes, numels = m.module.metadata(i)
                pieces = full.split(list(numels))
                for name, shape, piece in zip(names, shapes, pieces):
                    out[_join(prefixes[id(m)], name)] = piece.view(shape)
            else:
                out[_join(prefixes[id(m)], m._param_name_groups[i][0])] = full.view(p._orig_size)  # type: ignore
    return out


def _join(prefix: str, name: str) -> str:
    return _clean_path(f"{prefix}.{name}" if prefix else name)


def assert_idle(root: FSDP, after_forward: bool = False) -> None:
    """Every instance IDLE with ``p.data`` its fp32 shard, and every full buffer freed.

    Args:
        after_forward: between a forward and its backward, instances that do not reshard after forward (the root
            by default) legitimately keep their full parameters.
    """
    for m in get_fsdp_instances(root):
        assert m.training_state == TrainingState.IDLE, f"{type(m).__name__} is in {m.training_state}"
        keeps_full = after_forward and not m.reshard_after_forward
        for h in m._handles:
            if h.fp32_shard is not None:
                assert h.param.data.data_ptr() == h.fp32_shard.data_ptr(), f"{h.name}: p.data is not its shard"
            if keeps_full:
                continue
            assert h.state == HandleState.SHARDED, f"{h.name} is {h.state} (expected SHARDED)"
            if h.full_padded is not None:
                assert h.full_padded.untyped_storage().size() == 0, f"{h.name}: full buffer not freed"


def assert_close_dict(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str, **tol: float) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(actual)} vs {sorted(expected)}"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m: f"{what} {name}: {m}", **tol)


def assert_update_close(
    actual: Dict[str, Tensor], expected: Dict[str, Tensor], init: Dict[str, Tensor], rel: float, what: str
) -> None:
    """Low-precision runs: the parameter error is at most ``rel`` times the reference's total update (in norm).

    A wrong gradient scale or a lost update gives a ratio near 1, while compute-dtype rounding stays far below.
    """
    assert sorted(actual) == sorted(expected), f"{what}: names differ: {sorted(actual)} vs {sorted(expected)}"
    for name in expected:
        moved = (expected[name] - init[name]).norm().item()
        err = (actual[name] - expected[name]).norm().item()
        assert err <= rel * moved + 1e-4, f"{what} {name}: error {err:.3g} vs reference update {moved:.3g} (norms)"


# ------------------------------------------------------------------------------------------------------ parity


# (loss tolerance relative to the first step's loss, parameter error relative to the reference update; None: fp32
# closeness). Measured worst cases on this matrix: fp16 loss 0.3%, param 0.2%; bf16 loss 2%, param 1% (SGD) and up
# to 10% with Adam, whose per-element normalisation amplifies rounding of near-zero gradients.
TOLERANCES = {
    ("fp32", "sgd"): (1e-5, None),
    ("fp32", "adam"): (1e-5, None),
    ("fp16", "sgd"): (1e-2, 0.02),
    ("fp16", "adam"): (1e-2, 0.02),
    ("bf16", "sgd"): (5e-2, 0.05),
    ("bf16", "adam"): (5e-2, 0.25),
}


# The feature matrices (optimize_backward_concat, zero2) on their small odd-sized nets. DTYPES: compute dtype per
# precision. ELEMENTWISE_TOL: (atol, rtol) where elementwise closeness is meaningful (losses; gradients of two
# modes). UPDATE_REL: mixed-precision parameters vs the fp32 reference, error at most this fraction of the
# reference's whole update (norm, per parameter): an absolute bound at bf16 rounding scale exceeds the two-step
# update of several parameters, so a dropped gradient would pass it; this ratio is ~1 for a dropped gradient.
# Measured worst: fp16 0.4%, bf16 4.5%.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ELEMENTWISE_TOL = {"fp32": (1e-5, 1e-5), "fp16": (2e-2, 2e-2), "bf16": (6e-2, 6e-2)}
UPDATE_REL = {"fp16": 0.05, "bf16": 0.2}


def precision_of(fsdp_kwargs: Dict[str, Any]) -> str:
    if not fsdp_kwargs.get("mixed_precision"):
        return "fp32"
    return "bf16" if fsdp_kwargs.get("compute_dtype") == torch.bfloat16 else "fp16"


def train_and_compare(
    rank: int,
    world_size: int,
    model_cls: Callable[[], nn.Module],
    fsdp_kwargs: Dict[str, Any],
    mode: str,
    optim: str = "sgd",
    steps: int = 3,
    local_batch: int = 2,
    global_n: Optional[int] = None,
    inner_kwargs: Optional[Dict[str, Any]] = None,
    wrapper: Optional[Callable[[nn.Module], FSDP]] = None,
) -> FSDP:
    """Train FSDP and the reference side by side; assert loss per step and parameters after the steps match.

    ``wrapper``, if given, replaces :func:`wrap_model` (``mode`` and ``inner_kwargs`` are then unused).
    Returns the trained FSDP model (idle) for further checks.
    """
    model, ref = build(model_cls)
    fsdp = wrapper(model) if wrapper is not None else wrap_model(model, fsdp_kwargs, mode, inner_kwargs)
    init = ref_params(ref)
    opt, ref_opt = make_optim(fsdp.parameters(), optim), make_optim(ref.parameters(), optim)
    n = global_n if global_n is not None else local_batch * world_size
    loss_rtol, param_rel = TOLERANCES[precision_of(fsdp_kwargs), optim]
    first_loss = 0.0
    for step in range(steps):
        batch = global_batch(ref, step, n)
        opt.zero_grad()
        loss = scaled_loss(type(ref), fsdp(*local_slice(batch, rank, world_size)), n, world_size)
        loss.backward()
        assert_idle(fsdp)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = reference_loss(ref, batch, world_size)
        ref_loss.backward()
        ref_opt.step()
        # Relative to the larger of the first and current loss: a loss that shrinks towards 0 keeps a fixed scale.
        first_loss = first_loss if step else abs(ref_loss.item())
        scale = max(first_loss, abs(ref_loss.item()))
        assert_loss_close(mean_over_ranks(loss.item()), ref_loss.item(), loss_rtol * scale + 1e-6, step)
    if param_rel is None:
        # atol 1e-4: under another summation order (another CPU's kernels; ATEN_CPU_CAPABILITY=default here) a ReLU
        # input near 0 can flip, and one element of a trained weight then ends 3.5e-5 away (test_fsdp_apply.py).
        assert_close_dict(full_params(fsdp), ref_params(ref), "param", rtol=1e-4, atol=1e-4)
    else:
        assert_update_close(full_params(fsdp), ref_params(ref), init, param_rel, "param")
    assert_idle(fsdp)
    return fsdp


def assert_loss_close(got: float, expected: float, atol: float, step: int) -> None:
    assert abs(got - expected) <= atol, f"step {step}: loss {got} != reference {expected} (atol {atol:.3g})"


def reference_loss(ref: nn.Module, batch: Batch, world_size: int) -> Tensor:
    """Global-batch loss; per rank slice for batch-dependent models (BN statistics are per rank without SyncBN)."""
    n = batch[0].shape[0]
    if not getattr(ref, "BATCH_DEPENDENT", False):
        return scaled_loss(type(ref), ref(*batch), n, 1)
    pieces = [local_slice(batch, r, world_size) for r in range(world_size)]
    return sum(scaled_loss(type(ref), ref(*p), n, 1) for p in pieces if p[0].shape[0] > 0)  # type: ignore


class DtypeRecorder(nn.Module):
    """A linear layer that records the dtypes it sees in forward (input, weight, its buffer)."""

    def __init__(self, in_features: int = 4, out_features: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.register_buffer("scale", torch.ones(out_features))
        self.seen: List[Dict[str, torch.dtype]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append({"input": x.dtype, "weight": self.linear.weight.dtype, "buffer": self.scale.dtype})
        return self.linear(x) * self.scale
