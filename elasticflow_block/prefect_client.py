"""Prefect's synchronous client, with one TLS context per process.

Prefect builds a new TLS context for every client it makes, loading the CA
bundle each time: 25 ms of CPU, even for an http:// API. A flow process's
progress reports, a pipeline waiting for its training run and the tests'
polls each make a client a few times a second, so that was most of the CPU
a test spent waiting for a run (and a quarter of the test process's CPU in
`tests/service/test_worker.py`). The context is built as Prefect builds it
(its settings read at each call, so a changed setting makes a new one) and
kept.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any


@functools.cache
def _tls(cert_file: str | None, insecure: bool) -> ssl.SSLContext:
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if not cert_file:
        import certifi

        cert_file = certifi.where()
    return ssl.create_default_context(cafile=cert_file)


def sync_client() -> Any:
    """`get_client(sync_client=True)`, on the process's TLS context for the current settings."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    context = _tls(PREFECT_API_SSL_CERT_FILE.value(), bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value()))
    return get_client(sync_client=True, httpx_settings={"verify": context})
