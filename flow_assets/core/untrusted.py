"""What every server of flowopt (the gateway, the training API, the bus consumer) does with input
it did not write: compare a bearer token, measure how deeply JSON nests, and keep the server's
own file paths out of what it answers. One home, so that the three front doors agree."""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence

# an absolute POSIX path: "/" not preceded by a word character, ".", ":", "~", "-" or "/" (so a
# URL's "//host/route" and a ratio "1/2" are left alone), up to whitespace, a quote or a bracket
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`,;()\[\]{}<>]+")


def authorised(header: str | None, tokens: Sequence[str]) -> bool:
    """Whether the ``Authorization`` header ``Bearer <token>`` names one of ``tokens``
    (constant-time compare, ``hmac.compare_digest``; no tokens configured means nobody is
    authorised)."""
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer ") :].encode()
    return any(hmac.compare_digest(given, t.encode()) for t in tokens if t)


def scrub_paths(text: str) -> str:
    """``text`` with every absolute filesystem path replaced by ``<path>``: what a server returns
    to a client (an error message, a job's ``reason``) must not show where it keeps its lake,
    models or instance."""
    return _ABSOLUTE_PATH.sub("<path>", text)


def json_depth(value: object) -> int:
    """How deeply objects and arrays nest in a decoded JSON value (a scalar is 0, ``[]`` and
    ``{}`` are 1). Iterative, so any depth is measured without ``RecursionError``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest
