"""What the SQL stores share: their SQL files, a DB-API cursor wrapper, the KeyTransaction over it.

SQLite and PostgreSQL alike run the gate's rules through one
:class:`~singleton_tasks.records.KeyTransaction` over that wrapper.

The SQL lives in ``stores/sql/``: a schema file per dialect (a fresh install), numbered
migrations per dialect (upgrades), and ``queries.sql`` with the runtime statements written
once with ``:name`` parameters and converted per dialect here.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import re
import sqlite3
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, ClassVar, NoReturn, Protocol

from .. import gate
from ..errors import SchemaVersionError, StoreUnavailableError
from ..outcomes import HolderRef, KeySnapshot, RunState
from ..records import KeyMeta, KeyTransaction, RunRecord, decode_run, encode_run
from ._driver_errors import TranslatedErrors, sqlite_duplicate_column, sqlite_no_such_column, unavailable
from .base import SCHEMA_VERSION, RuleStore, snapshot_of

#: How many expired settled markers (or idle keys) one settlement (or one key going idle) sweeps:
#: more than it adds, so expired state never piles up while the namespace is in use.
SWEEP_BATCH = 2

_SECTION = re.compile(r"^-- name: (\w+)(?: \((\w+)\))?[ \t]*$", re.MULTILINE)
_NAMED = re.compile(r"(?<![:\w]):(\w+)")
_MIGRATION = re.compile(r"^(\d{4})_\w+\.sql$")


def _sqlite_statements(script: str) -> list[str]:
    """Split a script at statement ends as SQLite sees them (executescript would COMMIT first)."""
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statements.append(buffer.strip())
            buffer = ""
    if _strip_comments(buffer).strip():
        raise ValueError(f"incomplete SQL statement at the end of a script: {buffer.strip()[:80]!r}")
    return statements


def _strip_comments(sql: str) -> str:
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))


_NUL_ESCAPES = re.compile("[\x00\ue000]")
_NUL_UNESCAPES = re.compile("\ue000(.)", re.DOTALL)


def _escape_nul(text: str) -> str:
    """PostgreSQL text cannot hold NUL: NUL → U+E000 ``0``, U+E000 → U+E000 ``e`` (reversible)."""
    if "\x00" not in text and "\ue000" not in text:
        return text  # every ordinary key is stored as itself
    return _NUL_ESCAPES.sub(lambda m: "\ue0000" if m.group() == "\x00" else "\ue000e", text)


def _unescape_nul(text: str) -> str:
    if "\ue000" not in text:
        return text
    return _NUL_UNESCAPES.sub(lambda m: "\x00" if m.group(1) == "0" else "\ue000", text)


def _same(text: str) -> str:
    return text


def _pyformat(sql: str) -> str:
    """``:name`` → psycopg's ``%(name)s`` (a literal ``%`` is doubled first)."""
    return _NAMED.sub(r"%(\1)s", sql.replace("%", "%%"))


_ADD_COLUMN = re.compile(r"^\s*ALTER\s+TABLE\s+\w+\s+ADD\s+COLUMN\s", re.IGNORECASE)
_DROP_COLUMN = re.compile(r"^\s*ALTER\s+TABLE\s+\w+\s+DROP\s+COLUMN\s", re.IGNORECASE)


def _sqlite_column_exists(statement: str, error: Exception) -> bool:
    """A re-applied ``ADD COLUMN`` or ``DROP COLUMN`` (SQLite has no ``IF [NOT] EXISTS`` for
    them): the column is there, or gone already."""
    statement = _strip_comments(statement)
    return (bool(_ADD_COLUMN.match(statement)) and sqlite_duplicate_column(error)) or (
        bool(_DROP_COLUMN.match(statement)) and sqlite_no_such_column(error)
    )


def _never(statement: str, error: Exception) -> bool:
    return False


@dataclass(frozen=True)
class Dialect:
    """What differs between the SQL stores' databases, beyond the per-dialect SQL files."""

    name: str  # "sqlite" | "postgres": the folder of its migrations and the tag in queries.sql
    convert: Callable[[str], str]  # queries.sql's ``:name`` parameters → the driver's style
    statements: Callable[[str], list[str]]  # a script → what one execute() call accepts
    store_text: Callable[[str], str] = _same  # a namespace, scope, key or run id → its column value
    load_text: Callable[[str], str] = _same  # and back
    #: A migration statement's error that means "already done" (migrations must re-apply safely).
    already_applied: Callable[[str, Exception], bool] = _never


