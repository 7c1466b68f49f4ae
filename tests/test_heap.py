"""The collector kept off what planning built (``autopar.planner.heap``): frozen while planning, handed back after,
cyclic garbage made meanwhile collected, and a process's own frozen objects left frozen."""

from __future__ import annotations

import gc
import itertools
import weakref

import autopar
from autopar.models import load_model
from autopar.planner.heap import FrozenHeap


class _Node:
    def __init__(self) -> None:
        self.other = self  # a cycle: only the collector frees it


def test_what_is_kept_is_frozen_until_exit_and_cycles_made_meanwhile_are_collected_after() -> None:
    assert gc.get_freeze_count() == 0
    with FrozenHeap() as heap:
        node = _Node()
        heap.keep()
        assert gc.get_freeze_count() > 0
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is not None  # frozen: not collected while planning
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None


def test_a_process_that_froze_its_own_objects_is_left_as_it_was() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with FrozenHeap() as heap:
            heap.keep()
            assert not heap.active
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_a_disabled_collector_is_left_off() -> None:
    gc.disable()
    try:
        with FrozenHeap() as heap:
            heap.keep()
            assert not heap.active and gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_planning_hands_the_heap_back() -> None:
    """``autopar.plan`` (with and without micro-batches) freezes while it works and leaves nothing frozen."""
    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16, overrides={"n_layer": 2})
    seen = []
    calls = itertools.count()

    def sample(phase, info) -> None:  # gc.get_freeze_count walks the frozen objects: every 16th collection's start
        if phase == "start" and next(calls) % 16 == 0:
            seen.append(gc.get_freeze_count())

    gc.callbacks.append(sample)
    try:
        # micro-batched: one pipeline candidate and the plan without (the micro-batched path, PipelineChoice, and
        # its shared heap; pipeline="auto"'s other candidates take the same path)
        for pipeline, micro in (("none", {}), ("auto", {"microbatches": 2, "schedule": "1f1b"})):
            autopar.plan(
                model,
                autopar.Mesh((2,)),
                example_inputs=args,
                example_kwargs=kwargs,
                profile="cpu",
                pipeline=pipeline,
                **micro,
            )
            assert gc.get_freeze_count() == 0
    finally:
        gc.callbacks.pop()
    assert max(seen, default=0) > 0  # collections ran while objects were frozen
