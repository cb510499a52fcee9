"""Two network namespaces joined by a veth pair, and a tbf throttle on the link.

For the demo, the tests and the benchmark: a real network path between two KV-transfer
peers on one machine (netem is not built into every kernel; tbf is).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class NetlabError(Exception):
    pass


def ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise NetlabError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@dataclass(frozen=True, slots=True)
class Link:
    a: str  # namespace names
    b: str
    dev_a: str  # veth ends
    dev_b: str
    addr_a: str
    addr_b: str

    def throttle(self, rate: str, queue_latency: str = "2s") -> None:
        """Shape traffic leaving A (what A sends to B) to ``rate`` (e.g. "100mbit"). A queue
        deep enough for ``queue_latency`` slows TCP down rather than dropping its packets."""
        ip(
            "netns",
            "exec",
            self.a,
            "tc",
            "qdisc",
            "add",
            "dev",
            self.dev_a,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "32kb",
            "latency",
            queue_latency,
        )

    def release(self) -> None:
        ip("netns", "exec", self.a, "tc", "qdisc", "del", "dev", self.dev_a, "root")


@contextmanager
def veth_pair(prefix: str = "kvw", subnet: int = 98) -> Iterator[Link]:
    tag = f"{prefix}{os.getpid() % 10000}"
    link = Link(f"{tag}a", f"{tag}b", f"{tag}va"[:15], f"{tag}vb"[:15], f"10.{subnet}.0.1", f"10.{subnet}.0.2")
    ip("netns", "add", link.a)
    try:
        ip("netns", "add", link.b)
        try:
            ip("link", "add", link.dev_a, "type", "veth", "peer", "name", link.dev_b)
            for ns, dev, addr in ((link.a, link.dev_a, link.addr_a), (link.b, link.dev_b, link.addr_b)):
                ip("link", "set", dev, "netns", ns)
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                ip("-n", ns, "link", "set", "lo", "up")
            yield link
        finally:
            ip("netns", "del", link.b)
    finally:
        ip("netns", "del", link.a)


@dataclass(frozen=True, slots=True)
class Pod:
    """A network namespace reachable from the host over a veth pair, like a Kubernetes pod."""

    netns: str
    host_dev: str
    host_addr: str
    pod_addr: str


@contextmanager
def pod_netns(prefix: str = "kvp", subnet: int = 97) -> Iterator[Pod]:
    tag = f"{prefix}{os.getpid() % 10000}"
    pod = Pod(tag, f"{tag}h"[:15], f"10.{subnet}.0.1", f"10.{subnet}.0.2")
    ip("netns", "add", pod.netns)
    try:
        ip("link", "add", pod.host_dev, "type", "veth", "peer", "name", f"{tag}p"[:15])
        try:
            ip("link", "set", f"{tag}p"[:15], "netns", pod.netns)
            ip("addr", "add", f"{pod.host_addr}/24", "dev", pod.host_dev)
            ip("link", "set", pod.host_dev, "up")
            ip("-n", pod.netns, "addr", "add", f"{pod.pod_addr}/24", "dev", f"{tag}p"[:15])
            ip("-n", pod.netns, "link", "set", f"{tag}p"[:15], "up")
            ip("-n", pod.netns, "link", "set", "lo", "up")
            yield pod
        finally:
            subprocess.run(["ip", "link", "del", pod.host_dev], capture_output=True, check=False)
    finally:
        ip("netns", "del", pod.netns)
