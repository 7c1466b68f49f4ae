"""``autopar.reshard``: a tensor moved between (mesh, placements) layouts, sub-meshes included.

Truth comes from the layout itself: every rank builds the same full tensor, cuts
its source piece with ``layout.shard_tensor`` (random addends for ``Partial``),
reshards, and must hold exactly ``shard_tensor(full, dst)`` on the destination.
The bytes each rank sent are what ``reshard_cost`` (the cost model) says, pair
by pair, and the collectives of a same-mesh reshard are its ``transitions``.
The transfer plan itself is checked without ranks: every destination element
arrives once per addend, replicas share the sends, and a rank that already holds
a region sends nothing.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from dist_utils import run_ranks

import autopar
from autopar.mesh import Mesh
from autopar.pieces import coordinates, shard_tensor
from autopar.placement import parse_placements
from autopar.runtime import CollectiveCounter, plan_transfers, reshard_cost
from costmodel import load_profile

WORLD = 4
A, B = Mesh((2,), ranks=(0, 1)), Mesh((2,), ranks=(2, 3))  # disjoint halves of the world
LEFT3, RIGHT3 = Mesh((3,), ranks=(0, 1, 2)), Mesh((3,), ranks=(1, 2, 3))  # overlapping
SQUARE, LINE = Mesh((2, 2)), Mesh((4,))  # the whole world, two shapes
ODD = Mesh((2, 2), ranks=(3, 1, 0, 2))  # the whole world, permuted

# (name, shape, source (mesh, placements), destination (mesh, placements))
CASES = [
    ("disjoint S0->S1", (6, 10), (A, "S(0)"), (B, "S(1)")),
    ("disjoint R->S0 uneven", (7, 3), (A, "R"), (B, "S(0)")),
    ("overlap S0 uneven->R", (7, 5), (LEFT3, "S(0)"), (RIGHT3, "R")),
    ("overlap block-wise->S0", (4, 12), (LEFT3, "S(1)[2]"), (RIGHT3, "S(0)")),
    ("gather onto one rank", (5, 4), (LINE, "S(1)"), (Mesh((1,), ranks=(3,)), "R")),
    ("scatter from one rank", (9, 2), (Mesh((1,), ranks=(2,)), "R"), (SQUARE, "S(0),S(0)")),
    ("partial sum sub-mesh->R", (4, 6), (A, "P(sum)"), (RIGHT3, "R")),
    ("2-D partial max->shards", (4, 8), (SQUARE, "P(max),S(1)"), (B, "S(1)")),
    ("line->square", (8, 6), (LINE, "S(0)"), (SQUARE, "S(1),S(0)")),
    ("permuted world, same shape", (6, 6), (SQUARE, "S(0),R"), (ODD, "R,S(1)")),
    ("same world mesh: collectives", (8, 6), (SQUARE, "S(0),R"), (SQUARE, "R,S(1)")),
    ("same world mesh partial: collectives", (8, 6), (SQUARE, "P(sum),S(0)"), (SQUARE, "S(1),R")),
    ("bool mask across meshes", (5, 3), (A, "S(0)"), (B, "R")),
]


def _layout(pair):
    mesh, text = pair
    return mesh, parse_placements(text)


def _full(shape, dtype):
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape).sin() * 10
    return (full > 0) if dtype == torch.bool else full.to(dtype)


def _piece(full, layout, rank):
    mesh, placements = layout
    if rank not in mesh.ranks:
        return None
    return shard_tensor(full, placements, mesh.shape, mesh.coordinate(rank), partial_seed=7)


def _rank_fn(rank, world, cases):
    out = {}
    for name, shape, src, dst, dtype in cases:
        src, dst = _layout(src), _layout(dst)
        full = _full(shape, dtype)
        counter = CollectiveCounter()
        got = autopar.reshard(_piece(full, src, rank), src, dst, shape=shape, dtype=dtype, counter=counter)
        out[name] = (got, [(r.kind, r.axis, r.bytes) for r in counter.records])
    return out


def _dtype(name):
    return torch.bool if name.startswith("bool") else torch.float32


def test_reshard_gives_every_destination_rank_its_piece_and_sends_what_the_cost_model_prices():
    cases = [(n, s, src, dst, _dtype(n)) for n, s, src, dst in CASES]
    results = run_ranks(_rank_fn, WORLD, cases)
    profile = load_profile("cpu")
    for name, shape, src, dst, dtype in cases:
        src_l, dst_l = _layout(src), _layout(dst)
        full = _full(shape, dtype)
        for rank in range(WORLD):
            got, records = results[rank][name]
            want = _piece(full, dst_l, rank)
            if want is None:
                assert got is None, (name, rank)
            else:
                assert got is not None and got.dtype == dtype, (name, rank)
                where = f"{name} rank {rank}"
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
        cost = reshard_cost(shape, dtype, src_l, dst_l, profile, world_size=WORLD)
        if cost.how == "p2p":
            sent = {
                (rank, None): sum(b for kind, _, b in results[rank][name][1] if kind == "send") for rank in range(WORLD)
            }
            priced = {(rank, None): sum(b for a, _, b in cost.messages if a == rank) for rank in range(WORLD)}
            assert sent == priced, name
            assert all(
                len([1 for k, *_ in results[r][name][1] if k == "send"])
                == len([1 for a, *_ in cost.messages if a == r])
                for r in range(WORLD)
            ), name  # one message per peer
        else:
            assert name.startswith("same world mesh"), name
            for rank in range(WORLD):
                ran = [(k, a, b) for k, a, b in results[rank][name][1]]
                assert ran == [s for s in cost.steps if s[0] is not None], (name, rank, ran, cost.steps)
        assert cost.time_s > 0 and cost.bytes > 0, name


def test_a_same_mesh_reshard_runs_the_plans_collectives_and_a_sub_mesh_one_sends_point_to_point():
    profile = load_profile("cpu")
    dtype = torch.float32
    same = reshard_cost(
        (8, 6),
        dtype,
        (SQUARE, parse_placements("S(0),R")),
        (SQUARE, parse_placements("R,S(1)")),
        profile,
        world_size=WORLD,
    )
    assert same.how == "collectives" and [k for k, *_ in same.steps] == ["all_gather"]
    cross = reshard_cost(
        (6, 10), dtype, (A, parse_placements("S(0)")), (B, parse_placements("S(1)")), profile, world_size=WORLD
    )
    # each of ranks 2 and 3 needs a (6, 5) block: half of it from rank 0, half from rank 1
    assert cross.how == "p2p" and sorted(cross.messages) == [(0, 2, 60), (0, 3, 60), (1, 2, 60), (1, 3, 60)]


PLANS = [
    ((7, 5), (LEFT3, "S(0)"), (RIGHT3, "R")),
    ((4, 12), (LEFT3, "S(1)[2]"), (RIGHT3, "S(0)")),
    ((4, 6), (A, "P(sum)"), (RIGHT3, "R")),
    ((8, 6), (SQUARE, "R,R"), (LINE, "S(1)")),
    ((9, 9), (Mesh((3, 1), ranks=(3, 0, 1)), "S(0),R"), (Mesh((2,), ranks=(1, 2)), "S(1)")),
]


@pytest.mark.parametrize("shape,src,dst", PLANS, ids=[f"{s}" for s, *_ in PLANS])
def test_the_transfer_plan_delivers_each_element_of_each_destination_piece_once_per_addend(shape, src, dst):
    src, dst = _layout(src), _layout(dst)
    plan = plan_transfers(shape, src, dst)
    dmesh, dpl = dst
    for coord in coordinates(dmesh.shape):
        d = dmesh.ranks[coordinates(dmesh.shape).index(coord)]
        local = torch.Size(_piece(torch.zeros(shape), (dmesh, dpl), d).shape)
        hits = torch.zeros(local, dtype=torch.int64)
        for r in (r for r in plan.regions if r.dst_rank == d):
            hits[tuple(slice(a, a + n) for a, n in zip(r.dst_at, r.sizes))] += 1
        assert bool((hits == plan.addends).all()), (d, hits)


def test_a_rank_takes_what_it_holds_from_itself_and_replicas_share_the_sends():
    itemsize = 4
    held = plan_transfers((8, 6), _layout((SQUARE, "R,R")), _layout((LINE, "S(1)")))
    assert held.messages(itemsize) == {} and len(held.regions) == 4  # every rank already holds its piece
    shared = plan_transfers((8, 6), _layout((A, "R")), _layout((B, "S(0)")))
    # ranks 0 and 1 both hold the tensor: each sends one of the two destination pieces
    assert shared.messages(itemsize) == {(0, 2): 96, (1, 3): 96}
    overlap = plan_transfers((7, 5), _layout((LEFT3, "S(0)")), _layout((RIGHT3, "R")))
    # ranks 1 and 2 are in both meshes: each keeps its own rows and receives the rest
    sent = overlap.messages(itemsize)
    assert (1, 1) not in sent and sent[(0, 1)] == 3 * 5 * itemsize and sent[(2, 1)] == 2 * 5 * itemsize


def test_bad_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="destination .* is partial.*reshard to R"):
        plan_transfers((4,), (A, parse_placements("S(0)")), (B, parse_placements("P(sum)")))
    with pytest.raises(ValueError, match="mixes P\\(sum\\) and P\\(max\\)"):
        plan_transfers((4,), (SQUARE, parse_placements("P(sum),P(max)")), (B, parse_placements("R")))
    with pytest.raises(ValueError, match="1 placements .* 2 axes"):
        reshard_cost((4, 4), torch.float32, (SQUARE, "S(0)"), (B, "R"), load_profile("cpu"), world_size=4)
    with pytest.raises(ValueError, match="shards dim 2 of a tensor of shape \\(4, 4\\)"):
        reshard_cost((4, 4), torch.float32, (A, "S(2)"), (B, "R"), load_profile("cpu"), world_size=4)


def _bad_piece_fn(rank, world):
    from autopar.runtime import reshard

    errors = []
    piece = torch.zeros(3, 4) if rank in A.ranks else None  # the source piece of S(0) on A is (2, 4)
    try:
        reshard(piece, (A, "S(0)"), (B, "R"), shape=(4, 4), dtype=torch.float32)
    except ValueError as e:
        errors.append(str(e))
    try:
        reshard(None if rank in B.ranks else torch.zeros(2, 4), (A, "S(0)"), (B, "R"), shape=(4, 4))
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_a_wrong_piece_fails_every_rank_and_a_missing_dtype_names_the_fix():
    errors = run_ranks(_bad_piece_fn, WORLD)
    assert all(len(e) == 2 for e in errors), errors  # every rank raised both times: none was left waiting
    assert "holds (3, 4), but ['S(0)'] of a (4, 4) tensor gives it a piece of shape (2, 4)" in errors[0][0]
    assert "rank(s) [0, 1] were not given their source pieces" in errors[3][0]
    assert all("holds ranks (0, 1) of a world of 4" in e[1] and "pass dtype=" in e[1] for e in errors)


def _outside_world_fn(rank, world):
    """Destinations with ranks past a world of 2 (a sub-mesh of ranks 2, 3, and a 2x2 mesh): each must raise
    on every rank, not wait for ranks that do not exist; and dtype= converts a piece held in another dtype."""
    errors = []
    piece = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float64)
    for dst in ((Mesh((2,), ranks=(2, 3)), ["R"]), (Mesh((2, 2)), ["R", "R"])):
        start = time.monotonic()
        try:
            autopar.reshard(piece, (Mesh((2,)), ["S(0)"]), dst, shape=(4,), dtype=torch.float64)
        except ValueError as e:
            errors.append((str(e), time.monotonic() - start))
    whole = autopar.reshard(piece, (Mesh((2,)), ["S(0)"]), (Mesh((2,)), ["R"]), shape=(4,), dtype=torch.float32)
    return errors, whole


def test_a_reshard_to_ranks_outside_the_world_fails_on_every_rank_at_once():
    for rank, (errors, whole) in enumerate(run_ranks(_outside_world_fn, 2, timeout_s=60)):
        assert len(errors) == 2, (rank, errors)  # both calls raised here: no rank was left waiting
        (sub, sub_s), (square, square_s) = errors
        assert "destination Mesh" in sub and "ranks [2, 3] are outside the world of 2 (ranks 0..1)" in sub
        assert "ranks [2, 3] are outside the world of 2" in square
        assert sub_s < 10 and square_s < 10
        assert whole.dtype == torch.float32 and whole.tolist() == [0.0, 1.0, 2.0, 3.0]


def _state_dict_fn(rank, world):
    shapes = {"w": (6, 4), "b": (6,)}
    full = {k: _full(s, torch.float32) for k, s in shapes.items()}
    src = {"w": _layout((A, "S(0)")), "b": _layout((A, "R"))}
    dst = _layout((SQUARE, "R,S(0)"))
    pieces = {k: _piece(full[k], src[k], rank) for k in shapes}
    got = autopar.reshard(pieces, src, dst, shape=shapes, dtype={"w": torch.float32, "b": torch.float32})
    return {k: (v, _piece(full[k], dst, rank)) for k, v in got.items()}


def test_a_state_dict_reshards_entry_by_entry():
    for rank, result in enumerate(run_ranks(_state_dict_fn, WORLD)):
        assert set(result) == {"w", "b"}
        for key, (got, want) in result.items():
            assert torch.equal(got, want), (rank, key)
