"""``autopar run``: train a compiled model on local ranks (or under torchrun) and check it against one device.

``runner`` trains a model (``autopar.models`` finds it: a built-in name or a user's
factory) on every rank and compares outputs, gradients and parameters with one
device (``one_device_check``); ``run_report`` renders what it found; ``resume`` checks a checkpoint can be
replayed; ``progress`` is the terminal progress bar the CLI and calibration draw.
"""

from __future__ import annotations

from .progress import TerminalProgress
from .resume import check_replayable, resolve_checkpoint, saved_step
from .run_report import render_report
from .runner import LaunchError, RunConfig, run

__all__ = [
    "LaunchError",
    "TerminalProgress",
    "check_replayable",
    "RunConfig",
    "render_report",
    "resolve_checkpoint",
    "run",
    "saved_step",
]
