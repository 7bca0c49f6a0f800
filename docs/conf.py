# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Sphinx configuration. Build with: pip install sphinx && sphinx-build -b html docs docs/_build/html"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

from fairscale.version import __version__  # noqa: E402

project = "fairscale (maintained)"
author = "the fairscale-maintained contributors"
release = __version__
version = __version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build"]
html_theme = "alabaster"
