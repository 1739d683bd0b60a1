"""The ``singleton-tasks`` command against real stores with seeded state."""

from __future__ import annotations

import getpass
import io
import json
import logging
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import dramatiq
import pytest
from click.testing import CliRunner, Result
from conftest import POSTGRES_URL, REDIS_URL, StoreFactory, purge_namespaces, require_server

from singleton_tasks import Store, clock, store_from_url
from singleton_tasks.cli import cli
from singleton_tasks.cli.top import TopState, render_top_frame
from singleton_tasks.outcomes import Decision, Registered, RunSpec, RunState
from singleton_tasks.stores import SCHEMA_VERSION
from singleton_tasks.testing import ManualClock, at

SCOPE = "inv"
WIDE = {"COLUMNS": "200"}  # rich wraps at 80 columns when it sees no terminal


@dataclass
class Seeded:
    store: Store
    url: str
    now: float
    a0: str  # holder of store:A, executing, admitted 20 s ago
    a1: str  # store:A waiter 1, gated
    a2: str  # store:A waiter 2, pending (registered, never delivered)
    b0: str  # holder of store:B, waiting for its retry
    c0: str  # holder of store:C, executing
    a1_generation: int  # the generation of a1's deferred copy
    a1_payload: bytes  # the message a1 is issued again from

    def args(self, *more: str) -> list[str]:
        return [*more, "--store", self.url, "--namespace", self.store.namespace]


def spec(key: str, run_id: str) -> RunSpec:
    return RunSpec(scope=SCOPE, key=key, run_id=run_id, limit=1, lease=60.0, orphan_timeout=600.0)


def seed(store: Store, url: str) -> Seeded:
    """Three keys, one slot each; store:A backed up with a gated and a pending waiter."""
    now = clock.now()
    ids = {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in ("a0", "a1", "a2", "b0", "c0")}
    for name, key in (
        ("a0", "store:A"),
        ("a1", "store:A"),
        ("a2", "store:A"),
        ("b0", "store:B"),
        ("c0", "store:C"),
    ):
        assert at(store, now - 30).register(spec(key, ids[name])).status is Registered.REGISTERED
    for name, key in (("a0", "store:A"), ("b0", "store:B"), ("c0", "store:C")):
        assert at(store, now - 20).claim(spec(key, ids[name]), 0, None).decision is Decision.ADMITTED
    message = dramatiq.Message(
        queue_name="inv", actor_name="sync", args=("A",), kwargs={}, options={}, message_id=ids["a1"]
    )
    gated = at(store, now - 10).claim(spec("store:A", ids["a1"]), 0, message.encode())
    assert gated.decision is Decision.GATED
    b0_token = at(store, now).snapshot(scope=SCOPE, key="store:B")[0].holders[0].token
    assert at(store, now - 10).suspend(SCOPE, "store:B", ids["b0"], b0_token, delay=5.0)
    assert gated.generation is not None
    return Seeded(
        store=store, url=url, now=now, a1_generation=gated.generation, a1_payload=message.encode(), **ids
    )


