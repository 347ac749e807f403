"""The Prefect server's app as `rlhf up` and the temporary server of `rlhf run` serve it: Prefect's own, behind a check
of the `Host` header.

A server on 127.0.0.1 is still reachable from a browser on the same machine through DNS rebinding (a page of
attacker.example whose name then resolves to 127.0.0.1): its requests carry `Host: attacker.example`, and without an
auth string Prefect would answer them. Starlette's TrustedHostMiddleware answers 400 to any `Host` but the ones the
server is reached by: `RLHF_PREFECT_ALLOWED_HOSTS` (comma-separated; default 127.0.0.1 and localhost).

    uvicorn --factory rlhf_pipeline.deployments.prefect_app:create_app --host 127.0.0.1 --port 4200 --lifespan on
"""

from __future__ import annotations

import os

ALLOWED_HOSTS_ENV = "RLHF_PREFECT_ALLOWED_HOSTS"


def allowed_hosts() -> list[str]:
    given = os.environ.get(ALLOWED_HOSTS_ENV, "127.0.0.1,localhost")
    return [host.strip() for host in given.split(",") if host.strip()]


def create_app():
    """Prefect's app (as its own uvicorn factory builds it, from the environment's settings), behind the host check."""
    from prefect.server.api.server import create_app as prefect_app
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    return TrustedHostMiddleware(prefect_app(), allowed_hosts=allowed_hosts())
