"""Shared fixtures: tiny Hugging Face models built from configs (random weights, meta device)."""

from __future__ import annotations

import functools
import logging

import pytest

logging.getLogger("transformers").setLevel(logging.ERROR)


@functools.cache
def _model(name: str, batch: int, seq: int):
    from autopar.models import load_model

    return load_model(name, batch=batch, seq=seq)


@pytest.fixture
def tiny_model():
    """tiny_model(name, batch, seq) -> (model, args, kwargs) on the meta device (cached)."""
    return _model


def pytest_configure(config):
    # tests/dist_utils.py is imported by multi-rank tests as a plain module
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
