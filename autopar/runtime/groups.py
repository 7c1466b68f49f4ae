"""Process groups for a device mesh: one ``torch.distributed`` group per (mesh axis, axis group).

``MeshGroups(mesh)`` is built on every rank inside an initialized default process
group whose world size is ``mesh.size``.  It creates, on every rank and in the same
order, one group per line of ranks along each mesh axis (``Mesh.axis_groups``) —
``dist.new_group`` is collective over the whole world, so skipping a group on one
rank would hang the others — and keeps the groups this rank belongs to.

Group rank vs axis coordinate: ``dist.new_group`` numbers a group's members in
sorted global-rank order, which differs from their coordinate along the axis on a
permuted mesh (``Mesh(..., ranks=...)``).  Collectives return pieces in group-rank
order; ``axis_order(axis)`` gives, for each group rank, the member's axis
coordinate so callers can put pieces back in mesh order.

Failing fast (``fail`` / ``collectives``): a rank that cannot make a call its
peers are making (bad input found before the first collective) must not leave
them waiting in a collective until the process group's timeout.  gloo's
``ProcessGroup.abort()`` does not close a group's connections in torch 2.13 (a
blocked peer still waits), but dropping the last reference to a group after
``dist.destroy_process_group(group)`` does: every peer blocked on it then fails
at once with "Connection closed by peer".  So the failing rank writes its reason
to the default group's store and waits ``FAIL_GRACE_S`` for every other rank to
report the same call failed (bad input given to every rank: nobody waits, the
groups stay usable); if some rank did not, it shuts this mesh's groups down.  A
rank whose collective then breaks (``collectives``) reads the reason from the
store, shuts its own groups down (so ranks blocked on *its* groups follow) and
raises it.  A mesh shut down this way refuses further collectives
(``check_alive``): compile again.

``init_distributed()`` initializes the default group from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``): nccl with
one GPU per rank (``cuda:LOCAL_RANK``) when CUDA is available, gloo on CPU otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.mesh import Mesh

from .group_cache import clear as clear_shared_groups
from .group_cache import forget as forget_shared_groups
from .group_cache import shared_groups

__all__ = ["MeshGroups", "init_distributed", "ranks_per_node", "release_all"]

logger = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# how long a failing rank waits for the others to report the same failure before it shuts the groups
# down: covers the skew of ranks reaching the same call (the previous step's collectives keep them within
# an optimizer step of each other); only a failure on some ranks pays it
FAIL_GRACE_S = 5.0
_INSTANCES = itertools.count()  # MeshGroups built in this process: the same sequence on every rank
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every MeshGroups alive in this process (release_all)


def init_distributed(backend: str | None = None, *, timeout: timedelta | None = None) -> str:
    """Initialize the default process group from torchrun's environment; return the backend.

    ``backend=None`` picks ``"nccl"`` when CUDA is available, else ``"gloo"``.  With
    nccl the current CUDA device is set to ``LOCAL_RANK`` before the group is
    created (one GPU per rank).  Idempotent: when the default group already exists
    it is left alone and its backend returned.  Raises ValueError when a torchrun
    variable is missing.
    """
    if not dist.is_available():
        raise ValueError("init_distributed: this torch build has no torch.distributed; install a build with it")
    if dist.is_initialized():
        return str(dist.get_backend())
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"init_distributed: environment variables {missing} are not set; launch with torchrun "
            "(torchrun --nproc-per-node N script.py) or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise ValueError(f"init_distributed: backend {backend!r} needs CUDA but no GPU is visible; use 'gloo'")
        local_rank = int(os.environ.get("LOCAL_RANK", int(os.environ["RANK"]) % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    logger.info("initialized %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    return str(dist.get_backend())


def ranks_per_node() -> int | None:
    """The ranks torchrun started on each node (``LOCAL_WORLD_SIZE``) when the job spans several nodes, else None.

    torchrun numbers ranks node by node, so node ``k`` holds ranks ``k*L .. k*L + L - 1``:
    the layout ``DeviceProfile.link_for_axis`` assumes with ``devices_per_node = L``.
    """
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local and world and int(local) < int(world):
        return int(local)
    return None


class MeshGroups:
    """This rank's view of the mesh: its coordinate and one process group per mesh axis.

    Contract: construct on every rank, in the same program order relative to other
    ``dist.new_group`` calls (group creation is collective over the world).

    ``native_reduce_scatter`` chooses how ``P(sum) -> S`` runs: ``True`` issues a real
    (padded) reduce-scatter, ``False`` emulates it with an all-reduce and a local
    slice (same result, more traffic).  ``None`` (default) means native on nccl and
    emulated on other backends (older gloo builds have no reduce-scatter; torch 2.13's
    gloo does, and the tests run both paths on it).  Either
    way the collective counter records one ``reduce_scatter`` with the planned bytes.
    """

    def __init__(self, mesh: Mesh, *, native_reduce_scatter: bool | None = None) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"MeshGroups(mesh={mesh!r}): expected an autopar.Mesh, e.g. Mesh((2, 4), ('dp', 'tp'))")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"MeshGroups({mesh}): torch.distributed has no default process group; call "
                "torch.distributed.init_process_group(...) (or autopar.runtime.init_distributed()) on every rank "
                f"first, or launch the {mesh.size} ranks with torchrun"
            )
        world = dist.get_world_size()
        if world != mesh.size:
            dims = " * ".join(f"{n}({s})" for n, s in zip(mesh.axis_names, mesh.shape))
            raise ValueError(
                f"MeshGroups: world size {world} != mesh size {mesh.size} (mesh {mesh}: {dims}); launch "
                f"{mesh.size} ranks (torchrun --nproc-per-node {mesh.size}) or use a mesh whose axis sizes "
                f"multiply to {world}"
            )
        if not mesh.is_world(world):
            raise ValueError(
                f"MeshGroups: mesh {mesh} has ranks {mesh.ranks}, a sub-mesh of the {world} ranks of the world; "
                "planning and compile need a mesh over every rank (its ranks a permutation of 0..world size - 1). "
                "Use autopar.reshard to move tensors between sub-meshes"
            )
        self._mesh = mesh
        self._rank = dist.get_rank()
        self._backend = str(dist.get_backend())
        self._coordinate = mesh.coordinate(self._rank)
        self._native_rs = ("nccl" in self._backend) if native_reduce_scatter is None else bool(native_reduce_scatter)
        self._groups: list[dist.ProcessGroup] = []
        self._store = dist.distributed_c10d._get_default_store()  # where a failing rank leaves its reason
        self._key = f"autopar/mesh_groups{next(_INSTANCES)}"
        self._failures = 0  # calls every rank failed alike (same count on every rank)
        self._shut_down: str | None = None  # the reason, once the groups are destroyed
        self._members: list[tuple[int, ...]] = []
        self._order: list[tuple[int, ...]] = []
        self._flat: dict[tuple[int, ...], dist.ProcessGroup] = {}  # axes -> this rank's group over them flattened
        lines = [mesh.axis_groups(axis) for axis in range(mesh.ndim)]
        for axis, pg in enumerate(shared_groups(lines, self.device)):  # made once per process (shared_groups)
            if pg is None:
                raise AssertionError(f"rank {self._rank} is in no group of mesh axis {axis} of {mesh}")
            self._groups.append(pg)
            self._members.append(next(tuple(r) for r in lines[axis] if self._rank in r))
            group_ranks = dist.get_process_group_ranks(pg)  # global ranks in group-rank order
            self._order.append(tuple(mesh.coordinate(r)[axis] for r in group_ranks))
        _LIVE.add(self)

    # ---- identity -------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self._rank

    @property
    def coordinate(self) -> tuple[int, ...]:
        """This rank's mesh coordinate."""
        return self._coordinate

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def device(self) -> torch.device:
        """``cuda:LOCAL_RANK`` on nccl (one GPU per rank), else ``cpu``."""
        if "nccl" in self._backend:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        return torch.device("cpu")

    @property
    def native_reduce_scatter(self) -> bool:
        return self._native_rs

    # ---- failing fast ---------------------------------------------------------------
    def fail(self, reason: str, *, grace_s: float = FAIL_GRACE_S) -> bool:
        """This rank cannot make the call its peers are making; returns whether the groups were shut down.

        Reports ``reason`` in the store and waits up to ``grace_s`` for every rank
        to report the same failure; if one does not (it is presumably blocked in a
        collective), records ``reason`` for the others and destroys this mesh's
        groups, so that rank fails at once (see the module docstring).
        """
        if self._shut_down is not None:
            return True
        call = f"{self._key}/failure{self._failures}"
        self._failures += 1
        everyone = [f"{call}/rank{r}" for r in range(self._mesh.size)]
        try:
            self._store.set(everyone[self._rank], reason)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                if self._store.check(everyone):
                    return False
                time.sleep(0.005)
            self._store.set(f"{self._key}/shut_down", f"rank {self._rank}: {reason}")
        except (RuntimeError, OSError) as e:  # no store to tell the others: still shut down, they fail anyway
            logger.warning("autopar: could not report a failed call in the store: %s", e)
        self._shutdown(f"rank {self._rank}: {reason}")
        return True

    @contextlib.contextmanager
    def collectives(self, what: str) -> Iterator[None]:
        """Run collectives; one that breaks because a peer shut the groups down raises that peer's reason."""
        try:
            yield
        except RuntimeError as e:
            reason = self._shut_down or self._peer_reason()
            if reason is None:
                raise
            self._shutdown(reason)
            raise ValueError(
                f"{what} on rank {self._rank} (mesh coordinate {self._coordinate}) stopped: {reason}\n"
                "The rank that failed shut the mesh's process groups down so that no rank waits for the "
                "collective timeout. Fix: give every rank inputs of the compiled shapes, and compile again"
            ) from e

    def _peer_reason(self) -> str | None:
        """The reason a peer shut the groups down, if one did (None also when the store cannot be read)."""
        key = f"{self._key}/shut_down"
        try:
            return self._store.get(key).decode() if self._store.check([key]) else None
        except (RuntimeError, OSError):
            return None

    def check_alive(self, what: str) -> None:
        """Raise ValueError when a failed call shut this mesh's groups down (nothing can run on them)."""
        if self._shut_down is not None:
            raise ValueError(
                f"{what}: the mesh's process groups were shut down after a failed call ({self._shut_down}); "
                "compile the model again (autopar.compile) to get new groups"
            )

    def _shutdown(self, reason: str) -> None:
        if self._shut_down is not None:
            return
        self._shut_down = reason
        groups, self._groups = [*self._groups, *self._flat.values()], []
        self._flat = {}
        for other in list(_LIVE):  # meshes sharing these groups (shared_groups) cannot run on them either
            if other is not self and any(g in groups for g in (*other._groups, *other._flat.values())):
                other.release(f"{reason} (on a mesh sharing its process groups)")
        forget_shared_groups(groups)
        while groups:  # popped: this frame keeps no reference, so the connections close as each one goes
            with contextlib.suppress(Exception):  # a group a peer already broke may refuse a clean destroy
                dist.destroy_process_group(groups.pop())
        logger.warning("autopar: shut down the process groups of %s: %s", self._mesh, reason)

    def release(self, reason: str) -> None:
        """Drop this rank's references to its groups (they are destroyed when nothing else holds them); later
        collectives raise ``reason`` (``check_alive``)."""
        if self._shut_down is None:
            self._shut_down, self._groups, self._flat = reason, [], {}

    # ---- axes -----------------------------------------------------------------------
    def axis_group(self, axis: int | str) -> dist.ProcessGroup:
        """The process group of this rank's line of ranks along ``axis``."""
        if self._shut_down is not None:
            self.check_alive(f"collective on mesh axis {axis}")
        return self._groups[self._mesh.axis_index(axis)]

    def add_flat_groups(self, axis_sets) -> None:
        """Create the process groups of each set of axes in ``axis_sets`` (tuples of axis indices) flattened into
        one (``flat_group``).  Collective: every rank calls it with the same sets in the same order (the plan's
        ``flat_grad_axes``, at compile)."""
        wanted = []
        for axes in axis_sets:
            axes = tuple(sorted(self._mesh.axis_index(a) for a in axes))
            if axes not in self._flat and axes not in wanted:
                wanted.append(axes)
        made = shared_groups([self._mesh.axis_groups(axes) for axes in wanted], self.device)
        self._flat.update(zip(wanted, made))

    def flat_group(self, axes: tuple[int, ...]) -> dist.ProcessGroup:
        """This rank's process group over ``axes`` flattened into one: the ranks that differ from it on those axes
        only (made by ``add_flat_groups``)."""
        self.check_alive(f"collective on mesh axes {axes}")
        if axes not in self._flat:
            raise ValueError(
                f"no flattened process group over mesh axes {axes} of {self._mesh}: create it on every rank with "
                "MeshGroups.add_flat_groups first (compile does, for the plan's flat_grad_axes)"
            )
        return self._flat[axes]

    def axis_size(self, axis: int | str) -> int:
        return self._mesh.shape[self._mesh.axis_index(axis)]

    def axis_rank(self, axis: int | str) -> int:
        """This rank's position in its axis group: its mesh coordinate on ``axis``."""
        return self._coordinate[self._mesh.axis_index(axis)]

    def axis_ranks(self, axis: int | str) -> tuple[int, ...]:
        """Global ranks of this rank's axis group, in axis-coordinate order."""
        return self._members[self._mesh.axis_index(axis)]

    def axis_order(self, axis: int | str) -> tuple[int, ...]:
        """For each group rank of the axis group, the member's axis coordinate."""
        return self._order[self._mesh.axis_index(axis)]

    def __repr__(self) -> str:
        return f"MeshGroups({self._mesh}, rank={self._rank}, coordinate={self._coordinate}, backend={self._backend})"


def release_all(reason: str) -> int:
    """``MeshGroups.release`` on every mesh of this process (``autopar.runtime.at_exit``); how many there were."""
    meshes = list(_LIVE)
    for groups in meshes:
        groups.release(reason)
    clear_shared_groups()
    return len(meshes)
