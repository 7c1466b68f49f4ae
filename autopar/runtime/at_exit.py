"""Release the runtime's collectives and process groups before the interpreter shuts down.

A compiled module keeps its mesh's process groups (``MeshGroups``) and, after a step whose loss nobody read, the
loss's collective in flight (``deferred``).  Left to the interpreter's finalization, gloo's objects are destroyed
while Python is being torn down: a work that still holds tensors then takes the GIL of a dead interpreter, and
the process aborts after the training finished ("terminate called without an active exception", SIGABRT;
pytorch/pytorch#179291 diagnoses it and proposes the same cure inside torch).  ``release`` runs at exit
(``atexit``, while the interpreter is whole, after the user's ``dist.destroy_process_group()``): it waits for
the loss collectives started and never read, then has every holder registered with ``hold_until_exit`` (a
pipeline's stages and schedule, and the groups of weights two stages share: ``compiled.pipeline_runner``) drop what
it holds, then drops every mesh's groups, so they are destroyed here.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import weakref

from .deferred import wait_pending
from .groups import release_all

__all__ = ["hold_until_exit", "release"]

_HOLDERS: weakref.WeakSet = weakref.WeakSet()


def hold_until_exit(holder) -> None:
    """Call ``holder.release()`` at exit, before the mesh's groups are dropped: for an object that keeps process
    groups (or objects holding them) of its own."""
    _HOLDERS.add(holder)


def release() -> None:
    """Finish the pending loss collectives and drop every holder's and every mesh's process groups
    (idempotent)."""
    with contextlib.suppress(Exception):  # a group already broken: nothing left to finish
        wait_pending()
    holders = list(_HOLDERS)
    for holder in holders:
        with contextlib.suppress(Exception):
            holder.release()
    meshes = release_all("the interpreter is exiting")
    if holders or meshes:  # what they held in reference cycles goes now, not in the interpreter's teardown
        gc.collect()  # (only then: a process that only planned has a large heap and nothing to drop; 25 s measured)


atexit.register(release)