def url_of(store: Store, backend: str, tmp_path: Path) -> str:
    """The URL the CLI opens to see the fixture's store (none of these carry a password)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'singleton.db'}"
    return store.url


@pytest.fixture
def seeded(store_factory: StoreFactory, backend: str, tmp_path: Path) -> Seeded:
    store = store_factory(clock=ManualClock())  # seeded in the past; the CLI reads at the store's time
    return seed(store, url_of(store, backend, tmp_path))


def invoke(args: list[str], input: str | io.BytesIO | None = None) -> Result:
    return CliRunner().invoke(cli, args, input=input, env=WIDE, catch_exceptions=False)


def key_doc(document: dict[str, Any], key: str) -> dict[str, Any]:
    [found] = [k for k in document["keys"] if k["key"] == key]
    return found


# -- inspect ---------------------------------------------------------------------------------------


def test_inspect_json_shows_holders_and_waiters_in_order(seeded: Seeded) -> None:
    result = invoke(seeded.args("inspect", "--json"))
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)

    assert document["format"] == 1
    assert document["schema_version"] == SCHEMA_VERSION
    assert document["namespace"] == seeded.store.namespace
    assert document["totals"] == {"keys": 3, "holders": 3, "waiters": 2}
    assert [(k["scope"], k["key"]) for k in document["keys"]] == [
        (SCOPE, "store:A"),
        (SCOPE, "store:B"),
        (SCOPE, "store:C"),
    ]

    a = key_doc(document, "store:A")
    assert a["limit"] == 1 and a["token"] >= 1
    [holder] = a["holders"]
    assert holder["run_id"] == seeded.a0
    assert holder["token"] == a["token"]
    assert holder["status"] == "executing"
    assert holder["lease_expired"] is False
    assert 19.5 <= holder["lease_age"] < 60
    assert holder["admitted_at"] == pytest.approx(seeded.now - 20, abs=0.01)
    assert [(w["run_id"], w["position"], w["state"]) for w in a["waiters"]] == [
        (seeded.a1, 1, "gated"),
        (seeded.a2, 2, "pending"),
    ]
    assert all(29.5 <= w["waiting"] < 70 for w in a["waiters"])
    assert all(w["confirmed"] is True for w in a["waiters"])
    # The message a1 is issued again from; a2 was registered without one; a holder keeps none.
    assert [w["payload_bytes"] for w in a["waiters"]] == [len(seeded.a1_payload), None]
    assert holder["payload_bytes"] is None
    # a1: its delivered copy and the deferred copy it was replaced by; the others their first.
    assert [w["live_generations"] for w in a["waiters"]] == [[0, seeded.a1_generation], [0]]
    assert holder["live_generations"] == [0]

    [b_holder] = key_doc(document, "store:B")["holders"]
    assert (b_holder["run_id"], b_holder["status"]) == (seeded.b0, "waiting_for_retry")
    assert key_doc(document, "store:B")["waiters"] == []


def test_inspect_filters_by_key_and_scope(seeded: Seeded) -> None:
    only_a = json.loads(invoke(seeded.args("inspect", "--json", "--key", "store:A")).stdout)
    assert [k["key"] for k in only_a["keys"]] == ["store:A"]
    assert only_a["totals"] == {"keys": 1, "holders": 1, "waiters": 2}
    other = json.loads(invoke(seeded.args("inspect", "--json", "--scope", "other")).stdout)
    assert other["keys"] == [] and other["totals"] == {"keys": 0, "holders": 0, "waiters": 0}


def test_inspect_table_lists_every_run(seeded: Seeded) -> None:
    result = invoke(seeded.args("inspect"))
    assert result.exit_code == 0, result.output
    for run_id in (seeded.a0, seeded.a1, seeded.a2, seeded.b0, seeded.c0):
        assert run_id in result.stdout
    assert "waiting for retry" in result.stdout
    assert "3 keys, 3 holders, 2 waiters" in result.stdout
    assert result.stdout.index(seeded.a1) < result.stdout.index(seeded.a2)  # admission order


@pytest.mark.parametrize("backend", ["sqlite"])
def test_inspect_table_stays_readable_at_80_columns(store_factory: StoreFactory, tmp_path: Path) -> None:
    store = store_factory(clock=ManualClock())
    scope = "shop.tasks.sync_inventory_for_every_store"
    ids = [str(uuid.uuid4()) for _ in range(4)]  # run ids as Dramatiq and Celery make them
    now = clock.now()
    runs = [
        RunSpec(scope=scope, key="store:A", run_id=i, limit=2, lease=60.0, orphan_timeout=600.0) for i in ids
    ]
    for run in runs:
        at(store, now - 30).register(run)
    for run in runs[:2]:
        assert at(store, now - 20).claim(run, 0, None).decision is Decision.ADMITTED
    token = at(store, now).snapshot(scope=scope)[0].holders[1].token
    assert at(store, now - 10).suspend(scope, "store:A", ids[1], token, delay=5.0)
    assert at(store, now - 5).claim(runs[2], 0, b"payload").decision is Decision.GATED
    url = f"sqlite:///{tmp_path / 'singleton.db'}"
    result = CliRunner().invoke(
        cli, ["inspect", "--store", url, "--namespace", store.namespace], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    assert "…" not in result.stdout, result.stdout  # no column cut to an ellipsis
    for run_id in ids:
        assert any(run_id in line for line in lines), result.stdout  # whole, on one line
    tokens = [h.token for h in store.snapshot(scope=scope)[0].holders]
    assert all(len(str(t)) == 16 for t in tokens)  # clock-derived: microseconds
    for token in tokens:  # whole, as the logs and --json print it
        assert any(f"token {token}" in line for line in lines), result.stdout
    words = result.stdout.split()
    for word in ("token", "executing", "waiting", "retry", "gated", "pending"):
        assert word in words, result.stdout


def test_inspect_help_documents_the_json_format() -> None:
    result = CliRunner().invoke(cli, ["inspect", "--help"], env=WIDE)
    assert result.exit_code == 0
    fields = ('"format": 1', '"lease_age"', '"lease_expired"', '"waiting"', '"confirmed"', '"totals"')
    for field in (*fields, '"payload_bytes"', '"live_generations"'):
        assert field in result.output, result.output


# -- release ---------------------------------------------------------------------------------------


def test_release_frees_the_slot_and_names_the_woken_waiter(
    seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        result = invoke(seeded.args("release", seeded.a0, "--yes"))
    assert result.exit_code == 0, result.output
    assert f"released run {seeded.a0}" in result.stdout
    assert f"woke {seeded.a1}" in result.stdout

    [a] = seeded.store.snapshot(scope=SCOPE, key="store:A")
    assert a.holders == ()
    assert [w.run_id for w in a.waiters] == [seeded.a1, seeded.a2]
    # The slot is free: the woken waiter's deferred copy is admitted.
    claimed = seeded.store.claim(spec("store:A", seeded.a1), seeded.a1_generation, None)
    assert claimed.decision is Decision.ADMITTED

    [record] = [r for r in caplog.records if "operator release" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert seeded.a0 in record.getMessage() and "@" in record.getMessage()


def test_release_of_a_waiter_removes_it_from_the_line(seeded: Seeded) -> None:
    result = invoke(seeded.args("release", seeded.a1, "--yes"))
    assert result.exit_code == 0, result.output
    [a] = seeded.store.snapshot(scope=SCOPE, key="store:A")
    assert [h.run_id for h in a.holders] == [seeded.a0]
    assert [(w.run_id, w.position) for w in a.waiters] == [(seeded.a2, 1)]


def test_release_asks_first_and_unknown_runs_fail(seeded: Seeded) -> None:
    refused = invoke(seeded.args("release", seeded.c0), input="n\n")
    assert refused.exit_code == 1
    assert "Release run" in refused.output
    assert [h.run_id for h in seeded.store.snapshot(key="store:C")[0].holders] == [seeded.c0]

    confirmed = invoke(seeded.args("release", seeded.c0), input="y\n")
    assert confirmed.exit_code == 0, confirmed.output
    assert "no waiters left on key 'store:C'" in confirmed.stdout
    assert seeded.store.snapshot(key="store:C") == []

    unknown = invoke(seeded.args("release", "no-such-run", "--yes"))
    assert unknown.exit_code == 1
    assert "not registered" in unknown.output


def test_release_of_a_holder_with_only_pending_waiters_names_the_next(seeded: Seeded) -> None:
    seeded.store.release(SCOPE, "store:A", seeded.a1, token=None)  # a2 is next, pending
    result = invoke(seeded.args("release", seeded.a0, "--yes"))
    assert result.exit_code == 0, result.output
    assert f"next in line: {seeded.a2} (pending)" in result.stdout


# -- drop-waiters ----------------------------------------------------------------------------------


class ReplyAfter(io.BytesIO):
    """Typed confirmation whose first read runs ``meanwhile``: the store changes while the
    operator reads the list, between the listing and the drops."""

    def __init__(self, reply: bytes, meanwhile: Callable[[], None]) -> None:
        super().__init__(reply)
        self.meanwhile: Callable[[], None] | None = meanwhile

    def _first(self) -> None:
        run, self.meanwhile = self.meanwhile, None
        if run is not None:
            run()

    def read(self, size: int | None = -1) -> bytes:
        if size != 0:  # click probes the stream with read(0)
            self._first()
        return super().read(size)

    def read1(self, size: int | None = -1) -> bytes:
        self._first()
        return super().read1(size)

    def readline(self, size: int | None = -1) -> bytes:
        self._first()
        return super().readline(size)


def drops_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "operator drop of a waiter" in r.getMessage()]


def test_drop_waiters_drops_every_waiter_and_leaves_the_holder(
    seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        result = invoke(seeded.args("drop-waiters", "--key", "store:A", "--yes"))
    assert result.exit_code == 0, result.output
    assert f"1  {seeded.a1}  gated" in result.stdout and f"2  {seeded.a2}  pending" in result.stdout
    assert f"dropped {seeded.a1} (position 1)" in result.stdout
    assert f"dropped {seeded.a2} (position 2)" in result.stdout
    assert "dropped 2 of 2 waiters of key 'store:A' (scope 'inv'); 0 waiting now" in result.stdout

    [a] = seeded.store.snapshot(scope=SCOPE, key="store:A")
    assert a.waiters == ()
    [holder] = a.holders
    assert (holder.run_id, holder.executing) == (seeded.a0, True)
    assert [h.run_id for s in seeded.store.snapshot() for h in s.holders] == [seeded.a0, seeded.b0, seeded.c0]
    # The dropped waiter's deferred copy, when it comes due, is stale: the run does not execute.
    late = seeded.store.claim(spec("store:A", seeded.a1), seeded.a1_generation, None)
    assert late.decision is not Decision.ADMITTED

    records = drops_logged(caplog)
    assert [r.levelno for r in records] == [logging.WARNING, logging.WARNING]
    for record, run_id in zip(records, (seeded.a2, seeded.a1), strict=True):  # back to front
        message = record.getMessage()
        assert run_id in message and "'store:A'" in message and f"'{SCOPE}'" in message
        assert f" by {getpass.getuser()}@{socket.gethostname()}:" in message


def test_drop_waiters_asks_first(seeded: Seeded, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        refused = invoke(seeded.args("drop-waiters", "--key", "store:A"), input="n\n")
        unanswered = invoke(seeded.args("drop-waiters", "--key", "store:A"))  # no input: a refusal
    assert refused.exit_code == 1 and unanswered.exit_code == 1
    assert "Drop these 2 waiters?" in refused.output and "nothing dropped" in refused.output
    assert "Drop these 2 waiters?" in unanswered.output and "Aborted!" in unanswered.output
    assert [w.run_id for w in seeded.store.snapshot(key="store:A")[0].waiters] == [seeded.a1, seeded.a2]
    assert drops_logged(caplog) == []

    confirmed = invoke(seeded.args("drop-waiters", "--key", "store:A", "--scope", SCOPE), input="y\n")
    assert confirmed.exit_code == 0, confirmed.output
    assert seeded.store.snapshot(key="store:A")[0].waiters == ()


def test_drop_waiters_of_a_key_without_waiters_or_unknown(seeded: Seeded) -> None:
    none = invoke(seeded.args("drop-waiters", "--key", "store:B", "--yes"))
    assert none.exit_code == 0, none.output
    assert "key 'store:B' (scope 'inv') has no waiters: nothing to drop" in none.stdout
    assert [h.run_id for h in seeded.store.snapshot(key="store:B")[0].holders] == [seeded.b0]

    for args in (["--key", "store:Z"], ["--key", "store:A", "--scope", "other"]):
        unknown = invoke(seeded.args("drop-waiters", *args, "--yes"))
        assert unknown.exit_code == 1, unknown.output
        assert "has no holders or waiters" in unknown.output
    assert len(seeded.store.snapshot(key="store:A")[0].waiters) == 2


def test_drop_waiters_needs_a_scope_when_several_use_the_key(seeded: Seeded) -> None:
    other = RunSpec(scope="other", key="store:A", run_id="o1", limit=1, lease=60.0, orphan_timeout=600.0)
    seeded.store.register(other)
    ambiguous = invoke(seeded.args("drop-waiters", "--key", "store:A", "--yes"))
    assert ambiguous.exit_code == 2, ambiguous.output
    assert "several scopes ('inv', 'other')" in ambiguous.output
    assert len(seeded.store.snapshot(scope=SCOPE, key="store:A")[0].waiters) == 2
    one = invoke(seeded.args("drop-waiters", "--key", "store:A", "--scope", "other", "--yes"))
    assert one.exit_code == 0, one.output
    assert seeded.store.snapshot(scope="other") == []
    assert len(seeded.store.snapshot(scope=SCOPE, key="store:A")[0].waiters) == 2


def test_drop_waiters_leaves_a_waiter_admitted_meanwhile(
    seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    def admit_a1() -> None:
        """a0 finishes and a1's wake is admitted while the operator reads the list."""
        [a] = seeded.store.snapshot(key="store:A")
        done = seeded.store.release(SCOPE, "store:A", seeded.a0, token=a.holders[0].token)
        [wake] = done.wakes
        assert (
            seeded.store.claim(spec("store:A", seeded.a1), wake.generation, None).decision
            is Decision.ADMITTED
        )

    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        result = invoke(seeded.args("drop-waiters", "--key", "store:A"), input=ReplyAfter(b"y\n", admit_a1))
    assert result.exit_code == 1, result.output  # not every listed waiter was dropped
    assert f"{seeded.a1}: admitted meanwhile, left" in result.stdout
    assert f"dropped {seeded.a2} (position 2)" in result.stdout
    assert "dropped 1 of 2 waiters" in result.stdout
    [a] = seeded.store.snapshot(key="store:A")
    assert [h.run_id for h in a.holders] == [seeded.a1] and a.waiters == ()
    assert [seeded.a2 in r.getMessage() for r in drops_logged(caplog)] == [True]


