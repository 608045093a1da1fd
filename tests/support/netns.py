"""A real network on one machine for the e2e tests: each host in its own network namespace, all joined to one
bridge (a switch, in a namespace of its own) by veth pairs; taking a host's switch port down is a partition.

Every address is in the loopback range (127.100.0.0/24), which needs `route_localnet` inside each namespace, and
each namespace's loopback keeps only 127.0.0.1 for itself (the kernel's `local 127.0.0.0/8` route would otherwise
answer every 127.x address at home). Nothing is added to the root namespace: the test's own clients run inside a
namespace too (`Network.argv`). Creating namespaces needs root (CAP_NET_ADMIN); `Network.unavailable` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "127.100.0"  # loopback range only: these tests never address a private or public network


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    port: str  # its veth end on the switch


class Network:
    """Namespaces `<prefix>-<host>` and a switch `<prefix>-sw`; `close` removes them (killing what runs there)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.switch = f"{prefix}-sw"
        self.hosts: dict[str, Host] = {}
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    @staticmethod
    def sweep(stem: str) -> None:
        """Remove namespaces `<stem><pid>-*` left by a test process that is gone (killed before its clean-up)."""
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            pid = name[len(stem) :].partition("-")[0]
            if name.startswith(stem) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                for stale in _ip("netns", "pids", name, check=False).stdout.split():
                    _kill(int(stale))
                _ip("netns", "del", name, check=False)

    @staticmethod
    def unavailable() -> str:
        """Why this machine cannot run the network tests ("" when it can): tried by building a small one."""
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is not installed"
        network = None
        try:
            network = Network(f"mvprobe{os.getpid()}")
            network.add_host("a", 1)
            network.add_host("b", 2)
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            return f"network namespaces and veth pairs are not permitted here ({detail or exc})"
        finally:
            if network is not None:
                network.close()
        return ""

    def add_host(self, name: str, last_octet: int) -> Host:
        ns, port, address = f"{self.prefix}-{name}", f"p-{name}", f"{SUBNET}.{last_octet}"
        _ip("netns", "add", ns)
        self.hosts[name] = host = Host(name, ns, address, port)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        sysctl = ["net.ipv4.conf.all.route_localnet=1", "net.ipv4.conf.eth0.route_localnet=1"]
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", *sysctl], check=True, capture_output=True)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local")
        _ip("-n", ns, "route", "replace", "local", "127.0.0.1", "dev", "lo", "table", "local")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        return host

    def argv(self, host: str, command: list[str]) -> list[str]:
        """`command` run inside `host`'s namespace (ip execs it: the process's pid is the command's)."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *command]

    def set_link(self, host: str, up: bool) -> None:
        """Plug or unplug `host`'s cable: its switch port goes up or down (the host sees its carrier go)."""
        _ip("-n", self.switch, "link", "set", self.hosts[host].port, "up" if up else "down")

    def close(self) -> None:
        """Kill whatever still runs in the namespaces (only this test's processes can be there), then remove them."""
        for host in self.hosts.values():
            pids = _ip("netns", "pids", host.namespace, check=False).stdout.split()
            for pid in pids:
                _kill(int(pid))
        for ns in [h.namespace for h in self.hosts.values()] + [self.switch]:
            _ip("netns", "del", ns, check=False)
        self.hosts.clear()


@dataclass
class Run:
    started: float
    pid: int
    ended: float = 0.0
    code: int | None = None


@dataclass
class Supervised:
    """A process restarted whenever it exits, `restart_s` later: what systemd's `Restart=always` and
    `RestartSec=2` do for deploy/systemd/minivllm-worker@.service on a real host."""

    argv: list[str]
    log: Path
    env: dict[str, str]
    restart_s: float = 2.0
    runs: list[Run] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _proc: subprocess.Popen[bytes] | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"supervise {self.log.stem}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock, open(self.log, "ab") as out:  # stop() sees either no process or this one
                if self._stop.is_set():
                    return
                proc = self._proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
            run = Run(time.monotonic(), proc.pid)
            self.runs.append(run)
            run.code = proc.wait()
            run.ended = time.monotonic()
            with open(self.log, "a") as out:
                out.write(f"[supervisor] pid {proc.pid} exited with {run.code}; restarting in {self.restart_s:g} s\n")
            self._stop.wait(self.restart_s)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self.runs[-1].pid if self.runs else 0

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (as systemd stops a unit), SIGKILL after `timeout` s; no more restarts."""
        with self._lock:
            self._stop.set()
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(timeout)
