# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""What FullyShardedDataParallel's constructor does to the module it wraps: pick the parameters to own, shard them."""

from typing import List, Set, Tuple

import torch
from torch import nn

from fairscale.internal.sparse_layers import sparse_gradient_layer
from fairscale.nn.misc._flatten.grouping import MixedParameterGroupError
from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper

from . import aliasing, step_guard, ties
from .config import FSDPConfig
from .freed_views import FreedViews
from .handle import FlatHandle
from .unit import unit_of

NamedParams = List[Tuple[str, nn.Parameter]]


def flatten(
    module: nn.Module,
    owned: List[nn.Parameter],
    config: FSDPConfig,
    flatten_parameters: bool,
    optimize_backward_concat: bool,
) -> FlattenParamsWrapper:
    """Wrap ``module`` in the FlattenParamsWrapper that FSDP holds, flattening ``owned`` when
    ``flatten_parameters`` (otherwise nothing is flattened), and mark the flattened parameters' tied owners."""
    _refuse_module_without_forward(module, owned, config)
    try:
        fpw = FlattenParamsWrapper(
            module, param_list=owned if flatten_parameters else [], optimize_backward_concat=optimize_backward_concat
        )
    except MixedParameterGroupError as e:  # only then is the advice right (not for other refusals)
        raise ValueError(
            f"{e}\nWith FullyShardedDataParallel: wrap the parameters that differ (e.g. the frozen part) in their "
            "own FullyShardedDataParallel instance, or pass flatten_parameters=False."
        ) from e
    if flatten_parameters:
        if owned:
            step_guard.guard_flattened_parameters()
        ties.mark_flattened(
            owned,
            [m for _, m, _ in fpw._param_infos] + [info[2] for info in fpw._shared_param_infos],
            sharded=config.world_size > 1,
        )
    return fpw


def refuse_unsupported_layers(module: nn.Module) -> None:
    """Raise at wrapping for what would fail later inside FSDP with torch's words.

    * A layer that makes sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``): FSDP flattens, shards
      and reduce-scatters dense gradients (before: "reshape is not implemented for sparse tensors" in the first
      backward). A frozen one makes no gradient and is accepted.
    * A buffer on the meta device (parameters there are refused by the configuration): the first forward failed
      moving it, with "Cannot copy out of meta tensor" and no name.
    """
    sparse = sparse_gradient_layer(module)
    if sparse is not None:
        raise ValueError(
            f"FullyShardedDataParallel does not support sparse gradients: {sparse[0] or 'the module'} is an "
            f"{sparse[1]} with sparse=True. Build it with sparse=False (FSDP shards and reduces dense "
            "gradients), or keep it out of FSDP."
        )
    for name, p in module.named_parameters():
        if p.layout != torch.strided:  # failed in the flattening with "reshape is not implemented for sparse tensors"
            raise ValueError(
                f"FullyShardedDataParallel: parameter {name} is a {p.layout} tensor; FSDP shards dense parameters. "
                "Keep it dense (p.to_dense()), or keep the module that holds it out of FSDP"
            )
        if any(c.__name__ == "DTensor" for c in type(p).__mro__):
            raise ValueError(
                f"FullyShardedDataParallel: parameter {name} is a DTensor: the module was sharded already (torch's "
                "fully_shard / FSDP2, or tensor parallelism). fairscale's FSDP shards plain tensors: wrap the module "
                "before (instead of) torch's sharding"
            )
    for name, b in module.named_buffers():
        if b.device.type == "meta":
            raise ValueError(
                f"FullyShardedDataParallel: buffer {name} is on the meta device; materialise it before wrapping "
                "(module.to_empty(device=...), then initialise it)"
            )