SQLITE = Dialect(
    "sqlite", convert=_same, statements=_sqlite_statements, already_applied=_sqlite_column_exists
)
POSTGRES = Dialect(
    "postgres",
    convert=_pyformat,
    statements=lambda script: [script],
    store_text=_escape_nul,
    load_text=_unescape_nul,
)


def _sql_file(*parts: str) -> str:
    path = resources.files("singleton_tasks.stores").joinpath("sql")
    for part in parts:  # one name a call: Traversable.joinpath takes a single child before 3.11
        path = path.joinpath(part)
    return path.read_text(encoding="utf-8")


def parse_queries(text: str, dialect: str) -> dict[str, str]:
    """The named sections of a queries file for one dialect (a tagged section overrides)."""
    generic: dict[str, str] = {}
    specific: dict[str, str] = {}
    matches = list(_SECTION.finditer(text))
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        body = text[match.end() : following.start() if following else len(text)]
        sql = _strip_comments(body).strip().rstrip(";").strip()
        name, tag = match.group(1), match.group(2)
        target = generic if tag is None else specific if tag == dialect else None
        if target is None:
            continue
        if name in target:
            raise ValueError(f"query {name!r} is defined twice for {dialect}")
        target[name] = sql
    return {**generic, **specific}


@functools.cache
def queries(dialect: Dialect) -> Mapping[str, str]:
    """The runtime statements of ``queries.sql``, ready for the dialect's driver."""
    return {
        name: dialect.convert(sql)
        for name, sql in parse_queries(_sql_file("queries.sql"), dialect.name).items()
    }


def schema_script(dialect: Dialect) -> str:
    """The schema at :data:`SCHEMA_VERSION`: what ``migrate`` installs on an empty database."""
    return _sql_file(f"{dialect.name}_schema.sql")


def migration_scripts(dialect: Dialect) -> list[tuple[int, str]]:
    """``(version, script)`` of every numbered migration of the dialect, in order."""
    folder = resources.files("singleton_tasks.stores").joinpath("sql").joinpath(dialect.name)
    found = []
    for entry in folder.iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.read_text(encoding="utf-8")))
    return sorted(found)


class DBCursor(Protocol):
    """The part of a DB-API cursor the SQL stores use (sqlite3 and psycopg both fit)."""

    @property
    def rowcount(self) -> int: ...

    @property
    def description(self) -> Sequence[Sequence[Any]] | None: ...

    def execute(self, query: str, params: Any = ..., /) -> object: ...

    def fetchall(self) -> list[Any]: ...


def _raise_unavailable(where: str, error: BaseException) -> NoReturn:
    raise unavailable(where, error) from error


