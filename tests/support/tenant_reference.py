"""An independent per-tenant count of a KV event stream: plain dicts, nothing bounded, nothing
shared with kvwatch's counting (``daemon/engines``), as a ground truth for it.

Events are dicts as vLLM's classes give them (``msgspec.structs.asdict``), or the lab encoder's.
The rules are vLLM's: a request's cache salt is the last string of its first block's extra
keys, an adapter's name is ``lora_name``; a block after a parent is its parent's tenant; a CPU
block is the tenant of the GPU block of the same hash. A GPU store without a parent whose last
block the group holds is a prefix hit announced again (not a store). Only each medium's
reference group counts: the lowest group of a whole-prefix kind, else the lowest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

FULL = {None, "", "full_attention", "mla_attention", "sink_full_attention"}
FIELDS = ("stored", "removed", "removed_young", "regretted", "regret_tokens", "cleared")


@dataclass
class _Group:
    held: dict[Any, list[Any]] = field(default_factory=dict)  # hash -> [tenant, stored at, copies]
    gone: dict[Any, str] = field(default_factory=dict)  # hash -> tenant, removed


class TenantReference:
    def __init__(self, name: Callable[[str | None, str | None], str], thrash_seconds: float) -> None:
        self.name = name  # (salt, lora) -> the tenant's name, as kvwatch is configured to name it
        self.thrash = thrash_seconds
        self.groups: dict[tuple[str, int], _Group] = {}
        self.kinds: dict[tuple[str, int], str | None] = {}
        self.tenant_of: dict[Any, str] = {}
        self.counts: dict[tuple[str, str], dict[str, int]] = {}  # (medium, tenant) -> FIELDS

    def _ref(self, medium: str) -> int:
        """A tier below the pool has the pool's groups, whose kinds the pool's events tell."""
        idx = sorted(g for m, g in self.groups if m == medium)
        return next((g for g in idx if self.kinds.get(("GPU", g)) in FULL), idx[0])

    def _count(self, medium: str, tenant: str, what: str, n: int = 1) -> None:
        c = self.counts.setdefault((medium, tenant), dict.fromkeys(FIELDS, 0))
        c[what] += n

    def batch(self, ts: float, events: Iterable[Mapping[str, Any]]) -> None:
        for ev in events:
            kind = ev.get("type") or type(ev).__name__
            if kind == "AllBlocksCleared":
                self._clear()
                continue
            medium, idx = ev.get("medium") or "GPU", ev.get("group_idx") or 0
            key = (medium, idx)
            g = self.groups.setdefault(key, _Group())
            if kind == "BlockStored" and ev.get("kv_cache_spec_kind") is not None:
                self.kinds.setdefault(key, ev["kv_cache_spec_kind"])
            counted = idx == self._ref(medium)
            if kind == "BlockStored":
                self._store(ev, g, medium, ts, counted)
            elif kind == "BlockRemoved":
                self._remove(ev, g, medium, ts, counted)

    def _tenant(self, ev: Mapping[str, Any], medium: str) -> str:
        hashes, parent, lora = ev["block_hashes"], ev.get("parent_block_hash"), ev.get("lora_name")
        if medium == "GPU" and parent is None:
            extra = (ev.get("extra_keys") or [None])[0] or []
            salts = [x for x in extra if isinstance(x, str) and x != lora]
            salt = salts[-1] if salts else None
            return self.name(salt, lora) if salt is not None or lora is not None else "default"
        if medium != "GPU" and hashes and hashes[0] in self.tenant_of:
            return self.tenant_of[hashes[0]]
        if parent is not None and parent in self.tenant_of:
            return self.tenant_of[parent]
        return self.name(None, lora) if lora is not None else "unknown"

    def _store(self, ev: Mapping[str, Any], g: _Group, medium: str, ts: float, counted: bool) -> None:
        hashes = ev["block_hashes"]
        if medium == "GPU" and ev.get("parent_block_hash") is None and hashes and hashes[-1] in g.held:
            return  # a prefix hit announced again
        tenant = self._tenant(ev, medium)
        for h in hashes:
            self.tenant_of.setdefault(h, tenant)
            if h in g.gone:
                was = g.gone.pop(h)
                if counted:
                    self._count(medium, was, "regretted")
                    self._count(medium, was, "regret_tokens", ev["block_size"])
            if h in g.held:
                g.held[h][1:] = [ts, g.held[h][2] + 1]
                g.held[h][0] = tenant
            else:
                g.held[h] = [tenant, ts, 1]
        if counted:
            self._count(medium, tenant, "stored", len(hashes))

    def _remove(self, ev: Mapping[str, Any], g: _Group, medium: str, ts: float, counted: bool) -> None:
        for h in ev["block_hashes"]:
            entry = g.held.get(h)
            if entry is None:  # removed again without a store between: the first removal's mark stays
                g.gone.setdefault(h, "default")
                if counted:
                    self._count(medium, "unknown", "removed")
                continue
            tenant, at, copies = entry
            if copies > 1:
                entry[2] -= 1
            else:
                del g.held[h]
                g.gone[h] = tenant
            if counted:
                self._count(medium, tenant, "removed")
                if ts - at < self.thrash:
                    self._count(medium, tenant, "removed_young")

    def _clear(self) -> None:
        for (medium, idx), g in self.groups.items():
            if idx == self._ref(medium):
                for tenant, _, _ in g.held.values():
                    self._count(medium, tenant, "cleared")
            g.held.clear()
            g.gone.clear()

    def resident(self, medium: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for tenant, _, _ in self.groups.get((medium, self._ref(medium)), _Group()).held.values():
            out[tenant] = out.get(tenant, 0) + 1
        return out
