# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""AMPnet asynchronous pipeline training (``fairscale.experimental.nn.ampnet_pipe.pipe.AMPnetPipe``).

Not yet available in this distribution: it builds on ``fairscale.nn.pipe.AsyncPipe``'s event loop. Importing works;
constructing raises :class:`NotImplementedError`.
"""

from typing import List

__all__: List[str] = []