def test_drop_waiters_names_a_waiter_enqueued_meanwhile_that_now_owns_a_slot(
    store_factory: StoreFactory, backend: str, tmp_path: Path
) -> None:
    store = store_factory()
    url = url_of(store, backend, tmp_path)
    d = {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in ("d0", "d1", "d2", "d3")}
    two = {
        name: RunSpec(scope=SCOPE, key="store:D", run_id=run_id, limit=2, lease=60.0, orphan_timeout=600.0)
        for name, run_id in d.items()
    }
    for name in ("d0", "d1", "d2"):
        store.register(two[name])
    assert store.claim(two["d0"], 0, None).decision is Decision.ADMITTED
    assert store.claim(two["d2"], 0, b"d2").decision is Decision.GATED  # d1, pending, owns the free slot

    def enqueue_d3() -> None:
        store.register(two["d3"])
        assert store.claim(two["d3"], 0, b"d3").decision is Decision.GATED

    args = ["drop-waiters", "--key", "store:D", "--store", url, "--namespace", store.namespace]
    result = invoke(args, input=ReplyAfter(b"y\n", enqueue_d3))
    assert result.exit_code == 0, result.output
    assert d["d3"] not in result.stdout.split("Drop these")[0]  # not listed, so not dropped
    assert f"woke {d['d3']} (generation " in result.stdout
    assert f"woke {d['d2']}" not in result.stdout  # a dropped run is never named to wake
    assert "dropped 2 of 2 waiters of key 'store:D' (scope 'inv'); 1 waiting now" in result.stdout
    [snap] = store.snapshot(key="store:D")
    assert [h.run_id for h in snap.holders] == [d["d0"]]
    assert [(w.run_id, w.state) for w in snap.waiters] == [(d["d3"], RunState.WOKEN)]


