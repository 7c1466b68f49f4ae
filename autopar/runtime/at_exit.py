"""Release the runtime's collectives and process groups before the interpreter shuts down.

A compiled module keeps its mesh's process groups (``MeshGroups``) and, after a step whose loss nobody read, the
loss's collective in flight (``deferred``).  Left to the interpreter's finalization, gloo's objects are destroyed
while Python is being torn down: a work that still holds tensors then takes the GIL of a dead interpreter, and
the process aborts after the training finished ("terminate called without an active exception", SIGABRT;
pytorch/pytorch#179291 diagnoses it and proposes the same cure inside torch).  ``release`` runs at exit
(``atexit``, while the interpreter is whole, after the user's ``dist.destroy_process_group()``): it waits for
the loss collectives started and never read, then drops every mesh's groups, so they are destroyed here.
"""

from __future__ import annotations

import atexit
import contextlib

from .deferred import wait_pending
from .groups import release_all

__all__ = ["release"]


def release() -> None:
    """Finish the pending loss collectives and drop every mesh's process groups (idempotent)."""
    with contextlib.suppress(Exception):  # a group already broken: nothing left to finish
        wait_pending()
    release_all("the interpreter is exiting")


atexit.register(release)
