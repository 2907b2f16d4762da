"""The guard of the tests that compile for a TPU topology on this CPU (``libtpu``, the test extra)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_libtpu() -> None:
    """Called at a test module's import: skips the module when ``libtpu`` is not importable, except
    under ``CI=true``, where that fails; lets several pytest-xdist workers load libtpu at once
    (deviceless compiles need no TPU)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if importlib.util.find_spec("libtpu") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(
                "libtpu is not installed (the test extra pins it): the TPU compile check cannot run", pytrace=False
            )
        pytest.skip("libtpu is not installed: no TPU compiler to compile for", allow_module_level=True)
