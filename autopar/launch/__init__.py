"""``autopar run``: train a compiled model on local ranks (or under torchrun) and check it against one device.

``models`` finds what to train (built-in names from ``configs/models/``, or a user's
factory), ``runner`` trains it on every rank and compares outputs, gradients and
parameters with one device.
"""

from __future__ import annotations

from .models import builtin_models, default_seq, load_model, max_positions, model_config
from .runner import LaunchError, RunConfig, render_report, run

__all__ = [
    "LaunchError",
    "RunConfig",
    "builtin_models",
    "default_seq",
    "load_model",
    "max_positions",
    "model_config",
    "render_report",
    "run",
]
