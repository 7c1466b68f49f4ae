"""The cyclic garbage collector kept off what planning has already built.

Planning builds millions of long-lived objects (captured graphs, strategies, cost tables) and Python's collector
traverses every one of them at each full collection: measured on a 96-layer GPT-shaped model on 4 x 8 x 8 with
``pipeline="auto"`` (28 candidates), 24 s of a 150 s plan were collections, 15 s of it 17 full ones.
:class:`FrozenHeap` moves what is alive at each :meth:`FrozenHeap.keep` (after a capture and its strategies) into
the collector's permanent generation (``gc.freeze``), so later collections traverse only what planning makes after
it, and hands it all back at exit (``gc.unfreeze``): cyclic garbage made while frozen is collected after the plan,
not during it.

A plan that makes and drops much such garbage in parts (each mesh of a device count, ``mesh_choice.plan_devices``)
plans each part inside :meth:`FrozenHeap.part`: planning Llama 3 405B for 8,192 devices kept every mesh's contexts
and searches until the end, and was killed at 24 GB after 20 of its 79 meshes.  Inside a part, :meth:`keep` freezes
nothing (what the part builds is its own, garbage at its end but for the plan it returns) and no automatic full
collection runs (each would walk the part's contexts again: ``no_full_collections``; the young generations are still
collected), so the part's end collects it with one collection of the objects not frozen: the part's, not the
interpreter's modules and the captures frozen before it.  What the parts share (a capture, ``keep(shared=True)``) is
frozen when made, with whatever else is alive then; a part that froze so ends with a full collection instead
(:meth:`release`: everything handed back, collected, frozen again).  Measured on Llama 3 405B at 16,384 devices: the
full collection after each mesh took 1.6-3.7 s (92 meshes); four meshes, one after another, spent 11.9 s in
collections as parts with automatic full collections and 6.8 s without them, at a peak RSS of 1.54 and 1.82 GiB.

A process that froze objects itself (``gc.get_freeze_count() > 0`` at entry, a pre-fork server say) or turned the
collector off is left as it is.
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["FrozenHeap", "no_full_collections"]


class FrozenHeap:
    """``with FrozenHeap() as heap: ... heap.keep() ...``: see the module docstring.  Nested uses leave the
    outermost in charge (the inner one finds objects frozen already and does nothing)."""

    def __init__(self) -> None:
        self.active = False
        self.in_part = False  # inside ``part``: keep() freezes only what the parts share
        self.froze_in_part = False  # a shared keep() froze the part's own objects too

    def __enter__(self) -> FrozenHeap:
        self.active = gc.isenabled() and gc.get_freeze_count() == 0
        return self

    def keep(self, shared: bool = False) -> None:
        """Everything alive now is kept out of the collections until exit; inside a part only where ``shared``
        (what later parts read: a capture), the part's own objects then with it (module docstring)."""
        if not self.active or (self.in_part and not shared):
            return
        gc.freeze()
        if self.in_part:
            self.froze_in_part = True

    @contextlib.contextmanager
    def part(self):
        """``with heap.part(): ...``: the body's garbage collected at its end (module docstring)."""
        if not self.active or self.in_part:  # nested: the outer part collects
            yield
            return
        self.in_part, self.froze_in_part = True, False
        try:
            with no_full_collections():  # the part's objects are not frozen: not walked again and again
                yield
        finally:
            self.in_part = False
            if self.froze_in_part:
                self.release()
            else:
                gc.collect()

    def release(self) -> None:
        """The cyclic garbage made since entry collected now: everything frozen handed back, one full collection,
        and what is still alive kept again."""
        if self.active:
            gc.unfreeze()
            gc.collect()
            gc.freeze()

    def __exit__(self, *exc) -> None:
        if self.active:
            gc.unfreeze()


@contextlib.contextmanager
def no_full_collections():
    """Python's cyclic GC without automatic full collections (young generations still collected).

    Tracing and pricing a deep model make millions of long-lived objects, and each
    automatic full collection walks every object in the process: six of them came
    in a 96-layer prepare, about 2 s of its 8.  The thresholds are restored on the
    way out, so the collector runs as before afterwards.
    """
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*before)
