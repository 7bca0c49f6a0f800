# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Checks of user input in ``fairscale.optim`` and ShardedDataParallel still raise under ``python -O``.

``python -O`` removes every ``assert`` statement; a check written as one silently lets bad input through. The sample
below runs in a fresh ``python -O`` interpreter (one process, no process group) and expects each bad call to raise
the documented exception, which is also an ``AssertionError`` where upstream fairscale asserted.
"""

import os
import subprocess
import sys
import textwrap

import pytest

_SAMPLE = textwrap.dedent("""
    import sys

    import torch
    from torch import nn

    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS, AdaScale, Adam, Precision
    from fairscale.optim.layerwise_gradient_scaler import LayerwiseGradientScaler

    if not sys.flags.optimize:
        raise SystemExit("the sample must run under python -O")

    failures = []


    def expect(name, error, fn):
        try:
            fn()
        except error as e:
            if not isinstance(e, AssertionError):
                failures.append(f"{name}: {type(e).__name__} is not an AssertionError (upstream asserted)")
            return
        except Exception as e:  # a different error is a failure too
            failures.append(f"{name}: raised {type(e).__name__}: {e}")
            return
        failures.append(f"{name}: no error")


    def adascale():
        model = nn.Linear(2, 2)
        return AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), world_size=2)


    expect("AdaScale scale < 1", ValueError, lambda: adascale().set_scale(0.5))
    expect("AdaScale accumulate 0", ValueError, lambda: adascale().set_num_gradients_to_accumulate(0))
    expect("AdaScale scale_grad with scaled loss", RuntimeError, lambda: adascale().scale_grad_by_num_grads_to_accum())
    expect("AdaScale corr on one worker", RuntimeError,
           lambda: AdaScale(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), world_size=1,
                            num_gradients_to_accumulate=2)._compute_intra_grad_corr_mean())
    expect("Adam fp16 mode on fp32 parameters", ValueError,
           lambda: Adam(nn.Linear(2, 2).parameters(), precision=Precision.PURE_FP16))
    expect("layer-wise scaler growth <= 1", ValueError,
           lambda: LayerwiseGradientScaler(nn.Sequential(nn.Linear(2, 2)), {"0": 1.0}, growth_factor=1.0))

    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    oss = OSS(model.parameters(), lr=0.1)
    model.extra = nn.Linear(1, 1, device="meta")
    expect("ShardedDataParallel mixed device types", ValueError, lambda: ShardedDataParallel(model, oss))
    del model.extra
    sdp = ShardedDataParallel(model, oss)
    expect("ShardedDataParallel.reduce with nothing to reduce", RuntimeError, sdp.reduce)

    mixed = nn.Linear(2, 2)
    mixed.bias.data = mixed.bias.data.double()
    expect("OSS one owner, two dtypes on one device", TypeError, lambda: OSS(mixed.parameters(), lr=0.1))

    if failures:
        raise SystemExit("\\n".join(failures))
    print("all checks raised")
    """)


@pytest.mark.skip_under_python_O
def test_checks_raise_under_python_dash_o() -> None:
    env = dict(os.environ)
    env.pop("PYTHONOPTIMIZE", None)
    result = subprocess.run([sys.executable, "-O", "-c", _SAMPLE], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "all checks raised" in result.stdout, result.stdout + result.stderr
