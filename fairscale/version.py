# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Version of this distribution.

The version sits above upstream's last release (0.4.13) so that dependency resolvers prefer it,
and the local part (``+maint``) identifies this maintained distribution.
"""

__version_tuple__ = (0, 5, 0)
__version__ = "0.5.0+maint"
