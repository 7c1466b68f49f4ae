"""A batch the mesh does not divide: data-parallel pieces of unequal size train like one device.

On the tiny test models the search never splits an odd batch by itself (a
sequence split or a replicated plan is cheaper), so these tests make it: every
matmul module gets a MindSpore-style hint that splits its rows over the mesh
and the inputs are pinned to ``S(0)``; the search completes the rest under the
forced data-parallel family.  Ranks then hold batch pieces of different sizes
(3 rows on 2 ranks: 2 and 1; 5 on 3: 2, 2 and 1), so every uneven path is run:
slicing the global batch, the per-rank input mode, attention and the loss on
uneven pieces, all-gathers of unequal pieces and the gradient all-reduces
whose summands came from unequal pieces.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import _assert_trains_alike, _compile, _loss_and_logits, _model, _reference, _train
from torch import nn

SEQ = 15  # odd as well: no even split of any activation dim is on offer either

CASES = [("llama-tiny", 3, 2), ("bert-tiny", 5, 3)]


def _row_split_hints(model: nn.Module, ranks: int) -> dict:
    """Every matmul module (``nn.Linear``, GPT-2's ``Conv1D``): its activation rows split ``ranks`` ways."""
    return {
        name: ((ranks, 1), (1, 1))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    }


def _rank_fn(rank, world, name, batch):
    from autopar.pieces import shard_tensor
    from autopar.placement import parse_placements

    out = {}
    for mode in ("global", "local"):
        model, args, kwargs = _model(name, batch, SEQ)
        given = {"input_ids": args[0], **kwargs}
        sharded = _compile(
            model,
            args,
            kwargs,
            (world,),
            ("dp",),
            "data parallel",
            PARTITIONING_PROFILE,
            hints=_row_split_hints(model, world),
            input_placements=dict.fromkeys(given, ["S(0)"]),
            input_mode=mode,
        )
        if mode == "local":
            pieces = {
                k: shard_tensor(v, parse_placements(sharded.plan.inputs[k].placements), (world,), (rank,))
                for k, v in given.items()
            }
            args, kwargs = (pieces.pop("input_ids"),), pieces
        out[mode] = {
            "family": sharded.plan.family,
            "rows": int(args[0].shape[0]),
            "train": _train((sharded, _loss_and_logits(sharded)), args, kwargs),
        }
    return out


@pytest.mark.parametrize("name,batch,ranks", CASES, ids=[f"{n}-batch{b}-on{r}" for n, b, r in CASES])
def test_uneven_batch_pieces_train_like_one_device(name, batch, ranks):
    ref = _reference(name, batch, SEQ)
    results = run_ranks(_rank_fn, ranks, name, batch, timeout_s=600)
    want_rows = [len(piece) for piece in torch.arange(batch).tensor_split(ranks)]
    for rank, per_mode in enumerate(results):
        for mode, got in per_mode.items():
            where = f"{name}, batch {batch} on {ranks} ranks, rank {rank}, input_mode={mode}"
            assert got["family"] == "data parallel", where
            if mode == "local":
                assert got["rows"] == want_rows[rank], f"{where}: {got['rows']} rows, expected {want_rows[rank]}"
            _assert_trains_alike(got["train"], ref, where)
