"""Loading the ``server`` package for ``Inspector.serve()``, lazily: ``inspector`` imports no web code.

The package is the one shipped beside ``inspector``, even when the user's working directory
(first on ``sys.path``) has a ``server.py`` or ``server/`` of its own: then it is loaded from
its file under a private alias instead of by name.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .wire.errors import InspectorError

__all__ = ["load_server_module"]

_ALIAS = "_gradient_inspector_server"


def _server_package() -> ModuleType:
    """The ``server`` package shipped beside ``inspector``, even if ``server`` names another module."""
    here = Path(__file__).resolve().parent.parent / "server"
    existing = sys.modules.get("server")
    if existing is not None and Path(getattr(existing, "__file__", "") or "").resolve().parent == here:
        return existing
    if existing is None:
        spec = importlib.util.find_spec("server")
        if spec is not None and spec.origin and Path(spec.origin).resolve().parent == here:
            return importlib.import_module("server")
    if _ALIAS in sys.modules:
        return sys.modules[_ALIAS]
    spec = importlib.util.spec_from_file_location(
        _ALIAS, here / "__init__.py", submodule_search_locations=[str(here)]
    )
    if spec is None or spec.loader is None:
        raise InspectorError(f"the server package is missing from {here}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_ALIAS] = mod
    spec.loader.exec_module(mod)
    return mod


def load_server_module(name: str) -> ModuleType:
    """``server.<name>`` from the shipped package (e.g. ``"embed"``)."""
    return importlib.import_module(f"{_server_package().__name__}.{name}")
