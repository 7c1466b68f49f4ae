"""The cyclic garbage collector kept off what planning has already built.

Planning builds millions of long-lived objects (captured graphs, strategies, cost tables) and Python's collector
traverses every one of them at each full collection: measured on a 96-layer GPT-shaped model on 4 x 8 x 8 with
``pipeline="auto"`` (28 candidates), 24 s of a 150 s plan were collections, 15 s of it 17 full ones.
:class:`FrozenHeap` moves what is alive at each :meth:`FrozenHeap.keep` (after a capture and its strategies) into
the collector's permanent generation (``gc.freeze``), so later collections traverse only what planning makes after
it, and hands it all back at exit (``gc.unfreeze``): cyclic garbage made while frozen is collected after the plan,
not during it.  A plan that makes and drops much such garbage in parts (each mesh of a device count,
``mesh_choice.plan_devices``) hands it back after each part (:meth:`FrozenHeap.release`): planning Llama 3 405B for
8,192 devices kept every mesh's contexts and searches until the end, and was killed at 24 GB after 20 of its 79
meshes.  A release walks every object, frozen or not (1.2-2.5 s a mesh there), so it may be asked to collect only
once the resident set has grown by a given amount since the last collection (``after_growth``): memory the last
collection freed is used again before the process grows, so a part whose garbage fits in it costs no walk.
A process that froze objects itself (``gc.get_freeze_count() > 0`` at entry, a pre-fork server say) or turned the
collector off is left as it is.
"""

from __future__ import annotations

import gc
import os

__all__ = ["FrozenHeap", "resident_bytes"]


def resident_bytes() -> int | None:
    """The process's resident set now, in bytes (``/proc/self/statm``); None where the system does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class FrozenHeap:
    """``with FrozenHeap() as heap: ... heap.keep() ...``: see the module docstring.  Nested uses leave the
    outermost in charge (the inner one finds objects frozen already and does nothing)."""

    def __init__(self) -> None:
        self.active = False
        self.collected_at: int | None = None  # resident bytes after the last collection (None: none yet)

    def __enter__(self) -> FrozenHeap:
        self.active = gc.isenabled() and gc.get_freeze_count() == 0
        self.collected_at = resident_bytes()
        return self

    def keep(self) -> None:
        """Everything alive now is kept out of the collections until exit."""
        if self.active:
            gc.freeze()

    def release(self, after_growth: int = 0) -> bool:
        """The cyclic garbage made since entry collected now: everything frozen handed back, one full collection,
        and what is still alive kept again; with ``after_growth``, only if the resident set grew by at least that
        many bytes since the last collection (or entry), or the system does not say how large it is.  Whether it
        collected."""
        if not self.active:
            return False
        now = resident_bytes()
        if (
            after_growth
            and now is not None
            and self.collected_at is not None
            and now - self.collected_at < after_growth
        ):
            return False
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.collected_at = resident_bytes()
        return True

    def __exit__(self, *exc) -> None:
        if self.active:
            gc.unfreeze()
