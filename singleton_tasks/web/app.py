"""The web view's ASGI application (Starlette): the page, its data, its live stream, and release.

Routes: ``/`` the page; ``/static/…`` its script and style (served from the package: nothing
comes from the internet); ``/api/lanes`` one page of lanes as JSON; ``/api/events`` the same,
as server-sent events, one per store snapshot; ``/api/release`` frees a run's slot or place in
line and ``/api/drop-waiters`` cancels every run waiting on a key (both only with
``allow_release``, and with the token).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..cli._open import snapshots
from ..cli._settling import drop_waiters_of, find_run, release_run
from ..outcomes import HolderView
from ..stores import Store
from .lanes import PAGE_SIZE, Frame, LaneWatch, page_of

logger = logging.getLogger("singleton_tasks")

#: The header a release (or drop) request carries its token in. A custom header is also what keeps a
#: cross-site form from sending it: a browser asks the server first (a preflight it refuses).
TOKEN_HEADER = "X-Singleton-Token"
#: Scripts and styles from this server only, no inline script, no frames, no other connections.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
#: Host names a page on a loopback address is reached by. Any other Host header is refused: a
#: site that points its own name at 127.0.0.1 (DNS rebinding) does not get to read the lanes.
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]
#: Seconds between comments on an idle event stream (proxies close silent connections).
KEEPALIVE = 15.0


class _SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _value in headers}
                for name, value in SECURITY_HEADERS.items():
                    if name.lower().encode() not in present:
                        headers.append((name.lower().encode(), value.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _Streams:
    """Wakes every open event stream when the watch has a new frame (called from its thread)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.changed = asyncio.Event()

    def notify(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


def _query(request: Request) -> tuple[str, str, int]:
    task = request.query_params.get("task", "")
    key = request.query_params.get("key", "")
    try:
        page = int(request.query_params.get("page", "1"))
    except ValueError:
        page = 1
    return task, key, page


def accepted_host_names(host: str, allowed: Sequence[str] = ()) -> list[str]:
    """The names a request's Host header may give for a server listening on ``host``: the
    address itself, the loopback names when it listens on a loopback address or on every
    address, and ``allowed`` (``"*"``: any name). Any other name is a site that points its own
    name at this server (DNS rebinding): it is refused."""
    names = list(allowed)
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None  # a host name
    if address is None:
        names.append(host)
    elif not address.is_unspecified:
        names += [str(address), f"[{address}]"] if address.version == 6 else [str(address)]
    if host == "localhost" or (address is not None and (address.is_loopback or address.is_unspecified)):
        names += LOOPBACK_HOSTS
    return list(dict.fromkeys(name.lower() for name in names))


def create_app(
    store: Store,
    *,
    interval: float = 1.0,
    allow_release: bool = False,
    token: str | None = None,
    host: str = "127.0.0.1",
    allowed_hosts: Sequence[str] = (),
    page_size: int = PAGE_SIZE,
    scrub: Callable[[str], str] = str,
) -> Starlette:
    """The web view of ``store``: one snapshot per ``interval`` seconds shared by every page.

    ``allow_release`` adds the routes that settle runs (release, drop waiters), which need
    ``token`` (required then). A request must name the server by one of
    :func:`accepted_host_names` (``host``'s, and ``allowed_hosts``).
    """
    if allow_release and not token:
        raise ValueError("allow_release needs a token")
    streams = _Streams()
    watch = LaneWatch(store, interval, on_frame=streams.notify, scrub=scrub)
    static = resources.files("singleton_tasks.web") / "static"
    index_html = (static / "index.html").read_text(encoding="utf-8")

    def sliced(frame: Frame, request: Request) -> dict[str, Any]:
        task, key, page = _query(request)
        view = page_of(frame, task=task, key=key, page=page, page_size=page_size)
        view["allow_release"] = allow_release
        view["error"] = watch.error
        return view

    async def index(request: Request) -> Response:
        return HTMLResponse(index_html)

    async def lanes(request: Request) -> Response:
        frame = await asyncio.to_thread(watch.frame)
        return JSONResponse(sliced(frame, request))

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            watch.subscribe()
            try:
                frame = await asyncio.to_thread(watch.frame)
                while True:
                    yield f"event: frame\ndata: {json.dumps(sliced(frame, request))}\n\n"
                    changed = streams.changed
                    while True:
                        try:
                            await asyncio.wait_for(changed.wait(), timeout=KEEPALIVE)
                            break
                        except asyncio.TimeoutError:
                            yield ": keepalive\n\n"
                    frame = watch.latest()
            finally:
                watch.unsubscribe()

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def release(request: Request) -> Response:
        refused = _refuse(request, token, "release")
        if refused is not None:
            return refused
        fields = await _json_fields(request, "run_id")
        if fields is None:
            return _error(400, 'expected a JSON body {"run_id": "…"}')
        (run_id,) = fields
        found = find_run(await asyncio.to_thread(snapshots, store), run_id)
        if found is None:
            return _error(404, f"run {run_id} is not registered")
        snap, run = found
        outcome = await asyncio.to_thread(release_run, store, snap, run, _operator(request))
        if outcome is None:
            return _error(409, f"run {run_id} settled meanwhile: nothing released")
        what = "holder" if isinstance(run, HolderView) else "waiter"
        woke = [wake.run_id for wake in outcome.wakes]
        return JSONResponse(
            {"released": run_id, "was": what, "scope": snap.scope, "key": snap.key, "woke": woke}
        )

    async def drop_waiters(request: Request) -> Response:
        refused = _refuse(request, token, "drop of waiters")
        if refused is not None:
            return refused
        fields = await _json_fields(request, "scope", "key")
        if fields is None:
            return _error(400, 'expected a JSON body {"scope": "…", "key": "…"}')
        scope, key = fields
        found = await asyncio.to_thread(snapshots, store, scope, key)
        if not found:
            return _error(404, f"key {key!r} of scope {scope!r} has no holders or waiters")
        done = await asyncio.to_thread(drop_waiters_of, store, found[0], _operator(request))
        return JSONResponse(
            {
                "scope": scope,
                "key": key,
                "dropped": [w.run_id for w in done.dropped],
                "left": [w.run_id for w in done.left],  # admitted or settled meanwhile
                "woke": [wake.run_id for wake in done.wakes],
                "waiting": len(done.after.waiters) if done.after else 0,
            }
        )

    routes = [
        Route("/", index),
        Route("/api/lanes", lanes),
        Route("/api/events", events),
        Mount("/static", app=StaticFiles(directory=str(static)), name="static"),
    ]
    if allow_release:
        routes.append(Route("/api/release", release, methods=["POST"]))
        routes.append(Route("/api/drop-waiters", drop_waiters, methods=["POST"]))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        streams.loop = asyncio.get_running_loop()
        watch.start()
        try:
            yield
        finally:
            watch.close()

    middleware = [
        Middleware(_SecurityHeaders),
        Middleware(TrustedHostMiddleware, allowed_hosts=accepted_host_names(host, allowed_hosts)),
    ]

    async def internal_error(request: Request, error: Exception) -> Response:
        # Starlette answers an unhandled error outside every middleware: the headers go here too.
        logger.error("web: %s failed", request.url.path, exc_info=error)
        return JSONResponse({"error": "internal error"}, status_code=500, headers=SECURITY_HEADERS)

    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={Exception: internal_error},
    )
    app.state.watch = watch
    return app


