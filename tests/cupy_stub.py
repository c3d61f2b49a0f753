"""A pytest plugin standing in for CuPy (``-p cupy_stub``), so the GPU tests can be collected on a
machine without a GPU: every ``cupy``, ``cupyx`` and ``cupy_backends`` module imports, and every name
in them is a permissive type (attributes, calls and items give more of them; isinstance against it
is false). Nothing runs on it: test_collect_gpu_tests.py uses it to collect, not to run, the ``-m gpu``
tests, so a broken parametrization or a module that no longer imports fails CI, not a GPU call."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = ("cupy", "cupyx", "cupy_backends")


class _Meta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        return _stub(cls.__name__ + "()")

    def __getitem__(cls, key):
        return _stub(cls.__name__ + "[]")

    def __iter__(cls):
        return iter(())

    def __int__(cls) -> int:
        return 0

    def __index__(cls) -> int:
        return 0

    def __bool__(cls) -> bool:
        return False


def _stub(name: str) -> type:
    return _Meta(name, (), {})


class _Module(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


sys.meta_path.insert(0, _Finder())
