# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Every code example of ``docs/*.rst`` and ``README.md`` runs, on real gloo worlds, and does what the text says.

Each literal block is registered in :data:`KINDS` (a new block without an entry fails
``test_every_example_is_classified``, so every example gets run). Python blocks are executed as written; the only
edits are the explicit, checked substitutions of :func:`adapt` (the process group already exists in a test rank;
the zero2 example asks CUDA for the number of GPUs per node). Shell blocks are checked against the code they name
(the benchmark's option parser, ``setup.py``'s extras, ``.ci/run``) or run (the consolidate tool).
``docs/wrap_and_checkpoint.rst``'s marked script is run by ``tests/nn/wrap/test_wrap_fsdp_policy.py``.
"""

import copy
import glob
import os
import re
import shlex
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fairscale.fair_dev.testing.engine import run_cases, run_distributed
from fairscale.internal import collectives
from fairscale.internal.collectives import count_collectives
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import consolidate, get_fsdp_instances
from fairscale.nn.data_parallel._fsdp.state import HandleState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "benchmarks")

# Kinds of the code blocks of each file, in order. "python": executed below; "shell": checked by
# test_shell_commands (or run, for the consolidate tool); "text": program output; "script": run elsewhere.
KINDS: Dict[str, List[str]] = {
    "README.md": ["python", "shell"],
    "docs/api.rst": [],
    "docs/architecture.rst": ["text", "text"],
    "docs/benchmarks.rst": ["shell", "shell", "text", "shell", "text", "text"]
    + ["text", "text"]  # issue 31: the H200 run's train table and its unit profile
    # issue 28: latency run, instructions, train, the async reduce-scatter runs, the forward-prefetch runs, the
    # full run's targets and the phase timing of the plain step, accum, targets, accum after
    + ["shell", "text", "text", "text", "text", "text", "text", "text", "text", "text", "text"]
    + ["shell", "text"]
    + ["shell", "text"],  # issue 29: the hybrid scenario's command and one run
    "docs/clients.rst": [],
    # The DCP section's blocks ("script") are run by tests/nn/data_parallel/test_fsdp_dcp_docs.py.
    # Its OSS subsection's two blocks ("script") are run by tests/optim/test_oss_dcp.py.
    # Its tensor-parallel block ("script", the sixth of the section) by tests/nn/data_parallel/test_fsdp_dcp_groups.py.
    "docs/checkpointing.rst": ["python"] * 5 + ["shell", "shell", "python", "python"] + ["script"] * 8,
    "docs/differences.rst": [],
    "docs/fsdp.rst": ["python"],
    "docs/getting_started.rst": ["shell", "python"],
    "docs/index.rst": [],
    "docs/maintaining.rst": ["script"] * 5,  # run by tests/test_upstream_api.py
    "docs/modules.rst": [],
    "docs/model_parallel.rst": ["script"] * 3,  # run by tests/nn/model_parallel/test_model_parallel_docs.py
    "docs/optimize_backward_concat.rst": ["python"],
    "docs/overlap.rst": ["text", "text"],
    "docs/oss.rst": ["script"] * 4,  # run by tests/optim/test_oss_docs.py
    "docs/optim.rst": ["script"] * 2,  # run by tests/optim/test_optim_docs.py
    "docs/wrap_and_checkpoint.rst": ["script", "python"],
    "docs/zero2.rst": ["python", "shell", "text"],
    "docs/hybrid.rst": ["python"],
    "docs/experimental.rst": ["script"],  # run by tests/experimental/test_experimental_docs.py
    "docs/pipe.rst": ["script"] * 3,  # run by tests/nn/pipe/test_pipe_docs.py
}


# ------------------------------------------------------------------------------------------------------ extraction


def rst_blocks(path: str) -> List[Tuple[int, str]]:
    """``(line, code)`` of every literal block (``::`` paragraphs and ``code-block`` directives) of an rst file."""
    lines = open(path).read().splitlines()
    blocks: List[Tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        code_block = re.match(r"^\s*\.\. code-block::", line)
        other_directive = re.match(r"^\s*\.\. [\w-]+::", line)
        if code_block or (line.endswith("::") and not other_directive):
            indent = len(line) - len(line.lstrip())
            j = i + 1
            body: List[str] = []
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                body.append(lines[j])
                j += 1
            blocks.append((i + 1, textwrap.dedent("\n".join(body)).strip("\n")))
            i = j
        else:
            i += 1
    return blocks


def md_blocks(path: str) -> List[Tuple[int, str]]:
    text = open(path).read()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in re.finditer(r"```\w*\n(.*?)```", text, re.S)]


def blocks_of(name: str) -> List[Tuple[int, str]]:
    path = os.path.join(ROOT, name)
    return md_blocks(path) if name.endswith(".md") else rst_blocks(path)


def block(name: str, index: int) -> str:
    assert KINDS[name][index] in ("python", "shell"), (name, index)
    return blocks_of(name)[index][1]


def adapt(code: str, replacements: Dict[str, str]) -> str:
    """Apply explicit substitutions; each must match, so an edited example cannot silently skip one."""
    for old, new in replacements.items():
        assert old in code, f"the example no longer contains {old!r}: update this test with it"
        code = code.replace(old, new)
    return code


def run_example(name: str, index: int, namespace: Dict[str, Any], code: str = "") -> Dict[str, Any]:
    code = code or block(name, index)
    line = blocks_of(name)[index][0]
    exec(compile(code, f"{name}:{line}", "exec"), namespace)
    return namespace


def _init_process_group(backend: str, *args: Any, **kwargs: Any) -> None:
    """Stands for ``dist.init_process_group`` in a test rank, whose (gloo) group the engine already created."""
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert backend in ("gloo", "nccl"), backend


INIT = {"dist.init_process_group(": "_init_process_group("}
UNWRAPPED = {"from fairscale.nn import FullyShardedDataParallel as FSDP": "FSDP = lambda module, **kwargs: module"}


# ------------------------------------------------------------------------------------------------------ inventory


def test_every_example_is_classified() -> None:
    names = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.rst")))
    assert sorted(names) == sorted(KINDS), "a docs page was added or removed: register its blocks in KINDS"
    for name in names:
        found = blocks_of(name)
        assert len(found) == len(KINDS[name]), (
            f"{name} has {len(found)} code blocks (lines {[line for line, _ in found]}) but KINDS lists "
            f"{len(KINDS[name])}: register and test the new example"
        )


# ------------------------------------------------------------------------------------------------------ shell


def _setup_extras() -> List[str]:
    text = open(os.path.join(ROOT, "setup.py")).read()
    section = text[text.index("extras_require") :]
    section = section[: section.index("}")]
    return re.findall(r'"(\w+)":', section)


def _commands(code: str) -> List[List[str]]:
    """Shell lines (continuations joined, comments dropped), each split on ``&&`` into argument lists."""
    joined = code.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip() if not line.strip().startswith("#") else ""
        for part in filter(None, (p.strip() for p in line.split("&&"))):
            out.append(shlex.split(part))
    return out


def _check_command(argv: List[str], extras: List[str]) -> str:
    if argv[:2] == ["pip", "install"]:
        for arg in argv[2:]:
            match = re.fullmatch(r"\.\[([\w,]+)\]", arg)
            for extra in match.group(1).split(",") if match else []:
                assert extra in extras, f"pip extra {extra!r} is not in setup.py's extras_require {extras}"
        return "pip"
    if argv[:2] == ["python", "benchmarks/fsdp.py"]:
        if BENCH_DIR not in sys.path:
            sys.path.insert(0, BENCH_DIR)
        from _fsdp_bench.config import parse_args

        if "--help" in argv:
            with pytest.raises(SystemExit) as exc:
                parse_args(argv[2:])
            assert exc.value.code == 0
        else:
            from overlap_scenario import split_scenario  # `--scenario overlap` leaves the main job's scenarios

            for args in split_scenario(argv[2:]):
                if args is not None:
                    parse_args(args)  # exits with code 2 on an option the benchmark does not have
        return "benchmark"
    if argv[:3] == ["python", "-m", "fairscale.nn.data_parallel.consolidate"]:
        return "consolidate"  # run by test_checkpointing_examples
    if argv[:3] == ["python", "-m", "pytest"]:
        return "pytest"
    raise AssertionError(f"unknown command in the docs: {argv}")


def test_shell_commands() -> None:
    extras = _setup_extras()
    seen: Dict[str, int] = {}
    for name, kinds in KINDS.items():
        for index, kind in enumerate(kinds):
            if kind == "shell":
                for argv in _commands(block(name, index)):
                    what = _check_command(argv, extras)
                    seen[what] = seen.get(what, 0) + 1
    assert seen.get("benchmark", 0) >= 4 and seen.get("consolidate") == 2 and seen.get("pytest") == 1, seen
    # README: CI reads both commands from the README (.ci/readme_commands.py; tests/test_ci_readme.py checks .ci/run).
    readme_test_command = block("README.md", 1).strip().splitlines()[-1].strip()
    assert "python -m pytest" in readme_test_command
    parsed = subprocess.run(
        [sys.executable, os.path.join(ROOT, ".ci", "readme_commands.py"), "2"], capture_output=True, text=True
    )
    assert parsed.stdout.strip() == readme_test_command, parsed.stderr


# ------------------------------------------------------------------------------------------------------ models


class Block(nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim + 1)
        self.fc2 = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class BlockNet(nn.Module):
    """What the examples call ``model``: blocks in ``model.blocks`` plus parameters the root owns."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.head = nn.Linear(6, 3)
        self.input_dtypes: List[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        self.input_dtypes.append(x.dtype)
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def _full_state(model: Any) -> Dict[str, Tensor]:
    if isinstance(model, FSDP):
        return {k: v.float().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _assert_update_close(got: Dict[str, Tensor], want: Dict[str, Tensor], init: Dict[str, Tensor], rel: float) -> None:
    """16-bit runs: the whole update equals the reference's up to ``rel`` of its norm (a lost or doubled update
    is off by ~1)."""
    assert list(got) == list(want)
    moved = torch.cat([(want[k] - init[k]).reshape(-1) for k in want])
    err = torch.cat([(got[k] - want[k]).reshape(-1) for k in want])
    assert moved.norm() > 0, "the reference did not move"
    assert err.norm() <= rel * moved.norm(), f"update error {err.norm():.3g} vs reference update {moved.norm():.3g}"


# ------------------------------------------------------------------------------------------------------ python


def _readme() -> None:
    """README: bf16 mixed precision, the root casts the input to bf16, one AdamW step like the unwrapped model."""
    torch.manual_seed(0)
    template = BlockNet()
    batch = torch.randn(4, 5)
    ns = run_example(
        "README.md",
        0,
        {"MyModel": lambda: copy.deepcopy(template), "batch": batch, "_init_process_group": _init_process_group},
        adapt(block("README.md", 0), INIT),
    )
    model = ns["model"]
    assert isinstance(model, FSDP) and model.compute_dtype == torch.bfloat16
    assert model.module.module.input_dtypes == [torch.bfloat16]
    ref = run_example(
        "README.md",
        0,
        {"MyModel": lambda: copy.deepcopy(template), "batch": batch, "_init_process_group": _init_process_group},
        adapt(adapt(block("README.md", 0), INIT), UNWRAPPED),
    )["model"]
    _assert_update_close(_full_state(model), _full_state(ref), _full_state(template), rel=0.1)


def _getting_started() -> None:
    """10 SGD steps on two ranks (same data on both) equal the unwrapped script's, in fp32."""
    # The engine's group outlives the example: its closing destroy_process_group() is left out here.
    code = adapt(block("docs/getting_started.rst", 1), {**INIT, "dist.destroy_process_group()": "pass"})
    torch.manual_seed(0)
    ns = run_example("docs/getting_started.rst", 1, {"_init_process_group": _init_process_group}, code)
    torch.manual_seed(0)
    ref = run_example(
        "docs/getting_started.rst", 1, {"_init_process_group": _init_process_group}, adapt(code, UNWRAPPED)
    )
    assert isinstance(ns["model"], FSDP) and not isinstance(ref["model"], FSDP)
    got, want = _full_state(ns["model"]), _full_state(ref["model"])
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(ns["loss"].item(), ref["loss"].item(), rtol=1e-5, atol=1e-6)


def _fsdp_usual_pattern() -> None:
    """docs/fsdp.rst: one instance per block plus the root; only one block's full parameters exist at a time in
    forward; the root keeps its parameters between forward and backward; trains like the unwrapped model."""
    torch.manual_seed(0)
    template = BlockNet()
    ns = run_example("docs/fsdp.rst", 0, {"torch": torch, "model": copy.deepcopy(template)})
    model = ns["model"]
    instances = get_fsdp_instances(model)
    assert len(instances) == 1 + len(template.blocks)
    assert all(m.mixed_precision and m.compute_dtype == torch.bfloat16 for m in instances)
    blocks = instances[1:]
    full_while_running: List[int] = []

    def count_full(*_: Any) -> None:
        full_while_running.append(sum(any(h.state == HandleState.FULL for h in m._handles) for m in blocks))

    for m in blocks:
        m.module.module.register_forward_pre_hook(count_full)
    ref = copy.deepcopy(template)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randn(4, 5)
    out = model(x)
    assert full_while_running == [1, 1, 1], full_while_running
    assert all(h.state == HandleState.FULL for h in instances[0]._handles), "the root must keep its parameters"
    out.float().pow(2).mean().backward()
    opt.step()
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    _assert_update_close(_full_state(model), _full_state(ref), _full_state(template), rel=0.05)


def _optimize_backward_concat_loop() -> None:
    """docs/optimize_backward_concat.rst: the loop runs with no SplitWithSizesBackward at all, releases the
    accumulation buffers, and trains like the unwrapped model on the summed microbatch losses."""
    torch.manual_seed(0)
    template = BlockNet()
    loader = [[torch.randn(3, 5) for _ in range(3)] for _ in range(2)]
    model = copy.deepcopy(template)
    with torch.autograd.profiler.profile() as prof:
        ns = run_example("docs/optimize_backward_concat.rst", 0, {"model": model, "loader": loader})
    splits = sum(e.name in ("SplitWithSizesBackward0", "FlatParamViewsBackward") for e in prof.function_events)
    assert splits == 0, f"{splits} SplitWithSizesBackward0 with optimize_backward_concat=True"
    instances = get_fsdp_instances(ns["model"])
    assert len(instances) == 4 and all(m.optimize_backward_concat for m in instances)
    assert all(h.grad_accum_flat is None for m in instances for h in m._handles), "a buffer outlived its window"
    ref = copy.deepcopy(template)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    for step_batches in loader:
        for microbatch in step_batches:
            ref(microbatch).float().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_update_close(_full_state(ns["model"]), _full_state(ref), _full_state(template), rel=0.1)


def _auto_wrap_bn() -> None:
    """docs/wrap_and_checkpoint.rst: batch norm in its own fp32, non-flat, non-resharding, unbucketed instance."""
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    ns = run_example("docs/wrap_and_checkpoint.rst", 1, {"FSDP": FSDP, "model": copy.deepcopy(template)})
    model = ns["model"]
    root, bn = get_fsdp_instances(model)
    assert root.mixed_precision and isinstance(bn.module.module, nn.BatchNorm1d)
    assert not bn.mixed_precision and not bn.flatten_parameters and bn.bucket_cap_mb == 0
    assert not bn.reshard_after_forward
    x = torch.randn(6, 5)
    model(x).float().sum().backward()
    template(x)
    layer = bn.module.module
    assert layer.running_mean.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in bn.params)
    torch.testing.assert_close(layer.running_mean, template[1].running_mean, rtol=1e-2, atol=1e-3)


def _python_examples(rank: int, world_size: int) -> None:
    run_cases(
        [
            ("README.md", _readme),
            ("getting_started.rst", _getting_started),
            ("fsdp.rst", _fsdp_usual_pattern),
            ("optimize_backward_concat.rst", _optimize_backward_concat_loop),
            ("wrap_and_checkpoint.rst,auto_wrap_bn", _auto_wrap_bn),
        ]
    )


def test_python_examples_on_two_ranks() -> None:
    run_distributed(_python_examples, 2, timeout=120)


def _two_node_example(name: str) -> Tuple[Dict[str, Any], nn.Module]:
    """Run the first example of ``name`` (which wraps a ``model`` with ``.blocks``) as on 2 "nodes" of 2 GPUs;
    returns its namespace and an unwrapped copy of the model it started from."""
    code = adapt(block(name, 0), dict(INIT, **{"torch.cuda.device_count()": "_gpus_per_node()"}))
    torch.manual_seed(0)
    template = BlockNet()
    namespace = {
        "model": copy.deepcopy(template),
        "_init_process_group": _init_process_group,
        "_gpus_per_node": lambda: 2,
    }
    return run_example(name, 0, namespace, code), template


def _zero2_example(rank: int, world_size: int) -> None:
    """docs/zero2.rst on 4 CPU ranks as 2 "nodes" of 2: backward gathers of the blocks over the 2-rank group,
    forward gathers and reduce-scatters over all 4, one step like the unwrapped model."""
    ns, template = _two_node_example("docs/zero2.rst")
    model = ns["model"]
    assert collectives.group_ranks(ns["node_group"]) == ((0, 1) if rank < 2 else (2, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 5)
    with count_collectives() as counter:
        model(x).float().pow(2).mean().backward()
    gathers = [r for r in counter.records if r.kind == "all_gather"]
    assert {r.group_size for r in gathers if r.phase == "forward"} == {4}, counter.summary()
    assert [r.group_size for r in gathers if r.phase == "backward"] == [2] * len(template.blocks), counter.summary()
    assert {r.group_size for r in counter.records if r.kind == "reduce_scatter"} == {4}, counter.summary()
    opt.step()
    ref = copy.deepcopy(template)
    ref(x).pow(2).mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    _assert_update_close(_full_state(model), _full_state(ref), _full_state(template), rel=0.05)


def test_zero2_example_on_four_ranks() -> None:
    run_distributed(_zero2_example, 4, timeout=120)


def _hybrid_example(rank: int, world_size: int) -> None:
    """docs/hybrid.rst on 4 CPU ranks as 2 "nodes" of 2: gathers and reduce-scatters inside the node, one all-reduce
    per bucket across the nodes, one step like the unwrapped model on the same (global) batch."""
    ns, template = _two_node_example("docs/hybrid.rst")
    model = ns["model"]
    assert collectives.group_ranks(ns["shard"]) == ((0, 1) if rank < 2 else (2, 3))
    assert collectives.group_ranks(ns["replicate"]) == ((0, 2) if rank % 2 == 0 else (1, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    with count_collectives() as counter:
        model(xs[rank]).float().pow(2).mean().backward()
    node = (0, 1) if rank < 2 else (2, 3)
    across = (0, 2) if rank % 2 == 0 else (1, 3)
    assert {r.ranks for r in counter.records if r.kind in ("all_gather", "reduce_scatter")} == {node}, counter.summary()
    reduces = [r for r in counter.records if r.kind == "all_reduce"]
    assert reduces and {r.ranks for r in reduces} == {across}, counter.summary()
    opt.step()
    ref = copy.deepcopy(template)
    # The hybrid step averages the four ranks' gradients, as the mean loss over the four batches does.
    torch.stack([ref(x).pow(2).mean() for x in xs]).mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    _assert_update_close(_full_state(model), _full_state(ref), _full_state(template), rel=0.05)


def test_hybrid_example_on_four_ranks() -> None:
    run_distributed(_hybrid_example, 4, timeout=120)


# ------------------------------------------------------------------------------------------------------ checkpointing

CKPT = "docs/checkpointing.rst"


def _checkpoint_namespace(rank: int, world_size: int) -> Tuple[Dict[str, Any], Any]:
    """``model`` (nested FSDP), ``optim`` (Adam, with state), ``rank``, ``world_size``; and a function training one
    more step (so that a later load has something to undo)."""
    torch.manual_seed(0)
    net = BlockNet()
    for i, blk in enumerate(net.blocks):
        net.blocks[i] = FSDP(blk)
    model = FSDP(net)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)

    def step() -> None:
        optim.zero_grad()
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
        optim.step()

    step()
    return {"torch": torch, "os": os, "model": model, "optim": optim, "rank": rank, "world_size": world_size}, step


def _same(actual: Dict[str, Tensor], expected: Dict[str, Tensor], what: str, ordered: bool = True) -> None:
    assert (list(actual) if ordered else sorted(actual)) == (list(expected) if ordered else sorted(expected)), what
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{what}: {key}"


def _checkpointing(rank: int, world_size: int, directory: str) -> None:
    os.chdir(directory)
    os.makedirs("ckpt", exist_ok=True)  # the sharded example writes into ckpt/ (it does not create it)
    ns, step = _checkpoint_namespace(rank, world_size)
    model = ns["model"]
    # Full state dict: save on rank 0, load on every rank.
    run_example(CKPT, 0, ns)
    collectives.barrier()
    saved = torch.load("model.pt", weights_only=True)
    _same(saved, model.state_dict(), "model.pt")
    step()
    run_example(CKPT, 1, ns)
    _same(model.state_dict(), saved, "after loading model.pt")
    # Sharded checkpoint and its metadata, loaded back at the same world size.
    run_example(CKPT, 2, ns)
    collectives.barrier()
    local = {k: v.clone() for k, v in model.local_state_dict().items()}
    step()
    run_example(CKPT, 3, ns)
    _same(model.local_state_dict(), local, "after load_local_state_dict")
    # Offline consolidation: "The result equals model.state_dict() (the same keys, values bit for bit)".
    full = run_example(CKPT, 4, ns)["full"]
    # (Keys in instance order, root first, not module order: same keys, as upstream.)
    _same(full, model.state_dict(), "consolidate_shard_weights", ordered=False)
    if rank == 0:  # the command-line tool, with the docs' arguments
        for index in (5, 6):
            (argv,) = _commands(block(CKPT, index))
            assert consolidate.main(argv[3:]) == 0, argv
        _same(torch.load("full.pt", weights_only=True), full, "consolidated by the command line", ordered=False)
        assert sorted(os.listdir("ckpt3")) == [f"checkpoint-rank-{r}.pt" for r in range(3)]
        _same(consolidate.consolidate_checkpoint_dir("ckpt3"), full, "resharded for 3 ranks", ordered=False)
    # Resume model and optimizer from a full checkpoint (written as the example before it intends, see
    # test_checkpointing_optimizer_save_example).
    full_osd = model.gather_full_optim_state_dict(optim=ns["optim"])
    model_sd = model.state_dict()
    if rank == 0:
        torch.save({"model": model_sd, "optim": full_osd}, "ckpt.pt")
    collectives.barrier()
    optim_local = copy.deepcopy(ns["optim"].state_dict())
    step()
    run_example(CKPT, 8, ns)
    _same(model.state_dict(), model_sd, "model after resuming from ckpt.pt")
    resumed = ns["optim"].state_dict()
    for pid, entry in optim_local["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(resumed["state"][pid][key]), torch.as_tensor(value)), (pid, key)


def test_checkpointing_examples(tmp_path: Any) -> None:
    run_distributed(_checkpointing, 2, str(tmp_path), timeout=120)


def _optimizer_save_example(rank: int, world_size: int, directory: str) -> None:
    os.chdir(directory)
    ns, _ = _checkpoint_namespace(rank, world_size)
    run_example(CKPT, 7, ns)
    collectives.barrier()
    ckpt = torch.load("ckpt.pt", weights_only=False)
    assert sorted(ckpt) == ["model", "optim"] and list(ckpt["model"]) == list(ns["model"].state_dict())


def test_checkpointing_optimizer_save_example(tmp_path: Any) -> None:
    """The "Optimizer state" save example, run as written on 2 ranks.

    Known failure (audit): it calls the collective ``model.state_dict()`` under ``if rank == 0``, so rank 0 waits
    for a gather the other ranks never join (the text admits it in parentheses). Fix the example, not the test.
    """
    run_distributed(_optimizer_save_example, 2, str(tmp_path), timeout=15)
