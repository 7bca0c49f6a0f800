# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Upstream's import surface of fairscale.nn.pipe, and the interpreter-exit fix."""

import importlib
import sys

import pytest

SURFACE = {
    "fairscale.nn": ["Pipe", "PipeRPCWrapper"],
    "fairscale.nn.pipe": ["Pipe", "AsyncPipe", "PipeRPCWrapper", "is_checkpointing", "is_recomputing", "LazyModule"],
    "fairscale.nn.pipe.pipe": [
        "Pipe",
        "BalanceError",
        "split_module",
        "verify_module",
        "verify_splitting",
        "recommend_auto_balance",
        "MOVING_DENIED",
    ],
    "fairscale.nn.pipe.pipeline": ["Pipeline", "clock_cycles", "depend", "copy", "wait"],
    "fairscale.nn.pipe.microbatch": ["Batch", "check", "scatter", "gather", "Tensors", "TensorOrTensors", "Function"],
    "fairscale.nn.pipe.checkpoint": [
        "Checkpointing",
        "Checkpoint",
        "Recompute",
        "is_checkpointing",
        "is_recomputing",
        "enable_checkpointing",
        "enable_recomputing",
        "save_rng_states",
        "restore_rng_states",
        "Function",
        "TensorOrTensors",
        "Tensors",
    ],
    "fairscale.nn.pipe.dependency": ["fork", "join", "Fork", "Join"],
    "fairscale.nn.pipe.phony": ["get_phony"],
    "fairscale.nn.pipe.copy": ["Copy", "Wait"],
    "fairscale.nn.pipe.stream": [
        "CPUStreamType",
        "CPUStream",
        "AbstractStream",
        "new_stream",
        "current_stream",
        "default_stream",
        "use_device",
        "use_stream",
        "get_device",
        "wait_stream",
        "record_stream",
        "is_cuda",
        "as_cuda",
    ],
    "fairscale.nn.pipe.worker": ["Task", "worker", "create_workers", "join_workers", "spawn_workers"],
    "fairscale.nn.pipe.batchnorm": ["DeferredBatchNorm"],
    "fairscale.nn.pipe.balance": ["balance_by_time", "balance_by_size", "blockpartition", "profile"],
    "fairscale.nn.pipe.balance.blockpartition": ["solve"],
    "fairscale.nn.pipe.balance.profile": ["layerwise_sandbox", "detach", "profile_times", "profile_sizes"],
    "fairscale.nn.pipe.skip": ["skippable", "stash", "pop", "verify_skippables", "Namespace"],
    "fairscale.nn.pipe.skip.skippable": ["Skippable", "skippable", "stash", "pop", "verify_skippables"],
    "fairscale.nn.pipe.skip.namespace": ["Namespace"],
    "fairscale.nn.pipe.skip.tracker": [
        "SkipTracker",
        "SkipTrackerThroughPotals",
        "use_skip_tracker",
        "current_skip_tracker",
    ],
    "fairscale.nn.pipe.skip.portal": ["Portal", "PortalBlue", "PortalOrange", "PortalCopy"],
    "fairscale.nn.pipe.skip.layout": ["SkipLayout", "inspect_skip_layout"],
    "fairscale.nn.pipe.async_pipe": ["AsyncPipe", "PartitionInfo", "verify_module", "check_balance"],
    "fairscale.nn.pipe.async_pipeline": ["AsyncPipeline"],
    "fairscale.nn.pipe.async_schedule": [
        "create_task",
        "Location",
        "Invocation",
        "ModuleWrapper",
        "AsyncMessageType",
        "AsyncMessageBody",
        "TailBackwardContext",
        "AutogradWithoutActivations",
        "AsyncRecvOperator",
        "AsyncEventLoop",
    ],
    "fairscale.nn.pipe.messages": [
        "Transport",
        "RpcTransport",
        "SendRecvTransport",
        "MakeTransport",
        "MessageQueues",
        "MESSAGE_TENSOR_SIZE",
        "rpc_push_queue",
        "to_input_device",
    ],
    "fairscale.nn.pipe.types": [
        "ACTIVATIONS_GRADS_QUEUE",
        "SKIP_TENSOR_QUEUE",
        "PORTAL_QUEUE",
        "EVENT_LOOP_QUEUE",
        "EVENT_LOOP_ACTIVATIONS_QUEUE",
        "EVENT_LOOP_GRADIENTS_QUEUE",
        "MESSAGE_GENERATION_START",
        "MessageGeneration",
        "LazyModule",
        "PipeMessage",
        "InputDevice",
        "Tensors",
        "TensorOrTensors",
    ],
    "fairscale.nn.pipe.rpc": [
        "PipeRPCWrapper",
        "PipeBackRedirect",
        "callback_with_model",
        "set_device_based_on_group",
        "get_shapes",
        "get_dtype",
        "get_global_ranks_from_group",
        "DEFAULT_MAX_SOURCE_POSITIONS",
        "DEFAULT_MAX_TARGET_POSITIONS",
    ],
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_names(module):
    mod = importlib.import_module(module)
    missing = [name for name in SURFACE[module] if not hasattr(mod, name)]
    assert not missing


def test_all_lists():
    import fairscale.nn.pipe as pipe
    from fairscale.nn.pipe import balance, batchnorm, checkpoint, skip, types

    assert pipe.__all__ == ["Pipe", "is_checkpointing", "is_recomputing", "LazyModule"]
    assert checkpoint.__all__ == ["is_checkpointing", "is_recomputing"]
    assert skip.__all__ == ["skippable", "stash", "pop", "verify_skippables", "Namespace"]
    assert balance.__all__ == ["balance_by_time", "balance_by_size"]
    assert batchnorm.__all__ == ["DeferredBatchNorm"]
    assert (types.EVENT_LOOP_QUEUE, types.MESSAGE_GENERATION_START) == (3, 6)
    from fairscale.nn.pipe.async_schedule import AsyncMessageType, Location

    assert (AsyncMessageType.Activations.value, AsyncMessageType.Gradients.value) == (1, 2)
    assert repr(Location(2, 0)) == "2@0"


def test_message_tags_advance():
    import torch

    from fairscale.nn.pipe import types

    first = types.PipeMessage(0, 1, 3, tensors=(torch.zeros(1), torch.zeros(1)))
    second = types.PipeMessage(0, 1, 3, tensor_count=4)
    third = types.PipeMessage(0, 1, 3)
    assert second.tag == first.tag + 2 and third.tag == second.tag + 4


def test_no_hang_at_interpreter_exit(monkeypatch):
    """Upstream's finalizer waited for its worker threads even at interpreter shutdown, when daemon threads no
    longer run: a Pipe alive at exit hung the process. Simulate shutdown: workers gone, ``sys.is_finalizing()``."""
    import threading

    import torch
    from torch import nn

    from fairscale.nn.pipe import Pipe

    pipe = Pipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"])
    engine = pipe.pipeline
    # The worker thread stops, as daemon threads do at shutdown, without answering later stop requests.
    engine.in_queues[0].put(None)
    assert engine.out_queues[0].get(timeout=10) == (False, None)
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    finalizer = threading.Thread(target=engine.__del__, daemon=True)
    finalizer.start()
    finalizer.join(timeout=10)
    assert not finalizer.is_alive(), "the pipeline finalizer blocked at interpreter shutdown"
    monkeypatch.undo()
    engine.in_queues = None  # already stopped: nothing left for the real finalizer
    del pipe, engine, torch
