"""Gradient-norm clipping of a compiled module: the norm of the *full* gradient, as on one device.

``torch.nn.utils.clip_grad_norm_(sharded.parameters(), ...)`` would see only this
rank's pieces: under a sharded plan every rank would compute another norm and clip
by another factor.  ``clip_grad_norm_`` here (``ShardedModule.clip_grad_norm_``, as
FSDP's method of that name) returns the norm ``torch.nn.utils.clip_grad_norm_``
would return on the unpartitioned model, the same on every rank, and scales every
local gradient by the same factor.

The math.  Each rank holds, for each parameter, the piece of its gradient under
the gradient's placement (its state placement: ``S``/``R`` per mesh axis, never
``P`` once backward is done).  A piece is held by ``r = prod(mesh[a] for the axes a
where the placement is R)`` ranks: the ranks that differ only on those axes.  So
for a finite ``p``

    ||g||_p^p = sum over ranks of  sum over params  ||local piece||_p^p / r

which is one all-reduce (sum) of one scalar over the mesh; for ``p = inf`` the
maximum of the local maxima (all-reduce max, no weights).  Then, as torch does,
``coef = min(1, max_norm / (norm + 1e-6))`` multiplies every gradient.  Uneven
shards need nothing special: each piece is counted once per holder.

The all-reduce is outside the plan's collective list (it is not part of the
step the plan prices) and is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from autopar.placement import Partial, Placement, Replicate

from .groups import MeshGroups

__all__ = ["clip_grad_norm_", "replication"]


def replication(placement: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> int:
    """How many ranks hold the same piece of a tensor under ``placement`` (the product of its R axes).

    Stored gradients are never Partial (backward reduced them); one would be a bug upstream.
    """
    if any(isinstance(p, Partial) for p in placement):
        raise AssertionError(f"a stored gradient at {placement}: Partial gradients are reduced before they are stored")
    return math.prod(n for p, n in zip(placement, mesh_shape) if isinstance(p, Replicate))


def clip_grad_norm_(
    grads: Iterable[tuple],
    groups: MeshGroups,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the local ``grads`` (each with its placement) in place by the full gradient's norm; return that norm.

    An entry may carry a third value, the number of ranks holding that piece, where the placement does not say
    it (a pipelined plan's weight: replicated along the pipeline axis, held only by its stages' ranks).
    Must be called on every rank of the mesh (one all-reduce over all of it).
    """
    mesh_shape = tuple(groups.mesh.shape)
    grads = [(g, rest[1] if len(rest) > 1 else replication(rest[0], mesh_shape)) for g, *rest in grads if g is not None]
    p = float(norm_type)
    device = grads[0][0].device if grads else groups.device
    if math.isinf(p):  # an uneven shard may leave a rank an empty piece: it adds nothing, and must not raise
        maxima = [g.detach().abs().amax().double() for g, _ in grads if g.numel()]
        total = torch.stack(maxima).amax() if maxima else torch.zeros((), dtype=torch.float64, device=device)
        with groups.collectives("clip_grad_norm_"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g, copies in grads:
            norm = torch.linalg.vector_norm(g.detach(), p, dtype=torch.float64)
            total += norm**p / copies
        with groups.collectives("clip_grad_norm_"):
            dist.all_reduce(total)
        total = total ** (1.0 / p)
    dtype = grads[0][0].dtype if grads else torch.float32
    total = total.to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {p} of the gradients is non-finite ({float(total)}), so it cannot be "
            "clipped; set error_if_nonfinite=False to clip anyway (the gradients then hold non-finite values)"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.mul_(coef.to(g.dtype))
    return total
