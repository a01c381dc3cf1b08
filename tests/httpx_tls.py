"""One default TLS context for the test process's httpx clients, made once.

httpx builds a new default `ssl.SSLContext` for every client — loading certifi's CA bundle,
15 ms on a quiet machine and 180 ms on a loaded two-core one — and `httpx.get`/`post` make a
client per call. The tests talk plain HTTP to their own local servers (the sandbox, uvicorn,
the MCP gateway and upstreams), where that context is never used, and some poll so: in the
gateway and crash tests it was a sixth of a test process's CPU (py-spy, CI's pair running).

The context asked for is the same every time (verify=True, no client certificate, the same
SSL_CERT_FILE/SSL_CERT_DIR), so the first one made serves them all. A client asking for
anything else (its own `verify` context, as the TLS tests of the tool wire do, or `False`)
gets what it asked for, made as before. Processes the tests start are untouched. Installed by
tests/conftest.py.
"""

from __future__ import annotations

import os
import ssl
from typing import Any


def install() -> None:
    from httpx._transports import default

    made = default.create_ssl_context
    if getattr(made, "shared_default", False):
        return
    shared: dict[tuple[str, str], ssl.SSLContext] = {}

    def create_ssl_context(
        verify: ssl.SSLContext | str | bool = True, cert: Any = None, trust_env: bool = True
    ) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return made(verify=verify, cert=cert, trust_env=trust_env)
        # What httpx reads to make the default one: the same answers, the same context.
        env = os.environ if trust_env else {}
        key = (env.get("SSL_CERT_FILE", ""), env.get("SSL_CERT_DIR", ""))
        if key not in shared:
            shared[key] = made(verify=True, cert=None, trust_env=trust_env)
        return shared[key]

    create_ssl_context.shared_default = True  # type: ignore[attr-defined]
    default.create_ssl_context = create_ssl_context  # type: ignore[assignment]
