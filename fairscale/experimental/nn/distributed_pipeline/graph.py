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


def _describe(module: RemoteModule) -> str:
    """A RemoteModule for messages: its ``repr()`` raises."""
    return f"{type(module).__name__} on {getattr(module, 'on', '?')}"


NodeDataSource = Union[RemoteModule, Tuple[RemoteModule, int]]
DataSourceSpec = Union[int, NodeDataSource]
NodeDataConsumer = DataConsumer[Node]  # upstream's public alias
_SourceSpec = DataSourceSpec  # for annotations inside PipelineModulesGraph, whose attribute shadows the name


class PipelineModulesGraph(nn.Module):
    """A graph of ``RemoteModule`` s for :class:`DistributedPipeline`.

    Inputs of a layer are given as: an ``int`` (that model input), a ``RemoteModule`` (its single output) or
    ``(RemoteModule, k)`` (output ``k`` of a module returning a tuple, added with ``num_outputs > k``). Referenced
    modules must already be in the graph, each ``RemoteModule`` is one layer (added once), every layer takes at
    least one input, and every layer but the last feeds a later one (the last one's output is the model output).
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
        raise ValueError(
            f"{_describe(module)} is not in the graph; add it with add_layer/add_sequence before using its output"
        )

    def _data_source_spec_to_data_source(self, spec: _SourceSpec) -> DataSource:
        if isinstance(spec, bool) or not isinstance(spec, (int, RemoteModule, tuple)):
            raise TypeError(
                f"a layer input must be an int (a model input), a RemoteModule or a (RemoteModule, index) pair, got "
                f"{type(spec).__name__}"
            )
        if isinstance(spec, int):
            if spec < 0:  # the forward indexed its inputs from the end, silently
                raise ValueError(f"model input index {spec} is negative; number the model's inputs from 0")
            return DataSource(None, spec)
        if isinstance(spec, RemoteModule):
            node = self._find_node(spec)
            if node.num_outputs is not None:
                # Its consumer got output 0 silently: a whole-output reference names no output of a tuple.
                raise ValueError(
                    f"{_describe(spec)} declares num_outputs={node.num_outputs}; refer to one of its outputs as "
                    "(module, k)"
                )
            return DataSource(node, 0)
        if len(spec) != 2 or not isinstance(spec[0], RemoteModule):
            raise TypeError("a tuple layer input must be (RemoteModule, output index)")
        module, index = spec
        node = self._find_node(module)
        if node.num_outputs is None and index == 0 and not isinstance(index, bool):
            return DataSource(node, 0)  # upstream's spelling of the whole output of a single-output layer
        if node.num_outputs is None:
            # Another index was ignored and the whole output passed on, silently.
            raise ValueError(
                f"({_describe(module)}, {index}) reads output {index}, but that layer was added without "
                "num_outputs: add it with num_outputs=<number of outputs used>, or refer to its whole output as "
                "the module alone"
            )
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < node.num_outputs:
            # An index past the outputs failed on the producer's worker, and the pipeline waited for the RPC timeout.
            raise ValueError(
                f"({_describe(module)}, {index!r}): the output index must be an int in [0, {node.num_outputs}) "
                f"since that layer declares num_outputs={node.num_outputs}"
            )
        return DataSource(node, index)

    def add_layer(self, module: RemoteModule, inputs: List[_SourceSpec], num_outputs: Optional[int] = None) -> None:
        """Append ``module``, fed by ``inputs``; ``num_outputs`` when it returns a tuple whose items are used.

        Raises:
            ValueError: ``module`` is already in the graph (each ``RemoteModule`` may appear once), ``inputs`` is
                empty, ``num_outputs`` is not a positive int, an input refers to a module not in the graph, or an
                output index does not fit the producer's ``num_outputs``.
            TypeError: ``module`` is not a ``RemoteModule``, or an input is not an ``int``, a ``RemoteModule`` or a
                ``(RemoteModule, int)`` pair.
        """
        if not callable(getattr(module, "get_module_rref", None)):
            # A local module was taken, and building the pipeline failed on a missing get_module_rref (a fuzz, s. 45).
            raise TypeError(
                f"layer {len(self.nodes)} must be a torch.distributed.nn.RemoteModule (the pipeline runs each layer "
                f"on its worker through its module RRef), got {type(module).__name__}; create it with "
                "RemoteModule('worker/cpu', module_cls, args)"
            )
        existing = next((i for i, n in enumerate(self.nodes) if n.module is module), None)
        if existing is not None:
            # Inputs name modules, so consumers of a second call were wired to the first one (a silently wrong
            # output), and the parameters were stepped once per call.
            raise ValueError(
                f"{_describe(module)} is already in the graph as layer {existing}: a RemoteModule may be added once. "
                "To apply the same weights twice, add a second RemoteModule on the same module, made with "
                "RemoteModule.init_from_module_rref(f'{module.on}/{module.device}', module.get_module_rref())"
            )
        if not isinstance(inputs, (list, tuple)) or not inputs:
            # A layer with no inputs was never fed and the pipeline waited for the RPC timeout.
            raise ValueError(
                f"layer {len(self.nodes)} ({_describe(module)}) needs at least one input (a model input index or "
                "another layer's output): a layer without inputs never runs"
            )
        if num_outputs is not None and (isinstance(num_outputs, bool) or not isinstance(num_outputs, int)):
            raise ValueError(f"num_outputs must be None or a positive int, got {num_outputs!r}")
        if num_outputs is not None and num_outputs < 1:
            raise ValueError(f"num_outputs must be None or a positive int, got {num_outputs}")
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
        """Append a chain: the first module takes ``first_module_inputs``, each next one the previous output.

        All or nothing: when ``add_layer`` refuses a module, none of the chain stays in the graph (a part of it
        would be a layer nobody reads).
        """
        count = len(self.nodes)
        try:
            for i, module in enumerate(modules):
                inputs: List[_SourceSpec] = first_module_inputs if i == 0 else [modules[i - 1]]
                self.add_layer(module, inputs, last_module_num_outputs if i == len(modules) - 1 else None)
        except Exception:
            del self.nodes[count:]
            raise

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

    def _check_single_output(self) -> None:
        """Every layer but the last must feed another: the last one's output is the pipeline's output.

        A layer whose output nobody read silently became the pipeline's output when it was added last, and made
        ``dist_autograd.backward`` wait for the RPC timeout otherwise (its input's send never got a gradient).
        """
        for i, node in enumerate(self.nodes[:-1]):
            if not node.output_consumers:
                raise ValueError(
                    f"layer {i} ({_describe(node.module)}) of the graph feeds no other layer: every layer but the "
                    f"last (layer {len(self.nodes) - 1}, the model output) must be an input of a later one; remove "
                    "the unused layer"
                )

    def partition_graph(self) -> List[Tuple[List[Node], rpc.RRef[Any]]]:
        """Split the graph into chains; returns ``(nodes, RRef of the module running them)`` per partition.

        Raises:
            ValueError: a layer other than the last feeds no other layer.
        """
        self._compile()
        self._check_single_output()
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
