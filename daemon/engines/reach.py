"""How kvwatch reaches what an engine listens on, across network namespaces, and only that.

A wildcard bind (``tcp://*:5557``) is reached on 127.0.0.1 when the engine shares
kvwatch's network namespace, else on the engine's own address in its namespace (a
pod IP, read from the namespace's routing table). An ``ipc://`` path is reached
through the engine's own view of the file system. What cannot be reached (an
endpoint vLLM connects out to, ``inproc://``, loopback inside another namespace) is
answered with a note, never guessed.

A command line is the watched process's to write, and kvwatch runs as root: where it says the
engine listens is believed only where that is the process's own. An HTTP host must be an
address (a name is never resolved) that is loopback in kvwatch's own namespace, or local to the
process's network namespace (its ``/32 host LOCAL`` routes, its IPv6 addresses): a metadata
address, another host or a neighbour pod's address is refused. An ``ipc://`` path never leaves
the process's root (no ``..``), a TCP port is within 1..65535.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvwatch.daemon.host.procfs import ProcError, ProcFS

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}  # noqa: S104 - names of "all interfaces", matched not bound
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def local_addresses(fib_trie: str) -> list[str]:
    """Every local IPv4 address of a /proc/PID/net/fib_trie (loopback too), in its order."""
    out: list[str] = []
    last_ip = None
    for line in fib_trie.splitlines():
        s = line.strip()
        if s.startswith("|--"):
            last_ip = s[3:].strip()
        elif s == "/32 host LOCAL" and last_ip and last_ip not in out:
            out.append(last_ip)
    return out


def local_ipv4(fib_trie: str) -> str | None:
    """The first non-loopback local IPv4 address in a /proc/PID/net/fib_trie."""
    return next((a for a in local_addresses(fib_trie) if not a.startswith("127.")), None)


def inet6_addresses(if_inet6: str) -> list[str]:
    """The IPv6 addresses of a /proc/PID/net/if_inet6 (32 hex digits first on each line)."""
    out = []
    for line in if_inet6.splitlines():
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        if len(word) == 32:
            try:
                out.append(str(ipaddress.IPv6Address(int(word, 16))))
            except ValueError:
                continue
    return out


def port_number(text: str) -> int | None:
    """A TCP port from text: digits, 1..65535."""
    if not (text.isascii() and text.isdigit()) or len(text) > 5:
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def _address(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
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

    def local(self, pid: int) -> set[Address]:
        """The addresses of the process's network namespace (none when they cannot be read)."""
        found: list[str] = []
        for read, parse in ((self.procfs.fib_trie, local_addresses), (self.procfs.if_inet6, inet6_addresses)):
            try:
                found += parse(read(pid))
            except ProcError:
                continue
        return {a for a in map(_address, found) if a is not None}

    def connect(self, endpoint: str, pid: int) -> tuple[str | None, str, bool]:
        """Where kvwatch connects to reach what the engine binds (vLLM's own bind rule):
        (address, note, refused); refused when the endpoint is not the process's own."""
        if endpoint.startswith("tcp://"):
            return self._tcp(endpoint, pid)
        if endpoint.startswith("ipc://"):
            path = endpoint[len("ipc://") :]
            if ".." in path.split("/"):
                return None, "a KV event ipc:// path that leaves the engine's own root (..): refused", True
            base = self.procfs.root_path(pid) if path.startswith("/") else self.procfs.cwd_path(pid)
            return f"ipc://{base}/{path.lstrip('/')}", "", False
        return None, f"{endpoint}: not reachable from another process", False

    def _tcp(self, endpoint: str, pid: int) -> tuple[str | None, str, bool]:
        if "*" not in endpoint and "::" not in endpoint:
            return None, f"{endpoint}: vLLM connects out to this endpoint (no wildcard), nothing to subscribe to", False
        port = port_number(endpoint.rpartition(":")[2])
        if port is None:
            return None, "a KV event endpoint without a port in 1..65535: refused", True
        addr = self.address(pid)
        if addr is None:
            return None, f"{endpoint}: no address found in the engine's network namespace", False
        return f"tcp://{addr}:{port}", "", False

    def http_host(self, host: str | None, pid: int) -> tuple[str | None, str, bool]:
        """Where to reach the HTTP server a process says it binds to ``host``: (address, note,
        refused); refused when the host is not the process's own to name."""
        if host is None or host in _WILDCARD_HOSTS:
            addr = self.address(pid)
            return addr, "" if addr else "no address found in the engine's network namespace", False
        ip = _address("127.0.0.1" if host == "localhost" else host)
        if ip is None:
            return None, "metrics --host is a name, not an address: never resolved, refused", True
        if ip.is_loopback:
            if self.same_netns(pid):
                return str(ip), "", False
            return None, f"metrics listen on {ip} inside another network namespace", False
        if ip in self.local(pid):
            return str(ip), "", False
        return None, f"metrics --host {ip} is not an address of the engine's network namespace: refused", True
