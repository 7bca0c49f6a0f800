# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""OSS's broadcast buckets: one flat buffer per (device, owning rank) that the owner's trainable parameters are
views of, so that sharing the updated parameters is one broadcast per owner instead of one per parameter."""

from typing import Any, Dict, List, Sequence

import torch

from fairscale.internal import collectives
from fairscale.internal.collectives import WorkHandle
from fairscale.internal.errors import FairscaleTypeError
from fairscale.nn.misc.param_bucket import ParamBucket

__all__ = ["Buckets", "build_buckets", "broadcast_buckets"]

# {device: {owner rank: bucket}}, the layout upstream exposes as ``OSS.buckets``.
Buckets = Dict[torch.device, Dict[int, ParamBucket]]


@torch.no_grad()
def build_buckets(per_device: Dict[Any, List[List[torch.Tensor]]], previous: Buckets) -> Buckets:
    """(Re)build the buckets for the current trainability.

    Frozen parameters get a private copy of their storage (they may still be views of an older bucket, which must
    not keep them alive or overwrite them). An owner whose parameters on a device are all frozen gets no new
    bucket, but keeps the one it had (upstream keeps it too, and it is broadcast as before: every rank keeps
    the same set of buckets, which is what the broadcasts require).

    Raises:
        TypeError: (also an ``AssertionError``, as upstream asserted) one owner's trainable parameters on one device
            have different dtypes; nothing is changed then.
    """
    _check_one_dtype_per_bucket(per_device)
    buckets: Buckets = {}
    for device, per_rank in per_device.items():
        device_buckets: Dict[int, ParamBucket] = dict(previous.get(device, {}))
        for owner, params in enumerate(per_rank):
            if not params:
                continue
            for param in params:
                if not param.requires_grad:
                    param.data = param.data.detach().clone()
            trainable = [p for p in params if p.requires_grad]
            if not trainable:
                continue
            bucket = ParamBucket(sum(p.numel() for p in trainable), trainable[0].dtype, device)
            for param in trainable:
                bucket.add_param(param)
            device_buckets[owner] = bucket
        buckets[device] = device_buckets
    return buckets


def _check_one_dtype_per_bucket(per_device: Dict[Any, List[List[torch.Tensor]]]) -> None:
    # A flat bucket has one dtype: a parameter of another dtype would silently become a view of a different dtype.
    for device, per_rank in per_device.items():
        for owner, params in enumerate(per_rank):
            dtypes = sorted({str(p.dtype) for p in params if p.requires_grad})
            if len(dtypes) > 1:
                raise FairscaleTypeError(
                    f"OSS: the trainable parameters that rank {owner} owns on {device} have several dtypes "
                    f"({', '.join(dtypes)}); OSS broadcasts them as one flat buffer of one dtype. Give the model's "
                    "parameters one dtype (e.g. model.float()), or put each dtype in its own OSS."
                )


@torch.no_grad()
def broadcast_buckets(buckets: Buckets, group: Any, local_to_global: Sequence[int], fp16: bool) -> None:
    """Send every owner's bucket to all ranks (all broadcasts in flight at once), optionally as fp16.

    With ``fp16`` the buffers travel as half precision and come back in their own dtype, so every trainable
    parameter, the owner's included, ends up rounded to fp16 precision (as upstream; the ranks stay identical).
    """
    dtypes: Dict[int, torch.dtype] = {}
    if fp16:
        for device_buckets in buckets.values():
            for bucket in device_buckets.values():
                assert bucket.buffer is not None
                dtypes[id(bucket)] = bucket.buffer.dtype
                bucket.to(dtype=torch.float16, device=bucket.buffer.device, keep_param_alignment=False)
    handles: List[WorkHandle] = []
    for device_buckets in buckets.values():
        for owner, bucket in device_buckets.items():
            assert bucket.buffer is not None
            handle = collectives.broadcast(bucket.buffer, src=local_to_global[owner], group=group, async_op=True)
            assert handle is not None
            handles.append(handle)
    for handle in handles:
        handle.wait()
    if fp16:
        for device_buckets in buckets.values():
            for bucket in device_buckets.values():
                assert bucket.buffer is not None
                # Back to the bucket's own dtype (upstream assumed fp32, turning an fp16/bf16 model into fp32).
                bucket.to(dtype=dtypes[id(bucket)], device=bucket.buffer.device, keep_param_alignment=True)