# -- top -------------------------------------------------------------------------------------------


def lane(frame: str, key: str) -> str:
    [line] = [x for x in frame.splitlines() if f"· {key} " in x]
    return line


def test_top_once_renders_one_lane_per_key(seeded: Seeded) -> None:
    result = invoke(seeded.args("top", "--once"))
    assert result.exit_code == 0, result.output
    frame = result.stdout
    a, b, c = lane(frame, "store:A"), lane(frame, "store:B"), lane(frame, "store:C")
    assert "[■] ●○" in a and "1/1 held, 2 waiting, oldest" in a
    assert "[□]" in b and "0 waiting" in b
    assert "[■]" in c and "0 waiting" in c
    assert "keys 3  holders 3  waiters 2  handoffs/s –" in frame


def test_top_without_a_terminal_prints_a_frame_per_refresh(seeded: Seeded) -> None:
    """`top | cat`, `top > file` (CliRunner's output is no terminal): whole plain-text frames, one
    per refresh and a blank line after each, as `top -b` does; `--frames N` stops after N."""
    result = invoke(seeded.args("top", "--frames", "2", "--interval", "0.1"))
    assert result.exit_code == 0, result.output
    frames = result.stdout.split("\n\n")
    assert frames[-1] == "" and len(frames) == 3, result.stdout  # two frames, each ending in a blank line
    for frame in frames[:2]:
        assert frame.startswith("singleton-tasks top · "), frame
        assert "[■] ●○" in lane(frame, "store:A"), frame
        assert "keys 3  holders 3  waiters 2  handoffs/s" in frame
    assert "\x1b[" not in result.stdout  # no colours, no cursor movement


