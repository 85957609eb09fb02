"""The framework integrations' tests: real Lightning and transformers trainers on tiny CPU models.

The frameworks are optional extras (scripts/setup.sh installs them). Without them these tests
are skipped locally, and fail in CI (``CI=true``), where a skip would hide a broken set-up.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def need(module: str) -> ModuleType:
    """Import ``module``, or skip the calling test module (fail under CI)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise ImportError(
                f"{module} is missing: scripts/setup.sh installs the lightning and hf extras"
            ) from e
        pytest.skip(f"{module} is not installed (pip install -e '.[lightning,hf]')", allow_module_level=True)
