# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The example of ``docs/experimental.rst`` runs, and the public names of upstream's ``fairscale.experimental``
import on a CPU-only machine."""

import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PUBLIC = {
    "fairscale.experimental.nn": ["BaselineSoftmaxNllLoss", "MEVO", "OffloadModel", "SyncBatchNorm"],
    "fairscale.experimental.nn.offload": ["OffloadModel", "ModelShard", "OffloadFunction", "ShardSyncLayer"],
    "fairscale.experimental.nn.mevo": [
        "MemoryEfficientVocabOutput", "BaselineSoftmax", "BaselineSoftmaxNllLoss", "BackwardTrigger",
        "BackwardTriggerFn", "GetMaxFunction", "GetSumFunction", "TargetScoreFunction", "lmcl_matmul", "get_data",
        "DEBUG",
    ],
    "fairscale.experimental.nn.auto_shard": ["shard_model"],
    "fairscale.experimental.nn.ampnet_pipe.pipe": ["AMPnetPipe"],
    "fairscale.experimental.nn.ampnet_pipe.ampnet": ["AsyncAMPnetEventLoop", "create_task_without_skip_trackers"],
    "fairscale.experimental.nn.distributed_pipeline": ["PipelineModulesGraph", "DistributedLoss", "DistributedPipeline"],
    "fairscale.experimental.nn.distributed_pipeline.data": ["DataConsumer"],
    "fairscale.experimental.nn.distributed_pipeline.graph": [
        "PipelineModulesGraph", "MultiInputSequential", "RemoteSequential", "DataSource", "Node",
    ],
    "fairscale.experimental.nn.distributed_pipeline.pipeline": [
        "DistributedPipeline", "check_pytorch_version", "MOVING_DENIED",
    ],
    "fairscale.experimental.nn.distributed_pipeline.partition_handler": [
        "PartitionHandler", "DistributedPipelineRecord",
    ],
    "fairscale.experimental.nn.distributed_pipeline.trace": ["make_graph", "RemoteModuleTracer", "GraphCreator"],
    "fairscale.experimental.nn.data_parallel": ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"],
    "fairscale.experimental.nn.data_parallel.gossip": [
        "SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel", "PushPull", "PushSum",
        "DynamicBipartiteExponentialGraph", "DynamicBipartiteLinearGraph", "DynamicDirectedExponentialGraph",
        "DynamicDirectedLinearGraph", "GraphManager", "NPeerDynamicDirectedExponentialGraph", "RingGraph",
        "MixingManager", "UniformMixing", "communicate", "CudaEventRecorder",
    ],
    "fairscale.experimental.nn.data_parallel.gossip.distributed": ["HEARTBEAT_TIMEOUT", "BROADCAST_BUCKET_SIZE"],
    "fairscale.experimental.nn.data_parallel.gossip.gossiper": ["Gossiper", "dist_backend"],
    "fairscale.experimental.nn.data_parallel.gossip.graph_manager": ["Edge"],
    "fairscale.experimental.nn.data_parallel.gossip.utils": [
        "MultiProcessAdapter", "communicate", "create_process_group", "flatten_tensors", "group_by_dtype",
        "make_logger", "unflatten_tensors",
    ],
    "fairscale.experimental.nn.data_parallel.gossip.utils.cuda_metering": [
        "CudaEventRecorder", "DummyCudaEventRecorder", "EventRecorder", "create_event_recorder",
        "create_and_record_event", "MAX_LEN_DEQUEUE",
    ],
    "fairscale.experimental.tooling.layer_memory_tracker": [
        "LayerwiseMemoryTracker", "LayerMemoryTrace", "TraceForwardEvent", "TraceBackwardEvent",
        "LayerwiseMemoryTrackerSummary", "ProcessGroupTracker", "ProcessGroupTrackingEvent",
        "find_best_reset_points", "suggest_checkpoint_location", "SuggestedCheckpoints",
        "compare_memory_traces_in_plot", "matplotlib_figure_to_image", "null_context",
    ],
    "fairscale.experimental.wgit": ["SignalSparsity", "Algo", "random_sparse_mask", "EnergyConcentrationProfile"],
    "fairscale.experimental.wgit.sha1_store": ["SHA1_Store"],
    "fairscale.experimental.wgit.utils": ["ExitCode"],
    "fairscale.experimental.wgit.cli": ["main"],
}  # fmt: skip


def test_public_names_import() -> None:
    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"{module} lacks {missing}"
    assert importlib.import_module("fairscale.experimental").__all__ == []
    from fairscale.experimental.nn.data_parallel.gossip.distributed import BROADCAST_BUCKET_SIZE, HEARTBEAT_TIMEOUT

    assert (HEARTBEAT_TIMEOUT, BROADCAST_BUCKET_SIZE) == (300, 10 * 1024 * 1024)


def test_ampnet_pipe_is_an_async_pipe() -> None:
    from fairscale.experimental.nn.ampnet_pipe.pipe import AMPnetPipe
    from fairscale.nn.pipe import AsyncPipe

    assert issubclass(AMPnetPipe, AsyncPipe)
    assert importlib.import_module("fairscale.experimental.nn.ampnet_pipe").__all__ == []


def test_docs_example_runs() -> None:
    with open(os.path.join(ROOT, "docs", "experimental.rst")) as f:
        text = f.read()
    block = re.search(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", text)
    assert block is not None
    code = "\n".join(line[4:] for line in block.group(1).splitlines())
    exec(compile(code, "docs/experimental.rst", "exec"), {})
