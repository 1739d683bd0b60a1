"""``singleton-tasks web``: serve the lanes to a browser, live (the ``web`` extra; docs/web.md)."""

from __future__ import annotations

import logging

import click

from ..stores import redact_url
from ..stores.base import scrub_secrets
from ..stores.choice import default_store_url
from ._open import StoreProblem, open_store, store_options

TOKEN_ENV = "SINGLETON_TASKS_WEB_TOKEN"
#: Seconds an open page's event stream may delay a shutdown (a tab left open never ends it).
SHUTDOWN_GRACE = 2


@click.command()
@store_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="Port.")
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="A host name the page is reached by, besides the --host address (and the loopback names "
    "on a loopback or 0.0.0.0); repeatable; '*' for any. Other names are refused (DNS rebinding).",
)
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.2),
    help="Seconds between store snapshots (one per interval, shared by every open page).",
)
@click.option(
    "--allow-release",
    is_flag=True,
    help="Offer a release button on each run and a drop-waiters button on each lane with waiters; "
    "both need the token (--token).",
)
@click.option(
    "--token",
    envvar=TOKEN_ENV,
    default=None,
    help=f"The token a release or a drop of waiters must carry [env {TOKEN_ENV}; prefer the variable: "
    "a command line is visible to every user of the host].",
)
def web(
    store_url: str | None,
    namespace: str,
    host: str,
    port: int,
    allowed_hosts: tuple[str, ...],
    interval: float,
    allow_release: bool,
    token: str | None,
) -> None:
    """Serve the lanes to a browser, live: holders, waiters in line, recent handoffs.

    Read-only unless --allow-release. Listens on 127.0.0.1 unless --host says otherwise; the
    page never shows the store's URL.
    """
    if allow_release and not token:
        raise click.UsageError(f"--allow-release needs a token: --token or {TOKEN_ENV}")
    try:
        import uvicorn

        from ..web import create_app
        from ..web.app import accepted_host_names
    except ImportError as error:
        raise StoreProblem(
            f"singleton-tasks web needs the web extra: pip install 'singleton-tasks[web]' ({error})"
        ) from None
    url = store_url or default_store_url()
    with open_store(store_url, namespace) as store:
        app = create_app(
            store,
            interval=interval,
            allow_release=allow_release,
            token=token,
            host=host,
            allowed_hosts=allowed_hosts,
            scrub=lambda text: scrub_secrets(text, url),
        )
        logging.getLogger("singleton_tasks").setLevel(logging.INFO)
        click.echo(
            f"serving the lanes of {redact_url(url)} (namespace {namespace}) on http://{host}:{port}/ "
            + ("with release and drop of waiters (token required)" if allow_release else "read-only"),
            err=True,
        )
        names = accepted_host_names(host, allowed_hosts)
        click.echo(
            f"answering requests for {'any host name' if '*' in names else ', '.join(names)}", err=True
        )
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE,
        )