def test_top_shows_each_keys_token_at_80_columns() -> None:
    """A lane is one line that ends with the key's last token as its last 6 digits after an
    ellipsis (docs/operations.md#top; `inspect` shows it whole): too narrow, the counts before it
    are cut, not the token."""
    url = f"memory://top-{uuid.uuid4().hex}"
    store = store_from_url(url, clock=ManualClock())
    store.migrate()
    now = clock.now()
    for key in ("store:A", "store:B", "store:C"):
        count = 4 if key == "store:A" else 1  # A: a holder and three gated waiters
        runs = [RunSpec("sync_inventory", key, str(uuid.uuid4()), limit=1) for _ in range(count)]
        for run in runs:
            at(store, now - 5).register(run)
        assert at(store, now - 4).claim(runs[0], 0, None).decision is Decision.ADMITTED
        for run in runs[1:]:
            assert at(store, now - 3).claim(run, 0, b"payload").decision is Decision.GATED
    result = CliRunner().invoke(cli, ["top", "--once", "--store", url], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    for snap in store.snapshot():
        line = lane(result.stdout, snap.key)
        assert len(str(snap.token)) == 16, snap.token  # clock-derived: microseconds
        assert line.endswith(f"  token …{str(snap.token)[-6:]}"), result.stdout
        assert len(line) <= 80, line
    assert "[■]   1/1 held, 0 waiting  token …" in lane(result.stdout, "store:B"), result.stdout
    assert "[■] ●●●  1/1 held, 3 waiting, oldest " in lane(result.stdout, "store:A"), result.stdout
    narrow = CliRunner().invoke(cli, ["top", "--once", "--store", url], env={"COLUMNS": "60"})
    [a] = store.snapshot(key="store:A")
    assert lane(narrow.stdout, "store:A").endswith(f"1/1 held, …  token …{str(a.token)[-6:]}"), narrow.stdout


def test_top_frame_rates_handoffs_between_frames(seeded: Seeded) -> None:
    state = TopState()
    t0 = clock.now()
    first = render_top_frame(seeded.store, state, now=t0)
    assert "handoffs/s –" in first
    [a] = at(seeded.store, t0).snapshot(key="store:A")
    release = at(seeded.store, t0 + 0.5).release(SCOPE, "store:A", seeded.a0, token=a.holders[0].token)
    assert [w.run_id for w in release.wakes] == [seeded.a1]
    wake = release.wakes[0]
    assert (
        at(seeded.store, t0 + 1).claim(spec("store:A", seeded.a1), wake.generation, None).decision
        is Decision.ADMITTED
    )
    second = render_top_frame(seeded.store, state, now=t0 + 2)
    assert "handoffs/s 0.5" in second
    assert "[■] ○" in lane(second, "store:A") and "1 waiting" in lane(second, "store:A")


# -- migrate ---------------------------------------------------------------------------------------


def test_migrate_check_exit_codes_on_a_fresh_sqlite_file(tmp_path: Path) -> None:
    """A SQLite store creates its schema at first use: nothing is due before, nor after `migrate`."""
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    before = invoke(["migrate", "--check", "--store", url])
    assert before.exit_code == 0, before.output
    assert "no schema yet; nothing to migrate" in before.output
    assert list(tmp_path.iterdir()) == []
    migrated = invoke(["migrate", "--store", url])
    assert migrated.exit_code == 0, migrated.output
    after = invoke(["migrate", "--check", "--store", url])
    assert after.exit_code == 0, after.output
    assert f"schema version {SCHEMA_VERSION} is current" in after.output
    store = store_from_url(url)
    try:
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


def test_read_only_commands_never_create_a_store(tmp_path: Path) -> None:
    path = tmp_path / "never.db"
    url = f"sqlite:///{path}"
    check = invoke(["migrate", "--check", "--store", url])
    assert check.exit_code == 0 and "nothing to migrate" in check.output, check.output
    shown = invoke(["inspect", "--store", url])
    assert shown.exit_code == 0 and "0 keys, 0 holders, 0 waiters" in shown.output, shown.output
    document = json.loads(invoke(["inspect", "--json", "--store", url]).stdout)
    assert document["schema_version"] is None and document["keys"] == []
    assert invoke(["top", "--once", "--store", url]).exit_code == 0
    assert invoke(["release", "some-run", "--yes", "--store", url]).exit_code == 1
    assert invoke(["drop-waiters", "--key", "store:A", "--yes", "--store", url]).exit_code == 1
    assert list(tmp_path.iterdir()) == []  # no database file, no WAL, no journal
    assert invoke(["migrate", "--store", url]).exit_code == 0  # migrate itself creates it
    assert path.exists()


def test_a_sqlite_path_in_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    """A mistyped directory is not an empty store: every command exits 2 naming the path, and
    creates nothing. A missing file in an existing directory is shown empty, with a note."""
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}"
    for args in (
        ["inspect"],
        ["inspect", "--json"],
        ["top", "--once"],
        ["top", "--frames", "1"],
        ["migrate", "--check"],
        ["migrate"],
        ["release", "some-run", "--yes"],
        ["drop-waiters", "--key", "store:A", "--yes"],
    ):
        result = invoke([*args, "--store", url])
        assert result.exit_code == 2, (args, result.output)
        assert f"the directory '{tmp_path / 'no' / 'such' / 'dir'}' does not exist" in result.stderr, args
        assert result.stdout == "", (args, result.stdout)
    assert list(tmp_path.iterdir()) == []
    missing_file = invoke(["inspect", "--store", f"sqlite:///{tmp_path / 'x.db'}"])
    assert missing_file.exit_code == 0, missing_file.output
    assert f"no SQLite file at '{tmp_path / 'x.db'}' yet" in missing_file.stderr
    assert "0 keys, 0 holders, 0 waiters" in missing_file.stdout
    assert list(tmp_path.iterdir()) == []


