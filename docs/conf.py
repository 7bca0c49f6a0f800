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
extensions = ["sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
# docs/modules.rst: one generated page per public module (into docs/_modules, not kept in git).
autosummary_generate = True
templates_path = ["_templates"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Members without a docstring of their own get none (torch's inherited ones, e.g. autograd.Function.forward's,
# refer to labels of torch's docs).
autodoc_inherit_docstrings = False
exclude_patterns = ["_build", "_templates"]
html_theme = "alabaster"
