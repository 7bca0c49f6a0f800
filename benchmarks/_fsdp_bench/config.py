# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Command line and configuration of the FSDP benchmark (one frozen dataclass, validated once)."""

import argparse
import dataclasses
import math
import os
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .corpus import corpus_tokens

PEERS = ("fairscale", "fsdp2", "fsdp1", "ddp")
SCENARIOS = ("train", "accum", "zero2", "latency", "hybrid")
#: The model each scenario trains ("gpt": the GPT of --layers/--hidden...; "latency": --latency-layers tiny blocks).
MODELS = ("gpt", "latency")
MIXED_PRECISION = ("none", "fp16", "bf16")
WRAP_POLICIES = ("block", "size", "none")

#: A ``reshard_after_forward`` setting: ``True``/``False``, or an int G = reshard to groups of G ranks after
#: forward (FSDP2's int, fairscale's ``zero2_process_group`` of G ranks).
Reshard = Union[bool, int]


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Every option of one benchmark invocation (see ``python benchmarks/fsdp.py --help``)."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_len: int = 64
    vocab: int = 1024
    batch: int = 8
    microbatches: int = 2
    world_size: int = 2
    reshard_after_forward: Tuple[Reshard, ...] = (True, False)
    mixed_precision: str = "none"
    flatten: bool = True
    optimize_backward_concat: bool = False
    checkpoint_activations: bool = False
    auto_wrap_policy: str = "block"
    wrap_min_params: int = 100_000
    steps: int = 20
    warmup: int = 1
    seed: int = 0
    lr: float = 1e-3
    compare: Tuple[str, ...] = PEERS
    scenarios: Tuple[str, ...] = ("train",)
    accum_microbatches: int = 8
    accum_batch: int = 1
    accum_reshard_after_forward: bool = False
    zero2_world_size: int = 4
    latency_layers: int = 48
    latency_hidden: int = 16
    latency_batch: int = 1
    latency_steps: int = 50
    collective_calls: int = 1000
    zero2_group_size: int = 2
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    link_gbps: Optional[float] = None
    link_latency_us: float = 0.0
    link_intra_gbps: Optional[float] = None
    hybrid_world_size: int = 4
    hybrid_ranks_per_node: int = 2
    hybrid_intra_gbps: float = 0.25
    #: ``None``: a tenth of ``hybrid_intra_gbps`` (see :attr:`hybrid_inter`).
    hybrid_inter_gbps: Optional[float] = None
    hybrid_model_nodes: int = 8
    hybrid_model_ranks_per_node: int = 8
    overlap_gbps: Tuple[float, ...] = (0.02, 0.08, 0.32)
    overlap_steps: int = 4
    cost_model_unit_ms: Optional[float] = None
    device: str = "cpu"
    threads: int = 0
    out: Optional[str] = "fsdp_benchmark.json"
    plot: Optional[str] = "fsdp_benchmark.png"
    timeout: float = 1800.0
    # Not an option: the latency scenario replaces it (with layers, hidden ...) in its own copy of the config.
    model: str = "gpt"

    @property
    def hybrid_inter(self) -> float:
        """The hybrid scenario's inter-node GB/s (``--hybrid-inter-gbps``, default 10x slower than intra-node)."""
        return self.hybrid_inter_gbps if self.hybrid_inter_gbps is not None else self.hybrid_intra_gbps / 10

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens one rank processes per microbatch."""
        return self.batch * self.seq_len


def scenario_config(cfg: BenchConfig, scenario: str) -> BenchConfig:
    """The configuration a scenario's runs use: its own microbatch size (accum), or its own model (latency)."""
    if scenario == "accum":
        return dataclasses.replace(cfg, batch=cfg.accum_batch)
    if scenario == "latency":
        # One microbatch per step and ZeRO-3 (every hook and both gathers run): the fixed cost per step and unit.
        return dataclasses.replace(
            cfg,
            model="latency",
            layers=cfg.latency_layers,
            hidden=cfg.latency_hidden,
            heads=1,
            batch=cfg.latency_batch,
            microbatches=1,
            steps=cfg.latency_steps,
            reshard_after_forward=(True,),
            optimize_backward_concat=False,
            checkpoint_activations=False,
            auto_wrap_policy="block",
        )
    return cfg


def _bool_value(text: str) -> bool:
    value = _reshard_value(text)
    if not isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _reshard_value(text: str) -> Reshard:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    try:
        value = int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--reshard-after-forward takes true, false or an int group size >= 2, got {text!r}"
        ) from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"an int --reshard-after-forward must be >= 2 (a group size), got {value}")
    return value


