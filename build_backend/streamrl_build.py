"""The build backend of ``pip install -e .``: setuptools' own (``setuptools.build_meta``, every
hook as it is), with one notice of its editable install left out.

setuptools prints "Please be careful with folders in your working directory with the same name
as your package as they may take precedence during imports" after every editable install it
does with an import finder, which it does whenever the packages are not all under one folder:
here the design's folders sit at the top of the checkout and install as ``streamrl.<folder>``
(``[tool.setuptools] package-dir``). The notice is about nothing this layout does: the one
folder named like the package is the package itself (``streamrl/``), and what a Python outside
the checkout can import (``streamrl.*`` only, no folder as a top-level name) is checked by
tests/test_layout.py. Every other message of the build, a warning included, is kept.
"""

from __future__ import annotations

import warnings
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  every other hook, as setuptools defines it

EDITABLE_NOTICE = r"\s*Editable installation\."
"""The summary line of the notice (``setuptools.command.editable_wheel``), matched at its
start: the notice, of category ``InformationOnly``, and nothing else."""


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    """``setuptools.build_meta.build_editable``, without the notice (module docstring)."""
    from setuptools.warnings import InformationOnly

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EDITABLE_NOTICE, category=InformationOnly)
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
