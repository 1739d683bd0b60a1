"""``singleton-tasks web``'s server: its data (inspect's document, paged), its headers, its release.

In process with Starlette's TestClient against real memory and SQLite stores; the page itself,
in a real browser, is tests/browser/.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from click.testing import CliRunner
from conftest import StoreFactory, backend_params
from starlette.testclient import TestClient
from test_cli import SCOPE, Seeded, seed, spec, url_of
from web_server import serving

from singleton_tasks import Store
from singleton_tasks.cli import cli
from singleton_tasks.outcomes import Decision, Registered
from singleton_tasks.testing import ManualClock
from singleton_tasks.web import create_app
from singleton_tasks.web.app import CONTENT_SECURITY_POLICY, TOKEN_HEADER
from singleton_tasks.web.lanes import LaneWatch

STATIC = Path(__file__).parents[1] / "singleton_tasks" / "web" / "static"
TOKEN = "s3cret-token"
HOST = "http://127.0.0.1:8080"


@pytest.fixture(params=backend_params(["memory", "sqlite"]))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def seeded(store_factory: StoreFactory, backend: str, tmp_path: Path) -> Seeded:
    store = store_factory(clock=ManualClock())
    return seed(store, url_of(store, backend, tmp_path))


def client(store: Store, **options: Any) -> TestClient:
    return TestClient(create_app(store, **options), base_url=HOST)


def hold(store: Store, key: str, *run_ids: str, scope: str = SCOPE) -> None:
    """Register ``run_ids`` on ``key`` in order; the first is admitted, the others wait."""
    for run_id in run_ids:
        assert store.register(replace(spec(key, run_id), scope=scope)).status is Registered.REGISTERED
    assert store.claim(replace(spec(key, run_ids[0]), scope=scope), 0, None).decision is Decision.ADMITTED


def test_the_page_data_is_inspects_document_with_holders_and_waiters_in_order(seeded: Seeded) -> None:
    with client(seeded.store) as http:
        page = http.get("/api/lanes").json()
    assert page["totals"] == {"keys": 3, "holders": 3, "waiters": 2}
    assert [lane["key"] for lane in page["keys"]] == ["store:A", "store:B", "store:C"]
    a = page["keys"][0]
    assert [h["run_id"] for h in a["holders"]] == [seeded.a0]
    assert a["holders"][0]["status"] == "executing" and a["limit"] == 1
    assert [(w["run_id"], w["position"], w["state"]) for w in a["waiters"]] == [
        (seeded.a1, 1, "gated"),
        (seeded.a2, 2, "pending"),
    ]
    assert page["keys"][1]["holders"][0]["status"] == "waiting_for_retry"
    assert page["allow_release"] is False
    assert (page["page"], page["pages"], page["matched"]) == (1, 1, 3)


def test_the_page_never_shows_the_store_url(seeded: Seeded) -> None:
    with client(seeded.store) as http:
        body = http.get("/api/lanes").text + http.get("/").text
    assert "store" not in http.get("/api/lanes").json()
    assert seeded.store.url not in body
    assert seeded.url not in body


def test_every_response_carries_the_content_security_policy(seeded: Seeded) -> None:
    with client(seeded.store) as http:
        for path in ("/", "/api/lanes", "/static/lanes.js", "/static/lanes.css"):
            response = http.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert response.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY


def test_the_page_has_no_inline_script_and_its_script_never_parses_data_as_html() -> None:
    page = (STATIC / "index.html").read_text()
    assert page.count("<script") == page.count('<script src="/static/lanes.js" defer></script>') == 1
    assert "http://" not in page and "https://" not in page  # nothing from the internet
    script = (STATIC / "lanes.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


def test_filters_by_task_and_key_and_pages_many_keys(store_factory: StoreFactory) -> None:
    store = store_factory()
    for i in range(120):
        hold(store, f"k{i:03d}", f"r{i}-{uuid.uuid4().hex[:6]}", scope="sync" if i % 2 else "mail")
    with client(store, page_size=50) as http:
        first = http.get("/api/lanes").json()
        assert (first["pages"], first["matched"], len(first["keys"])) == (3, 120, 50)
        last = http.get("/api/lanes", params={"page": 3}).json()
        assert [lane["key"] for lane in last["keys"]][-1] == "k119" and len(last["keys"]) == 20
        beyond = http.get("/api/lanes", params={"page": 99}).json()
        assert beyond["page"] == 3
        mail = http.get("/api/lanes", params={"task": "mail"}).json()
        assert mail["matched"] == 60 and {lane["scope"] for lane in mail["keys"]} == {"mail"}
        one = http.get("/api/lanes", params={"task": "sync", "key": "k11"}).json()
        assert [lane["key"] for lane in one["keys"]] == ["k111", "k113", "k115", "k117", "k119"]
        assert one["totals"]["keys"] == 120  # the totals stay the store's


def test_pages_share_one_snapshot_per_interval(store_factory: StoreFactory) -> None:
    store = store_factory()
    hold(store, "k", "r1")
    watch = LaneWatch(store, interval=60.0)
    frames = [watch.frame() for _ in range(10)]
    assert watch.reads == 1
    assert all(frame is frames[0] for frame in frames)


def test_handoffs_are_seen_between_frames_with_the_gap_as_a_range(store_factory: StoreFactory) -> None:
    store = store_factory()
    hold(store, "k", "first", "second")
    watch = LaneWatch(store, interval=0.0)
    before = watch.frame()
    assert before["handoffs"] == []
    [holder] = before["keys"][0]["holders"]
    assert store.release(SCOPE, "k", "first", token=holder["token"]).released
    assert store.claim(spec("k", "second"), 0, None).decision is Decision.ADMITTED
    after = watch.frame()
    [handoff] = after["handoffs"]
    assert (handoff["key"], handoff["released"], handoff["admitted"]) == ("k", "first", "second")
    assert 0 <= handoff["gap_min"] <= handoff["gap_max"] <= after["now"] - before["now"] + 0.01


def test_a_request_for_another_host_name_is_refused(seeded: Seeded) -> None:
    """DNS rebinding: a site that points its name at 127.0.0.1 does not read the lanes."""
    with client(seeded.store) as http:
        assert http.get("/api/lanes", headers={"Host": "evil.example"}).status_code == 400
        assert http.get("/api/lanes", headers={"Host": "localhost:8080"}).status_code == 200


def test_read_only_has_no_release_or_drop_route(seeded: Seeded) -> None:
    with client(seeded.store) as http:
        response = http.post("/api/release", json={"run_id": seeded.a0}, headers={TOKEN_HEADER: TOKEN})
        assert response.status_code in (404, 405)
        response = drop(http, "store:A", **{TOKEN_HEADER: TOKEN})
        assert response.status_code in (404, 405)
        lanes = json.dumps(http.get("/api/lanes").json())
    assert seeded.a0 in lanes and seeded.a1 in lanes and seeded.a2 in lanes


def release(http: TestClient, run_id: str, **headers: str) -> Any:
    return http.post("/api/release", json={"run_id": run_id}, headers={"Origin": HOST, **headers})


def test_release_needs_the_token_and_a_same_origin_request(
    seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    with client(seeded.store, allow_release=True, token=TOKEN) as http:
        assert http.get("/api/lanes").json()["allow_release"] is True
        assert release(http, seeded.a0).status_code == 401
        assert release(http, seeded.a0, **{TOKEN_HEADER: "wrong"}).status_code == 401
        cross = release(http, seeded.a0, **{TOKEN_HEADER: TOKEN, "Origin": "https://evil.example"})
        assert cross.status_code == 403
        form = http.post(
            "/api/release",
            content=f"run_id={seeded.a0}",
            headers={
                "Origin": HOST,
                TOKEN_HEADER: TOKEN,
                "Content-Type": "application/x-www-form-urlencoded",
            },
        )
        assert form.status_code == 415
        assert seeded.a0 in json.dumps(http.get("/api/lanes").json())  # still held

        with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
            done = release(http, seeded.a0, **{TOKEN_HEADER: TOKEN})
        assert done.status_code == 200, done.text
        assert done.json()["released"] == seeded.a0 and done.json()["key"] == "store:A"
        assert release(http, seeded.a0, **{TOKEN_HEADER: TOKEN}).status_code == 404
    assert not any(h.run_id == seeded.a0 for s in seeded.store.snapshot() for h in s.holders)
    [logged] = [r.getMessage() for r in caplog.records if "operator release by" in r.getMessage()]
    assert "testclient:" in logged and seeded.a0 in logged and "'store:A'" in logged


def drop(http: TestClient, key: str, scope: str = SCOPE, **headers: str) -> Any:
    return http.post(
        "/api/drop-waiters", json={"scope": scope, "key": key}, headers={"Origin": HOST, **headers}
    )


def waiting(store: Store, key: str) -> list[str]:
    return [w.run_id for s in store.snapshot(scope=SCOPE, key=key) for w in s.waiters]


def test_dropping_waiters_needs_the_token_and_a_same_origin_request(
    seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    with client(seeded.store, allow_release=True, token=TOKEN) as http:
        with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
            assert drop(http, "store:A").status_code == 401
            assert drop(http, "store:A", **{TOKEN_HEADER: "wrong"}).status_code == 401
            cross = drop(http, "store:A", **{TOKEN_HEADER: TOKEN, "Origin": "https://evil.example"})
            assert cross.status_code == 403
            fetched = drop(http, "store:A", **{TOKEN_HEADER: TOKEN, "Sec-Fetch-Site": "cross-site"})
            assert fetched.status_code == 403
        assert waiting(seeded.store, "store:A") == [seeded.a1, seeded.a2]  # nothing dropped
    refusals = [r.getMessage() for r in caplog.records if "web drop of waiters refused" in r.getMessage()]
    assert len(refusals) == 4 and all("testclient:" in refusal for refusal in refusals)
    assert not [r for r in caplog.records if "operator drop of a waiter" in r.getMessage()]


def test_dropping_waiters_drops_them_leaves_the_holders_and_logs_each(
    seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    with client(seeded.store, allow_release=True, token=TOKEN) as http:
        with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
            done = drop(http, "store:A", **{TOKEN_HEADER: TOKEN})
        assert done.status_code == 200, done.text
        assert done.json() == {
            "scope": SCOPE,
            "key": "store:A",
            "dropped": [seeded.a1, seeded.a2],
            "left": [],
            "woke": [],
            "waiting": 0,
        }
        again = drop(http, "store:A", **{TOKEN_HEADER: TOKEN})
        assert again.status_code == 200 and again.json()["dropped"] == []
        assert drop(http, "store:Z", **{TOKEN_HEADER: TOKEN}).status_code == 404
        assert drop(http, "store:A", scope="other", **{TOKEN_HEADER: TOKEN}).status_code == 404
        malformed = http.post(
            "/api/drop-waiters", json={"key": "store:A"}, headers={"Origin": HOST, TOKEN_HEADER: TOKEN}
        )
        assert malformed.status_code == 400
    assert waiting(seeded.store, "store:A") == []
    [snap] = seeded.store.snapshot(scope=SCOPE, key="store:A")
    assert [h.run_id for h in snap.holders] == [seeded.a0]  # the holder keeps its slot
    logged = [r.getMessage() for r in caplog.records if "operator drop of a waiter" in r.getMessage()]
    assert len(logged) == 2  # one line per dropped run, as the CLI logs them
    for run_id, line in zip((seeded.a2, seeded.a1), logged, strict=True):  # back to front
        assert run_id in line and "testclient:" in line and "(web)" in line and "'store:A'" in line


def test_release_without_a_token_is_refused_at_start(store_factory: StoreFactory) -> None:
    result = CliRunner().invoke(cli, ["web", "--store", "memory://x", "--allow-release"], env={})
    assert result.exit_code == 2 and "needs a token" in result.output
    with pytest.raises(ValueError, match="token"):
        create_app(store_factory(), allow_release=True)


def test_web_listens_on_loopback_unless_told() -> None:
    from singleton_tasks.cli.web import web

    [host] = [p for p in web.params if p.name == "host"]
    assert host.default == "127.0.0.1"


def frames(response: Any) -> Iterator[dict[str, Any]]:
    """The frames of an event stream, as they arrive."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and event == "frame":
            yield json.loads(line.removeprefix("data: "))


