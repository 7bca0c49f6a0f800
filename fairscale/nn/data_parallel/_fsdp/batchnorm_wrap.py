# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""``auto_wrap_bn``: put every batch-norm layer of a model in its own full-precision FSDP instance.

Why batch-norm layers get their own instance: under ``mixed_precision=True`` an FSDP instance computes with
fp16/bf16 copies of its parameters, but batch-norm statistics (and its affine parameters) are numerically fragile in
low precision. Wrapping each batch-norm layer separately, with ``mixed_precision=False``, keeps its weights, gradients
and running statistics in fp32 while the rest of the model runs in the compute dtype. Batch-norm layers are tiny, so
their instances neither flatten nor reshard (nothing to save) and reduce their gradients without bucketing.
"""

from typing import Any, Dict, List, Optional

import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fairscale.internal.parallel import get_process_group_cached
from fairscale.nn.wrap import auto_wrap, config_auto_wrap_policy, enable_wrap
from fairscale.nn.wrap.auto_wrap import ConfigAutoWrap

__all__ = ["auto_wrap_bn"]


def auto_wrap_bn(
    module: nn.Module,
    single_rank_pg: bool = False,
    process_group: Optional[Any] = None,
    fsdp_config: Optional[Dict[str, Any]] = None,
    wrap_it: bool = True,
    assert_on_collision: bool = True,
) -> nn.Module:
    """Wrap every batch-norm layer of ``module`` in its own ``FullyShardedDataParallel`` instance.

    Every ``torch.nn.modules.batchnorm._BatchNorm`` in ``module.modules()`` (``BatchNorm1d/2d/3d``,
    ``SyncBatchNorm``, ``module`` itself if it is one) gets a ``wrapper_config`` attribute, the FSDP
    arguments of its instance. By default these are::

        {"process_group": <see below>, "mixed_precision": False, "flatten_parameters": False,
         "reshard_after_forward": False, "bucket_cap_mb": 0, "force_input_to_fp32": False}

    so the layer keeps fp32 weights, gradients and running statistics even inside a mixed-precision model (it
    accepts fp16/bf16 inputs and returns outputs in the input dtype). Then, with ``wrap_it=True``, the tagged
    layers are wrapped by :func:`~fairscale.nn.wrap.auto_wrap` with
    :func:`~fairscale.nn.wrap.config_auto_wrap_policy`. Wrap the rest of the model afterwards, e.g.
    ``model = FSDP(auto_wrap_bn(model), mixed_precision=True)``.

    Call it on a module that contains no FSDP instance yet, on every rank (with ``single_rank_pg=True`` it creates
    process groups, a collective operation).

    Args:
        module (nn.Module): the model whose batch-norm layers are wrapped (in place).
        single_rank_pg (bool): put each batch-norm instance in a process group of its own rank only. Its
            parameters are then not sharded and its gradients are *not* averaged across ranks: every rank trains
            its own batch-norm weights. Experimental, as upstream. Default: ``False``.
        process_group (ProcessGroup, optional): the sharding group of the batch-norm instances; ``None``: FSDP's
            default group. Cannot be combined with ``single_rank_pg=True``.
        fsdp_config (dict, optional): FSDP arguments used instead of the defaults above. A ``process_group``
            chosen by ``single_rank_pg`` or ``process_group`` is added to it unless it names one itself.
        wrap_it (bool): wrap the tagged layers now. With ``False`` only the ``wrapper_config`` attributes are set,
            for a later :func:`~fairscale.nn.wrap.wrap` / :func:`~fairscale.nn.wrap.auto_wrap` to honour.
            Default: ``True``.
        assert_on_collision (bool): raise if a batch-norm layer already has a ``wrapper_config``; with
            ``False`` the existing one is replaced. Default: ``True``.

    Returns:
        nn.Module: ``module`` with its batch-norm layers wrapped (or ``FullyShardedDataParallel(module)`` when
        ``module`` itself is a batch-norm layer); ``module`` unchanged but tagged when ``wrap_it=False``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``fsdp_config`` is not a dict.
        ValueError: a layer already has a ``wrapper_config`` (with ``assert_on_collision=True``), or the process
            group arguments contradict each other.
        NotImplementedError: called with ``wrap_it=True`` inside an :func:`~fairscale.nn.wrap.enable_wrap`
            context (contexts do not nest).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"auto_wrap_bn expects an nn.Module, got {type(module).__name__}")
    if fsdp_config is not None and not isinstance(fsdp_config, dict):
        raise TypeError(f"auto_wrap_bn: fsdp_config must be a dict of FSDP arguments, got {type(fsdp_config).__name__}")
    if wrap_it and ConfigAutoWrap.in_autowrap_context:
        raise NotImplementedError(
            "auto_wrap_bn(wrap_it=True) was called inside an enable_wrap() context, and wrapping contexts do not "
            "nest. Call it before entering enable_wrap(), or pass wrap_it=False so only the wrapper_config tags are "
            "set and your own auto_wrap()/wrap() picks them up."
        )
    config = _bn_wrapper_config(single_rank_pg, process_group, fsdp_config)
    _tag_batchnorms(module, config, assert_on_collision)
    if not wrap_it:
        return module
    with enable_wrap(config_auto_wrap_policy, wrapper_cls=wrapper_class()):
        return auto_wrap(module)


