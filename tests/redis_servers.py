"""Private redis-server and Sentinel processes on loopback for the tests that need a server of their own
(an eviction policy, replicas, a failover): started in a tmp folder, stopped by PID."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from services import require_executable


class RedisProcess:
    """One redis-server (or Sentinel) the test started; ``client`` talks to it."""

    def __init__(self, port: int, directory: Path, args: list[str], *, sentinel: bool = False) -> None:
        self.port = port
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        executable = require_executable("redis-server")
        if sentinel:
            config = directory / "sentinel.conf"
            config.write_text("\n".join(args) + "\n")  # Sentinel rewrites its config: a file it owns
            command = [executable, str(config), "--sentinel", "--port", str(port), "--bind", "127.0.0.1"]
            command += ["--dir", str(directory), "--logfile", str(directory / "sentinel.log")]
        else:
            command = [executable, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(directory)]
            command += ["--save", "", "--appendonly", "no", "--logfile", str(directory / "redis.log"), *args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:  # waiting for a server we just started, not polling library state
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@contextlib.contextmanager
def redis_server(port: int, directory: Path, *args: str) -> Iterator[RedisProcess]:
    server = RedisProcess(port, directory, list(args))
    try:
        yield server
    finally:
        server.stop()


def wait_for(condition: object, what: str, timeout: float = 20.0) -> None:
    """Wait for servers we started to reach a state (a replica in sync, a failover done)."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def replica_in_sync(primary: RedisProcess, replicas: int = 1) -> bool:
    info = primary.client.info("replication")
    return bool(
        info.get("connected_slaves", 0) >= replicas
        and all(
            info.get(f"slave{i}", {}).get("state") == "online" for i in range(int(info["connected_slaves"]))
        )
    )


def as_written_by_version_3(store: Any) -> None:
    """Rewrite a Redis store's busy keys as schema version 3 left them: each run's ``reissue_at``
    under its old name ``passed_over_at``, the waiters that had one in an ``overdue`` zset by it,
    no ``unconfirmed`` zset, no ``due_at`` and no due index (per-key commands: a cluster client
    routes each)."""
    client = store._client
    for tag in store._busy_tags():
        prefix = store._ns_colon + tag + b":"
        client.hdel(prefix + b"meta", "due_at")
        client.zrem(store._due_index_key(tag), tag)
        client.delete(prefix + b"unconfirmed")
        for run_id in client.zrange(prefix + b"holders", 0, -1) + client.zrange(prefix + b"waiters", 0, -1):
            run = prefix + b"run:" + run_id
            state, value = client.hmget(run, ["state", "reissue_at"])
            client.hdel(run, "reissue_at")
            client.hset(run, "passed_over_at", value)
            if value and state != b"holding":
                client.zadd(prefix + b"overdue", {run_id: float(value)})