def _split_list(values: Sequence[str]) -> List[str]:
    """Accept both ``--compare a b`` and ``--compare a,b``."""
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``benchmarks/fsdp.py``."""
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="benchmarks/fsdp.py",
        description="Train a small GPT-style LM with this fork's FSDP and its peers (PyTorch FSDP2/FSDP1, DDP) side "
        "by side and report step time, tokens/s, peak memory, collectives and loss parity.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    m.add_argument("--hidden", type=int, default=d.hidden, help="model width")
    m.add_argument("--heads", type=int, default=d.heads, help="attention heads (must divide --hidden)")
    m.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    m.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (>= 4)")
    t = p.add_argument_group("training")
    t.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per microbatch")
    t.add_argument("--microbatches", type=int, default=d.microbatches, help="microbatches per optimizer step")
    t.add_argument("--steps", type=int, default=d.steps, help="timed optimizer steps per run")
    t.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps before the timed ones")
    t.add_argument("--seed", type=int, default=d.seed, help="seed of the model init and the batch sampling")
    t.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    w = p.add_argument_group("sharding")
    w.add_argument("--world-size", type=int, default=d.world_size, help="ranks started (ignored under torchrun)")
    w.add_argument(
        "--reshard-after-forward",
        type=_reshard_value,
        nargs="+",
        metavar="RAF",
        default=list(d.reshard_after_forward),
        help="one run per value: true, false, or an int G (reshard to groups of G ranks: FSDP2's int, fairscale's "
        "zero2_process_group of G ranks)",
    )
    w.add_argument(
        "--mixed-precision",
        choices=MIXED_PRECISION,
        default=d.mixed_precision,
        help="compute dtype (fp32 master shards)",
    )
    w.add_argument("--flatten", action=argparse.BooleanOptionalAction, default=d.flatten, help="flatten_parameters")
    w.add_argument(
        "--optimize-backward-concat",
        action=argparse.BooleanOptionalAction,
        default=d.optimize_backward_concat,
        help="fairscale's optimize_backward_concat in the train scenario (the accum scenario runs both)",
    )
    w.add_argument(
        "--checkpoint-activations",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="checkpoint_wrapper on every block",
    )
    w.add_argument(
        "--auto-wrap-policy",
        choices=WRAP_POLICIES,
        default=d.auto_wrap_policy,
        help="block: one unit per transformer block; size: default_auto_wrap_policy with "
        "--wrap-min-params; none: one unit for the whole model",
    )
    w.add_argument(
        "--wrap-min-params", type=int, default=d.wrap_min_params, help="threshold of --auto-wrap-policy size"
    )
    r = p.add_argument_group("what to run")
    r.add_argument(
        "--compare", nargs="+", metavar="PEER", default=list(d.compare), help=f"peers, from {', '.join(PEERS)}"
    )
    r.add_argument(
        "--scenario",
        nargs="+",
        default=list(d.scenarios),
        help="train: peers side by side; accum: --accum-microbatches window with optimize_backward_concat off/on; "
        "zero2: --zero2-world-size ranks with and without a zero2 group of --zero2-group-size; latency: every peer "
        "on --latency-layers tiny units (CPU cost per step, per unit and per collective); hybrid: "
        "--hybrid-world-size ranks on nodes of --hybrid-ranks-per-node, simulated link, full vs hybrid sharding "
        "(fairscale replicate_process_group, FSDP2 HSDP, FSDP1 HYBRID_SHARD); all: every one "
        "(benchmarks/fsdp.py also takes overlap, oss, tp and pipe, run by their own modules)",
    )
    r.add_argument("--accum-microbatches", type=int, default=d.accum_microbatches, help="window of the accum scenario")
    r.add_argument(
        "--accum-batch",
        type=int,
        default=d.accum_batch,
        help="sequences per rank per microbatch in the accum scenario (small microbatches: the case accumulation is for)",
    )
    r.add_argument(
        "--accum-reshard-after-forward",
        type=_bool_value,
        default=d.accum_reshard_after_forward,
        metavar="BOOL",
        help="reshard_after_forward of the accum scenario (default false: parameters stay gathered over the window)",
    )
    r.add_argument(
        "--latency-layers",
        type=int,
        default=d.latency_layers,
        help="latency scenario: tiny blocks, each its own FSDP unit (compute negligible: per-unit CPU cost shows)",
    )
    r.add_argument("--latency-hidden", type=int, default=d.latency_hidden, help="latency scenario: model width")
    r.add_argument(
        "--latency-batch", type=int, default=d.latency_batch, help="latency scenario: sequences per rank per step"
    )
    r.add_argument("--latency-steps", type=int, default=d.latency_steps, help="latency scenario: timed steps per run")
    r.add_argument(
        "--collective-calls",
        type=int,
        default=d.collective_calls,
        help="latency scenario: 1-element all-reduces per timing block of the collectives layer (ours vs raw)",
    )
    r.add_argument("--zero2-world-size", type=int, default=d.zero2_world_size, help="ranks of the zero2 scenario")
    r.add_argument(
        "--zero2-group-size",
        type=int,
        default=d.zero2_group_size,
        help="zero2 group (= ranks per node in the cost model)",
    )
    h = p.add_argument_group("hybrid scenario (always on a simulated link: the node layout decides each group's)")
    h.add_argument("--hybrid-world-size", type=int, default=d.hybrid_world_size, help="ranks of the hybrid scenario")
    h.add_argument(
        "--hybrid-ranks-per-node",
        type=int,
        default=d.hybrid_ranks_per_node,
        help="ranks per simulated node = the shard group (node of rank r: r // this)",
    )
    h.add_argument(
        "--hybrid-intra-gbps", type=float, default=d.hybrid_intra_gbps, help="GB/s of a group inside one node"
    )
    h.add_argument(
        "--hybrid-inter-gbps",
        type=float,
        default=d.hybrid_inter_gbps,
        help="GB/s of a group spanning nodes (default: --hybrid-intra-gbps / 10)",
    )
    h.add_argument(
        "--hybrid-model-nodes", type=int, default=d.hybrid_model_nodes, help="cost model: nodes of the big cluster"
    )
    h.add_argument(
        "--hybrid-model-ranks-per-node",
        type=int,
        default=d.hybrid_model_ranks_per_node,
        help="cost model: ranks per node of the big cluster",
    )
    r.add_argument("--intra-node-gbps", type=float, default=d.intra_node_gbps, help="cost model: GB/s inside a node")
    r.add_argument("--inter-node-gbps", type=float, default=d.inter_node_gbps, help="cost model: GB/s across nodes")
    r.add_argument(
        "--cost-model-unit-ms",
        type=float,
        default=d.cost_model_unit_ms,
        help="cluster prediction: also predict with this forward+backward compute per unit (ms), e.g. a GPU's",
    )
    s = p.add_argument_group("simulated link (every peer; fairscale via its collectives layer, others via c10d)")
    s.add_argument(
        "--link-gbps",
        type=float,
        default=d.link_gbps,
        help="delay every collective by latency + bytes / bandwidth (GB/s); default: no delay",
    )
    s.add_argument("--link-latency-us", type=float, default=d.link_latency_us, help="per-collective latency (us)")
    s.add_argument(
        "--link-intra-gbps",
        type=float,
        default=d.link_intra_gbps,
        help="bandwidth of the zero2 group (inside a node) when --link-gbps is set; default: --link-gbps",
    )
    s.add_argument(
        "--overlap-gbps",
        type=float,
        nargs="+",
        default=list(d.overlap_gbps),
        help="link bandwidths of the overlap scenario",
    )
    s.add_argument("--overlap-steps", type=int, default=d.overlap_steps, help="timed steps per overlap run")
    e = p.add_argument_group("environment and output")
    e.add_argument("--device", choices=("cpu", "cuda"), default=d.device, help="cuda: one GPU per rank, NCCL")
    e.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank (0: cores / ranks)")
    e.add_argument("--out", default=d.out, help="JSON file with every number ('' to skip)")
    e.add_argument("--plot", default=d.plot, help="PNG with loss curves and step times ('' to skip; needs matplotlib)")
    e.add_argument("--timeout", type=float, default=d.timeout, help="seconds before a hung world is killed")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> BenchConfig:
    """Parse and validate the command line; errors exit with argparse's usage message."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    compare = tuple(_split_list(ns.compare))
    scenarios = tuple(_split_list(ns.scenario))
    if "all" in scenarios:
        scenarios = SCENARIOS
    cfg = BenchConfig(
        layers=ns.layers,
        hidden=ns.hidden,
        heads=ns.heads,
        seq_len=ns.seq_len,
        vocab=ns.vocab,
        batch=ns.batch,
        microbatches=ns.microbatches,
        world_size=ns.world_size,
        reshard_after_forward=tuple(dict.fromkeys(ns.reshard_after_forward)),
        mixed_precision=ns.mixed_precision,
        flatten=ns.flatten,
        optimize_backward_concat=ns.optimize_backward_concat,
        checkpoint_activations=ns.checkpoint_activations,
        auto_wrap_policy=ns.auto_wrap_policy,
        wrap_min_params=ns.wrap_min_params,
        steps=ns.steps,
        warmup=ns.warmup,
        seed=ns.seed,
        lr=ns.lr,
        compare=compare,
        scenarios=tuple(dict.fromkeys(scenarios)),
        accum_microbatches=ns.accum_microbatches,
        accum_batch=ns.accum_batch,
        accum_reshard_after_forward=ns.accum_reshard_after_forward,
        zero2_world_size=ns.zero2_world_size,
        latency_layers=ns.latency_layers,
        latency_hidden=ns.latency_hidden,
        latency_batch=ns.latency_batch,
        latency_steps=ns.latency_steps,
        collective_calls=ns.collective_calls,
        zero2_group_size=ns.zero2_group_size,
        intra_node_gbps=ns.intra_node_gbps,
        inter_node_gbps=ns.inter_node_gbps,
        link_gbps=ns.link_gbps,
        link_latency_us=ns.link_latency_us,
        link_intra_gbps=ns.link_intra_gbps,
        hybrid_world_size=ns.hybrid_world_size,
        hybrid_ranks_per_node=ns.hybrid_ranks_per_node,
        hybrid_intra_gbps=ns.hybrid_intra_gbps,
        hybrid_inter_gbps=ns.hybrid_inter_gbps,
        hybrid_model_nodes=ns.hybrid_model_nodes,
        hybrid_model_ranks_per_node=ns.hybrid_model_ranks_per_node,
        overlap_gbps=tuple(ns.overlap_gbps),
        overlap_steps=ns.overlap_steps,
        cost_model_unit_ms=ns.cost_model_unit_ms,
        device=ns.device,
        threads=ns.threads,
        out=ns.out or None,
        plot=ns.plot or None,
        timeout=ns.timeout,
    )
    problems = validate(cfg)
    if problems:
        parser.error("; ".join(problems))
    return cfg