def collect_params_to_own(module: nn.Module, fsdp_cls: type) -> Tuple[NamedParams, NamedParams, List[str]]:
    """Parameters of ``module`` not yet owned by a nested FSDP instance, parameters owned by a sibling, tie problems.

    A parameter already sharded by an FSDP instance outside ``module`` (a weight tied to a sibling) is skipped, as
    upstream, and returned as foreign: unless ``append_shared_param`` declares it, the first forward raises. Ties
    that no declaration can make work are returned as problems and raise at the first forward too (see
    :func:`.ties.find_unhonourable_ties`); owning such a parameter here would silently untie it. Nested instances
    learn that they have a parent (``no_sync()`` is refused on them, before their lazy init as after).
    """
    nested_owned: Set[int] = set()
    for m in module.modules():
        nested = unit_of(m)
        if nested is not None:
            nested.has_fsdp_parent = True
            nested_owned.update(id(p) for p in m.parameters())
    tie_problems = ties.find_unhonourable_ties(module, nested_owned, fsdp_cls)
    foreign: NamedParams = []
    owned: NamedParams = []
    seen = set()
    # nn.Module's own walk of the registered parameters: a module overriding named_parameters() (to hide one from an
    # optimizer) hid it from FSDP too, which then never managed it ("internal error"; a fuzz, session 49).
    for name, p in nn.Module.named_parameters(module):
        if id(p) in seen or id(p) in nested_owned:
            continue
        seen.add(id(p))
        if hasattr(p, "_is_sharded"):
            foreign.append((name, p))
            continue
        owned.append((name, p))
    overlap = aliasing.find_overlapping(owned)
    if overlap is not None:
        raise ValueError(
            f"FullyShardedDataParallel: parameters {overlap[0]} and {overlap[1]} view overlapping memory (one is a "
            "view of the other's data); FSDP shards each parameter into its own copy, so the two would train apart. "
            "Use the same Parameter object in both places (a tie), or give each its own memory (.clone())"
        )
    return owned, foreign, tie_problems


def shard_parameter(p: nn.Parameter, name: str, config: FSDPConfig) -> FlatHandle:
    """Shard ``p`` in place (see :meth:`FlatHandle.shard_param_`) and move the shard to the compute device."""
    unsharded = p.data
    handle = FlatHandle.shard_param_(p, name, config.world_size, config.rank)
    handle.replicated = config.replicate_size > 1
    with torch.no_grad():
        accelerator = config.compute_device.type not in ("cpu", "meta")
        if accelerator and not config.move_params_to_cpu and p.device.type not in ("meta", config.compute_device.type):
            # A model built on the CPU with an accelerator compute device: only the shard moves, and before the user
            # builds (or loads) the optimizer, so its state is created next to the parameters.
            p.data = p.data.to(config.compute_device)
    if p.data.data_ptr() != unsharded.data_ptr():
        FreedViews.retire(p, unsharded)  # the wrapped modules' views of it would keep it alive
    return handle


def shard_parameters(
    wrapper: FlattenParamsWrapper, params: List[nn.Parameter], names: List[str], config: FSDPConfig
) -> List[FlatHandle]:
    """Shard every parameter a new instance owns (:func:`shard_parameter`); return their handles in order."""
    handles = [shard_parameter(p, name, config) for p, name in zip(params, names)]
    # The wrapper's list of its last views (read by checkpoint_wrapper) held the unsharded flat parameters too: it
    # lists what the modules hold now (the stand-ins; found by a review, session 42).
    user_module = wrapper.__dict__.get("_modules", {}).get("_fpw_module")
    if user_module is not None and user_module.__dict__.get("_unflattened_param_views"):
        slots = [(m, n) for flat in wrapper.flat_params for _, m, n in flat._param_infos]
        user_module.__dict__["_unflattened_param_views"] = [m.__dict__.get(n) for m, n in slots]
    return handles


def _refuse_module_without_forward(module: nn.Module, owned: List[nn.Parameter], config: FSDPConfig) -> None:
    """Raise ``ValueError`` for a sharded instance over a module that nothing calls (``nn.ModuleList``).

    Such a wrapper's forward, where its parameters are gathered, never runs, so the items its parent calls computed
    with this rank's shard: a wrong output on some ranks with no error, or a misleading one (a fuzz, session 48).
    Fine: items wrapped on their own (they own their parameters), a shard that is the whole parameter (a shard group
    of one rank), a class called through its own ``__call__``, a forward set on the instance (``torch.compile``).
    """
    if not owned or config.world_size == 1 or getattr(module.forward, "__func__", None) is not nn.Module.forward:
        return
    # ParameterList and ParameterDict override __call__ only to refuse being called.
    if type(module).__call__ is not nn.Module.__call__ and not isinstance(module, (nn.ParameterList, nn.ParameterDict)):
        return
    raise ValueError(
        f"FullyShardedDataParallel cannot wrap a {type(module).__name__} that holds parameters of its own: it has no "
        "forward, so the wrapper's forward, which gathers the full parameters, would never run, and the modules in "
        "it, called by their parent, would compute with this rank's shard. Wrap the module that uses it instead (or "
        "each module in a ModuleList or ModuleDict on its own); auto_wrap's default_auto_wrap_policy never wraps "
        "these containers."
    )
