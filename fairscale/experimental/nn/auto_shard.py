# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Split a model into consecutive pipeline stages of about equal parameter count with ``torch.fx``.

:func:`shard_model` traces the model (sub-modules that fx cannot trace, e.g. with data-dependent control flow,
become leaves), walks the graph in order assigning nodes to shards by their parameter count, pulls nodes back
into an earlier shard when an edge would skip over a shard boundary, and cuts the graph into one
``torch.fx.GraphModule`` per shard. Chaining the shards (``for s in shards: x = s(x)``) computes the model.

The boundary rules are upstream's and decide where the cuts fall, so they are kept exactly (see
``docs/differences.rst``): a node's parameters are looked up by its fx name, then by the part of the name before
the first ``_`` (so the children of an ``nn.Sequential`` root, named ``_0``, ``_1`` ..., count as the whole model);
a shard closes once its count is strictly above ``total // shard_count``.
"""

import logging
from typing import Any, Dict, List, Set

import torch
import torch.fx
import torch.nn as nn
from torch.fx.node import Node

__all__ = ["shard_model"]


class _ExtendedLeafTracer(torch.fx.Tracer):
    """fx tracer that also treats the given module instances as leaves."""

    def __init__(self, leaf_modules: Set[nn.Module]) -> None:
        super().__init__()
        self.leaf_modules = leaf_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) or m in self.leaf_modules


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    """Trace ``model``, making every sub-module that fails to trace on its own a leaf."""
    leaves: Set[nn.Module] = set()
    probe = _ExtendedLeafTracer(leaves)
    for name, module in model.named_modules():
        if probe.is_leaf_module(module, name):
            continue
        try:
            _ExtendedLeafTracer(leaves).trace(module)
        except Exception as e:
            # Any failure, not only TypeError and TraceError (upstream's): fx raises RuntimeError for ``len(x)`` on a
            # proxy, and other untraceable code raises other types. A failure of the root itself still surfaces,
            # from the final trace below.
            logging.info("auto_shard: tracing %r failed (%s); treating it as a leaf", name or "<root>", e)
            leaves.add(module)
    graph = _ExtendedLeafTracer(leaves).trace(model)
    return torch.fx.GraphModule(model, graph)


def _get_count(param_count: Dict[str, int], node_name: str) -> int:
    if node_name in param_count:
        return param_count[node_name]
    prefix = node_name.split("_")[0]
    if prefix in param_count:
        return param_count[prefix]
    raise RuntimeError(f"Unable to find match between param {param_count} and node {node_name}")


def _node_params(param_count: Dict[str, int], node_name: str) -> int:
    try:
        return _get_count(param_count, node_name)
    except RuntimeError:
        return 0


def _shard_sums(assignment: Dict[str, int], param_count: Dict[str, int]) -> Dict[int, int]:
    sums: Dict[int, int] = {}
    for name, shard in assignment.items():
        sums[shard] = sums.get(shard, 0) + _node_params(param_count, name)
    return sums


def _split_nodes(traced: torch.fx.GraphModule, shard_count: int = 3) -> Dict[str, int]:
    """Assign every node (by name) a shard id, so that no edge skips over a shard."""
    param_count: Dict[str, int] = {
        name.replace(".", "_"): sum(p.numel() for p in module.parameters()) for name, module in traced.named_modules()
    }
    per_shard = param_count[""] // shard_count
    assignment: Dict[str, int] = {}
    order: List[str] = []
    shard_id = 0
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            assignment[node.name] = shard_id
            order.append(node.name)
        elif node.op in ("get_attr", "call_function", "call_method", "call_module"):
            min_shard, min_name = shard_id, ""
            # Every node it reads, also inside lists and keyword arguments (``torch.cat([x, h])``): upstream looked
            # at direct positional arguments only, so such a skip crossed a boundary and the stage failed.
            for arg in node.all_input_nodes:
                if arg.name not in assignment:
                    continue
                if order and arg.name == order[-1]:
                    continue
                if assignment[arg.name] < min_shard:
                    min_shard, min_name = assignment[arg.name], arg.name
            if min_shard < shard_id:
                # Pull everything back to the producer into its shard: no edge may skip a boundary.
                for name in reversed(order):
                    assignment[name] = min_shard
                    if name == min_name:
                        break
                shard_id = min_shard
            assignment[node.name] = shard_id
            order.append(node.name)
            if _shard_sums(assignment, param_count).get(shard_id, 0) > per_shard:
                shard_id += 1
        elif node.op == "output":
            break
    return assignment


def _updates_in_place(traced: torch.fx.GraphModule, node: Any, value: Any) -> bool:
    """Whether ``node`` changes ``value`` in place and returns it (``h.relu_()``, ``F.relu(h, inplace=True)``, an
    ``nn.ReLU(inplace=True)``): the last stage then hands on the model's output itself."""
    if not isinstance(node, Node) or not node.args or node.args[0] is not value:
        return False
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("__")
    if node.op == "call_function":
        # F.relu(h, inplace=True), or the function form of an in-place op (torch.relu_(h), torch.sigmoid_(h)).
        name = getattr(node.target, "__name__", "")
        return node.kwargs.get("inplace") is True or (name.endswith("_") and not name.startswith("__"))
    if node.op == "call_module":
        return getattr(traced.get_submodule(str(node.target)), "inplace", False) is True
    return False


