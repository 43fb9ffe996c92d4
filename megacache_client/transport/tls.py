"""The process's one TLS context for the cache server (and a blob store it redirects to)."""

from __future__ import annotations

import os
import ssl
import threading

_tls: ssl.SSLContext | None = None
_tls_lock = threading.Lock()


def tls_context() -> ssl.SSLContext:
    """The process's TLS context, made once. httpx makes a new one for every client, loading
    the whole CA bundle (35-130 ms measured here), and a trainer makes several clients
    (prefetch, load, publish, report), the load's on the way to the first step. It trusts
    what httpx would: SSL_CERT_FILE / SSL_CERT_DIR when set, else certifi's bundle (an
    https:// server, or the S3 store a blob download is redirected to)."""
    global _tls
    with _tls_lock:
        if _tls is None:
            cafile = os.environ.get("SSL_CERT_FILE") or None
            capath = os.environ.get("SSL_CERT_DIR") or None
            if cafile is None and capath is None:
                try:
                    import certifi  # httpx's own requirement

                    cafile = certifi.where()
                except ImportError:  # the system's trust store, then
                    pass
            _tls = ssl.create_default_context(cafile=cafile, capath=capath)
        return _tls
