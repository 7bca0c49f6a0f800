"""Runs a fairseq 0.12.2 command-line tool on CPU with this stage's workarounds applied at import time.

Usage: python fairseq_launch.py {preprocess,train} [fairseq arguments...]
For distributed training start it under torchrun (one process per rank, gloo):
    torchrun --standalone --nproc-per-node 2 fairseq_launch.py train ... --cpu --distributed-backend gloo

Written for this repository's `clients` CI stage (.ci/clients/run); docs/clients.rst lists the workarounds:

1. Python 3.11 dataclasses: fairseq 0.12.2 gives config fields dataclass instances as defaults
   (`common: CommonConfig = CommonConfig()`), which Python 3.11 refuses ("mutable default ... use default_factory").
   fairseq reads those defaults back (`__dataclass_fields__[k].default`), so a default_factory would not do: the
   check alone is skipped, for such defaults only, by making the default's class hashable for the duration of the
   check. The result is what Python 3.10 built.
2. Launcher: fairseq spawns `min(torch.cuda.device_count(), world_size)` processes itself, i.e. none on CPU. Under
   torchrun it sees MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK, uses env:// and does not spawn; nothing to patch, but
   the device id it then takes is cfg.device_id (0 on every rank), which is only ever used for CUDA.
3. Gradient norm: Trainer.clip_grad_norm sums the per-rank squared norms of a sharded (FSDP) model with
   `total_norm.cuda()`, even when clipping is off (the norm is logged as gnorm). Replaced by the same all-reduce on
   the tensor's own device.
4. Checkpoints: fairseq calls torch.load without weights_only, which torch >= 2.6 takes as weights_only=True and then
   refuses fairseq's own checkpoints (they hold its argparse/omegaconf config objects). TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
   restores the old default for those calls (the files are the ones this same workload wrote a moment before).
5. Exit: fairseq leaves the gloo process group to interpreter finalization, where gloo's worker threads now and
   then abort the process (SIGABRT, "terminate called without an active exception"); an atexit handler destroys
   it while Python is still whole.

6. bf16 on CPU: fairseq 0.12.2 makes --bf16 (and --memory-efficient-bf16) imply --tpu, i.e. torch_xla. The parsed
   arguments get tpu=False back, so bf16 training runs on the CPU as it would on a GPU.

Not a workaround: with CLIENTS_FAIRSEQ_STATS=path, rank 0 appends one JSON line per update to that file, with the
update's loss and gradient norm at full precision (fairseq's own log rounds them to 3 decimals), for the comparisons
of .ci/clients/fairseq_workload.py.
"""

import dataclasses
import os
import sys


def _allow_dataclass_instance_defaults() -> None:
    original = dataclasses._get_field

    def get_field(cls, name, annotation, *rest):
        default = cls.__dict__.get(name, dataclasses.MISSING)
        if isinstance(default, dataclasses.Field):
            default = default.default
        default_cls = type(default)
        if dataclasses.is_dataclass(default_cls) and default_cls.__dict__.get("__hash__", 0) is None:
            default_cls.__hash__ = object.__hash__  # only while Python checks this field; restored below
            try:
                return original(cls, name, annotation, *rest)
            finally:
                default_cls.__hash__ = None
        return original(cls, name, annotation, *rest)

    dataclasses._get_field = get_field


def _cpu_grad_norm() -> None:
    import torch
    from fairseq.distributed import utils as distributed_utils
    from fairseq.trainer import Trainer

    def clip_grad_norm(self, clip_norm):
        sharded = self.is_fsdp and (self.data_parallel_process_group is not None or torch.distributed.is_initialized())

        def sum_over_ranks(local_norm):
            squared = local_norm.float() ** 2  # on the tensor's own device (fairseq: .cuda())
            squared = distributed_utils.all_reduce(squared, group=self.data_parallel_process_group)
            return squared**0.5

        return self.optimizer.clip_grad_norm(clip_norm, aggregate_norm_fn=sum_over_ranks if sharded else None)

    Trainer.clip_grad_norm = clip_grad_norm


def _record_update_stats(path: str) -> None:
    import json

    import torch
    from fairseq.trainer import Trainer

    original = Trainer._reduce_and_log_stats

    def reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        if grad_norm is not None and self.data_parallel_rank == 0 and logging_outputs:
            # The outputs arrive here summed over the ranks; the loss is the criterion's sum (base e).
            loss_sum = sum(float(log.get("loss", 0)) for log in logging_outputs)
            size = sum(float(log.get("sample_size", 0)) for log in logging_outputs)
            norm = float(grad_norm) if torch.is_tensor(grad_norm) else grad_norm
            with open(path, "a") as f:
                f.write(json.dumps({"update": self.get_num_updates(), "loss": loss_sum / size, "gnorm": norm}) + "\n")
        return original(self, logging_outputs, sample_size, grad_norm)

    Trainer._reduce_and_log_stats = reduce_and_log_stats


def _bf16_without_tpu() -> None:
    from fairseq import options

    original = options.parse_args_and_arch

    def parse_args_and_arch(*args, **kwargs):
        parsed = original(*args, **kwargs)
        parsed.tpu = False  # fairseq sets it for --bf16; there is no TPU here
        return parsed

    options.parse_args_and_arch = parse_args_and_arch


def _destroy_process_group_at_exit() -> None:
    import atexit

    import torch.distributed as dist

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("preprocess", "train"):
        sys.exit(__doc__)
    tool = sys.argv.pop(1)
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    _allow_dataclass_instance_defaults()
    _cpu_grad_norm()
    if tool == "train":
        _bf16_without_tpu()
    _destroy_process_group_at_exit()
    if os.environ.get("CLIENTS_FAIRSEQ_STATS"):
        _record_update_stats(os.environ["CLIENTS_FAIRSEQ_STATS"])
    if tool == "preprocess":
        from fairseq_cli.preprocess import cli_main
    else:
        from fairseq_cli.train import cli_main
    sys.argv[0] = "fairseq-" + tool
    cli_main()


if __name__ == "__main__":
    main()