def validate(cfg: BenchConfig) -> List[str]:
    """Every problem with ``cfg``, each phrased as what is wrong and what to pass instead."""
    out: List[str] = []
    positive = ("layers", "hidden", "heads", "seq_len", "batch", "microbatches", "world_size", "steps")
    for name in positive:
        if getattr(cfg, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.heads >= 1 and cfg.hidden % cfg.heads != 0:
        out.append(f"--heads ({cfg.heads}) must divide --hidden ({cfg.hidden})")
    if cfg.vocab < 4:
        out.append(f"--vocab must be >= 4 (got {cfg.vocab})")
    if cfg.warmup < 0:
        out.append(f"--warmup must be >= 0 (got {cfg.warmup})")
    unknown = [c for c in cfg.compare if c not in PEERS]
    if unknown or not cfg.compare:
        out.append(f"--compare takes peers among {', '.join(PEERS)} (got {', '.join(cfg.compare) or 'nothing'})")
    bad = [s for s in cfg.scenarios if s not in SCENARIOS]
    if bad or not cfg.scenarios:
        out.append(f"--scenario takes {', '.join(SCENARIOS)} or all (got {', '.join(cfg.scenarios) or 'nothing'})")
    for value in cfg.reshard_after_forward:
        if not isinstance(value, bool) and cfg.world_size % value != 0:
            out.append(f"--reshard-after-forward {value} must divide --world-size {cfg.world_size}")
    if "accum" in cfg.scenarios and cfg.accum_microbatches < 2:
        out.append(f"--accum-microbatches must be >= 2 for an accumulation window (got {cfg.accum_microbatches})")
    for name in ("latency_layers", "latency_hidden", "latency_batch", "latency_steps", "collective_calls"):
        if getattr(cfg, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.accum_batch < 1:
        out.append(f"--accum-batch must be >= 1 (got {cfg.accum_batch})")
    if cfg.wrap_min_params < 0:
        out.append(f"--wrap-min-params must be >= 0 (got {cfg.wrap_min_params})")
    if cfg.seq_len >= 4096 and cfg.vocab >= 4:  # the corpus has tens of thousands (building it takes a second)
        corpus = corpus_tokens(cfg.vocab)
        if cfg.seq_len + 1 >= corpus:
            out.append(f"--seq-len must be below the embedded corpus's {corpus - 1} tokens (got {cfg.seq_len})")
    if cfg.device == "cuda" and not (hasattr(torch, "accelerator") and torch.accelerator.is_available()):
        # Counted without creating a context (the CUDA ranks are spawned, not forked).
        out.append("--device cuda: no CUDA device is available here; run with --device cpu")
    if "zero2" in cfg.scenarios:
        g, n = cfg.zero2_group_size, cfg.zero2_world_size
        if g < 1 or n < 2 or n % g != 0 or g == n:
            out.append(
                f"--zero2-group-size ({g}) must divide --zero2-world-size ({n}) and be smaller than it, e.g. 2 and 4"
            )
    if "hybrid" in cfg.scenarios:
        out += _hybrid_problems(cfg)
    if cfg.threads < 0:
        out.append(f"--threads must be >= 0 (got {cfg.threads})")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        out.append(f"--lr must be a finite number > 0 (got {cfg.lr})")
    if not (cfg.timeout > 0 and math.isfinite(cfg.timeout)):
        out.append(f"--timeout must be a finite number > 0 of seconds (got {cfg.timeout})")
    out += _output_problems(cfg)
    if not (cfg.intra_node_gbps > 0 and cfg.inter_node_gbps > 0):
        out.append("--intra-node-gbps and --inter-node-gbps must be > 0")
    for name in ("link_gbps", "link_intra_gbps"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            out.append(f"--{name.replace('_', '-')} must be > 0 GB/s (omit it for no simulated link; got {value})")
    if cfg.link_intra_gbps is not None and cfg.link_gbps is None:
        out.append("--link-intra-gbps needs --link-gbps (the bandwidth of the full group)")
    if not cfg.link_latency_us >= 0:
        out.append(f"--link-latency-us must be >= 0 (got {cfg.link_latency_us})")
    if not cfg.overlap_gbps or any(not g > 0 for g in cfg.overlap_gbps):
        out.append(f"--overlap-gbps takes bandwidths > 0 GB/s (got {list(cfg.overlap_gbps)})")
    if cfg.cost_model_unit_ms is not None and not cfg.cost_model_unit_ms > 0:
        out.append(f"--cost-model-unit-ms must be > 0 (got {cfg.cost_model_unit_ms})")
    if cfg.overlap_steps < 1:
        out.append(f"--overlap-steps must be >= 1 (got {cfg.overlap_steps})")
    return out


def _output_problems(cfg: BenchConfig) -> List[str]:
    """--out and --plot are written after the whole run: a path that cannot be written is refused before it."""
    out: List[str] = []
    for flag, path in (("--out", cfg.out), ("--plot", cfg.plot)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            out.append(f"{flag} {path} is a directory; pass a file name ('' to skip)")
        elif not os.path.isdir(folder):
            out.append(f"{flag} {path}: the folder {folder} does not exist; create it or pass '' to skip")
        elif not os.access(folder, os.W_OK) or not _can_create(path):
            out.append(f"{flag} {path}: the file cannot be written; pass another path or '' to skip")
    return out


def _can_create(path: str) -> bool:
    """Whether ``path`` can be opened for writing (tried, and a file made for the try removed): the folder's mode
    does not tell for every file system (``/proc``, a read-only mount as root)."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError:
        return False
    if not existed:
        os.remove(path)
    return True


def _hybrid_problems(cfg: BenchConfig) -> List[str]:
    """What is wrong with the hybrid scenario's options."""
    out: List[str] = []
    g, n = cfg.hybrid_ranks_per_node, cfg.hybrid_world_size
    if g < 2 or n % g != 0 or n // g < 2:
        out.append(
            f"--hybrid-ranks-per-node ({g}) must be >= 2 and divide --hybrid-world-size ({n}) into >= 2 nodes, "
            "e.g. 2 and 4"
        )
    if not cfg.hybrid_intra_gbps > 0 or not cfg.hybrid_inter > 0:
        out.append(
            f"--hybrid-intra-gbps and --hybrid-inter-gbps must be > 0 GB/s (got {cfg.hybrid_intra_gbps}, "
            f"{cfg.hybrid_inter_gbps})"
        )
    if cfg.hybrid_model_nodes < 2 or cfg.hybrid_model_ranks_per_node < 2:
        out.append(
            f"--hybrid-model-nodes and --hybrid-model-ranks-per-node must be >= 2 (got {cfg.hybrid_model_nodes}, "
            f"{cfg.hybrid_model_ranks_per_node})"
        )
    return out
