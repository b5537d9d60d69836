"""Code versions and owners of the assets, as Dagster shows them.

An asset's ``code_version`` is the first 12 hex of the sha256 of the source of the pure modules
that compute it (not of the thin Dagster module around them). Dagster compares it with the version
recorded at each materialisation, so after an upgrade that changes, say, the advantage formula,
the UI marks exactly the partitions computed by the old formula as stale ("code version changed").
Hashing the source, instead of a hand-bumped string, means nobody has to remember to bump it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from functools import cache
from pathlib import Path

#: who answers for each group of assets (Dagster owner strings: ``team:<name>`` or an email)
DATA_OWNERS = ["team:flowopt-data"]
TRAINING_OWNERS = ["team:flowopt-training"]


@cache
def _module_files(name: str) -> tuple[Path, ...]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"no module {name!r} to take a code version from")
    origin = Path(spec.origin)
    if spec.submodule_search_locations:  # a package: every module in it
        return tuple(sorted(origin.parent.rglob("*.py")))
    return (origin,)


def code_version(*modules: str) -> str:
    """``code_version`` for an asset computed by ``modules`` (dotted names of modules or
    packages; a package counts every ``.py`` file under it): 12 hex of the sha256 of their
    sources (each preceded by its file name), modules in sorted order.

    Raises:
        ModuleNotFoundError: a name that is not importable.
    """
    digest = hashlib.sha256()
    for name in sorted(modules):
        for path in _module_files(name):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]
