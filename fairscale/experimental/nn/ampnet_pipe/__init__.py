# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AMPnet asynchronous pipeline training (``fairscale.experimental.nn.ampnet_pipe.pipe.AMPnetPipe``).

Built on ``fairscale.nn.pipe.AsyncPipe``: one process per stage, activations and gradients exchanged as
messages. The package itself exports nothing, as upstream.
"""

from typing import List

__all__: List[str] = []
