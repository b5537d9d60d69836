"""User code named as ``"package.module:function"`` (custom reward functions, agents)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


def import_function(path: str, what: str, error: type[Exception], arity: int) -> Callable[..., Any]:
    """Import the callable ``path`` names and check it accepts ``arity`` positional arguments.

    Args:
        what: how messages name it (``"reward function"``, ``"agent"``).
        error: the exception class raised on any problem.

    Raises:
        error: the path is malformed, the module or attribute does not exist, or the object is
            not callable with ``arity`` positional arguments (the message names ``path``).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{what} {path!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise error(f"{what} {path!r}: {exc}") from exc
    if not callable(fn):
        raise error(f"{what} {path!r} is not callable")
    try:
        inspect.signature(fn).bind(*([None] * arity))
    except TypeError as exc:
        raise error(f"{what} {path!r} must take {arity} positional argument(s): {exc}") from exc
    return fn
