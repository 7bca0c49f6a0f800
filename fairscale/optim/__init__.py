# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
from .oss import OSS as OSS
from .adascale import AdaScale as AdaScale
from .adascale import AdaScaleWrapper as AdaScaleWrapper
from .adam import Adam as Adam
from .adam import Precision as Precision
from .grad_scaler import GradScaler as GradScaler
