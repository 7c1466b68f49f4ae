"""Process groups shared by every mesh of this process: one ``dist.new_group`` per set of ranks, not one per compile.

torch keeps every group ``dist.new_group`` makes until ``dist.destroy_process_group``: dropping a compiled module
does not free its groups.  Each gloo group keeps a thread of its own that wakes every 10 ms (its TCP transport's
event loop polls with that timeout) and each nccl group a communicator with buffers on the GPU.  Groups made per
compile therefore pile up, and on CPU ranks they cost every later step: measured on the 2-core CI machine, 4 gloo
ranks, a step of 40 matmuls and an all-reduce took 171 ms with no other group alive and 216, 263 and 341 ms with
50, 100 and 200 idle ones (``scripts/idle_groups.py``).  ``autopar fidelity``, which calibrates and compiles a
dozen plans per case, had made 207 groups per rank by its seventh case, and timed its plans about twice as slow
as the same plans measured alone.  Megatron-LM makes its groups once per job for the same reasons.

``shared_groups(sets, device)``: each set is a partition of some of the world's ranks into lines (the lines of a
mesh axis); for each set, this rank's line's group, or None where it is in no line of it.  Collective over the
world: every rank calls it with the same sets in the same program order, as ``dist.new_group`` itself requires.

A set's groups are made once and then reused, but only when every rank can reuse them: a mesh shut down after a
failed call (``MeshGroups._shutdown``) destroys its groups on the ranks that saw the failure, and a rank that did
not would otherwise skip the ``dist.new_group`` calls the others make, and hang them.  So the ranks first agree, one
all-reduce (MIN) over the default group of one flag per set: 1 where this rank still holds the set's groups.  Sets
any rank lacks are made again on every rank, in the order given.  The cache belongs to the default group it was
made in: a new default group (``destroy_process_group`` then ``init_process_group``) starts it afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["clear", "forget", "shared_groups"]

Lines = tuple[tuple[int, ...], ...]

_GROUPS: dict[Lines, dist.ProcessGroup | None] = {}  # lines -> this rank's group among them (None: in none)
_WORLD: list = [None]  # the default group the cached groups were made in


def shared_groups(sets: Sequence[Sequence[Sequence[int]]], device: torch.device) -> list[dist.ProcessGroup | None]:
    """This rank's group of each set of lines of ranks (None where it is in none), made once per set and process
    (module docstring).  ``device``: where the default group's collectives run (``cuda:LOCAL_RANK`` on nccl)."""
    keys = [tuple(tuple(int(r) for r in line) for line in lines) for lines in sets]
    if _WORLD[0] is not dist.group.WORLD:
        _GROUPS.clear()
        _WORLD[0] = dist.group.WORLD
    held = torch.tensor([int(key in _GROUPS and _alive(_GROUPS[key])) for key in keys], dtype=torch.int32)
    held = held.to(device)
    if keys:
        dist.all_reduce(held, op=dist.ReduceOp.MIN)
    rank = dist.get_rank()
    out = []
    for key, everyone_holds in zip(keys, held.tolist()):
        if not everyone_holds:
            mine = None
            for line in key:  # every rank makes every line's group, in the same order
                group = dist.new_group(ranks=list(line))
                if rank in line:
                    mine = group
            _GROUPS[key] = mine
        out.append(_GROUPS[key])
    return out


def clear() -> None:
    """Drop this rank's references to the shared groups (``runtime.at_exit``: destroyed while the interpreter is
    whole); the next ``shared_groups`` call makes them again on every rank."""
    _GROUPS.clear()
    _WORLD[0] = None


def forget(groups: Sequence[dist.ProcessGroup]) -> None:
    """Drop this rank's cached references to ``groups`` (a mesh shutting them down: ``MeshGroups._shutdown``
    destroys them, and their connections close only when nothing holds them).  The sets they belonged to are made
    again by the next ``shared_groups`` call that asks for them, on every rank (the ranks agree first)."""
    for key in [k for k, g in _GROUPS.items() if g is not None and any(g is d for d in groups)]:
        del _GROUPS[key]


def _alive(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is still registered with torch (not destroyed); a rank in no line has nothing to lose."""
    if group is None:
        return True
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True
