"""The TLS context every HTTP client of flowopt's serving side shares.

``httpx`` and ``httpx2`` build a TLS context for every client made without ``verify=<context>``,
whether or not its URL is ``https``, and building one loads the trusted certificates: ~21 ms of
CPU (timed on the 2-core development machine). A calculator rollout on the tiny model takes
~55 ms in all, so a client per rollout, or two, was a large part of it.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def default_tls_context() -> ssl.SSLContext:
    """The context ``httpx`` builds by default (certificates verified against ``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR`` when set, else certifi's bundle; host names checked), built once per process
    and shared by every client that passes it as ``verify=``. A context may be shared across
    threads and event loops as long as its settings no longer change: callers must not change
    the one returned.

    Raises:
        ssl.SSLError, OSError: the trusted certificates cannot be loaded.
    """
    import httpx  # here: the code location loads without httpx (tests/test_imports.py)

    return httpx.create_ssl_context()
