"""Moved: selective checkpointing is the package ``ckptlib.selective`` now; this module keeps
old imports working.

``from ckptlib.policies import selective_checkpoint, SelectivePlans, ...`` gives the
same objects as ``from ckptlib.selective import ...``, and so does every other name
this module used to define, private ones included (``ckptlib.policies._OpGraph``).
Where each part went: the table in ``ckptlib/selective/__init__.py``.
"""
from __future__ import annotations

import importlib
from typing import Any

from ckptlib.selective import *  # noqa: F401,F403  (the public names, as before)
from ckptlib.selective import __all__  # noqa: F401

_MODULES = ("entry", "policy", "modes", "cache", "opgraph", "ops", "plans", "signatures", "costs")
# one storage rule for checkpoint and selective
_RENAMED = {"_storage_key": ("ckptlib.storage", "storage_ptr")}


def __getattr__(name: str) -> Any:
    """An old private name (``_OpGraph``, ``_fingerprint`` ...), from the module that holds it
    now."""
    if name in _RENAMED:
        module_name, new_name = _RENAMED[name]
        return getattr(importlib.import_module(module_name), new_name)
    for module_name in _MODULES:
        module = importlib.import_module(f"ckptlib.selective.{module_name}")
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module 'ckptlib.policies' has no attribute {name!r}")
