"""A 3-primary + 3-replica Redis Cluster on loopback ports, started and stopped by PID.

Used by the ``redis_cluster`` fixture (conftest.py) and the benchmarks (``python -m
tests.loopback_cluster`` prints the URL of a running one and stops it on Ctrl-C). Each node keeps
nothing on disk but its cluster config, in a temporary folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from services import require_executable

#: Loopback ports of the cluster nodes (their cluster bus ports are these + 10000).
PORTS = tuple(range(7101, 7107))
#: A node unseen this long is failed over: short, so a failover test takes seconds.
NODE_TIMEOUT_MS = 1500


@dataclass
class LoopbackCluster:
    folder: Path
    ports: tuple[int, ...] = PORTS
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports[:3])

    def start(self) -> None:
        server = require_executable("redis-server")
        cli = require_executable("redis-cli")
        for port in self.ports:
            self.start_node(port, server)
        for port in self.ports:
            self._wait_ping(port)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()

    def start_node(self, port: int, server: str | None = None) -> None:
        node_dir = self.folder / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        log = open(node_dir / "redis.log", "ab")  # the server writes it while it runs
        self.processes[port] = subprocess.Popen(
            [
                server or require_executable("redis-server"),
                *("--port", str(port), "--bind", "127.0.0.1"),
                *("--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf")),
                *("--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--dir", str(node_dir)),
                *("--save", "", "--appendonly", "no", "--daemonize", "no"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def _wait_ping(self, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def live_ports(self) -> list[int]:
        return [port for port, process in self.processes.items() if process.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and the same slot owners, and every
        replica's link to its primary is up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                states, layouts, links = set(), set(), set()
                for port in self.live_ports():
                    client = redis.Redis(port=port, socket_timeout=1)
                    states.add(client.cluster("info")["cluster_state"])
                    # A replica that never synced with its primary cannot be promoted.
                    replication = client.info("replication")
                    if replication["role"] == "slave":
                        links.add(replication["master_link_status"])
                    layouts.add(
                        tuple(sorted((s[0], s[2][1]) for s in client.execute_command("CLUSTER SLOTS")))
                    )
                    client.close()
                if states == {"ok"} and len(layouts) == 1 and links <= {"up"}:
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster on {self.ports} not ok after {timeout} s")
            time.sleep(0.1)

    def primary_port_of(self, key: bytes | str) -> int:
        """The port of the primary that serves ``key``'s slot now."""
        client = redis.Redis(port=self.live_ports()[0], socket_timeout=2)
        try:
            slot = client.cluster("keyslot", key)
            for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        finally:
            client.close()
        raise LookupError(slot)

    def keys_on_distinct_primaries(self, prefix_of: Callable[[str], bytes], count: int) -> dict[str, int]:
        """``count`` key names ``k0``, ``k1``, ... on ``count`` different primaries: name -> port."""
        chosen: dict[str, int] = {}
        for number in range(10_000):
            key = f"k{number}"
            port = self.primary_port_of(prefix_of(key))
            if port not in chosen.values():
                chosen[key] = port
            if len(chosen) == count:
                return chosen
        raise LookupError(f"no {count} keys on distinct primaries")

    def primary_ports(self) -> list[int]:
        client = redis.Redis(port=self.live_ports()[0], socket_timeout=2)
        try:
            return sorted(
                {int(primary[1]) for _s, _e, primary, *_ in client.execute_command("CLUSTER SLOTS")}
            )
        finally:
            client.close()

    def kill(self, port: int) -> None:
        """SIGKILL one node, by PID (what a crashed host looks like)."""
        process = self.processes[port]
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def main() -> None:
    """Start a cluster, print its URL, stop it on SIGINT/SIGTERM (for benchmarks by hand)."""
    with tempfile.TemporaryDirectory(prefix="singleton-cluster-") as folder:
        cluster = LoopbackCluster(Path(folder))
        try:
            cluster.start()
            print(cluster.url, flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
