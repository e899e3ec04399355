"""The gateway's FastAPI app: ``create_app()`` (uvicorn's factory) and the health routes."""

from __future__ import annotations

import ipaddress
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from pagedq.config import Settings, get_settings
from pagedq.config.served import default_model
from pagedq.pipeline.gateway import openapi, responses, routes_batches, routes_completions, routes_jobs
from pagedq.pipeline.gateway.config import KEYS_FILE_VARIABLE, GatewayConfig
from pagedq.pipeline.gateway.errors import RETRY_AFTER_S, ApiError, install_handlers
from pagedq.pipeline.gateway.keys import KeyRing
from pagedq.pipeline.gateway.openapi import errors
from pagedq.pipeline.gateway.shapes import Health
from pagedq.pipeline.gateway.state import Gateway, gateway

GIL_SWITCH_INTERVAL_S = 0.0005


def create_app(settings: Settings | None = None, broker_url: str | None = None,
               config: GatewayConfig | None = None, keyring: KeyRing | None = None) -> FastAPI:
    """The app for a deployment: ``settings`` and ``config`` default to the environment (``PAGEDQ_*``, and what
    ``pagedq serve`` handed over); the keyring to the config's keys file (none: every request is the one anonymous
    tenant)."""
    config = config or GatewayConfig.from_env()
    # The event loop's streams wait on the GIL behind any request thread that computes (a 5,000-line batch being
    # validated and sent: seconds): hand the GIL over every 0.5 ms rather than Python's default 5 ms, so that each
    # of a stream's many hand-overs waits less (scripts/hostile_tenant.py cancel_storm --timeline shows it).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if keyring is None and config.api_keys_file is not None:
        keyring = KeyRing.load(config.api_keys_file)
    gw = Gateway(settings or get_settings(), broker_url, config, keyring)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await gw.aclose()
        gw.close()

    app = FastAPI(title="pagedq", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible HTTP API in front of pagedq's queue (docs/http.md)")
    app.state.gateway = gw
    install_handlers(app)
    if keyring is None:  # however it is served (plain uvicorn on 0.0.0.0 too): anonymous on loopback only
        app.add_middleware(LoopbackOnly)
    for module in (routes_completions, routes_jobs, routes_batches, responses):
        app.include_router(module.router)
    app.add_api_route("/health", health, methods=["GET"], response_model=Health, responses=errors(503))
    app.add_api_route("/ready", ready, methods=["GET"], response_model=Health, responses=errors(503))
    openapi.install(app)
    return app


def reached_from_outside(host: str) -> bool:
    """Whether the address a connection reached the server on (ASGI ``scope["server"]``) is one other hosts can
    use: an IP that is not loopback.  A name (an in-process transport's ``testserver``) or a Unix socket is not."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_loopback


class LoopbackOnly:
    """A gateway without API keys serves every request as one anonymous tenant: it answers only connections
    made to a loopback address, whoever started it and however (``pagedq serve`` also refuses to bind)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        server = scope.get("server") if scope["type"] == "http" else None
        if server and isinstance(server[0], str) and reached_from_outside(server[0]):
            refusal = ApiError(403, f"This gateway has no API keys, so it serves loopback only; it was reached on "
                                    f"{server[0]}. Set {KEYS_FILE_VARIABLE} (or --api-keys-file).", None,
                               "no_api_keys")
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def health(request: Request) -> dict:
    """The gateway is up and reaches Redis."""
    await gateway(request).aredis().ping()
    return Health(redis="ok").model_dump()


async def ready(request: Request) -> dict:
    """A GPU worker serves the default model."""
    gw = gateway(request)
    workers = await run_in_threadpool(gw.ready_workers)
    if default_model(gw.settings) not in workers:
        raise ApiError(503, f"No ready GPU worker serves the default model {default_model(gw.settings)!r}.", None,
                       "service_unavailable", RETRY_AFTER_S)
    return Health(redis="ok", workers=workers).model_dump()
