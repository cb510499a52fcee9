"""One medium of one KV event stream, by KV cache group.

A hybrid model keeps one KV cache group per attention kind (vLLM: a full-attention group and
several sliding-window groups for Gemma 3, gpt-oss; Mamba and attention groups for Qwen3-Next),
each with its own physical blocks in one shared pool, and vLLM announces every block range once
per group with ``group_idx``. The same block hash in two groups is two blocks: every memory of a
block (``blocks.py``) is kept per (stream, medium, group).

The medium's *logical* counts follow one group, its reference: the lowest-index group of a kind
that holds a request's whole prefix (``FULL_KINDS``; one whose kind the engine has not said yet
counts as one), else the lowest-index group (a model with sliding-window attention only). A
single-group engine's logical counts are its only group's, as they always were. When a lower
full-kind group appears later, the logical counts follow it from then on and stay monotonic;
so do each tenant's (``tenants.py``), which are the reference group's too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvwatch.daemon.engines.blocks import MediumBlocks
from kvwatch.daemon.model.engines import FULL_KINDS, OTHER_GROUP, GroupTotals, MediumTotals

if TYPE_CHECKING:
    from kvwatch.daemon.engines.memory_budget import StreamPlan

MAX_GROUPS = 16  # per medium; more are counted together as OTHER_GROUP
# per stream (two media's worth: the GPU pool's and a lower tier's every group); past it a
# medium's further groups count as its OTHER_GROUP. Every group is memories, counters per tenant
# and rows in each snapshot: a publisher naming 9 media x 17 groups would multiply them all.
MAX_STREAM_GROUPS = 2 * (MAX_GROUPS + 1)
MAX_KIND_CHARS = 40


def _part(bound: int, n: int) -> int:
    """One of ``n`` shares of a bound; never 0 (a memory turned off) unless the bound is."""
    return max(bound // n, 1) if bound > 0 else 0


def group_key(idx: int | None) -> int:
    """The group an event names: its ``group_idx``, or 0 where it names none (a single-group
    engine, vLLM before 0.26) or a negative one."""
    return idx if isinstance(idx, int) and idx >= 0 else 0


class MediumGroups:
    __slots__ = (
        "_offset",
        "_ref",
        "_ref_at",
        "_t_offset",
        "_t_ref_at",
        "bounds",
        "groups",
        "kinds",
        "like",
        "locality",
        "plan",
        "windows",
    )

    def __init__(
        self, bounds: tuple[int, int], like: MediumGroups | None = None, plan: StreamPlan | None = None
    ) -> None:
        self.bounds = bounds  # store times, removals remembered (``_rebalance``), set by the stream's plan
        # the stream's (``memory_budget.py``): its groups counted across media, its part split again
        self.plan = plan
        # a tier below the GPU pool holds the same groups (its group_idx is the pool's) and says
        # nothing of their kinds (the offloading connector's placeholders): the pool's say it
        self.like = like
        self.groups: dict[int, MediumBlocks] = {}
        self.kinds: dict[int, str] = {}
        self.windows: dict[int, int] = {}
        self.locality = ""
        self._ref: int | None = None
        self._offset = MediumTotals()  # logical counts up to the reference's last change
        self._ref_at = MediumTotals()  # the reference's counts at that change
        self._t_offset: dict[int, MediumTotals] = {}  # the same, per tenant tag
        self._t_ref_at: dict[int, MediumTotals] = {}

    def group(self, idx: int | None) -> MediumBlocks:
        g = self.groups.get(0 if idx is None else idx)  # the per-event path: a known group
        if g is not None:
            return g
        key = group_key(idx)
        g = self.groups.get(key)
        if g is None:
            if len(self.groups) >= MAX_GROUPS or (self.plan is not None and not self.plan.room(MAX_STREAM_GROUPS)):
                key = OTHER_GROUP
                g = self.groups.get(key)
            if g is None:
                g = self.groups[key] = MediumBlocks(*self.bounds)
                self.choose(force=True)
                if self.plan is not None:
                    self.plan.apply()  # a medium's second group doubles what it holds
        return g

    @property
    def grouped(self) -> bool:
        """More than one group: the others hold one more bound beside the reference's."""
        return len(self.groups) > 1

    def set_bounds(self, bounds: tuple[int, int]) -> None:
        if bounds != self.bounds:
            self.bounds = bounds
            if self._ref is not None:
                self._rebalance()

    def _rebalance(self) -> None:
        """The reference group remembers as much as a single-group medium would; the others share
        one more such bound between them (a hybrid's window groups mirror each other, and their
        blocks leave young by design): at most twice a single group's memory per medium."""
        others = max(len(self.groups) - 1, 1)
        stored, removed = self.bounds
        for k, g in self.groups.items():
            if k == self._ref:
                g.resize(stored, removed)
            else:
                g.resize(_part(stored, others), _part(removed, others))

    def learn(self, idx: int | None, kind: str | None, window: int | None, locality: str | None) -> bool:
        """What a BlockStored says of its group (and where the medium lives); True when it told a
        group's kind for the first time (or a new one)."""
        if locality and locality != self.locality and len(locality) <= MAX_KIND_CHARS:
            self.locality = locality
        key = group_key(idx)
        if kind is None or key not in self.groups or self.kinds.get(key) == kind:
            return False
        self.kinds[key] = kind if len(kind) <= MAX_KIND_CHARS and kind.isprintable() else "unknown"
        if window:
            self.windows[key] = window
        self.choose()
        return True

    def kind(self, idx: int) -> str:
        k = self.kinds.get(idx)
        if k is None and self.like is not None:
            return self.like.kinds.get(idx, "")
        return k or ""

    def is_full(self, idx: int) -> bool:
        return self.kind(idx) in FULL_KINDS

    def choose(self, *, force: bool = False) -> None:
        """The reference: the lowest-index group of a whole-prefix kind, else the lowest."""
        idx = sorted(k for k in self.groups if k != OTHER_GROUP) or [OTHER_GROUP]
        ref = next((k for k in idx if self.is_full(k)), idx[0])
        if ref == self._ref:
            if force:
                self._rebalance()
            return
        if self._ref is not None:
            self._offset = self.logical()
            self._t_offset = self.logical_tenants()
        self._ref = ref
        self._ref_at = self.groups[ref].totals()
        self._t_ref_at = self.groups[ref].tenant_totals()
        self._rebalance()

    @property
    def reference(self) -> int:
        return self._ref if self._ref is not None else 0

    def logical(self) -> MediumTotals:
        if self._ref is None:
            return MediumTotals()
        now = self.groups[self._ref].totals()
        return replace(self._offset + (now - self._ref_at), resident=now.resident)

    def logical_tenants(self) -> dict[int, MediumTotals]:
        """Per tenant tag, the reference group's counts (``logical``'s, per tenant)."""
        if self._ref is None:
            return {}
        now = self.groups[self._ref].tenant_totals()
        out: dict[int, MediumTotals] = {}
        for tag in sorted(now.keys() | self._t_offset.keys()):
            n = now.get(tag, MediumTotals())
            since = n - self._t_ref_at.get(tag, MediumTotals())
            out[tag] = replace(self._t_offset.get(tag, MediumTotals()) + since, resident=n.resident)
        return out

    def totals(self, medium: str, tenants: Sequence[str] | None = None) -> list[GroupTotals]:
        """Every group's; with the stream's tenant names (by tag), each group's per tenant too."""
        ref = self.reference
        return [
            GroupTotals(
                medium,
                k,
                self.kind(k),
                self._window(k),
                k == ref,
                g.totals(),
                {tenants[t]: m for t, m in g.tenant_totals().items()} if tenants else {},
            )
            for k, g in sorted(self.groups.items())
        ]

    def _window(self, idx: int) -> int | None:
        w = self.windows.get(idx)
        if w is None and self.like is not None and idx not in self.kinds:
            return self.like.windows.get(idx)
        return w

    @property
    def remembered(self) -> int:
        return sum(g.remembered for g in self.groups.values())

    @property
    def held_bytes(self) -> int:
        return sum(g.held_bytes for g in self.groups.values())

    def regret_horizon(self, now: float) -> float:
        """The reference group's: seconds back from ``now`` within which its removals are all
        remembered (0 before its first removal)."""
        g = self.groups.get(self._ref) if self._ref is not None else None
        return g.regret_horizon(now) if g is not None else 0.0

    def drop_all(self) -> None:
        for g in self.groups.values():
            g.drop_all()

    def clear(self) -> None:
        for g in self.groups.values():
            g.clear()
