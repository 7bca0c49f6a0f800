# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The model as a graph of ``RemoteModule`` s, and its partitioning into chains that run on one worker."""

from dataclasses import dataclass
from typing import Any, List, Optional, Set, Tuple, Union

import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.nn.api.remote_module import RemoteModule

from .data import DataConsumer

__all__ = ["PipelineModulesGraph", "MultiInputSequential", "RemoteSequential", "DataSource", "Node"]


@dataclass
class DataSource:
    """Output ``output_idx`` of ``producer``, or model input number ``output_idx`` when ``producer`` is None."""

    producer: Optional["Node"]
    output_idx: int


class Node:
    """One ``RemoteModule`` of the graph with its inputs and (after compiling) the consumers of its outputs."""

    def __init__(self, module: RemoteModule) -> None:
        self.module = module
        self.num_outputs: Optional[int] = None
        self.inputs: List[DataSource] = []
        self.output_consumers: List[DataConsumer["Node"]] = []


class MultiInputSequential(nn.Module):
    """Like ``nn.Sequential``, but the first module takes any number of inputs."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__()
        self.modules_list = nn.ModuleList(modules)

    def forward(self, *inputs: Any) -> Any:
        output = self.modules_list[0](*inputs)
        for module in self.modules_list[1:]:
            output = module(output)
        return output


def RemoteSequential(rref_list: List[rpc.RRef[Any]]) -> MultiInputSequential:
    """The local modules behind ``rref_list`` (all owned by this worker) chained as one module."""
    return MultiInputSequential(*(rref.local_value() for rref in rref_list))


def _remote_sequential_rref(rref_list: List[rpc.RRef[Any]]) -> rpc.RRef[Any]:
    """Runs on the modules' owner: an RRef of their ``RemoteSequential``, which exists when the caller gets it."""
    return rpc.RRef(RemoteSequential(rref_list))


NodeDataSource = Union[RemoteModule, Tuple[RemoteModule, int]]
DataSourceSpec = Union[int, NodeDataSource]
NodeDataConsumer = DataConsumer[Node]  # upstream's public alias
_SourceSpec = DataSourceSpec  # for annotations inside PipelineModulesGraph, whose attribute shadows the name


class PipelineModulesGraph(nn.Module):
    """A graph of ``RemoteModule`` s for :class:`DistributedPipeline`.

    Inputs of a layer are given as: an ``int`` (that model input), a ``RemoteModule`` (its single output) or
    ``(RemoteModule, k)`` (output ``k`` of a module returning a tuple). Referenced modules must already be in the
    graph.
    """

    # Upstream exposes the type of the ``inputs`` items on the class.
    DataSourceSpec = _SourceSpec

    def __init__(self) -> None:
        super().__init__()
        self.nodes: List[Node] = []
        self.model_input_consumers: List[DataConsumer[Node]] = []

    def _find_node(self, module: RemoteModule) -> Node:
        for n in self.nodes:
            if n.module is module:
                return n
        # repr() of a RemoteModule raises, so describe it by hand.
        what = f"{type(module).__name__} on {getattr(module, 'on', '?')}"
        raise ValueError(f"{what} is not in the graph; add it with add_layer/add_sequence before using its output")

    def _data_source_spec_to_data_source(self, spec: _SourceSpec) -> DataSource:
        if isinstance(spec, int):
            return DataSource(None, spec)
        if isinstance(spec, RemoteModule):
            return DataSource(self._find_node(spec), 0)
        module, index = spec
        return DataSource(self._find_node(module), index)

    def add_layer(self, module: RemoteModule, inputs: List[_SourceSpec], num_outputs: Optional[int] = None) -> None:
        """Append ``module``, fed by ``inputs``; ``num_outputs`` when it returns a tuple whose items are used."""
        sources = [self._data_source_spec_to_data_source(i) for i in inputs]
        node = Node(module)
        node.num_outputs = num_outputs
        node.inputs = sources
        self.nodes.append(node)

    def add_sequence(
        self,
        modules: List[RemoteModule],
        first_module_inputs: List[_SourceSpec],
        last_module_num_outputs: Optional[int] = None,
    ) -> None:
        """Append a chain: the first module takes ``first_module_inputs``, each next one the previous output."""
        for i, module in enumerate(modules):
            inputs: List[_SourceSpec] = first_module_inputs if i == 0 else [modules[i - 1]]
            self.add_layer(module, inputs, last_module_num_outputs if i == len(modules) - 1 else None)

    def _compile(self) -> None:
        # Rebuilt from scratch, so compiling twice does not duplicate consumers (upstream appended again).
        self.model_input_consumers = []
        for node in self.nodes:
            node.output_consumers = []
        for node in self.nodes:
            for input_index, source in enumerate(node.inputs):
                consumer = DataConsumer(node, input_index, source.output_idx)
                if source.producer is not None:
                    source.producer.output_consumers.append(consumer)
                else:
                    self.model_input_consumers.append(consumer)

    def _trace_modules(self, node: Node) -> List[Node]:
        """The longest chain from ``node`` through single consumers on the same worker and device."""
        partition = []
        current = node
        while True:
            partition.append(current)
            if len(current.output_consumers) != 1 or current.num_outputs is not None:
                break
            nxt = current.output_consumers[0].consumer
            if nxt.inputs != [DataSource(current, 0)]:
                break
            if nxt.module.on != current.module.on or nxt.module.device != current.module.device:
                break
            current = nxt
        return partition

    def partition_graph(self) -> List[Tuple[List[Node], rpc.RRef[Any]]]:
        """Split the graph into chains; returns ``(nodes, RRef of the module running them)`` per partition."""
        self._compile()
        used: Set[int] = set()
        partitions: List[Tuple[List[Node], rpc.RRef[Any]]] = []
        for node in self.nodes:
            if id(node) in used:
                continue
            partition = self._trace_modules(node)
            if used.intersection(id(n) for n in partition):
                raise RuntimeError("fairscale internal error: a node was put in two pipeline partitions")
            used.update(id(n) for n in partition)
            if len(partition) == 1:
                remote_module = partition[0].module.get_module_rref()
            else:
                rrefs = [n.module.get_module_rref() for n in partition]
                # Synchronous: the partition's handler dereferences this RRef in an RPC handler, which must not
                # wait there for a module still being built (see partition_handler's threading design).
                remote_module = rpc.rpc_sync(partition[0].module.on, _remote_sequential_rref, args=(rrefs,))
            partitions.append((partition, remote_module))
        return partitions
