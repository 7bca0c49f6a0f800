# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AsyncPipe stages that stop agreeing after the first step (which a collective checks): caught by message headers.

Each message between stages carries its step's number, mode and number of micro-batches; a stage that receives one
of another kind of step raises ``StagesDisagreeError`` (a ``RanksDisagreeError``) and stops the stages that wait
for it with the same error, instead of a hang or gradients of another step. Bodies are module-level functions (the
suite also runs with ``FAIRSCALE_TEST_START_METHOD=spawn``); each rank returns its outcomes, checked by the test.
"""

import copy
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from fairscale.fair_dev.testing.engine import run_distributed
from fairscale.internal.agreement import RanksDisagreeError
from fairscale.internal.collectives import count_collectives
from fairscale.nn.pipe import AsyncPipe
from fairscale.nn.pipe.async_schedule import PipelineAbortedError, StagesDisagreeError
from fairscale.nn.pipe.messages import SendRecvTransport

TIMEOUT = 60.0
# A disagreement must end every stage concerned within about a second; the margin is for a loaded CI machine.
_WITHIN_S = 10.0
CHUNKS = 4
BALANCES = {2: [2, 3], 3: [1, 2, 2]}
MODE = "whether gradients come back (training mode with autograd on)"
COUNT = "the number of micro-batches"
STEP = "the step number (calls of forward on this AsyncPipe that ran the pipeline)"

Outcome = Tuple[str, str]


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and torch.allclose(a, b, rtol=1.3e-6, atol=1e-5), (a, b)


def _sgd_step(module: nn.Module, lr: float = 0.1) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
            p.grad = None


def _finish(pipe: AsyncPipe) -> None:
    # Every queued send was received and every rank is done before the next world or case.
    if pipe.pipeline is not None and isinstance(pipe.pipeline.transport, SendRecvTransport):
        pipe.pipeline.transport.flush()
    dist.barrier()


class _Pair:
    """An AsyncPipe stage and the same layers of a single-process reference model."""

    def __init__(self, rank: int, world_size: int) -> None:
        torch.manual_seed(3)
        model = _model()
        self.reference = copy.deepcopy(model)
        balance = BALANCES[world_size]
        self.pipe = AsyncPipe(model, balance, group=dist.group.WORLD, chunks=CHUNKS)
        self.rank = rank
        start = sum(balance[:rank])
        self.ref_layers = list(self.reference)[start : start + balance[rank]]

    def matching_step(self, seed: int, training: bool = True) -> None:
        """A step run by every stage alike: outputs, gradients and the SGD update equal the reference's."""
        self.pipe.train(training)
        self.reference.train(training)
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
        xp, xr = x.clone().requires_grad_(training), x.clone().requires_grad_(training)
        out = self.pipe(xp)
        ref_out = self.reference(xr)
        if self.pipe.final_stage:
            _assert_close(out, ref_out)
        if not training:
            return
        ref_out.pow(2).sum().backward()
        if self.pipe.final_stage:
            out.pow(2).sum().backward()
        if self.rank == 0:
            _assert_close(xp.grad, xr.grad)
        for mine, ref in zip(self.pipe, self.ref_layers):
            for p, q in zip(mine.parameters(), ref.parameters()):
                _assert_close(p.grad, q.grad)
        _sgd_step(self.pipe)
        _sgd_step(self.reference)

    def diverging_step(self, training: bool, rows: int = 8) -> Outcome:
        """A step in which this stage may differ from the others: ``("returned" | "raised", message)``."""
        self.pipe.train(training)
        start = time.monotonic()
        outcome: Outcome = ("returned", "")
        try:
            out = self.pipe(torch.randn(rows, 3, requires_grad=training))
            if training and self.pipe.final_stage:
                out.pow(2).sum().backward()
        except StagesDisagreeError as exc:
            assert isinstance(exc, RanksDisagreeError) and not isinstance(exc, PipelineAbortedError)
            outcome = ("raised", str(exc))
        elapsed = time.monotonic() - start
        assert elapsed < _WITHIN_S, f"stage {self.rank} took {elapsed:.1f} s to end with {outcome}"
        # Nothing of the failed step may remain for the next one.
        for p in self.pipe.parameters():
            p.grad = None
        return outcome

    def close(self) -> None:
        _finish(self.pipe)


def _mode_switch(rank: int, world_size: int, eval_stage: int) -> List[Outcome]:
    """Step 2: stage ``eval_stage`` runs in eval mode, the others train; step 3 trains everywhere again."""
    pair = _Pair(rank, world_size)
    pair.matching_step(0)
    outcome = pair.diverging_step(training=rank != eval_stage)
    # Every message of step 2 was received: step 3 is exact (no gradients of step 2 left in flight).
    pair.matching_step(2)
    pair.close()
    return [outcome]


def _microbatch_count(rank: int, world_size: int, rows: List[int], training: bool) -> List[Outcome]:
    """Step 2: stage ``s`` gets ``rows[s]`` rows (``CHUNKS`` micro-batches of 2, or fewer)."""
    pair = _Pair(rank, world_size)
    pair.matching_step(0)
    outcome = pair.diverging_step(training, rows=rows[rank])
    pair.matching_step(2)
    pair.close()
    return [outcome]


def _extra_step(rank: int, world_size: int) -> List[Outcome]:
    """The last stage counts one step more than the first (as if it ran a step the other did not)."""
    pair = _Pair(rank, world_size)
    pair.matching_step(0)
    assert pair.pipe.pipeline is not None
    if pair.pipe.final_stage:
        pair.pipe.pipeline.steps += 1
    outcome = pair.diverging_step(training=True)
    if pair.pipe.final_stage:
        pair.pipe.pipeline.steps -= 1
    pair.matching_step(2)
    pair.close()
    return [outcome]


