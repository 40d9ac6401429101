"""Run a callback once a module has been imported, without importing it ourselves.

Used to register the ``"dualkv"`` attention with transformers only when transformers' modelling
code is loaded anyway, so that importing ``dualkv.models`` stays cheap. The finder removes itself
after the first import of its module; the callback runs right after the module has executed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

__all__ = ["call_when_imported"]


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader and runs the callback after ``exec_module``."""

    def __init__(self, loader, callback: Callable[[], None]):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name):  # get_code, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]):
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec


def call_when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` now if module ``name`` is imported, else right after it gets imported."""
    if name in sys.modules:
        callback()
        return
    if any(isinstance(f, _PostImportFinder) and f.name == name and f.callback is callback for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PostImportFinder(name, callback))