def _operator(request: Request) -> str:
    """Who asked for a release or a drop, as the log names them: the client, through the web."""
    return f"{_client(request)} (web)"


def _client(request: Request) -> str:
    """Who asked, as the log names them: the client's address and port."""
    if request.client is None:
        return "an unknown client"
    return f"{request.client.host}:{request.client.port}"


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"error": detail}, status_code=status)


def _refuse(request: Request, token: str | None, action: str) -> JSONResponse | None:
    """The refusal of a request that settles runs (cross-site, or without the token), logged."""
    refused = _refuse_cross_site(request) or _refuse_token(request, token)
    if refused is not None:
        logger.warning("web %s refused (%s) for %s", action, bytes(refused.body).decode(), _client(request))
    return refused


async def _json_fields(request: Request, *names: str) -> list[str] | None:
    """The JSON body's ``names``, each a non-empty string; None when the body is not that."""
    try:
        body = await request.json()
        values = [body[name] for name in names]
    except (ValueError, KeyError, TypeError):
        return None
    if not all(isinstance(value, str) and value for value in values):
        return None
    return values


def _refuse_cross_site(request: Request) -> JSONResponse | None:
    """A request another site's page made: its Origin is not this server, or it is no JSON."""
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        return _error(403, "cross-origin request refused")
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return _error(403, "cross-site request refused")
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return _error(415, "expected application/json")
    return None


def _refuse_token(request: Request, token: str | None) -> JSONResponse | None:
    given = request.headers.get(TOKEN_HEADER, "")
    if token is None or not hmac.compare_digest(given.encode(), token.encode()):
        return _error(401, f"a valid {TOKEN_HEADER} header is required")
    return None
