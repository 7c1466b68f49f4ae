"""The CLI's argparse types: each flag's text read as its value, an error in the flag's words where it is not one
(``autopar/cli.py`` builds the parsers with them)."""

from __future__ import annotations

import argparse

from .units import parse_bytes

__all__ = [
    "FLAG_FAMILY",
    "bucket_arg",
    "bytes_arg",
    "family_arg",
    "mesh_shape",
    "microbatches_arg",
    "positive_float",
    "positive_int",
    "virtual_stages_arg",
]


def mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected sizes joined by 'x', e.g. 8 or 2x4") from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: every axis size must be >= 1")
    return shape


def bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def bucket_arg(text: str) -> int | None:
    """``--grad-bucket-bytes``: a size, or 0 for no buckets (None)."""
    return None if text.strip() in ("0", "none") else bytes_arg(text)


#: ``--family``'s words for ``autopar.planner.FAMILIES`` (``autopar run --family`` takes the same).
FLAG_FAMILY = {f.replace(" ", "-"): f for f in ("data parallel", "sharded parameters", "tensor parallel")}


def family_arg(text: str) -> str | None:
    if text == "auto":
        return None
    if text not in FLAG_FAMILY:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of auto, {', '.join(FLAG_FAMILY)}")
    return FLAG_FAMILY[text]


def _whole_at_least(text: str, least: int) -> int:
    if not text.strip().lstrip("+").isdigit() or int(text) < least:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= {least}")
    return int(text)


def positive_int(text: str) -> int:
    return _whole_at_least(text, 1)


def whole_number(text: str) -> int:
    return _whole_at_least(text, 0)


def microbatches_arg(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def virtual_stages_arg(text: str) -> int | str:
    if text == "auto":
        return text
    n = positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto or a whole number >= 2 (stages per rank)")
    return n


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return x