def _check(outcomes: List[List[Outcome]], expected: List[str], *differences: str) -> None:
    """Each rank's outcome is as ``expected``; the raising ranks give the same message, naming ``differences``."""
    assert [o[0][0] for o in outcomes] == expected, outcomes
    messages = {o[0][1] for o in outcomes if o[0][0] == "raised"}
    assert len(messages) == 1, messages
    message = messages.pop()
    for difference in differences:
        assert difference in message, message
    assert "run steps that do not match" in message and "same mode" in message, message


def test_mode_switch_at_step_2() -> None:
    """A stage switched to eval mode at step 2 while the others train: the stage that receives a message of the
    other mode raises, and so does every stage that waits for it (the earlier stages wait for gradients); step 3
    then matches the reference. Before, the first stage waited forever for gradients (last stage in eval), or got
    step 2's gradients in step 3 (first stage in eval)."""
    # The last stage in eval: it finds out, and stops the first stage, which waits for its gradients.
    outcomes = run_distributed(_mode_switch, 2, 1, timeout=TIMEOUT)
    _check(outcomes, ["raised", "raised"], f"{MODE}: True on stage 0, False on stage 1")
    # The first stage in eval waits for nothing in step 2 and returns; the last stage raises (no gradient is sent).
    outcomes = run_distributed(_mode_switch, 2, 0, timeout=TIMEOUT)
    _check(outcomes, ["returned", "raised"], f"{MODE}: False on stage 0, True on stage 1")


def test_microbatch_count_at_step_2() -> None:
    """Each stage splits its own input, so the numbers of micro-batches can differ at a later step (a last stage
    given a smaller batch, say): both stages raise in training, instead of the first one waiting forever for
    gradients the last one never sends (or the last one waiting for activations never sent)."""
    outcomes = run_distributed(_microbatch_count, 2, [8, 6], True, timeout=TIMEOUT)
    _check(outcomes, ["raised", "raised"], f"{COUNT}: 4 on stage 0, 3 on stage 1")
    outcomes = run_distributed(_microbatch_count, 2, [6, 8], True, timeout=TIMEOUT)
    _check(outcomes, ["raised", "raised"], f"{COUNT}: 3 on stage 0, 4 on stage 1")
    # In eval mode the first stage waits for nothing: it returns (its activations were all received).
    outcomes = run_distributed(_microbatch_count, 2, [8, 6], False, timeout=TIMEOUT)
    _check(outcomes, ["returned", "raised"], f"{COUNT}: 4 on stage 0, 3 on stage 1")


def test_step_number() -> None:
    """Stages that counted different numbers of steps (one ran a step the other did not) raise on both, naming
    the step numbers."""
    outcomes = run_distributed(_extra_step, 2, timeout=TIMEOUT)
    _check(outcomes, ["raised", "raised"], f"{STEP}: 2 on stage 0, 3 on stage 1")


def test_three_stages() -> None:
    """With three stages every stage that waits for the one that disagrees stops with the same error: a middle
    stage in eval mode stops both its neighbours; the last stage in eval mode stops the middle one, which passes it
    on to the first; a first stage in eval mode returns."""
    outcomes = run_distributed(_mode_switch, 3, 1, timeout=TIMEOUT)
    _check(outcomes, ["raised", "raised", "raised"], f"{MODE}: True on stage 0, False on stage 1")
    outcomes = run_distributed(_mode_switch, 3, 2, timeout=TIMEOUT)
    _check(outcomes, ["raised", "raised", "raised"], f"{MODE}: True on stage 1, False on stage 2")
    outcomes = run_distributed(_mode_switch, 3, 0, timeout=TIMEOUT)
    _check(outcomes, ["returned", "raised", "raised"], f"{MODE}: False on stage 0, True on stage 1")


def _agreeing_steps(rank: int, world_size: int) -> Dict[str, Any]:
    """Three training steps, then eval steps (with and without autograd), all matching the reference."""
    pair = _Pair(rank, world_size)
    pair.matching_step(0)
    with count_collectives() as counter:
        for seed in (1, 2):
            pair.matching_step(seed)
        pair.matching_step(3, training=False)
        with torch.no_grad():
            pair.matching_step(4, training=False)
    assert pair.pipe.pipeline is not None
    counts = {name: counter.count(name) for name in ("all_gather_object", "send", "recv")}
    steps = pair.pipe.pipeline.steps
    pair.close()
    return {"counts": counts, "steps": steps}


def test_agreeing_steps_match_reference() -> None:
    """The normal case: training steps then eval steps on every stage match a single-process reference, and the
    per-step check costs no collective and no message (one header and one tensor per micro-batch and direction)."""
    results = run_distributed(_agreeing_steps, 2, timeout=TIMEOUT)
    assert [r["steps"] for r in results] == [5, 5]
    # Steps 2-5: 2 training steps with 4 micro-batches each way, 2 eval steps with 4 activations only.
    messages = 2 * CHUNKS * 2 + 2 * CHUNKS * 2
    first, last = results[0]["counts"], results[1]["counts"]
    assert first == {"all_gather_object": 0, "send": messages, "recv": 2 * CHUNKS * 2}, first
    assert last == {"all_gather_object": 0, "send": 2 * CHUNKS * 2, "recv": messages}, last
