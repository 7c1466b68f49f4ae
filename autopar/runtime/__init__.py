"""Runtime communication for executing plans on real ranks.

- ``groups``: ``MeshGroups`` (one process group per mesh axis line) and
  ``init_distributed`` (torchrun environment -> default process group).
- ``group_cache``: ``shared_groups``, the process groups of a set of rank lines, made once per process
  and shared by every mesh (groups made per compile pile up: gloo's each wake every 10 ms).
- ``redistribute``: ``redistribute_local`` runs ``transitions()``'s steps as
  collectives; ``Move`` is one edge's move resolved once (forward and gradient
  placements), ``Redistribute`` / ``redistribute`` its autograd function.
- ``resharding``: ``reshard`` moves a tensor between (mesh, placements) layouts, sub-meshes
  included (collectives on one world mesh, point-to-point sends otherwise);
  ``reshard_cost`` says how and what it costs.
- ``counter``: ``CollectiveCounter`` records what ran, to compare with the plan.
- ``zero``: ``StateShards``, ZeRO-1/2 parameters (gradient and optimizer state
  sharded beyond the parameter) and the optimizer step's all-gather.
- ``buckets``: ``GradBuckets``, DDP-style bucketed gradient all-reduces overlapped
  with backward.
- ``deferred``: the loss's last collective started without waiting
  (``PendingLoss``, read on first use; backward never waits for it).
- ``at_exit``: at interpreter exit, the pending loss collectives finished and every
  mesh's process groups dropped while Python is whole (gloo aborts otherwise).
"""

from __future__ import annotations

from . import at_exit  # noqa: F401 - registers the release at interpreter exit
from .at_exit import hold_until_exit
from .buckets import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES, GradBuckets, bucket_layout, bucketable
from .clip import clip_grad_norm_, replication
from .counter import CollectiveCounter, CollectiveRecord
from .deferred import PendingLoss, defer_loss_tail, wait_pending
from .group_cache import shared_groups
from .groups import MeshGroups, init_distributed, ranks_per_node
from .redistribute import Move, Redistribute, nesting_conflict, nesting_steps, redistribute, redistribute_local
from .resharding import ReshardCost, TransferPlan, plan_transfers, reshard, reshard_cost
from .spawn import RankError, RankSettings, spawn_ranks
from .zero import StateShards, from_state_shard

__all__ = [
    "hold_until_exit",
    "shared_groups",
    "CollectiveCounter",
    "CollectiveRecord",
    "PendingLoss",
    "MeshGroups",
    "init_distributed",
    "ranks_per_node",
    "Move",
    "Redistribute",
    "nesting_conflict",
    "redistribute",
    "redistribute_local",
    "StateShards",
    "from_state_shard",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "bucket_layout",
    "GradBuckets",
    "RankError",
    "ReshardCost",
    "TransferPlan",
    "plan_transfers",
    "reshard",
    "reshard_cost",
    "bucketable",
    "clip_grad_norm_",
    "replication",
    "defer_loss_tail",
    "nesting_steps",
    "spawn_ranks",
    "RankSettings",
    "wait_pending",
]
