"""Sharding strategy rules, one module per op family (see ``base`` for the contract)."""

from __future__ import annotations

import importlib

from .base import AxisStrategy, OpCall, OpComm, OpStrategy, expand_to_mesh, register, rule_for

__all__ = ["AxisStrategy", "OpCall", "OpComm", "OpStrategy", "expand_to_mesh", "register", "rule_for"]

#: Every rule module; importing one registers its rules.
RULE_MODULES = (
    "matmul",
    "conv",
    "pointwise",
    "reductions",
    "norms",
    "views",
    "embedding",
    "attention",
    "misc",
    "hints",
)


def _import_rule_modules() -> bool:
    for name in RULE_MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:  # a family not written yet: its ops fall back
            if e.name != f"{__name__}.{name}":
                raise
    return True


_load_rules = _import_rule_modules()
