# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""ShardedDataParallel refuses a trainable layer with sparse gradients at wrapping, naming it.

Accepted before, it failed in the first backward with a message about contiguity (a fuzz of OSS and
ShardedDataParallel, session 44). One process, no process group: the check runs before any communication.
"""

import pytest
import torch
from torch import nn

from fairscale.nn.data_parallel import ShardedDataParallel
from fairscale.optim import OSS


@pytest.mark.parametrize("layer", [nn.Embedding(10, 3, sparse=True), nn.EmbeddingBag(10, 3, sparse=True)])
def test_sparse_embedding_is_refused_at_wrapping(layer):
    model = nn.Sequential(nn.Linear(3, 3), layer)
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"sparse gradients: 1 is an Embedding(Bag)? with sparse=True.*sparse=False"):
        ShardedDataParallel(model, optimizer)


def test_frozen_sparse_embedding_is_accepted():
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True).requires_grad_(False), nn.Linear(3, 1))
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ddp = ShardedDataParallel(model, optimizer)
    ddp(torch.tensor([[1, 2]])).sum().backward()
    optimizer.step()
