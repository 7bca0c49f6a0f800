# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""One benchmark run on one rank: the timed training loop, then an untimed probe run on a fresh copy.

Timed loop: ``warmup + steps`` optimizer steps; each step runs ``microbatches`` forward/backward passes (gradient
sync only in the last) and AdamW. Wall time is taken per accumulation window (all forward/backward passes) and per
step (window + optimizer), with a device synchronize on accelerators. fairscale's collective counter is active
during every step (it only appends a record per collective). The runs of a scenario live side by side and take
their steps in turn.

Probe run: the model is built again from the same seed and trained for six steps (the first initialises lazily);
the next three are the memory steps (the highest peak of the three), the fifth runs under the torch profiler (the
ops in backward), the sixth with the collective spy on (every implementation's collectives), and in the latency
scenario a seventh under cProfile (Python calls). Nothing of it slows the timed loop down. On CPU, memory is the C
heap in use (:mod:`.heap`) relative to just before the model was built, sampled during the memory steps, with no
profiler running (its event buffers are in the same heap); without glibc the fallback is the profiler's allocator
events over a single memory step, and the profiler then runs from the model's construction through that step,
which is also its ops step.
"""

import contextlib
import gc
import statistics
import time
from typing import Any, Callable, ContextManager, Dict, List

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fairscale.internal.collectives import count_collectives
from fairscale.internal.device import DeviceHandle

from .config import BenchConfig
from .corpus import Corpus
from .heap import HEAP_METHOD_PREFIX, HeapSampler, heap_in_use
from .latency import count_python_calls
from .link import NodeLayout, link_for_peer
from .model import lm_loss
from .peers import Peer, RunSpec, build_peer
from .probes import BACKWARD, PROBE_STEP, CommSpy, analyze_profile, quiet_stderr, summary_by_ranks

Progress = Callable[[int, int, float, float], None]

#: Steps of the probe run whose highest memory is reported (see probe_run).
MEMORY_STEPS = 3


def _window(
    peer: Peer,
    corpus: Corpus,
    cfg: BenchConfig,
    spec: RunSpec,
    step: int,
    rank: int,
    world: int,
    device: torch.device,
    spy: Any = None,
    annotate: bool = False,
) -> torch.Tensor:
    """Forward and backward of every microbatch of one step; returns the step's loss (mean over microbatches)."""
    total = torch.zeros((), device=device)
    phase = spy.phase if spy is not None else (lambda _name: contextlib.nullcontext())
    for mb in range(spec.microbatches):
        tokens, targets = (t.to(device) for t in corpus.batch(step, mb, rank, world, cfg.batch))
        with peer.microbatch(mb == spec.microbatches - 1):
            with phase("forward"), peer.forward_context():
                loss = lm_loss(peer.model(tokens), targets) / spec.microbatches
            with phase("backward"), record_function(BACKWARD) if annotate else contextlib.nullcontext():
                loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
        total += loss.detach()
    return total


class TimedRun:
    """The timed training loop of one run on this rank, advanced one step at a time.

    The runs of a scenario are stepped in turn (step 0 of every run, then step 1 ...), so that load from anything
    else on the machine, which changes over time, is spread over all runs instead of landing on whichever ran
    while it was there.
    """

    def __init__(
        self, spec: RunSpec, cfg: BenchConfig, corpus: Corpus, rank: int, world: int, device: torch.device
    ) -> None:
        self.spec, self.cfg, self.corpus = spec, cfg, corpus
        self.rank, self.world, self.device = rank, world, device
        self.handle = DeviceHandle.for_device(device)
        self.peer = build_peer(spec, cfg, device)
        self.optim = torch.optim.AdamW(self.peer.model.parameters(), lr=cfg.lr)
        self.losses: List[float] = []
        self.window_s: List[float] = []
        self.step_s: List[float] = []
        # CPU time of the step: the whole process (every thread: gloo's included) and the rank's own thread.
        self.cpu_s: List[float] = []
        self.thread_cpu_s: List[float] = []
        self.collectives: List[Dict[str, Dict[str, int]]] = []
        # The last step's collectives per group (global ranks), from fairscale's counter.
        self.collectives_by_ranks: Dict[str, Dict[str, int]] = {}

    def step(self, step: int) -> None:
        """Run and time optimizer step ``step``."""
        self.handle.synchronize()
        c0, tc0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        with count_collectives() as counter, self._link():
            loss = _window(self.peer, self.corpus, self.cfg, self.spec, step, self.rank, self.world, self.device)
            self.handle.synchronize()
            t1 = time.perf_counter()
            self.optim.step()
            self.optim.zero_grad(set_to_none=True)
            self.handle.synchronize()
        t2 = time.perf_counter()
        self.cpu_s.append(time.process_time() - c0)
        self.thread_cpu_s.append(time.thread_time() - tc0)
        self.losses.append(float(loss.item()))
        self.window_s.append(t1 - t0)
        self.step_s.append(t2 - t0)
        self.collectives.append(counter.summary())
        self.collectives_by_ranks = summary_by_ranks(
            (r.kind, r.phase or "none", r.ranks, r.bytes) for r in counter.records
        )

    def _link(self) -> ContextManager[None]:
        """The simulated link around the step: ``--link-gbps`` (nothing without it), or in the hybrid scenario always
        the node layout's (see link.NodeLayout)."""
        cfg = self.cfg
        if self.spec.scenario == "hybrid":
            # Always on a simulated link, each group's bandwidth from its ranks (the floor run passes ops through).
            layout = NodeLayout(cfg.hybrid_ranks_per_node, cfg.hybrid_intra_gbps, cfg.hybrid_inter)
            gbps = None if self.spec.floor else cfg.hybrid_inter
            return link_for_peer(self.spec.peer, gbps, cfg.link_latency_us, None, layout)
        intra = {} if cfg.link_intra_gbps is None else {cfg.zero2_group_size: cfg.link_intra_gbps}
        return link_for_peer(self.spec.peer, cfg.link_gbps, cfg.link_latency_us, intra)

    def close(self) -> Dict[str, Any]:
        """Free the model; returns per-step losses, times and collective counts."""
        notes = self.peer.notes
        del self.peer, self.optim
        return {
            "loss": self.losses,
            "window_s": self.window_s,
            "step_s": self.step_s,
            "cpu_s": self.cpu_s,
            "thread_cpu_s": self.thread_cpu_s,
            "collectives": self.collectives,
            "collectives_by_ranks": self.collectives_by_ranks,
            "notes": notes,
        }


def timed_runs(
    specs: List[RunSpec],
    cfg: BenchConfig,
    corpus: Corpus,
    rank: int,
    world: int,
    device: torch.device,
    progress: Progress,
) -> List[Dict[str, Any]]:
    """Build every run of ``specs`` and step them in turn (the order rotates every step); one result per spec."""
    if not specs:
        return []
    runs = [TimedRun(spec, cfg, corpus, rank, world, device) for spec in specs]
    total = cfg.warmup + cfg.steps
    for step in range(total):
        for i in range(len(runs)):
            runs[(step + i) % len(runs)].step(step)
        progress(step + 1, total, runs[0].losses[-1], statistics.median(r.step_s[-1] for r in runs))
    results = [r.close() for r in runs]
    del runs
    gc.collect()
    return results


def probe_run(
    spec: RunSpec, cfg: BenchConfig, corpus: Corpus, rank: int, world: int, device: torch.device
) -> Dict[str, Any]:
    """Build again and run the probe steps: memory over the second to fourth, ops in the fifth (see the module
    docstring)."""
    handle = DeviceHandle.for_device(device)
    on_cpu = device.type == "cpu"
    gc.collect()
    spy = CommSpy()
    heap_base = heap_in_use() if on_cpu else None
    # The profiler's allocator events are the CPU fallback where the C heap cannot be read: then the profiler runs
    # from the model's construction and the second step is measured under it, as before. Otherwise the profiler
    # only watches the third step: its event buffers live in the same C heap and grow with every op (about 4 MiB
    # per step of the default model), which would count them in the peak, more for a peer that runs more ops.
    events_memory = on_cpu and heap_base is None
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=events_memory)
    profiling = False

    def start_profiler() -> None:
        nonlocal profiling
        with quiet_stderr():  # kineto prints a line to stderr when it starts and stops
            prof.start()
        profiling = True

    def train_step(step: int, annotate: bool) -> None:
        _window(peer, corpus, cfg, spec, step, rank, world, device, annotate=annotate)
        optim.step()
        optim.zero_grad(set_to_none=True)
        handle.synchronize()

    if events_memory:
        start_profiler()
    try:
        peer = build_peer(spec, cfg, device)
        optim = torch.optim.AdamW(peer.model.parameters(), lr=cfg.lr)
        train_step(0, annotate=False)
        handle.reset_peak_memory_stats()
        steady_device = handle.memory_allocated()
        heap_steady = heap_in_use()
        if events_memory:
            sampler = None
            with record_function(PROBE_STEP):
                train_step(1, annotate=True)
            peak_device = handle.max_memory_allocated()
        else:
            # The highest of a few steps: a step's peak depends on when the asynchronous collectives free their
            # buffers (one step's peak moved by up to 2 MiB from rank to rank on the default model).
            with HeapSampler() if heap_base is not None else contextlib.nullcontext() as sampler:
                for i in range(MEMORY_STEPS):
                    train_step(1 + i, annotate=False)
            peak_device = handle.max_memory_allocated()
            start_profiler()
            with record_function(PROBE_STEP):
                train_step(1 + MEMORY_STEPS, annotate=True)
        # The spy is a Python dispatch mode: every op then runs through Python, which changes what is allocated and
        # when it is freed (on CPU it moved fairscale's peak up by 7 MiB and FSDP2's down by 3 on the 6 x 256 model).
        # So it watches a step of its own, after the measured ones.
        with spy:
            _window(peer, corpus, cfg, spec, 2 + MEMORY_STEPS, rank, world, device, spy=spy)
            with spy.phase("optimizer"):
                optim.step()
                optim.zero_grad(set_to_none=True)
            handle.synchronize()
    finally:
        if profiling:
            with quiet_stderr():
                prof.stop()
    calls = None
    if spec.scenario == "latency":
        # A last step under cProfile (after the torch profiler stopped: the two would count each other): how many
        # Python calls each peer makes per step, which is what its CPU time per unit is made of on a tiny model.
        calls = count_python_calls(lambda: train_step(3 + MEMORY_STEPS, annotate=False))
    analysis = analyze_profile(prof, spec.microbatches, track_memory=on_cpu and heap_base is None)
    if on_cpu and heap_base is not None and heap_steady is not None and sampler is not None:
        # Since model construction, the profiler never on (see above).
        memory = {"steady_bytes": heap_steady - heap_base, "peak_bytes": sampler.peak - heap_base}
        method = f"{HEAP_METHOD_PREFIX} (main arena + mmap), sampled every 0.1 ms, since model construction"
    elif on_cpu:
        memory = analysis["memory"]
        method = "torch profiler CPU allocator events since model construction (live tensor bytes)"
    else:
        memory = {"steady_bytes": steady_device, "peak_bytes": peak_device}
        method = f"{device.type} caching allocator: memory_allocated / max_memory_allocated"
    del peer, optim, prof
    gc.collect()
    return {
        "memory": memory,
        "memory_method": method,
        "backward_ops": analysis["backward_ops"],
        "spy": spy.summary(),
        "spy_by_ranks": spy.summary_by_ranks(),
        "calls": calls,
    }
