# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""A dropped SGP model is freed and its gossip thread ends.

Before, the gossip thread (a daemon looping forever) held the model's SGP state, hence its module and gossip
buffers: every SGP model built in a process stayed alive with its thread. Now the thread holds the state only during
a round and ends once the model is gone; a model still in use keeps gossiping.

Worlds run in gloo processes started by the test engine, with module-level bodies (so the file also passes with
``FAIRSCALE_TEST_START_METHOD=spawn``).
"""

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from fairscale.experimental.nn.data_parallel import gossip
from fairscale.experimental.nn.data_parallel.gossip import SlowMoBaseAlgorithm
from fairscale.fair_dev.testing.engine import run_distributed

TIMEOUT = 60.0


def _sgp_model(rank: int) -> gossip.SlowMoDistributedDataParallel:
    inner = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        inner.weight.fill_(rank + 1.0)
    return gossip.SlowMoDistributedDataParallel(
        inner, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP, slowmo_momentum=0.0
    )


def _lifetime_world(rank: int, world_size: int) -> None:
    kept = _sgp_model(rank)
    for _ in range(2):  # a dropped model, also after it gossiped
        model = _sgp_model(rank)
        model.perform_slowmo(torch.optim.SGD(model.parameters(), lr=0.1))
        assert model._sgp is not None
        thread = model._sgp.gossip_thread
        assert thread is not None and thread.is_alive()
        module_ref = weakref.ref(model.module)
        del model
        gc.collect()
        assert module_ref() is None, "the dropped model's module is still alive"
        thread.join(timeout=10)
        assert not thread.is_alive(), "the dropped model's gossip thread did not end"
    # The model still referenced gossips on (gc passes do not end its thread): the ranks' 1 and 2 are averaged.
    gc.collect()
    kept.perform_slowmo(torch.optim.SGD(kept.parameters(), lr=0.1))
    assert kept.module.weight.item() == pytest.approx(1.5)


def test_dropped_sgp_model_is_freed_and_its_thread_ends() -> None:
    run_distributed(_lifetime_world, 2, timeout=TIMEOUT)
