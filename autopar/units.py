"""Byte quantities as users write them (``1500000000``, ``512MiB``, ``1.5GiB``, ``40GB``)."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string with an optional unit (KiB/MiB/GiB/TiB, KB/MB/GB/TB)."""
    if isinstance(value, bool):
        raise TypeError(f"memory size {value!r}: expected bytes (int) or a string like '40GiB'")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory size {value!r}: expected a positive number of bytes")
        return int(value)
    if str(value).strip().startswith("-"):
        raise ValueError(f"memory size {value!r}: expected a positive size, e.g. 40GiB")
    m = _RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"memory size {value!r}: expected bytes or a number with a unit, e.g. 1500000000, 512MiB, 1.5GiB, 40GB"
        )
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"memory size {value!r}: expected a positive size")
    return n


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size (``1.50 GiB``); ``none`` for None."""
    if n is None:
        return "none"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_flops(n: float, per: str = "") -> str:
    """FLOPs with a decimal prefix (``7.04 TFLOP``; ``per="/s"``: ``312 TFLOP/s``)."""
    for prefix in ("", "k", "M", "G", "T", "P", "E"):
        if abs(n) < 1000 or prefix == "E":
            return f"{n:.3g} {prefix}FLOP{per}"
        n /= 1000
    return f"{n:.3g} EFLOP{per}"
