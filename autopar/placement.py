"""Placements: how one mesh axis lays out one tensor.

``Shard(dim)``, ``Replicate()`` and ``Partial("sum")`` are small immutable values
printed like DTensor's (``S(0)``, ``R``, ``P(sum)``) so logs, tests and plan JSON
read the same way.

``Shard(dim, blocks=b)`` is block-wise (strided) sharding: the dim is viewed as
``b`` equal blocks laid side by side (a fused qkv weight holds q, k and v), and
*each block* is split across the axis, so rank ``r`` owns the ``r``-th piece of
every block (whole heads of q, of k and of v).  Printed ``S(1)[3]``.

Uneven shards follow ``torch.tensor_split``: a dim of size ``n`` on ``k`` ranks
gives the first ``n % k`` ranks ``n // k + 1`` elements and the rest ``n // k``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "Shard",
    "Replicate",
    "Partial",
    "Placement",
    "parse_placement",
    "format_placements",
    "parse_placements",
    "shard_piece",
    "shard_sizes",
]


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor's ``dim`` is split across the axis (``blocks`` > 1: block-wise)."""

    dim: int
    blocks: int = 1

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard(dim={self.dim}): dim must be normalized to >= 0")
        if self.blocks < 1:
            raise ValueError(f"Shard(dim={self.dim}, blocks={self.blocks}): blocks must be >= 1")

    def __str__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim})[{self.blocks}]"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank of the axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class Partial:
    """Every rank holds a partial value; the full tensor is their reduction (``op``)."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in ("sum", "max"):
            raise ValueError(f"Partial(op={self.op!r}): expected 'sum' or 'max'")

    def __str__(self) -> str:
        return f"P({self.op})"

    __repr__ = __str__


Placement = Shard | Replicate | Partial

_SHARD_RE = re.compile(r"^S\((\d+)\)(?:\[(\d+)\])?$")
_PARTIAL_RE = re.compile(r"^P\((sum|max)\)$")


def parse_placement(text: str | Placement) -> Placement:
    """Parse the printed form (``R``, ``S(1)``, ``S(1)[3]``, ``P(sum)``) into a Placement."""
    if isinstance(text, (Shard, Replicate, Partial)):
        return text
    if not isinstance(text, str):
        raise TypeError(f"placement {text!r}: expected a str like 'R', 'S(0)' or 'P(sum)' or a Placement")
    t = text.strip()
    if t == "R":
        return Replicate()
    if m := _SHARD_RE.match(t):
        return Shard(int(m.group(1)), int(m.group(2) or 1))
    if m := _PARTIAL_RE.match(t):
        return Partial(m.group(1))
    raise ValueError(f"placement {text!r}: expected 'R', 'S(d)', 'S(d)[blocks]' or 'P(sum)'")


def parse_placements(items) -> tuple[Placement, ...]:
    """Parse a sequence of placements (strings or Placement objects), one per mesh axis."""
    if isinstance(items, str):
        items = [s for s in items.split(",") if s.strip()]
    return tuple(parse_placement(p) for p in items)


def format_placements(placements) -> list[str]:
    """Printed form of a placement tuple, one string per mesh axis."""
    return [str(p) for p in placements]


def shard_sizes(size: int, parts: int) -> list[int]:
    """Sizes of the ``parts`` pieces of a dim of ``size`` (``torch.tensor_split`` rule, ``shard_piece``)."""
    return [shard_piece(size, parts, i)[1] for i in range(parts)]


def shard_piece(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of ``shard_sizes(size, parts)``, in O(1): the first ``size % parts``
    pieces hold one element more.  (Meshes of thousands of devices price millions of local shapes: building the
    list of every piece for each was most of planning Llama 3 405B on (2, 4096).)"""
    base, extra = divmod(size, parts)
    return index * base + min(index, extra), base + (index < extra)