# The FullyShardedDataParallel class, registered by its module when it is imported (this package sits below the
# front and never imports it).
_WRAPPER_CLS: List[type] = []


def register_wrapper_class(cls: type) -> None:
    """Record the class :func:`auto_wrap_bn` wraps with (called once by the front module)."""
    _WRAPPER_CLS[:] = [cls]


def wrapper_class() -> type:
    if not _WRAPPER_CLS:  # only when this module is imported on its own, without the fairscale.nn.data_parallel package
        raise RuntimeError("auto_wrap_bn(wrap_it=True) needs fairscale.nn.data_parallel to be imported")
    return _WRAPPER_CLS[0]


def _bn_wrapper_config(
    single_rank_pg: bool, process_group: Optional[Any], fsdp_config: Optional[Dict[str, Any]]
) -> Dict[str, Any]:
    """The FSDP arguments every batch-norm layer is tagged with."""
    if single_rank_pg and process_group is not None:
        raise ValueError(
            "auto_wrap_bn: pass either single_rank_pg=True (one group per rank) or a process_group, not both"
        )
    group = _single_rank_group() if single_rank_pg else process_group
    if fsdp_config is None:
        return {
            "process_group": group,
            "mixed_precision": False,  # fp32 weights, gradients and statistics: the point of the separate instance
            "flatten_parameters": False,  # two tiny tensors; flattening buys nothing
            "reshard_after_forward": False,  # re-gathering a few hundred bytes in backward costs more than it saves
            "bucket_cap_mb": 0,
            "force_input_to_fp32": False,  # batch norm accepts fp16/bf16 inputs with fp32 weights
        }
    config = dict(fsdp_config)
    if group is not None:
        named = config.get("process_group")
        if named is not None and named is not group:
            raise ValueError(
                "auto_wrap_bn: fsdp_config names a process_group and single_rank_pg/process_group asks for another; "
                "give the group in one place only"
            )
        config["process_group"] = group
    return config


def _single_rank_group() -> Any:
    """This rank's one-member group.

    ``new_group`` must be entered by every rank for every group in the same order, so each rank creates (through
    the cache) the one-member group of every rank and keeps its own.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "auto_wrap_bn(single_rank_pg=True) needs torch.distributed to be initialized "
            "(dist.init_process_group(...)) to create the per-rank process groups"
        )
    groups = [get_process_group_cached(ranks=[r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _tag_batchnorms(module: nn.Module, config: Dict[str, Any], assert_on_collision: bool) -> None:
    for name, layer in module.named_modules():
        if not isinstance(layer, _BatchNorm):
            continue
        if assert_on_collision and hasattr(layer, "wrapper_config"):
            where = f"'{name}'" if name else "the root module"
            raise ValueError(
                f"auto_wrap_bn: batch-norm layer {where} already has a wrapper_config ({layer.wrapper_config!r}). "
                "Remove it, or pass assert_on_collision=False to replace it."
            )
        # A copy per layer, so editing one layer's config later cannot silently change the others.
        setattr(layer, "wrapper_config", dict(config))
