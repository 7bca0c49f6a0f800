# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The benchmark model: a small GPT-style decoder, and the plan of which submodules become sharding units.

The model avoids ops whose backward concatenates (no fused qkv ``split``/``chunk``), so that the ``aten::cat``
count the benchmark reports in backward comes from the data-parallel wrapper, not from the model.
"""

import functools
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap

from .config import BenchConfig


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v projections."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, self.heads, c // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))  # a module call is typed Any
        return out


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, both residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))  # a module call is typed Any
        return out


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, final norm and an (untied) LM head."""

    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int, vocab: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))  # a module call is typed Any
        return logits


class TinyBlock(nn.Module):
    """One layer of the latency model: a residual ``hidden x hidden`` linear (two ops of compute, one unit)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.lin(x))


class LatencyModel(nn.Module):
    """The latency scenario's model: embedding, ``layers`` tiny blocks (each its own unit), LM head.

    Its compute is negligible (a few microseconds of kernels per block), so a step costs what the data-parallel
    wrapper does per unit and per collective: the regime where an accelerator waits on the CPU.
    """

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(TinyBlock(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(x)  # a module call is typed Any
        return logits


def make_model(cfg: BenchConfig) -> nn.Module:
    """The model ``cfg.model`` names, with the default init of torch's RNG as it stands."""
    if cfg.model == "latency":
        return LatencyModel(cfg.layers, cfg.hidden, cfg.vocab)
    return GPT(cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.vocab)


def build_model(cfg: BenchConfig, device: torch.device) -> nn.Module:
    """The model, initialised from ``cfg.seed`` (identical on every rank and for every peer)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = make_model(cfg)
    if cfg.checkpoint_activations:
        for block in model.blocks:  # type: ignore[union-attr]
            checkpoint_wrapper(block)
    return model.to(device)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _block_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
    return True if recurse else isinstance(module, (Block, TinyBlock))


def wrap_policy(cfg: BenchConfig) -> Any:
    """The fairscale auto-wrap policy for ``cfg.auto_wrap_policy`` (``None`` for ``"none"``)."""
    if cfg.auto_wrap_policy == "block":
        return _block_policy
    if cfg.auto_wrap_policy == "size":
        return functools.partial(default_auto_wrap_policy, min_num_params=cfg.wrap_min_params)
    return None


class _Recorder:
    """A stand-in ``wrapper_cls`` for a dry run of ``auto_wrap``: notes each module it is asked to wrap."""

    def __init__(self) -> None:
        self.wrapped: List[int] = []

    def __call__(self, module: nn.Module, **kwargs: Any) -> nn.Module:
        self.wrapped.append(id(module))
        return module


def wrap_plan(cfg: BenchConfig, model: nn.Module) -> List[str]:
    """Dotted paths of the submodules that become their own sharding unit, children before parents.

    Found with a dry run of fairscale's ``auto_wrap`` and the configured policy, so every peer is sharded into
    exactly the units fairscale's auto-wrapping produces. The root is always a unit and is not listed.
    """
    policy = wrap_policy(cfg)
    if policy is None:
        return []
    recorder = _Recorder()
    with enable_wrap(wrapper_cls=recorder):
        auto_wrap(model, auto_wrap_policy=policy)
    names = {id(m): n for n, m in model.named_modules()}
    return [names[i] for i in recorder.wrapped if names.get(i)]


def unit_param_numels(model: nn.Module, plan: List[str]) -> Dict[str, List[int]]:
    """For each unit (the plan's paths and ``""`` for the root), the numels of the parameters it owns.

    A parameter belongs to the deepest unit whose path is a prefix of the parameter's name.
    """
    units: Dict[str, List[int]] = {path: [] for path in plan}
    units[""] = []
    ordered = sorted(units, key=len, reverse=True)
    for name, p in model.named_parameters():
        owner = next(u for u in ordered if u == "" or name.startswith(u + "."))
        units[owner].append(p.numel())
    return units
