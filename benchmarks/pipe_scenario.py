#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The ``pipe`` scenario of the main job: fairscale's pipeline parallelism against PyTorch's, on the benchmark GPT.

The GPT is cut into 2 stages as an ``nn.Sequential`` (embeddings + the first half of the blocks | the other blocks +
final norm + head) and trained from the same weights, on the same batches, split into ``--pipe-chunks`` (default 8)
micro-batches, three ways:

* ``Pipe``: :class:`fairscale.nn.Pipe` on one host (rank 0; both stages on rank 0's device, one worker thread per
  distinct device), no checkpointing;
* ``AsyncPipe``: :class:`fairscale.nn.pipe.AsyncPipe`, one stage per rank over 2 ranks;
* ``torch``: ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``), one stage per rank.

Per peer and stage: median step time, bubble fraction (1 - the stage's measured compute time / step time; compute
is timed per micro-batch in forward and backward by markers around the stage), peak memory (accelerator memory on
CUDA, the process's peak RSS on CPU), and the loss curve (the peers must agree).

Run through the main job (``python benchmarks/fsdp.py --scenario pipe``) or alone
(``python benchmarks/pipe_scenario.py --layers 4 --steps 5``). The world has 2 ranks.
"""

import inspect
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fsdp_bench.scenario_args import split_scenario_args  # noqa: E402
from _fsdp_bench.config import BenchConfig, parse_args  # noqa: E402
from _fsdp_bench.corpus import Corpus  # noqa: E402
from _fsdp_bench.model import GPT, build_model, lm_loss  # noqa: E402

from _fsdp_bench.worlds import run_function  # noqa: E402
from fairscale.internal import collectives  # noqa: E402
from fairscale.internal.device import DeviceHandle, cpu_peak_rss_bytes, current_accelerator_device  # noqa: E402
from fairscale.nn.pipe import AsyncPipe, Pipe  # noqa: E402

SCENARIO = "pipe"
VARIANTS = ("Pipe", "AsyncPipe", "torch")
STAGES = 2
CHUNKS_ENV = "FAIRSCALE_PIPE_CHUNKS"
DEFAULT_CHUNKS = 8


def split_scenario(argv: Sequence[str]) -> Tuple[Optional[List[str]], Optional[List[str]]]:
    """Split the main job's command line for the ``pipe`` scenario (see :func:`split_scenario_args`)."""
    return split_scenario_args(argv, SCENARIO)


class Embed(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb

    def forward(self, idx: Tensor) -> Tensor:
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln_f(x))


class _Mark(torch.autograd.Function):
    """Identity that notes the time its backward runs (the edges of a stage's backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, clock: "StageClock", edge: str) -> Tensor:
        ctx.clock, ctx.edge = clock, edge
        # A new tensor on the same storage (no copy) that is not a view: torch 2.6's pipelining detaches the last
        # stage's outputs in place, which views refuse ("Can't detach views in-place").
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        ctx.clock.backward_edge(ctx.edge)
        return grad, None, None


class StageClock:
    """Sums a stage's compute time: forward per call, backward between the output's and the input's gradient."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._bwd_start: List[float] = []

    def backward_edge(self, edge: str) -> None:
        if edge == "out":
            self._bwd_start.append(time.perf_counter())
        elif self._bwd_start:
            self.busy += time.perf_counter() - self._bwd_start.pop()


class Timed(nn.Module):
    """Wraps a stage's layers; times each forward and the matching backward with :class:`_Mark`."""

    def __init__(self, layers: nn.Sequential, clock: StageClock) -> None:
        super().__init__()
        self.layers = layers
        self.clock = clock

    def forward(self, x: Tensor) -> Tensor:
        start = time.perf_counter()
        if x.is_floating_point() and torch.is_grad_enabled():
            x = _Mark.apply(x.requires_grad_() if not x.requires_grad else x, self.clock, "in")
        y = self.layers(x)
        self.clock.busy += time.perf_counter() - start
        return _Mark.apply(y, self.clock, "out") if torch.is_grad_enabled() else y


def stages(cfg: BenchConfig, clocks: List[StageClock]) -> nn.Sequential:
    """The benchmark GPT as 2 timed stages (same weights for every peer)."""
    gpt = build_model(cfg, torch.device("cpu"))
    half = cfg.layers // 2
    first = nn.Sequential(Embed(gpt), *gpt.blocks[:half])
    second = nn.Sequential(*gpt.blocks[half:], Head(gpt))
    return nn.Sequential(Timed(first, clocks[0]), Timed(second, clocks[1]))


def _sgd(module: nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None


def _device(rank: int) -> torch.device:
    # The engine pins each CUDA rank to its GPU; on CPU every rank computes on the CPU.
    return current_accelerator_device() or torch.device("cpu")


def _run_variant(variant: str, cfg: BenchConfig, chunks: int, rank: int) -> Dict[str, Any]:
    device = _device(rank)
    handle = DeviceHandle.for_device(device)
    clocks = [StageClock(), StageClock()]
    model = stages(cfg, clocks).to(device)
    corpus = Corpus(cfg.vocab, cfg.seq_len, cfg.seed)
    losses: List[float] = []
    times: List[float] = []
    busy: List[List[float]] = []  # per step: compute seconds of each stage hosted here
    handle.reset_peak_memory_stats()
    first_micro_batch = corpus.batch(0, 0, 0, 1, cfg.batch)[0].to(device).tensor_split(chunks)[0]
    step_fn = _make_step(variant, model, chunks, rank, device, first_micro_batch)
    for step in range(cfg.warmup + cfg.steps):
        inputs, targets = (t.to(device) for t in corpus.batch(step, 0, 0, 1, cfg.batch))
        collectives.barrier()
        before = [c.busy for c in clocks]
        start = time.perf_counter()
        loss = step_fn(inputs, targets)
        handle.synchronize()
        elapsed = time.perf_counter() - start
        _sgd(model, cfg.lr)
        if loss is not None:
            losses.append(loss)
        if step >= cfg.warmup:
            times.append(elapsed)
            busy.append([c.busy - b for c, b in zip(clocks, before)])
    peak = handle.max_memory_allocated() if handle.is_accelerator else cpu_peak_rss_bytes()
    return {"times": times, "busy": busy, "losses": losses, "peak_bytes": peak}


def _match_link_opening_dtypes(stage: Any) -> None:
    """Make the dummy tensors a torch pipelining stage sends to open its links match the ones its peers receive.

    Before torch 2.10 (pytorch/pytorch#165143, fixed by #165539) a stage sends its index as an int64 scalar into its
    neighbour's ``torch.zeros(1)`` (the default dtype): NCCL does not check the sizes (undefined behaviour), gloo
    aborts both processes ("8 vs 4. Received data size doesn't match expected size"). Such an integer send is cast
    to the default dtype here, the receiving buffer's on those releases (every rank of the benchmark shares it); torch
    >= 2.10 sends and receives float32, and releases without this step (2.6 and before) have nothing to change.
    """
    make_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if make_ops is None:
        return

    def matched_ops() -> List[Any]:
        ops = make_ops()
        for op in ops:
            # Only the int64 index is wrong; a floating buffer (every receive, and the sends of torch >= 2.10) is kept.
            if not op.tensor.is_floating_point():
                op.tensor = op.tensor.to(torch.get_default_dtype())
        return ops

    stage._get_init_p2p_neighbors_ops = matched_ops


def _make_step(
    variant: str, model: nn.Sequential, chunks: int, rank: int, device: torch.device, first_micro_batch: Tensor
) -> Any:
    balance = [1, 1]
    if variant == "Pipe":
        if rank != 0:
            return lambda inputs, targets: None
        pipe = Pipe(model, balance, devices=[device, device], chunks=chunks, checkpoint="never")

        def pipe_step(inputs: Tensor, targets: Tensor) -> float:
            loss = lm_loss(pipe(inputs), targets)
            loss.backward()
            return float(loss.detach())

        return pipe_step
    if variant == "AsyncPipe":
        apipe = AsyncPipe(model, balance, group=torch.distributed.group.WORLD, chunks=chunks, checkpoint="never")

        def async_step(inputs: Tensor, targets: Tensor) -> Optional[float]:
            out = apipe(inputs)
            if not apipe.final_stage:
                return None
            loss = lm_loss(out, targets)
            loss.backward()
            return float(loss.detach())

        return async_step
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    kwargs: Dict[str, Any] = {}
    input_args = inspect.signature(PipelineStage.__init__).parameters.get("input_args")
    if input_args is not None and input_args.default is inspect.Parameter.empty:
        # torch 2.4's stages take example inputs and outputs instead of learning the shapes from the first step
        # (without outputs it runs the stage on uninitialised inputs: token ids out of the vocabulary).
        with torch.no_grad():
            hidden = model[0](first_micro_batch)
            kwargs["input_args"] = (first_micro_batch if rank == 0 else hidden,)
            kwargs["output_args"] = (hidden if rank == 0 else model[1](hidden),)
    stage = PipelineStage(model[rank], rank, STAGES, device, **kwargs)
    _match_link_opening_dtypes(stage)
    # torch >= 2.7 divides the summed micro-batch gradients by their number (scale_grads, on by default), as Pipe's
    # mean loss does; before, it summed them: there each micro-batch's loss is divided here instead.
    per_chunk = 1 if "scale_grads" in inspect.signature(ScheduleGPipe.__init__).parameters else chunks

    def loss_fn(out: Tensor, targets: Tensor) -> Tensor:
        return lm_loss(out, targets) / per_chunk

    schedule = ScheduleGPipe(stage, n_microbatches=chunks, loss_fn=loss_fn)

    def torch_step(inputs: Tensor, targets: Tensor) -> Optional[float]:
        if rank == 0:
            schedule.step(inputs)
            return None
        step_losses: List[Tensor] = []
        schedule.step(target=targets, losses=step_losses)
        return float(torch.stack(step_losses).mean()) * per_chunk

    return torch_step


def _chunks() -> int:
    return int(os.environ.get(CHUNKS_ENV, DEFAULT_CHUNKS))


def _rank_body(rank: int, world_size: int, cfg: BenchConfig) -> Dict[str, List[Dict[str, Any]]]:
    chunks = _chunks()
    results: Dict[str, List[Dict[str, Any]]] = {}
    for variant in VARIANTS:
        results[variant] = collectives.all_gather_object(_run_variant(variant, cfg, chunks, rank))
    return results


def summarize(per_rank: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Per peer: median step time (slowest rank), bubble fraction and peak memory per stage, losses."""
    rows: Dict[str, Dict[str, Any]] = {}
    for variant, ranks in per_rank.items():
        hosts = ranks[:1] if variant == "Pipe" else ranks  # Pipe: both stages live on rank 0
        step = max(statistics.median(r["times"]) for r in hosts)
        row: Dict[str, Any] = {"step_ms": 1000 * step}
        for j in range(STAGES):
            # Only the rank hosting stage j has time on its clock.
            busy = max(statistics.median([b[j] for b in r["busy"]]) if r["busy"] else 0.0 for r in hosts)
            host = hosts[0] if variant == "Pipe" else hosts[j]
            row[f"busy_ms_stage{j}"] = 1000 * busy
            row[f"bubble_stage{j}"] = max(0.0, 1 - busy / step) if step > 0 else 0.0
            row[f"peak_mb_stage{j}"] = host["peak_bytes"] / 2**20
        row["losses"] = next((r["losses"] for r in ranks if r["losses"]), [])
        rows[variant] = row
    reference = rows["torch"]["losses"]
    for row in rows.values():
        row["max_loss_diff_vs_torch"] = max((abs(a - b) for a, b in zip(row["losses"], reference)), default=0.0)
    return rows


def format_table(rows: Dict[str, Dict[str, Any]]) -> str:
    lines = [f"pipe scenario: 2 stages, {_chunks()} micro-batches (Pipe: both stages on rank 0's device)"]
    header = f"{'peer':<10} {'step ms':>9} {'bubble s0':>10} {'bubble s1':>10} {'peak MB s0':>11} {'peak MB s1':>11}"
    lines.append(header + f" {'loss diff vs torch':>19}")
    for variant, row in rows.items():
        lines.append(
            f"{variant:<10} {row['step_ms']:>9.1f} {row['bubble_stage0']:>10.2f} {row['bubble_stage1']:>10.2f}"
            f" {row['peak_mb_stage0']:>11.1f} {row['peak_mb_stage1']:>11.1f} {row['max_loss_diff_vs_torch']:>19.2e}"
        )
    return "\n".join(lines)


def run(argv: Sequence[str]) -> int:
    """Parse the shared options, run the three peers in one 2-rank world, print the table, write the JSON."""
    cfg = parse_args(list(argv))
    if cfg.layers < 2:
        raise SystemExit("the pipe scenario needs --layers >= 2 (one half per stage)")
    device = "cuda" if cfg.device == "cuda" else "cpu"
    results = run_function(_rank_body, STAGES, cfg, device=device, timeout=cfg.timeout)[0]
    rows = summarize(results)
    print("\n" + format_table(rows))
    if cfg.out:
        root, ext = os.path.splitext(cfg.out)
        path = f"{root}_pipe{ext or '.json'}"
        with open(path, "w") as f:
            json.dump({"chunks": _chunks(), "config": vars(cfg), "runs": rows}, f, indent=1, default=str)
        print(f"JSON: {os.path.abspath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