def test_migrate_check_and_inspect_on_a_mismatched_schema() -> None:
    from singleton_tasks.stores.memory import MemoryStore

    url = f"memory://schema-{uuid.uuid4().hex}"
    store = MemoryStore(url)
    store.set_schema_version_for_tests(SCHEMA_VERSION - 1)  # written by an older library
    older = invoke(["migrate", "--check", "--store", url])
    assert older.exit_code == 1 and f"upgrade due: schema version {SCHEMA_VERSION - 1} →" in older.output
    assert invoke(["migrate", "--store", url]).exit_code == 0
    assert invoke(["migrate", "--check", "--store", url]).exit_code == 0

    store.set_schema_version_for_tests(SCHEMA_VERSION + 1)  # written by a newer library
    newer = invoke(["migrate", "--check", "--store", url])
    assert newer.exit_code == 1 and "newer" in newer.output
    refused = invoke(["migrate", "--store", url])
    assert refused.exit_code == 1 and store.schema_version() == SCHEMA_VERSION + 1
    inspected = invoke(["inspect", "--store", url])
    assert inspected.exit_code == 2
    assert "singleton-tasks migrate" in inspected.output


@pytest.mark.redis
def test_migrate_check_on_redis_fresh_and_old_namespaces() -> None:
    """A fresh Redis namespace needs nothing (the store creates it at first use): exit 0, nothing
    written. A namespace an older library wrote is due: exit 1 until `migrate`."""
    require_server(REDIS_URL, "Redis")
    namespace = f"t{uuid.uuid4().hex[:12]}"
    store = store_from_url(REDIS_URL, namespace=namespace)
    try:
        fresh = invoke(["migrate", "--check", "--store", REDIS_URL, "--namespace", namespace])
        assert fresh.exit_code == 0, fresh.output
        assert "no schema yet; nothing to migrate" in fresh.output
        assert store.schema_version() is None  # --check wrote nothing
        store.migrate()
        store.set_schema_version_for_tests(SCHEMA_VERSION - 1)
        old = invoke(["migrate", "--check", "--store", REDIS_URL, "--namespace", namespace])
        assert old.exit_code == 1, old.output
        assert f"upgrade due: schema version {SCHEMA_VERSION - 1} → {SCHEMA_VERSION}" in old.output
        assert invoke(["migrate", "--store", REDIS_URL, "--namespace", namespace]).exit_code == 0
        current = invoke(["migrate", "--check", "--store", REDIS_URL, "--namespace", namespace])
        assert current.exit_code == 0 and "is current" in current.output, current.output
    finally:
        store.close()
        purge_namespaces("redis", REDIS_URL, {namespace})


