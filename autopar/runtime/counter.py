"""Collective counter: what the runtime actually issued, to compare with the plan's list.

Each record is the *semantic* collective of one transition step (``transitions``'s
``kind``), its mesh axis, the phase (``"forward"``/``"backward"``) and the bytes the
plan charges for it.  A step the backend emulates (``reduce_scatter`` as all-reduce
plus local slice on gloo) is still recorded once, as the planned collective with
the planned bytes, so run-time counts equal plan counts whatever the backend.
Free local steps (slice, mask) are not recorded.  A cross-mesh reshard
(``resharding.py``) records each point-to-point message a rank sends as a ``"send"``
on axis ``-1`` (between meshes), phase ``"reshard"``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["CollectiveRecord", "CollectiveCounter"]


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective issued on one mesh axis (a tuple: over several axes' groups flattened into one)."""

    kind: str
    axis: int | tuple[int, ...]
    phase: str
    bytes: int
    reduce_op: str = "sum"


@dataclass(slots=True)
class CollectiveCounter:
    """Mutable log of ``CollectiveRecord``s, in issue order; ``enabled=False`` pauses it."""

    records: list[CollectiveRecord] = field(default_factory=list)
    enabled: bool = True

    def record(self, kind: str, axis: int | tuple[int, ...], phase: str, bytes: int, reduce_op: str = "sum") -> None:
        """Append one record (no-op while disabled)."""
        if self.enabled:
            axis = tuple(int(a) for a in axis) if isinstance(axis, tuple) else int(axis)
            self.records.append(CollectiveRecord(kind, axis, phase, int(bytes), reduce_op))

    def clear(self) -> None:
        self.records.clear()

    def summary(self) -> Counter:
        """Counts per ``(kind, axis, phase)``."""
        return Counter((r.kind, r.axis, r.phase) for r in self.records)

    def total_bytes(self, phase: str | None = None) -> int:
        """Bytes over all records (of one phase when given)."""
        return sum(r.bytes for r in self.records if phase is None or r.phase == phase)

    def __len__(self) -> int:
        return len(self.records)
