#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``tp`` scenario of the main job: fairscale's tensor parallelism against PyTorch's, on the benchmark GPT.

The attention projections (q, k, v column-parallel; proj row-parallel) and the MLP (fc column-parallel; out
row-parallel) of every block are split over model-parallel groups of 2 ranks; embeddings, norms and the LM head
stay replicated. Two peers, from the same initial weights:

* ``fairscale``: :class:`~fairscale.nn.model_parallel.ColumnParallelLinear` /
  :class:`~fairscale.nn.model_parallel.RowParallelLinear`; with more than 2 ranks, FSDP over the data-parallel
  group (``get_data_parallel_group()``);
* ``torch``: ``torch.distributed.tensor.parallel`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a
  ``(dp, tp)`` device mesh; with more than 2 ranks, ``fully_shard`` (FSDP2) over the ``dp`` mesh dimension.

Per peer: median step time (slowest rank), parameter bytes per rank, peak accelerator memory (CUDA only), the loss
curve (the peers must agree), and the model-parallel traffic. fairscale's is read from the collective counter and
compared with the formula: per block, 2 all-reduces of the ``[batch, seq, hidden]`` activation in forward (after
each row-parallel layer) and 4 in backward (the input gradient of each column-parallel layer), so
``6 * layers * batch * seq * hidden * 4`` bytes per step in fp32. PyTorch's is counted with ``CommDebugMode``.

Run through the main job (``python benchmarks/fsdp.py --scenario tp``, with its model and world options; the
world size must be 2 or a multiple of 2) or on its own (``python benchmarks/tp_scenario.py --world-size 4``).
"""

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp_bench.scenario_args import split_scenario_args  # noqa: E402
from _fsdp_bench.config import BenchConfig, parse_args  # noqa: E402
from _fsdp_bench.corpus import Corpus  # noqa: E402
from _fsdp_bench.model import GPT, build_model, lm_loss  # noqa: E402
from _fsdp_bench.peers import _fully_shard  # noqa: E402

from _fsdp_bench.worlds import run_function  # noqa: E402
from fairscale.internal import collectives  # noqa: E402
from fairscale.internal.device import DeviceHandle  # noqa: E402
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP  # noqa: E402
from fairscale.nn.model_parallel import initialize as mpu  # noqa: E402
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402

VARIANTS = ("fairscale", "torch")
SCENARIO = "tp"
MODEL_PARALLEL = 2
COLUMN = ("attn.q", "attn.k", "attn.v", "fc")
ROW = ("attn.proj", "out")


def split_scenario(argv: Sequence[str]) -> Tuple[Optional[List[str]], Optional[List[str]]]:
    """Split the main job's command line for the ``tp`` scenario (see :func:`split_scenario_args`)."""
    return split_scenario_args(argv, SCENARIO)


class TPAttention(nn.Module):
    """The benchmark's causal attention on this rank's heads: q/k/v outputs hold ``heads / tp`` heads."""

    def __init__(self, attn: nn.Module, tp: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.local_heads = attn.heads // tp

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.reshape(b, t, self.local_heads, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _base_model(cfg: BenchConfig) -> GPT:
    model = build_model(cfg, torch.device("cpu"))
    for block in model.blocks:
        block.attn = TPAttention(block.attn, MODEL_PARALLEL)
    return model


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _fairscale_linear(dense: nn.Linear, column: bool) -> nn.Module:
    """The parallel layer holding this rank's slice of ``dense`` (same values as the torch peer's shard)."""
    rank = mpu.get_model_parallel_rank()
    if column:
        layer: nn.Module = ColumnParallelLinear(dense.in_features, dense.out_features, gather_output=False)
        weight, bias = dense.weight.chunk(MODEL_PARALLEL, 0)[rank], dense.bias.chunk(MODEL_PARALLEL, 0)[rank]
    else:
        layer = RowParallelLinear(dense.in_features, dense.out_features, input_is_parallel=True)
        weight, bias = dense.weight.chunk(MODEL_PARALLEL, 1)[rank], dense.bias
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def _build_fairscale(cfg: BenchConfig, device: torch.device, dp: int) -> nn.Module:
    mpu.initialize_model_parallel(MODEL_PARALLEL)
    model = _base_model(cfg)
    for block in model.blocks:
        for path in COLUMN + ROW:
            _set_submodule(block, path, _fairscale_linear(block.get_submodule(path), path in COLUMN))
    model = model.to(device)
    if dp == 1:
        return model
    group = mpu.get_data_parallel_group()
    return FSDP(model, process_group=group, process_group_reduce_scatter=group)


def _build_torch(cfg: BenchConfig, device: torch.device, dp: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # Same layout as fairscale's grid: model-parallel pairs are consecutive ranks.
    mesh = init_device_mesh(device.type, (dp, MODEL_PARALLEL), mesh_dim_names=("dp", "tp"))
    model = _base_model(cfg).to(device)
    plan: Dict[str, Any] = {p: ColwiseParallel() for p in COLUMN}
    plan.update({p: RowwiseParallel() for p in ROW})
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
    if dp > 1:
        # Looked up only here: FSDP2 is public in torch.distributed.fsdp from 2.6 (under _composable in 2.4/2.5), and
        # the 2-rank run (dp == 1) needs none.
        fully_shard = _fully_shard()
        if fully_shard is None:
            raise SystemExit("the tp scenario's torch peer needs FSDP2 (fully_shard) with more than 2 ranks")
        fully_shard(model, mesh=mesh["dp"])
    return model


def _param_bytes(model: nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _step(model: nn.Module, optimizer: Any, inputs: Tensor, targets: Tensor) -> float:
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return float(loss.item())


def _run_variant(variant: str, cfg: BenchConfig, corpus: Corpus, rank: int, world_size: int) -> Dict[str, Any]:
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    handle = DeviceHandle.for_device(device)
    handle.reset_peak_memory_stats()
    dp = world_size // MODEL_PARALLEL
    build = _build_fairscale if variant == "fairscale" else _build_torch
    model = build(cfg, device, dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    dp_rank = rank // MODEL_PARALLEL
    times: List[float] = []
    losses: List[float] = []
    comm: Dict[str, Any] = {}
    for step in range(cfg.warmup + cfg.steps):
        inputs, targets = (t.to(device) for t in corpus.batch(step, 0, dp_rank, dp, cfg.batch))
        handle.synchronize()
        start = time.perf_counter()
        if step == 0:
            losses.append(_counted_step(variant, model, optimizer, inputs, targets, comm))
        else:
            losses.append(_step(model, optimizer, inputs, targets))
        handle.synchronize()
        if step >= cfg.warmup:
            times.append(time.perf_counter() - start)
    if variant == "fairscale":
        mpu.destroy_model_parallel()
    return {
        "step_s": statistics.median(times) if times else 0.0,
        "param_bytes": _param_bytes(model),
        "peak_bytes": handle.max_memory_allocated(),
        "losses": losses,
        **comm,
    }


def _counted_step(
    variant: str, model: nn.Module, optimizer: Any, inputs: Tensor, targets: Tensor, out: Dict[str, Any]
) -> float:
    """One step with the model-parallel communication recorded (fairscale: counter; torch: CommDebugMode)."""
    if variant == "fairscale":
        with collectives.count_collectives() as counter:
            loss = _step(model, optimizer, inputs, targets)
        out["tp_all_reduces"] = counter.count("all_reduce", group_size=MODEL_PARALLEL)
        out["tp_bytes"] = counter.total_bytes("all_reduce", group_size=MODEL_PARALLEL)
        return loss
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        loss = _step(model, optimizer, inputs, targets)
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}
    out["tp_all_reduces"] = counts.get("all_reduce", 0)
    out["tp_comm_counts"] = counts
    return loss


def formula_bytes(cfg: BenchConfig) -> int:
    """fp32 bytes all-reduced over a model-parallel group per step: 6 activations per block (2 fwd, 4 bwd)."""
    return 6 * cfg.layers * cfg.batch * cfg.seq_len * cfg.hidden * 4


def _rank_body(rank: int, world_size: int, cfg: BenchConfig) -> Optional[Dict[str, Any]]:
    corpus = Corpus(cfg.vocab, cfg.seq_len, cfg.seed)
    results: Dict[str, Any] = {}
    for variant in VARIANTS:
        results[variant] = collectives.all_gather_object(_run_variant(variant, cfg, corpus, rank, world_size))
    return results if rank == 0 else None


def summarize(per_rank: Dict[str, List[Dict[str, Any]]], cfg: BenchConfig) -> Dict[str, Dict[str, Any]]:
    """One row per peer: slowest rank's median step, per-rank parameter bytes, traffic, loss difference."""
    rows: Dict[str, Dict[str, Any]] = {}
    for variant, ranks in per_rank.items():
        rows[variant] = {
            "step_ms": 1e3 * max(r["step_s"] for r in ranks),
            "param_mb_per_rank": statistics.mean(r["param_bytes"] for r in ranks) / 2**20,
            "peak_mb": max(r["peak_bytes"] for r in ranks) / 2**20,
            "tp_all_reduces": ranks[0]["tp_all_reduces"],
            "tp_mb": ranks[0].get("tp_bytes", 0) / 2**20,
            "losses": ranks[0]["losses"],
        }
    ref = rows["torch"]["losses"]
    for row in rows.values():
        row["max_loss_diff_vs_torch"] = max(abs(a - b) for a, b in zip(row["losses"], ref))
    rows["fairscale"]["tp_mb_formula"] = formula_bytes(cfg) / 2**20
    return rows


def format_table(rows: Dict[str, Dict[str, Any]], world_size: int) -> str:
    dp = world_size // MODEL_PARALLEL
    header = f"{'run':<10} {'step ms':>9} {'params MB/rank':>15} {'peak MB':>8} {'tp all-reduces':>15} {'tp MB':>8} {'loss diff':>10}"
    lines = [f"tp scenario: model parallel {MODEL_PARALLEL} x data parallel {dp} (world size {world_size})", header]
    for name, r in rows.items():
        mb = f"{r['tp_mb']:>8.2f}" if name == "fairscale" else f"{'-':>8}"
        lines.append(
            f"{name:<10} {r['step_ms']:>9.1f} {r['param_mb_per_rank']:>15.2f} {r['peak_mb']:>8.1f} "
            f"{r['tp_all_reduces']:>15} {mb} {r['max_loss_diff_vs_torch']:>10.2e}"
        )
    lines.append(f"formula: {rows['fairscale']['tp_mb_formula']:.2f} MB all-reduced per model-parallel group per step")
    return "\n".join(lines)


def check_config(cfg: BenchConfig) -> None:
    """The world must hold whole model-parallel pairs and the heads/hidden must split in two."""
    problems = []
    if cfg.world_size % MODEL_PARALLEL:
        problems.append(
            f"--world-size must be a multiple of {MODEL_PARALLEL} for the tp scenario (got {cfg.world_size})"
        )
    if cfg.heads % MODEL_PARALLEL:
        problems.append(f"--heads must be a multiple of {MODEL_PARALLEL} for the tp scenario (got {cfg.heads})")
    if problems:
        raise SystemExit("tp scenario: " + "; ".join(problems))


def run(argv: Sequence[str]) -> int:
    """Parse the shared options, run both peers in one world, print the table, write the JSON."""
    cfg = parse_args(list(argv))
    check_config(cfg)
    device = "cuda" if cfg.device == "cuda" else "cpu"
    results = run_function(_rank_body, cfg.world_size, cfg, device=device, timeout=cfg.timeout)[0]
    rows = summarize(results, cfg)
    print("\n" + format_table(rows, cfg.world_size))
    if cfg.out:
        root, ext = os.path.splitext(cfg.out)
        path = f"{root}_tp{ext or '.json'}"
        with open(path, "w") as f:
            json.dump({"world_size": cfg.world_size, "config": vars(cfg), "runs": rows}, f, indent=1, default=str)
        print(f"JSON: {os.path.abspath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