@pytest.mark.postgres
def test_migrate_check_on_postgres_without_the_schema_is_due() -> None:
    """Workers refuse a PostgreSQL database without the schema (an operator creates it): due."""
    require_server(POSTGRES_URL, "PostgreSQL")
    import psycopg

    schema = f"st_cli_test_{uuid.uuid4().hex[:10]}"
    separator = "&" if "?" in POSTGRES_URL else "?"
    url = f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
    try:
        empty = invoke(["migrate", "--check", "--store", url])
        assert empty.exit_code == 1, empty.output
        assert "upgrade due: no schema yet; workers refuse this store" in empty.output
        assert invoke(["migrate", "--store", url]).exit_code == 0
        assert invoke(["migrate", "--check", "--store", url]).exit_code == 0
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
            connection.execute(f'DROP SCHEMA "{schema}" CASCADE')


# -- passwords -------------------------------------------------------------------------------------

PASSWORD = "s3cret"


def all_commands(url: str, namespace: str, run_id: str) -> list[list[str]]:
    common = ["--store", url, "--namespace", namespace]
    return [
        ["inspect", *common],
        ["inspect", "--json", *common],
        ["top", "--once", *common],
        ["migrate", "--check", *common],
        # The wake cannot be published (nothing listens on port 1): the error is shown redacted.
        ["release", run_id, "--yes", "--broker", f"redis://user:{PASSWORD}@127.0.0.1:1/14", *common],
        ["release", "unknown-run", "--yes", *common],
        [
            "drop-waiters",
            "--key",
            "store:A",
            "--yes",
            "--broker",
            f"redis://user:{PASSWORD}@127.0.0.1:1/14",
            *common,
        ],
    ]


def assert_no_password(results: list[Result], caplog: pytest.LogCaptureFixture) -> None:
    for result in results:
        assert PASSWORD not in result.output
        assert PASSWORD not in repr(result.exception or "")
    assert PASSWORD not in caplog.text


@pytest.mark.postgres
def test_no_password_in_output_for_a_reachable_store(caplog: pytest.LogCaptureFixture) -> None:
    """memory:// and PostgreSQL under trust auth accept the password, so every command succeeds."""
    urls = [f"memory://user:{PASSWORD}@pw-{uuid.uuid4().hex}"]
    if POSTGRES_URL == "postgresql://127.0.0.1:5432/test":
        require_server(POSTGRES_URL, "PostgreSQL")
        urls.append(f"postgresql://root:{PASSWORD}@127.0.0.1:5432/test")
    for url in urls:
        namespace = f"pw{uuid.uuid4().hex[:10]}"
        store = store_from_url(url, namespace=namespace, clock=ManualClock())
        try:
            store.migrate()
            seeded = seed(store, url)
            with caplog.at_level(logging.DEBUG):
                results = [invoke(args) for args in all_commands(url, namespace, seeded.a0)]
            assert [r.exit_code for r in results] == [0, 0, 0, 0, 0, 1, 0], [r.output for r in results]
            assert "user:***@" in results[0].output or "root:***@" in results[0].output
            assert json.loads(results[1].stdout)["store"] == store.url
            assert "publishing wakes on redis://user:***@127.0.0.1:1/14 failed" in results[4].output
            assert_no_password(results, caplog)
        finally:
            store.close()