@pytest.mark.slow
def test_every_open_page_sees_a_change_within_a_second_from_one_shared_snapshot(
    store_factory: StoreFactory,
) -> None:
    store = store_factory()
    hold(store, "first", "r-first")
    app = create_app(store, interval=0.5)
    pages = 6
    with serving(app) as base, ExitStack() as streams, httpx.Client(base_url=base, timeout=10) as http:
        readers = [frames(streams.enter_context(http.stream("GET", "/api/events"))) for _ in range(pages)]
        assert all([lane["key"] for lane in next(reader)["keys"]] == ["first"] for reader in readers)
        reads_before, started = app.state.watch.reads, time.monotonic()
        hold(store, "second", "r-second")
        for reader in readers:
            seen = next(reader)
            while [lane["key"] for lane in seen["keys"]] != ["first", "second"]:
                seen = next(reader)
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, elapsed  # within about a second (an interval of 0.5 s)
        # Six pages, one read per interval: not six reads per interval.
        assert app.state.watch.reads - reads_before <= elapsed / 0.5 + 2
    assert app.state.watch.subscribers == 0  # every closed page unsubscribed


def test_a_store_down_at_start_shows_its_error_and_is_read_once_per_interval(tmp_path: Path) -> None:
    """The store unreachable before the first snapshot: every page gets an empty frame with the
    error (the page's banner), never a 500, and the store is asked once per interval, not once
    per request. The password in the URL is on no page."""
    from singleton_tasks import store_from_url

    store = store_from_url("redis://:hunter2@127.0.0.1:1/0?socket_connect_timeout=0.2")
    reads: list[float] = []

    def counting(read_store: Store) -> dict[str, Any]:
        reads.append(time.monotonic())
        from singleton_tasks.web.lanes import read_frame

        return read_frame(read_store)

    app = create_app(store, interval=30.0, scrub=lambda text: text.replace("hunter2", "***"))
    app.state.watch._read = counting
    with TestClient(app, base_url=HOST) as http:
        answers = [http.get("/api/lanes") for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 5
    page = answers[-1].json()
    assert page["keys"] == [] and page["error"] and "hunter2" not in answers[-1].text
    assert answers[-1].headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert len(reads) == 1


@pytest.mark.parametrize(
    ("bound", "allowed", "asked", "status"),
    [
        ("127.0.0.1", (), "127.0.0.1:8080", 200),
        ("127.0.0.2", (), "127.0.0.2:8080", 200),  # its own address
        ("127.0.0.1", (), "127.evil.example", 400),
        ("0.0.0.0", (), "evil.example:8080", 400),  # every address: still only the names allowed
        ("0.0.0.0", (), "localhost:8080", 200),
        ("0.0.0.0", ("lanes.internal",), "lanes.internal:8080", 200),
        ("10.1.2.3", (), "10.1.2.3:8080", 200),
        ("10.1.2.3", (), "evil.example", 400),
        ("0.0.0.0", ("*",), "evil.example", 200),  # asked for: any name
    ],
)
def test_only_the_host_names_the_server_is_reached_by_are_answered(
    store_factory: StoreFactory, bound: str, allowed: tuple[str, ...], asked: str, status: int
) -> None:
    """DNS rebinding on any bind address: a site that points its own name at the server reads
    nothing, unless its name is among ``allowed_hosts`` (``--allowed-host``)."""
    app = create_app(store_factory(), host=bound, allowed_hosts=allowed)
    with TestClient(app, base_url=HOST) as http:
        assert http.get("/api/lanes", headers={"Host": asked}).status_code == status


@pytest.mark.slow
def test_the_command_stops_on_sigterm_with_a_page_open(tmp_path: Path) -> None:
    """A browser tab left open must not keep ``singleton-tasks web`` from stopping (systemd,
    containers): the event streams are closed after a short grace."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "singleton_tasks.cli",
        "web",
        "--store",
        f"sqlite:///{tmp_path / 's.db'}",
    ]
    log = (tmp_path / "web.log").open("w")
    server = subprocess.Popen([*command, "--port", str(port)], stderr=log)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"{base}/api/lanes", timeout=1).raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(0.1)
        # A page's event stream as a browser holds it: open, its first frame read, never closed.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as page:
            page.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
            received = b""
            while b"event: frame" not in received:
                received += page.recv(65536)
            server.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            server.wait(timeout=15)  # raises TimeoutExpired while the open page holds it up
            assert time.monotonic() - stopped < 10
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def test_an_error_answer_carries_the_security_headers_and_no_password() -> None:
    """A release while the store is down fails inside the route (an unhandled error): the 500
    still carries the Content-Security-Policy, and says nothing of the store's URL."""
    from singleton_tasks import store_from_url

    store = store_from_url("redis://:hunter2@127.0.0.1:1/0?socket_connect_timeout=0.2")
    app = create_app(store, allow_release=True, token=TOKEN)
    with TestClient(app, base_url=HOST, raise_server_exceptions=False) as http:
        answer = http.post("/api/release", json={"run_id": "r"}, headers={TOKEN_HEADER: TOKEN})
    assert answer.status_code == 500
    assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "hunter2" not in answer.text and "127.0.0.1:1" not in answer.text
