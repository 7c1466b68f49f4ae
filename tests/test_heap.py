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


def test_release_collects_the_cycles_dropped_since_and_keeps_the_rest_frozen() -> None:
    """``FrozenHeap.release`` (after each mesh of a device count's plan): cyclic garbage made and dropped while
    frozen is collected at once, what is alive stays frozen."""
    with FrozenHeap() as heap:
        kept, dropped = _Node(), _Node()
        heap.keep()
        alive, gone = weakref.ref(kept), weakref.ref(dropped)
        del dropped
        gc.collect()
        assert gone() is not None  # frozen
        heap.release()
        assert gone() is None and alive() is kept and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_part_collects_its_cycles_at_its_end_and_freezes_only_what_the_parts_share() -> None:
    """``FrozenHeap.part`` (each mesh of a device count's plan): ``keep()`` inside it freezes nothing, so the part's
    cyclic garbage goes at its end; a shared ``keep`` freezes at once, and the part's garbage frozen with it goes at
    its end too (a full collection)."""
    with FrozenHeap() as heap:
        before = gc.get_freeze_count()
        with heap.part():
            dropped, kept = _Node(), _Node()
            heap.keep()
            assert gc.get_freeze_count() == before  # the part's own: not frozen
            gone, alive = weakref.ref(dropped), weakref.ref(kept)
            del dropped
        assert gone() is None and alive() is kept
        with heap.part():
            own, shared = _Node(), _Node()
            heap.keep(shared=True)
            assert gc.get_freeze_count() > before  # frozen when made, with what was alive
            gone, alive = weakref.ref(own), weakref.ref(shared)
            del own
            gc.collect()
            assert gone() is not None  # frozen with the shared object
        assert gone() is None and alive() is shared and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_device_count_plan_collects_each_meshs_garbage(monkeypatch) -> None:
    """``plan(devices=N)`` plans each mesh in a part of the heap, so its cyclic garbage goes before the next mesh
    (``mesh_choice.plan_devices``: the contexts and searches of meshes that lost were kept to the end, and 8,192
    devices ran out of memory)."""
    parts = []
    real = FrozenHeap.part
    monkeypatch.setattr(FrozenHeap, "part", lambda self: parts.append(1) or real(self))
    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16, overrides={"n_layer": 2})
    plan = autopar.plan(model, devices=4, example_inputs=args, example_kwargs=kwargs, profile="cpu")
    assert len(parts) == len(plan.meshes) >= 2 and gc.get_freeze_count() == 0