@pytest.mark.redis
def test_no_password_in_errors(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """A refused login, an unknown scheme, a closed port: the error names the redacted URL."""
    urls = [
        f"nosuch://user:{PASSWORD}@127.0.0.1/x",
        f"redis://user:{PASSWORD}@127.0.0.1:1/15",  # nothing listens on port 1
    ]
    if REDIS_URL == "redis://127.0.0.1:6379/15":
        require_server(REDIS_URL, "Redis")
        urls.append(f"redis://user:{PASSWORD}@127.0.0.1:6379/15")  # no such ACL user: login refused
    for url in urls:
        with caplog.at_level(logging.DEBUG):
            results = [
                CliRunner().invoke(cli, args, env=WIDE) for args in all_commands(url, "default", "some-run")
            ]
        for result in results:
            assert result.exit_code == 2, (url, result.output, result.exception)
        if url.startswith("nosuch"):
            assert "user:***@127.0.0.1" in results[0].output
        assert_no_password(results, caplog)


@pytest.mark.redis
def test_release_with_a_dramatiq_broker_publishes_the_wake() -> None:
    from conftest import BROKER_REDIS_URL
    from dramatiq.brokers.redis import RedisBroker

    require_server(BROKER_REDIS_URL, "Redis")
    store = store_from_url(f"memory://wake-{uuid.uuid4().hex}")
    queue = f"cli-wake-{uuid.uuid4().hex[:8]}"
    holder, waiter = spec("store:W", "holder-1"), spec("store:W", "waiter-1")
    store.register(holder)
    store.register(waiter)
    assert store.claim(holder, 0, None).decision is Decision.ADMITTED
    # The waiter's delivery, as the adapter stores it with the claim to wake it later.
    delivered = dramatiq.Message(
        queue_name=f"{queue}.DQ", actor_name="sync_inventory", args=("W",), kwargs={},
        options={"singleton_gen": 0, "redis_message_id": "stale-id", "eta": 1}, message_id="waiter-1",
    )  # fmt: skip
    assert store.claim(waiter, 0, delivered.encode()).decision is Decision.GATED

    broker = RedisBroker(url=BROKER_REDIS_URL, middleware=[])
    broker.declare_queue(queue)
    try:
        args = ["release", "holder-1", "--yes", "--store", store.url, "--broker", BROKER_REDIS_URL]
        result = invoke(args)
        assert result.exit_code == 0, result.output
        assert "woke waiter-1" in result.stdout and "wake message was published" in result.stdout
        consumer = broker.consume(queue, prefetch=1, timeout=100)
        received = None
        for _ in range(50):  # the consumer returns None on each 100 ms timeout
            received = next(consumer)
            if received is not None:
                break
        assert received is not None, "no wake message on the broker"
        assert received.message_id == "waiter-1"
        assert list(received.args) == ["W"]
        assert received.options.get("redis_message_id") != "stale-id"
        assert "eta" not in received.options
        # The message carries the generation the store made live for the wake: it is admitted.
        claimed = store.claim(waiter, received.options["singleton_gen"], None)
        assert claimed.decision is Decision.ADMITTED
        consumer.ack(received)
        consumer.close()
    finally:
        broker.flush(queue)
        broker.close()


def test_console_entry_point_logs_the_operator_release(tmp_path: Path) -> None:
    """``main()`` as the console script runs it: the warning reaches stderr, exit codes hold."""
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'entry.db'}"
    command = [sys.executable, "-m", "singleton_tasks.cli"]
    unknown = subprocess.run(
        [*command, "release", "unknown-run", "--yes", "--store", url], capture_output=True, text=True
    )
    assert unknown.returncode == 1, unknown.stderr
    store = store_from_url(url, clock=ManualClock())
    try:
        store.migrate()
        seeded = seed(store, url)
        done = subprocess.run(
            [*command, "release", seeded.a0, "--yes", "--store", url], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert f"woke {seeded.a1}" in done.stdout
        assert "WARNING singleton_tasks: operator release by " in done.stderr
        assert seeded.a0 in done.stderr
    finally:
        store.close()