def _check_output_is_last_value(traced: torch.fx.GraphModule) -> None:
    """Each stage hands on the last value it computes, so chaining the stages returns the model's output only when
    that output is the model's last computed value. Upstream's stages silently returned that last value instead (a
    statistic computed after the result, one element of a returned tuple)."""
    nodes = list(traced.graph.nodes)
    output, last = nodes[-1], nodes[-2] if len(nodes) > 1 else None
    if output.op == "output" and output.args[0] is not last and not _updates_in_place(traced, last, output.args[0]):
        raise ValueError(
            "shard_model: the model's output is not the last value its forward computes (it returns "
            f"{output.args[0]!r}, computed before {last!r}, or several values): the stages pass on one value each, so "
            "chaining them would not return the model's output. Return a single tensor computed last (compute "
            "auxiliary values before it)."
        )


def shard_model(model: nn.Module, shard_count: int = 3) -> List[torch.fx.GraphModule]:
    """Split ``model`` into a list of ``torch.fx.GraphModule`` stages of about equal parameter count.

    The first stage keeps the model's signature; every later stage takes one positional input (the previous
    stage's output). The stages share the model's sub-modules and parameters (same objects). The number of stages
    is what the boundary rules produce and can differ from ``shard_count``.

    Args:
        model (nn.Module): the model to split; it must be traceable by ``torch.fx`` at its top level.
        shard_count (int): the number of stages aimed for (default: 3).

    Returns:
        List[torch.fx.GraphModule]: the stages, in order.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: ``shard_count`` is not a positive integer, or the model's output is not the last value its
            forward computes (several returned values, or something computed after the result).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_model: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(shard_count, bool) or not isinstance(shard_count, int) or shard_count < 1:
        raise ValueError(f"shard_count must be a positive integer, got {shard_count!r}")
    traced = _trace(model)
    _check_output_is_last_value(traced)
    assignment = _split_nodes(traced, shard_count)
    shards: List[torch.fx.GraphModule] = []
    graph = torch.fx.Graph()
    env: Dict[str, Any] = {}
    prev_node: Any = None
    prev_shard = 0
    for node in traced.graph.nodes:
        shard = assignment.get(node.name, prev_shard)
        if node.op != "output" and shard > prev_shard:
            graph.output(env[prev_node.name])
            graph.lint()
            shards.append(torch.fx.GraphModule(model, graph))
            graph = torch.fx.Graph()
            placeholder = graph.placeholder(f"placeholder{len(shards)}")
            # The previous stage's output reaches the new stage through its placeholder. Upstream replaced all
            # positional args of the stage's first node by the placeholder, which breaks nodes with other args
            # (``mul(x, 2.0)``); mapping only the previous node keeps every case that worked and fixes those.
            env[prev_node.name] = placeholder
            prev_shard = shard
        if node.op == "output":
            graph.output(env[prev_node.name])
            graph.lint()
            shards.append(torch.fx.GraphModule(model, graph))
            break
        env[node.name] = graph.node_copy(node, lambda n: env[n.name])
        prev_node = node
    return shards
