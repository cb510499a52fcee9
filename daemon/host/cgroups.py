"""Container and pod identity from ``/proc/PID/cgroup`` lines, or from a cgroup's path.

Handles cgroup v1 and v2, cgroupfs and systemd drivers, docker, containerd
(cri-containerd), CRI-O and podman naming. The pod *name* is not in the cgroup
path; the caller may take it from the process's ``HOSTNAME`` (Kubernetes sets it
to the pod name) when the pod UID was found here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_CONTAINER = re.compile(
    r"(?:docker|cri-containerd|crio|libpod|containerd)[-:]([0-9a-f]{64})(?:\.scope)?$"
    r"|/([0-9a-f]{64})(?:\.scope)?$"
)
_POD_CGROUPFS = re.compile(r"/pod([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(?:/|$)")
_POD_SYSTEMD = re.compile(r"-pod([0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12})\.slice")


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    container_id: str = ""  # short (12 hex) id, "" when not in a container
    pod_uid: str = ""
    path: str = ""  # the unified (v2) path, or the memory controller's (v1)
    memory_path: str = ""  # the memory controller's path (v1), else the unified one
    unified_path: str = ""  # the cgroup v2 path ("" when the host has no unified hierarchy)


def _container_of(path: str) -> str:
    m = _CONTAINER.search(path.rstrip("/"))
    return (m.group(1) or m.group(2))[:12] if m else ""


def _pod_of(path: str) -> str:
    m = _POD_CGROUPFS.search(path)
    if m:
        return m.group(1)
    m = _POD_SYSTEMD.search(path)
    return m.group(1).replace("_", "-") if m else ""


def parse_cgroup(lines: Iterable[str]) -> CgroupIdentity:
    unified = memory = any_path = ""
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, path = parts
        any_path = any_path or path
        if controllers == "":
            unified = path
        if "memory" in controllers.split(","):
            memory = path
    chosen = unified or memory or any_path
    candidates = [p for p in (chosen, memory, unified, any_path) if p]
    container = next((c for c in map(_container_of, candidates) if c), "")
    pod = next((p for p in map(_pod_of, candidates) if p), "")
    return CgroupIdentity(
        container_id=container,
        pod_uid=pod,
        path=chosen,
        memory_path=memory or unified,
        unified_path=unified,
    )


def identity_of_path(path: str) -> CgroupIdentity:
    """Container and pod of a cgroup v2 path (a reclaiming task's cgroup, found by its id)."""
    return CgroupIdentity(
        container_id=_container_of(path),
        pod_uid=_pod_of(path),
        path=path,
        memory_path=path,
        unified_path=path,
    )
