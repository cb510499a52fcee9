"""How kvwatch reaches what an engine listens on, across network namespaces.

A wildcard bind (``tcp://*:5557``) is reached on 127.0.0.1 when the engine shares
kvwatch's network namespace, else on the engine's own address in its namespace (a
pod IP, read from the namespace's routing table). An ``ipc://`` path is reached
through the engine's own view of the file system. What cannot be reached (an
endpoint vLLM connects out to, ``inproc://``, loopback inside another namespace) is
answered with a note, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvwatch.daemon.host.procfs import ProcError, ProcFS

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}  # noqa: S104 - names of "all interfaces", matched not bound
_LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|localhost|::1|\[::1\])$")


def local_ipv4(fib_trie: str) -> str | None:
    """The first non-loopback local IPv4 address in a /proc/PID/net/fib_trie."""
    last_ip = None
    for line in fib_trie.splitlines():
        s = line.strip()
        if s.startswith("|--"):
            last_ip = s[3:].strip()
        elif s == "/32 host LOCAL" and last_ip and not last_ip.startswith("127."):
            return last_ip
    return None


@dataclass(slots=True)
class Reach:
    """How to reach a process's listening sockets from kvwatch."""

    procfs: ProcFS
    _own_netns: int | None = None

    def own_netns(self) -> int | None:
        if self._own_netns is None:
            try:
                self._own_netns = self.procfs.netns("self")
            except ProcError:
                return None
        return self._own_netns

    def same_netns(self, pid: int) -> bool:
        try:
            return self.procfs.netns(pid) == self.own_netns()
        except ProcError:
            return True  # cannot tell (no /proc ns access): assume the host network

    def address(self, pid: int) -> str | None:
        if self.same_netns(pid):
            return "127.0.0.1"
        try:
            return local_ipv4(self.procfs.fib_trie(pid))
        except ProcError:
            return None

    def connect(self, endpoint: str, pid: int) -> tuple[str | None, str]:
        """Where kvwatch connects to reach what the engine binds (vLLM's own bind rule)."""
        if endpoint.startswith("tcp://"):
            if "*" not in endpoint and "::" not in endpoint:
                return None, f"{endpoint}: vLLM connects out to this endpoint (no wildcard), nothing to subscribe to"
            port = endpoint.rpartition(":")[2]
            addr = self.address(pid)
            if addr is None:
                return None, f"{endpoint}: no address found in the engine's network namespace"
            return f"tcp://{addr}:{port}", ""
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://") :]
            base = self.procfs.root_path(pid) if path.startswith("/") else self.procfs.cwd_path(pid)
            return f"ipc://{base}/{path.lstrip('/')}", ""
        return None, f"{endpoint}: not reachable from another process"

    def http_host(self, host: str | None, pid: int) -> tuple[str | None, str]:
        if host is None or host in _WILDCARD_HOSTS:
            addr = self.address(pid)
            return addr, "" if addr else "no address found in the engine's network namespace"
        if _LOOPBACK.match(host):
            if self.same_netns(pid):
                return "127.0.0.1", ""
            return None, f"metrics listen on {host} inside another network namespace"
        return host, ""
