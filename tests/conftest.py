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


#: Tests that each take a minute or more on the 2-core machine (``pytest --durations``, 2026-11-28): pages of the
#: documentation that launch ranks, two torchrun launches.  Run first, they leave two workers (``-n 2``) the short
#: tests to share at the end (longest first: xdist's load scheduler hands out tests in collection order), instead
#: of one worker finishing a long test while the other idles.
LONGEST_FIRST = (
    "tests/test_docs.py::",
    "tests/test_multinode.py::",
    "tests/test_mesh_choice.py::test_compile_with_the_world_size",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within each group is kept
