#!/usr/bin/env python3
# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""Packaging for the maintained fairscale distribution (drop-in replacement for fairscale 0.4.13)."""

import os
import re

import setuptools

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version() -> str:
    with open(os.path.join(HERE, "fairscale", "version.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    assert match, "fairscale/version.py has no __version__"
    return match.group(1)


def read_requirements(name: str) -> list:
    with open(os.path.join(HERE, name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith(("#", "-r"))]


setuptools.setup(
    name="fairscale",
    version=read_version(),
    description="fairscale (maintained): FSDP and friends for current PyTorch, on CPU/gloo and CUDA/NCCL",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="BSD",
    packages=setuptools.find_packages(exclude=("tests", "tests.*", "benchmarks", "benchmarks.*", "tools", "tools.*")),
    package_data={"fairscale": ["py.typed"]},
    install_requires=read_requirements("requirements.txt"),
    extras_require={
        "dev": read_requirements("requirements-dev.txt"),
        # The main job's PNG plot; without matplotlib it still runs and says it skipped the plot.
        "benchmarks": ["matplotlib"],
    },
    python_requires=">=3.9",
    # fairscale.experimental.wgit (needs pygit2 at run time).
    entry_points={"console_scripts": ["wgit = fairscale.experimental.wgit.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: BSD License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
