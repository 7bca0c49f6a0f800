# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``make_graph``: build a :class:`PipelineModulesGraph` by fx-tracing a module whose layers are ``RemoteModule`` s.

Allowed in the traced forward: calls of ``RemoteModule`` s, ``operator.getitem`` on their outputs, the forward's
arguments and the output. Anything else (arithmetic between layers, plain ``torch.nn`` layers) is rejected, since
it would have to run somewhere.
"""

import contextlib
import inspect
import operator
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch.fx
import torch.nn as nn
from torch.distributed.nn.api.remote_module import RemoteModule

from fairscale.internal.errors import FairscaleValueError

from .graph import PipelineModulesGraph

__all__ = ["make_graph", "RemoteModuleTracer", "GraphCreator"]


class RemoteModuleTracer(torch.fx.Tracer):
    """Traces through every module except ``RemoteModule`` s, which stay leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, RemoteModule)


@contextlib.contextmanager
def _patch_attribute(cls: Any, name: str, value: Any) -> Iterator[None]:
    original = cls.__dict__.get(name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


class GraphCreator:
    """Turns a traced fx graph of remote calls into a :class:`PipelineModulesGraph`.

    Args:
        tracer: the tracer after ``tracer.trace(root)``.
        root: the traced module (default: ``tracer.root``, set by ``trace``).
        graph: the traced graph (default: ``tracer.graph``, the last one ``trace`` built).
    """

    def __init__(
        self, tracer: RemoteModuleTracer, root: Optional[nn.Module] = None, graph: Optional[torch.fx.Graph] = None
    ) -> None:
        self.tracer = tracer
        if root is None:
            root = getattr(tracer, "root", None)
        if graph is None:
            graph = getattr(tracer, "graph", None)
        if not isinstance(root, nn.Module) or not isinstance(graph, torch.fx.Graph):
            raise ValueError("GraphCreator needs a tracer that has traced a module (call tracer.trace(module) first)")
        self.root = root
        self.graph = graph
        self.arg_names = list(inspect.signature(root.forward).parameters)

    def get_module(self, node: torch.fx.Node) -> Optional[RemoteModule]:
        if node.op != "call_module":
            return None
        module = self.root.get_submodule(str(node.target))
        return module if isinstance(module, RemoteModule) else None

    def create_graph(self) -> PipelineModulesGraph:
        sources: Dict[torch.fx.Node, Any] = {}
        num_outputs: Dict[int, Optional[int]] = {}
        whole_used: Dict[int, bool] = {}
        calls: List[Tuple[RemoteModule, List[Any]]] = []
        names: Dict[int, str] = {}  # for messages (a RemoteModule has no repr)
        for node in self.graph.nodes:
            if node.op == "placeholder":
                sources[node] = self.arg_names.index(str(node.target))
            elif node.op == "call_module" and self.get_module(node) is not None:
                module = self.get_module(node)
                assert module is not None
                if node.kwargs:
                    raise FairscaleValueError(
                        f"make_graph: {node.target} is called with keyword arguments {sorted(node.kwargs)}; pass a "
                        "RemoteModule's inputs positionally"
                    )
                if id(module) in names:
                    # Consumers of the second call were wired to the first one: a silently wrong output.
                    raise ValueError(
                        f"make_graph: {node.target} is called more than once; a RemoteModule may be one layer of "
                        "the graph only. To apply the same weights twice, call a second RemoteModule made with "
                        "RemoteModule.init_from_module_rref(f'{module.on}/{module.device}', module.get_module_rref())"
                    )
                names[id(module)] = str(node.target)
                calls.append((module, [self._source(a, sources, whole_used) for a in node.args]))
                sources[node] = module
            elif node.op == "call_function" and node.target is operator.getitem and self._is_remote_output(node):
                module = sources[node.args[0]]
                index = int(node.args[1])
                num_outputs[id(module)] = max(num_outputs.get(id(module)) or 0, index + 1)
                sources[node] = (module, index)
            elif node.op == "output":
                self._check_output(node, sources, calls)
            else:
                raise FairscaleValueError(
                    f"make_graph: node {node.name} ({node.op} {node.target}) is neither a RemoteModule call, an index "
                    "into a RemoteModule's output, an argument nor the output; move that computation into a "
                    "RemoteModule"
                )
        graph = PipelineModulesGraph()
        for module, inputs in calls:
            n = num_outputs.get(id(module))
            if n is not None and whole_used.get(id(module)):
                raise FairscaleValueError(
                    f"make_graph: the output of {names[id(module)]} is used both whole and by index; index every "
                    "use of a multi-output module (out[0], out[1], ...)"
                )
            graph.add_layer(module, inputs, n)
        return graph

    @staticmethod
    def _check_output(
        node: torch.fx.Node, sources: Dict[torch.fx.Node, Any], calls: List[Tuple[RemoteModule, List[Any]]]
    ) -> None:
        # The pipeline's output is the last layer's: a forward returning anything else got that instead, silently.
        result = node.args[0] if node.args else None
        if not calls or not isinstance(result, torch.fx.Node) or sources.get(result) is not calls[-1][0]:
            raise ValueError(
                "make_graph: the forward must return the output of its last RemoteModule call (the pipeline's "
                f"output is that layer's), got {result!r}"
            )

    def _is_remote_output(self, node: torch.fx.Node) -> bool:
        arg = node.args[0]
        return isinstance(arg, torch.fx.Node) and self.get_module(arg) is not None

    @staticmethod
    def _source(arg: Any, sources: Dict[torch.fx.Node, Any], whole_used: Dict[int, bool]) -> Union[int, Any]:
        if not (isinstance(arg, torch.fx.Node) and arg in sources):
            raise FairscaleValueError(
                f"make_graph: a RemoteModule is called with {arg!r}; its arguments must be the forward's arguments or "
                "outputs of other RemoteModules (no constants or computed values)"
            )
        value = sources[arg]
        if isinstance(value, RemoteModule):
            whole_used[id(value)] = True
        return value


def _leaf_named_modules(
    self: nn.Module, memo: Optional[Set[nn.Module]] = None, prefix: str = "", remove_duplicate: bool = True
) -> Iterator[Tuple[str, nn.Module]]:
    """``named_modules`` of a module without sub-modules, reading none of its ``nn.Module`` state: a
    ``RemoteModule`` made by ``RemoteModule.init_from_module_rref`` (a second handle on a module, for shared
    weights) has none, and ``nn.Module.named_modules`` failed on its missing ``_modules``."""
    if memo is None:
        memo = set()
    if self not in memo:
        if remove_duplicate:
            memo.add(self)
        yield prefix, self


def _no_named_children(self: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    return iter(())


def make_graph(module: nn.Module) -> PipelineModulesGraph:
    """Trace ``module`` (its ``RemoteModule`` sub-modules become the graph's layers) into a graph.

    Every ``RemoteModule`` is called once (to apply the same weights twice, call a second ``RemoteModule`` made
    with ``RemoteModule.init_from_module_rref``) and the forward returns the output of the last call.
    """
    # RemoteModule refuses named_modules/named_children, which fx uses to find module paths; it is a leaf.
    with (
        _patch_attribute(RemoteModule, "named_modules", _leaf_named_modules),
        _patch_attribute(RemoteModule, "named_children", _no_named_children),
    ):
        tracer = RemoteModuleTracer()
        graph = tracer.trace(module)
    return GraphCreator(tracer, module, graph).create_graph()
