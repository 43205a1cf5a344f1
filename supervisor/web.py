"""`--http`: Prometheus metrics, the status as JSON, and a live status page, served from
the supervisor's own event loop (aiohttp; the `http` extra).

Every route but `/healthz` (which says whether the supervisor is healthy, and no data)
wants the supervisor's secret (the TCP listener's token file), as
`Authorization: Bearer <token>` or `?token=<token>` (the page passes it on to its own
requests): a loopback port is open to every local user, so it is no less guarded than
the socket. A non-loopback address is refused unless asked for (`--http-public`, guard.py).
Every asset is in this module: the page loads nothing from anywhere else.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from queryqueue.supervisor import health

if TYPE_CHECKING:
    from queryqueue.supervisor.metrics import Metrics
    from queryqueue.supervisor.server import QueueServer

_HEADERS = {
    "Referrer-Policy": "no-referrer",  # the token may be in the page's URL
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline';"
    " style-src 'self' 'unsafe-inline'; img-src 'self' data:",
}


# How long /healthz waits for the status: a store or a loop slower than this is unhealthy.
HEALTH_WITHIN_S = 5.0


class StatusSite:
    def __init__(self, server: QueueServer, metrics: Metrics, token: str) -> None:
        self.server = server
        self.metrics = metrics
        self._token = token.encode()
        self._runner: web.AppRunner | None = None
        self._page_text = (
            resources.files("queryqueue.supervisor").joinpath("status.html").read_text()
        )
        self.address: tuple[str, int] | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._page)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/healthz", self._health)
        return app

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]  # the port the kernel chose for port 0
        self.address = (str(bound[0]), int(bound[1]))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/healthz":
            probed: web.StreamResponse = await handler(request)  # no token, and no data
            return probed
        given = request.query.get("token", "")
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            given = header[len("Bearer ") :]
        if not hmac.compare_digest(given.encode(), self._token):
            return web.Response(
                status=401,
                text="queryqueue: this needs the supervisor's token"
                " (Authorization: Bearer <token>, or ?token=<token>)\n",
                headers={**_HEADERS, "WWW-Authenticate": 'Bearer realm="queryqueue"'},
            )
        response: web.StreamResponse = await handler(request)
        response.headers.update(_HEADERS)
        return response

    async def snapshot(self) -> dict[str, Any]:
        status = await self.server.describe()
        self.metrics.state.snapshot = status
        return status

    async def _metrics(self, request: web.Request) -> web.Response:
        await self.snapshot()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _status(self, request: web.Request) -> web.Response:
        status = await self.snapshot()
        status.update(
            {
                "now": time.time(),
                "recent": list(self.metrics.recent),
                "recent_errors": list(self.metrics.recent_errors),
                "chart": self.metrics.chart(),
            }
        )
        return web.Response(body=orjson.dumps(status, default=str), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        try:
            status = await asyncio.wait_for(self.server.describe(), HEALTH_WITHIN_S)
        except Exception:
            found = ["the store did not answer"]
        else:
            found = health.problems(status)
        text = "ok\n" if not found else "unhealthy: " + "; ".join(found) + "\n"
        return web.Response(status=503 if found else 200, text=text, headers=_HEADERS)

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=self._page_text, content_type="text/html")