class SQLCursor:
    """Runs named statements on a driver cursor; driver errors become StoreUnavailableError."""

    def __init__(
        self,
        raw: DBCursor,
        dialect: Dialect,
        errors: tuple[type[Exception], ...],
        where: str,
    ) -> None:
        self._raw = raw
        self.dialect = dialect
        self.queries = queries(dialect)
        #: ``with self._errors:`` turns the driver's errors into StoreUnavailableError. Its
        #: handler holds ``where``, not the cursor: a cursor per operation, freed without a cycle.
        self._errors = TranslatedErrors(errors, functools.partial(_raise_unavailable, where))

    def _execute(self, sql: str, params: Mapping[str, Any] | None) -> None:
        with self._errors:
            if params is None:
                self._raw.execute(sql)
            else:
                self._raw.execute(sql, params)

    def _fetchall(self) -> list[tuple[Any, ...]]:
        with self._errors:
            return [tuple(row) for row in self._raw.fetchall()]

    def all(self, name: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        self._execute(self.queries[name], params)
        return self._fetchall()

    def columns(self) -> tuple[str, ...]:
        """The column names of the last statement's rows (how run rows are decoded: by name)."""
        return tuple(str(column[0]) for column in self._raw.description or ())

    def one(self, name: str, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        rows = self.all(name, params)
        return rows[0] if rows else None

    def run(self, name: str, params: Mapping[str, Any]) -> int:
        """Execute a statement without a result; returns the affected row count."""
        self._execute(self.queries[name], params)
        return self._raw.rowcount

    def script(self, script: str) -> None:
        """Execute a schema or migration script (no parameters) inside the current transaction."""
        for statement in self.dialect.statements(script):
            try:
                self._execute(statement, None)
            except StoreUnavailableError as error:
                if not self.dialect.already_applied(statement, error):
                    raise


def _record(columns: Sequence[str], row: Sequence[Any], load_text: Callable[[str], str]) -> RunRecord:
    """A run's row as a record, its values taken by column name (``columns``: the row's names)."""
    values = dict(zip(columns, row, strict=True))
    return decode_run(load_text(str(values["run_id"])), values)


class SQLKeyTransaction(KeyTransaction):
    """One key's rows, read and written inside the store's transaction after :meth:`lock`.

    While the key is locked only this transaction changes its rows, so what it has read or
    written is kept and served again (write-through): the rules ask for the holders and the
    count several times per operation, and each question would be a round trip.
    """

    def __init__(self, cursor: SQLCursor, namespace: str, scope: str, key: str, *, now: float | None) -> None:
        self._cursor = cursor
        self._text = cursor.dialect.store_text
        self._load = cursor.dialect.load_text
        self._namespace = {"namespace": self._text(namespace)}
        self._key = {**self._namespace, "scope": self._text(scope), "key": self._text(key)}
        self._now_arg = now  # the clock to decide at (None: the database server's)
        self._now = 0.0
        self._meta = KeyMeta()  # the key row as stored, so unchanged counters are not rewritten
        self._created = False  # this transaction inserted the key row and has not written it since
        self._runs: dict[str, RunRecord | None] = {}  # run id -> its row as it is now (None: absent)
        self._holders: dict[str, RunRecord] | None = None  # with _count: loaded together, kept exact
        self._count = 0

    def lock(self, *, create: bool) -> bool:
        """Lock the key's row, creating it if ``create``; False if it does not exist.

        The lock's query also reads the store's clock, once the lock is held.
        """
        for _attempt in range(10):
            row = self._cursor.one("lock_key", {**self._key, "now": self._now_arg})
            if row is not None:
                idle_until = None if row[3] is None else float(row[3])
                due_at = None if row[5] is None else float(row[5])
                self._meta = KeyMeta(
                    token=int(row[0]),
                    seq=int(row[1]),
                    limit=int(row[2]),
                    idle_until=idle_until,
                    due_at=due_at,
                )
                self._now = float(row[4])
                return True
            if not create:
                return False
            # Another transaction may create it first (we then wait for it) or delete it while
            # we wait for its lock (an idle key forgotten): either way, look again.
            self._created = self._cursor.run("insert_key", self._key) == 1
        raise StoreUnavailableError(f"could not lock key {self._key['key']!r}: it keeps disappearing")

    def _summary(self) -> dict[str, RunRecord]:
        """The holders and the number of runs, in one round trip, once."""
        if self._holders is None:
            rows = self._cursor.all("key_summary", self._key)
            columns = self._cursor.columns()
            self._count = int(rows[0][0]) if rows else 0
            self._holders = {}
            for row in rows:
                if row[1] is not None:
                    run = self._keep(_record(columns[1:], row[1:], self._load))
                    self._holders[run.run_id] = run
        return self._holders

    def _waiters_exist(self) -> bool:
        holders = len(self._summary())  # loads the count too
        return self._count > holders

    def _keep(self, run: RunRecord) -> RunRecord:
        self._runs[run.run_id] = run
        return run

    def now(self) -> float:
        return self._now

    def meta(self) -> KeyMeta | None:
        return replace(self._meta)

    def drop_if_unwritten(self) -> None:
        """Delete the key row this transaction inserted and never wrote: a call that wrote nothing
        (a claim asked for its payload, a confirm of an unknown run) leaves no row, which would
        never be idle and so never swept."""
        if self._created:
            self._cursor.run("delete_key", self._key)

    def save_meta(self, meta: KeyMeta) -> None:
        if meta == self._meta:
            return
        became_idle = meta.idle_until is not None and self._meta.idle_until is None
        self._created = False
        self._cursor.run(
            "update_key",
            {
                **self._key,
                "token": meta.token,
                "seq": meta.seq,
                "slot_limit": meta.limit,
                "idle_until": meta.idle_until,
                "due_at": meta.due_at,
            },
        )
        self._meta = replace(meta)
        if became_idle:  # one key more to forget some day: forget a few whose day has come
            self._cursor.run("sweep_keys", {**self._namespace, "now": self._now, "count": SWEEP_BATCH})

    def get_run(self, run_id: str) -> RunRecord | None:
        if run_id not in self._runs:
            row = self._cursor.one("get_run", {**self._key, "run_id": self._text(run_id)})
            self._runs[run_id] = None if row is None else _record(self._cursor.columns(), row, self._load)
        run = self._runs[run_id]
        return None if run is None else run.copy()

    def save_run(self, run: RunRecord) -> None:
        self._created = False
        self._cursor.run("save_run", {**self._key, **encode_run(run), "run_id": self._text(run.run_id)})
        if self._holders is not None:
            if run.run_id not in self._runs:
                self._holders = None  # whether this inserted a row is unknown: reload when asked
            else:
                if self._runs[run.run_id] is None:
                    self._count += 1
                if run.state is RunState.HOLDING:
                    self._holders[run.run_id] = run.copy()
                else:
                    self._holders.pop(run.run_id, None)
        self._keep(run.copy())

    def delete_run(self, run_id: str) -> None:
        deleted = self._cursor.run("delete_run", {**self._key, "run_id": self._text(run_id)})
        self._runs[run_id] = None
        if self._holders is not None:
            self._count -= deleted
            self._holders.pop(run_id, None)

    def holders(self) -> list[RunRecord]:
        return [run.copy() for run in sorted(self._summary().values(), key=lambda r: r.token)]

    def count_runs(self) -> int:
        self._summary()
        return self._count

    def waiters_from(self, after_seq: int, count: int) -> list[RunRecord]:
        if not self._waiters_exist():
            return []
        rows = self._cursor.all("waiters_from", {**self._key, "after_seq": after_seq, "count": count})
        columns = self._cursor.columns()
        return [self._keep(_record(columns, row, self._load)).copy() for row in rows]

    def newest_waiter(self) -> RunRecord | None:
        if not self._waiters_exist():
            return None
        row = self._cursor.one("newest_waiter", self._key)
        return None if row is None else self._keep(_record(self._cursor.columns(), row, self._load)).copy()

    def waiters_before(self, seq: int) -> int:
        if not self._waiters_exist():
            return 0
        row = self._cursor.one("waiters_before", {**self._key, "seq": seq})
        return int(row[0]) if row else 0

    def unconfirmed_before(self, before: float) -> list[str]:
        if not self._waiters_exist():
            return []
        rows = self._cursor.all("unconfirmed_before", {**self._key, "before": before})
        return [self._load(str(row[0])) for row in rows]

    def settled_generation(self, run_id: str, now: float) -> int | None:
        row = self._cursor.one("settled_generation", {**self._key, "run_id": self._text(run_id), "now": now})
        return None if row is None else int(row[0])

    def mark_settled(self, run_id: str, generation: int, expires_at: float, now: float) -> None:
        # One marker more: sweep a few expired ones of the namespace, so they never pile up.
        self._cursor.run("sweep_settled", {**self._namespace, "now": now, "count": SWEEP_BATCH})
        self._cursor.run(
            "mark_settled",
            {**self._key, "run_id": self._text(run_id), "generation": generation, "expires_at": expires_at},
        )

    def clear_settled(self, run_id: str) -> None:
        self._cursor.run("clear_settled", {**self._key, "run_id": self._text(run_id)})


class SQLStore(RuleStore):
    """The gate's rules over SQL rows; a subclass supplies connections (:meth:`_begin`)."""

    dialect: ClassVar[Dialect]

    #: Expired settled markers, and as many idle keys, that :meth:`sweep` deletes per transaction:
    #: short transactions, so a sweep never holds a lock a run's operation waits on for long.
    sweep_batch: int = 500

    @abc.abstractmethod
    def _begin(self, *, write: bool) -> contextlib.AbstractContextManager[SQLCursor]:
        """A cursor in a transaction: committed on exit, rolled back on error.

        ``write``: the transaction will write (SQLite takes its write lock before reading).
        """

    @abc.abstractmethod
    def _now_arg(self) -> float | None:
        """The time the database is asked to decide at: None for the server's own clock."""

    @contextlib.contextmanager
    def transaction(self, scope: str, key: str) -> Iterator[KeyTransaction]:
        with self._begin(write=True) as cursor:
            tx = SQLKeyTransaction(cursor, self.namespace, scope, key, now=self._now_arg())
            tx.lock(create=True)
            yield tx
            tx.drop_if_unwritten()

    def _heartbeat_batch(self, holders: Sequence[HolderRef]) -> tuple[list[bool], float]:
        alive = [False] * len(holders)
        by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
        for index, ref in enumerate(holders):
            by_key[(ref.scope, ref.key)].append(index)
        store_time: float | None = None
        with self._begin(write=True) as cursor:
            # One transaction for the batch; keys locked in sorted order, so two batches never
            # deadlock (every other transaction locks a single key).
            for scope, key in sorted(by_key):
                tx = SQLKeyTransaction(cursor, self.namespace, scope, key, now=self._now_arg())
                if not tx.lock(create=False):
                    continue  # no key row: none of these runs holds anything
                store_time = tx.now()
                for index in by_key[(scope, key)]:
                    ref = holders[index]
                    alive[index] = gate.heartbeat(tx, ref.run_id, ref.token)
        return alive, self.time() if store_time is None else store_time

    def due_keys(self, now: float, count: int) -> list[tuple[str, str]]:
        load = self.dialect.load_text
        with self._begin(write=False) as cursor:
            rows = cursor.all(
                "due_keys", {"namespace": self.dialect.store_text(self.namespace), "now": now, "count": count}
            )
        return [(load(str(scope)), load(str(key))) for scope, key in rows]

    def sweep(self, *, until: float | None = None) -> int:
        """Forget expired settled markers and idle keys of the namespace, in small transactions."""
        swept, params = 0, {"namespace": self.dialect.store_text(self.namespace), "count": self.sweep_batch}
        while True:
            now = self.time()
            with self._begin(write=True) as cursor:
                batch = cursor.run("sweep_settled", {**params, "now": now})
                batch += cursor.run("sweep_keys", {**params, "now": now})
            swept += batch
            if batch == 0 or (until is not None and time.monotonic() >= until):
                return swept

    def snapshot(self, *, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        text, load = self.dialect.store_text, self.dialect.load_text
        with self._begin(write=False) as cursor:
            rows = cursor.all(
                "snapshot",
                {
                    "namespace": text(self.namespace),
                    "scope": None if scope is None else text(scope),
                    "key": None if key is None else text(key),
                },
            )
            columns = cursor.columns()[5:]  # the key's columns first (scope .. slot_limit), then the run's
        metas: dict[tuple[str, str], KeyMeta] = {}
        runs: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
        for row in rows:
            ident = (load(str(row[0])), load(str(row[1])))
            metas[ident] = KeyMeta(token=int(row[2]), seq=int(row[3]), limit=int(row[4]))
            runs[ident].append(_record(columns, row[5:], load))
        return [snapshot_of(s, k, metas[(s, k)], runs[(s, k)]) for s, k in sorted(metas)]

    @staticmethod
    def _has_version_table(cursor: SQLCursor) -> bool:
        row = cursor.one("schema_table_exists", {})
        return bool(row and row[0])

    @classmethod
    def _read_version(cls, cursor: SQLCursor) -> int | None:
        if not cls._has_version_table(cursor):
            return None
        row = cursor.one("schema_version", {})
        return None if row is None or row[0] is None else int(row[0])

    def schema_version(self) -> int | None:
        with self._begin(write=False) as cursor:
            return self._read_version(cursor)

    def migrate(self) -> None:
        """Install the schema on an empty database or apply the due migrations, in one transaction."""
        with self._begin(write=True) as cursor:
            if "migration_lock" in cursor.queries:
                cursor.run("migration_lock", {})
            if not self._has_version_table(cursor):  # an empty database: the schema file, at once
                cursor.script(schema_script(self.dialect))
                return
            current = self._read_version(cursor) or 0
            if current > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"{self!r}: schema version {current} is newer than this library's {SCHEMA_VERSION}; "
                    f"upgrade singleton-tasks"
                )
            for version, script in migration_scripts(self.dialect):
                if version > current:
                    cursor.script(script)

    def set_schema_version_for_tests(self, version: int | None) -> None:
        """Pretend another library version wrote this database (the schema-mismatch tests)."""
        with self._begin(write=True) as cursor:
            cursor.run("clear_schema_version", {})
            if version is not None:
                cursor.run("insert_schema_version", {"version": version})
