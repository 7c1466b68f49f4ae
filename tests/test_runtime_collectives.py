"""Runtime collectives on real gloo ranks: redistribute_local / Redistribute vs layout.py, counter vs transitions().

Truth: ``layout.shard_tensor`` gives every rank's piece before and after;
``layout.combine`` rebuilds Partial results and gradients; ``transitions()`` gives
the exact collective list the counter must hold.  All meshes of one world size run in
one spawn of N CPU processes (tests/dist_utils.py); process startup dominates.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from dist_utils import run_ranks

from autopar.mesh import Mesh
from autopar.pieces import combine, shard_tensor, unlayable_reason
from autopar.placement import Partial, Replicate, Shard, parse_placements
from autopar.runtime import (
    CollectiveCounter,
    MeshGroups,
    init_distributed,
    nesting_conflict,
    redistribute,
    redistribute_local,
)
from autopar.spec import TensorMeta
from autopar.transitions import consumer_grad_placement, producer_grad_placement, transitions

# name -> (mesh, native reduce-scatter): both reduce-scatter paths run on a 1-D and a 2-D mesh
MESHES = {
    "2": (Mesh((2,)), False),
    "4": (Mesh((4,)), True),
    "2x2": (Mesh((2, 2), ("dp", "tp")), False),
    "2x2-permuted": (Mesh((2, 2), ("dp", "tp"), ranks=(3, 1, 0, 2)), True),
}

# uneven rows (7, 5, 3: zero-size pieces on 4 ranks), dim 1 a multiple of 3 for S(1)[3] blocks
SHAPES = [(7, 15), (5, 12), (3, 15), (6, 12, 4)]

HANDPICKED_1D = [
    ("S(0)", "R"),
    ("S(1)[3]", "R"),
    ("S(0)", "S(1)"),
    ("S(1)[3]", "S(0)"),
    ("S(1)", "S(1)[3]"),
    ("P(sum)", "S(0)"),
    ("P(sum)", "S(1)[3]"),
    ("P(max)", "R"),
    ("P(max)", "S(0)"),
    ("R", "P(sum)"),
    ("R", "P(max)"),
    ("R", "S(1)[3]"),
    ("S(0)", "P(sum)"),
    ("P(sum)", "P(max)"),
    ("R", "R"),  # only the gradient moves (Megatron's f): forward is a view, not a copy
    ("P(sum)", "R"),
]
HANDPICKED_2D = [
    ("S(0),S(0)", "R,R"),
    ("S(0),S(1)", "S(1),S(0)"),
    ("P(sum),S(0)", "R,R"),
    ("S(0),P(sum)", "S(0),S(0)"),
    ("R,R", "S(0),S(0)"),
    ("S(1)[3],S(1)", "R,R"),
    ("S(1),S(1)[3]", "R,S(1)[3]"),
    ("P(sum),P(sum)", "R,R"),
    ("P(max),P(max)", "S(0),R"),
    ("P(sum),P(max)", "R,R"),
    ("S(0),S(0)", "S(0),R"),
    ("R,S(0)", "P(sum),S(0)"),
    ("P(sum),R", "S(0),S(0)"),
    ("S(1),R", "S(1),S(1)"),
    ("R,S(0)", "R,S(0)"),  # only the gradient moves
    # nested: transitions() joins the inner shard of a moved dim first, then re-slices it
    ("S(0),S(0)", "R,S(0)"),
    ("R,S(0)", "S(0),S(0)"),
    ("S(0),S(0)", "S(1),S(0)"),
    ("P(sum),S(0)", "S(0),S(0)"),
    ("S(1),S(0)", "S(0),S(0)"),
    ("S(0),S(1)[3]", "S(1)[3],S(1)[3]"),
]


def _full(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-100, 100, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _layable(shape, placements, mesh_shape) -> bool:
    return unlayable_reason(tuple(shape), tuple(placements), tuple(mesh_shape)) is None


def _random_placements(rng: random.Random, shape, mesh_shape, partial: bool):
    kinds = ["R", "S(0)", "S(1)", "S(1)[3]", "S(0)"] + (["P(sum)", "P(max)"] if partial else [])
    if len(shape) == 3:
        kinds.append("S(2)")
    return parse_placements([rng.choice(kinds) for _ in mesh_shape])


def _case(rng: random.Random, shape, src, dst, dtype, mesh_shape, seed: int) -> dict:
    split = [rng.random() < 0.5 for _ in mesh_shape]
    grad_src = tuple(consumer_grad_placement(p, s) for p, s in zip(dst, split))
    grad_dst = tuple(producer_grad_placement(p) for p in src)
    backward = (
        dtype.is_floating_point and nesting_conflict(TensorMeta(shape, dtype), grad_src, grad_dst, mesh_shape) is None
    )
    return dict(
        shape=shape, dtype=dtype, src=src, dst=dst, grad_src=grad_src, grad_dst=grad_dst, backward=backward, seed=seed
    )


def _cases(mesh_shape, n_random: int, seed: int) -> tuple[list[dict], int]:
    """Handpicked + random realizable (src, dst) pairs; also the number of conflicting pairs skipped."""
    rng = random.Random(seed)
    cases, skipped = [], 0
    hand = HANDPICKED_1D if len(mesh_shape) == 1 else HANDPICKED_2D
    for i, (s, d) in enumerate(hand):
        src, dst = parse_placements(s), parse_placements(d)
        shape = next(
            sh for sh in SHAPES[i % 2 :] + SHAPES if _layable(sh, src, mesh_shape) and _layable(sh, dst, mesh_shape)
        )
        reason = nesting_conflict(TensorMeta(shape, torch.float64), src, dst, mesh_shape)
        assert reason is None, f"handpicked {s} -> {d} on {mesh_shape}: {reason}"
        cases.append(_case(rng, shape, src, dst, torch.float64, mesh_shape, 1000 + i))
    while len(cases) < len(hand) + n_random:
        shape = rng.choice(SHAPES)
        dtype = rng.choice([torch.float64, torch.float64, torch.float32, torch.int64, torch.bool])
        partial = dtype.is_floating_point
        src = _random_placements(rng, shape, mesh_shape, partial)
        dst = _random_placements(rng, shape, mesh_shape, partial)
        if not (_layable(shape, src, mesh_shape) and _layable(shape, dst, mesh_shape)):
            continue
        if nesting_conflict(TensorMeta(shape, dtype), src, dst, mesh_shape) is not None:
            skipped += 1
            continue
        cases.append(_case(rng, shape, src, dst, dtype, mesh_shape, rng.randrange(1 << 30)))
    return cases, skipped


# ---- worker (runs on every rank) -------------------------------------------------------
def _world_worker(rank: int, world: int, jobs: list[tuple], conflict: bool) -> dict:
    """Every job (name, mesh, native reduce-scatter, cases) of one world size in one spawn (startup is the cost)."""
    out = {name: _redistribute_job(mesh_dict, native_rs, cases) for name, mesh_dict, native_rs, cases in jobs}
    if conflict:
        out["conflict"] = _conflict_job()
    return out


def _redistribute_job(mesh_dict: dict, native_rs: bool, cases: list[dict]) -> dict:
    mesh = Mesh.from_dict(mesh_dict)
    groups = MeshGroups(mesh, native_reduce_scatter=native_rs)
    coord = groups.coordinate
    results = []
    for c in cases:
        meta = TensorMeta(c["shape"], c["dtype"])
        full = _full(c["shape"], c["dtype"], c["seed"])
        x = shard_tensor(full, c["src"], mesh.shape, coord, partial_seed=c["seed"])
        counter = CollectiveCounter()
        y = redistribute_local(x, meta, c["src"], c["dst"], groups, counter=counter)
        res = {"y": y, "fwd": list(counter.records), "aliases": y.data_ptr() == x.data_ptr() and x.numel() > 0}
        if c["backward"]:
            counter.clear()
            xr = x.clone().requires_grad_(True)
            y2 = redistribute(xr, meta, c["src"], c["dst"], c["grad_src"], c["grad_dst"], groups, counter)
            grad_full = _full(c["shape"], c["dtype"], c["seed"] + 1)
            y2.backward(shard_tensor(grad_full, c["grad_src"], mesh.shape, coord, partial_seed=c["seed"] + 2))
            same = y2.untyped_storage().data_ptr() == xr.untyped_storage().data_ptr() and x.numel() > 0
            res.update(y2=y2.detach(), grad=xr.grad, both=list(counter.records), y2_aliases=same)
        results.append(res)
    info = {
        "rank": groups.rank,
        "coordinate": coord,
        "backend": groups.backend,
        "device": str(groups.device),
        "axis_rank": [groups.axis_rank(a) for a in range(mesh.ndim)],
        "axis_size": [groups.axis_size(a) for a in range(mesh.ndim)],
        "axis_ranks": [groups.axis_ranks(a) for a in range(mesh.ndim)],
        "pg_ranks": [torch.distributed.get_process_group_ranks(groups.axis_group(a)) for a in range(mesh.ndim)],
    }
    return {"info": info, "results": results}


def _expected_records(meta: TensorMeta, src, dst, mesh_shape, phase: str) -> list[tuple]:
    return [
        (s.kind, s.axis, phase, s.bytes, s.reduce_op)
        for s in transitions(meta, src, dst, mesh_shape, include_local=True)
        if s.kind is not None
    ]


def _as_tuples(records) -> list[tuple]:
    return [(r.kind, r.axis, r.phase, r.bytes, r.reduce_op) for r in records]


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact or not a.dtype.is_floating_point:
        return torch.equal(a, b)
    tol = dict(rtol=1e-4, atol=1e-5) if a.dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    return a.shape == b.shape and torch.allclose(a, b, **tol)


def _check_case(c: dict, per_coord: dict, mesh: Mesh) -> None:
    shape, src, dst, ms = c["shape"], c["src"], c["dst"], mesh.shape
    what = f"{shape} {c['dtype']} {','.join(map(str, src))} -> {','.join(map(str, dst))} on {mesh}"
    full = _full(shape, c["dtype"], c["seed"])
    meta = TensorMeta(shape, c["dtype"])
    src_partial = any(isinstance(p, Partial) for p in src)
    ys = {co: r["y"] for co, r in per_coord.items()}
    for co, y in ys.items():
        assert not per_coord[co]["aliases"], f"{what}: result aliases the input at {co}"
        if not src_partial:  # pure data movement (+ seedless masks): bit-exact pieces
            want = shard_tensor(full, dst, ms, co)
            assert _close(y, want, exact=True), f"{what}: piece at {co} differs from layout.shard_tensor"
        elif not any(isinstance(p, Partial) for p in dst):
            assert _close(y, shard_tensor(full, dst, ms, co), exact=False), f"{what}: piece at {co} is wrong"
    assert _close(combine(ys, dst, ms, shape), full, exact=not src_partial), f"{what}: combine(result) != full"
    want_fwd = _expected_records(meta, src, dst, ms, "forward")
    for co, r in per_coord.items():
        assert _as_tuples(r["fwd"]) == want_fwd, f"{what}: counter at {co} != transitions()"
    if not c["backward"]:
        return
    grad_full = _full(shape, c["dtype"], c["seed"] + 1)
    grads = {co: r["grad"] for co, r in per_coord.items()}
    assert all(_close(r["y2"], r["y"], exact=True) for r in per_coord.values()), f"{what}: autograd forward differs"
    for co, r in per_coord.items():  # a move that keeps the placement views its input (no copy per call)
        nonempty = math.prod(r["y"].shape) > 0
        assert r["y2_aliases"] == (tuple(src) == tuple(dst) and nonempty), f"{what}: autograd forward aliasing at {co}"
    got = combine(grads, c["grad_dst"], ms, shape)
    assert _close(got, grad_full, exact=False), (
        f"{what}: gradient {','.join(map(str, c['grad_src']))} -> {','.join(map(str, c['grad_dst']))} wrong"
    )
    want_both = want_fwd + _expected_records(meta, c["grad_src"], c["grad_dst"], ms, "backward")
    for co, r in per_coord.items():
        assert _as_tuples(r["both"]) == want_both, f"{what}: forward+backward counter at {co} != transitions()"


def _mesh_cases(name: str) -> tuple[list[dict], int]:
    return _cases(MESHES[name][0].shape, n_random=70, seed=sum(map(ord, name)))


@pytest.fixture(scope="module")
def world_runs():
    """world_runs(world) -> per-rank outputs of ``_world_worker`` for every mesh of that size (run once)."""
    cache: dict[int, list[dict] | Exception] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            jobs = [
                (name, mesh.to_dict(), native_rs, _mesh_cases(name)[0])
                for name, (mesh, native_rs) in MESHES.items()
                if mesh.size == world
            ]
            try:
                cache[world] = run_ranks(_world_worker, world, jobs, world == 4)
            except Exception as e:  # fail every dependent test with the ranks' traceback, without re-running
                cache[world] = e
        if isinstance(cache[world], Exception):
            raise cache[world]
        return cache[world]

    return get


@pytest.mark.parametrize("name", list(MESHES))
def test_redistribute_matches_layout_and_transitions(name, world_runs):
    mesh, _ = MESHES[name]
    cases, skipped = _mesh_cases(name)
    by_rank = {o[name]["info"]["rank"]: o[name] for o in world_runs(mesh.size)}
    for rank, o in by_rank.items():
        info = o["info"]
        assert info["coordinate"] == mesh.coordinate(rank)
        assert info["axis_rank"] == list(info["coordinate"])
        assert info["axis_size"] == list(mesh.shape)
        assert (info["backend"], info["device"]) == ("gloo", "cpu")
        for a in range(mesh.ndim):
            line = tuple(
                r
                for r in mesh.ranks
                if mesh.coordinate(r)[:a] + mesh.coordinate(r)[a + 1 :]
                == info["coordinate"][:a] + info["coordinate"][a + 1 :]
            )
            assert info["axis_ranks"][a] == line and sorted(info["pg_ranks"][a]) == sorted(line)
    kinds, flags = set(), set()
    for i, c in enumerate(cases):
        per_coord = {by_rank[r]["info"]["coordinate"]: by_rank[r]["results"][i] for r in by_rank}
        _check_case(c, per_coord, mesh)
        steps = transitions(TensorMeta(c["shape"], c["dtype"]), c["src"], c["dst"], mesh.shape, include_local=True)
        kinds |= {s.kind or ("slice" if isinstance(s.dst, Shard) else "mask") for s in steps}
        pl = c["src"] + c["dst"]
        flags |= {"blocks"} if any(isinstance(p, Shard) and p.blocks > 1 for p in pl) else set()
        flags |= {"backward"} if c["backward"] else set()
        for ps in (c["src"], c["dst"]):
            dims = [p.dim for p in ps if isinstance(p, Shard)]
            flags |= {"nested"} if len(dims) != len(set(dims)) else set()
    # the sample must exercise every step kind, block shards and backward (2-D meshes: nested dims too)
    assert kinds >= {"all_gather", "all_to_all", "all_reduce", "reduce_scatter", "slice", "mask"}, kinds
    assert flags >= ({"blocks", "backward"} | ({"nested"} if mesh.ndim > 1 else set())), flags
    assert len(cases) >= 70 and skipped < len(cases), (len(cases), skipped)


# ---- nested-layout conflicts -------------------------------------------------------------
MIXED = (parse_placements("P(max),P(sum)"), parse_placements("R,P(sum)"))  # full = max_axis0(sum_axis1(...))


def _conflict_job() -> dict:
    from autopar.runtime.redistribute import _run_step, _steps

    mesh = Mesh((2, 2))
    groups = MeshGroups(mesh)
    src, dst = MIXED
    meta = TensorMeta((4, 3), torch.float64)
    full = _full(meta.shape, meta.dtype, 7)
    x = shard_tensor(full, src, mesh.shape, groups.coordinate, partial_seed=7)
    try:
        redistribute_local(x, meta, src, dst, groups)
        message = None
    except ValueError as e:
        message = str(e)
    # what transitions()'s steps give if run anyway: one axis-0 all_reduce(max) ahead of the inner sum
    steps, _ = _steps(meta, src, dst, mesh.shape)
    out, current = x, list(src)
    for st in steps:
        out, _ = _run_step(out, st, current, meta.shape, groups)
        current[st.axis] = st.dst
    return {
        "coordinate": groups.coordinate,
        "message": message,
        "unchecked": out,
        "full": full,
        "kinds": [(s.kind, s.axis, s.reduce_op) for s in steps],
    }


def test_nested_conflicts_are_refused_with_the_reason(world_runs):
    out = [o["conflict"] for o in world_runs(4)]
    assert out[0]["kinds"] == [("all_reduce", 0, "max")]
    unchecked = combine({o["coordinate"]: o["unchecked"] for o in out}, MIXED[1], (2, 2), (4, 3))
    assert not torch.allclose(unchecked, out[0]["full"])  # the refusal is needed: running it is wrong
    for o in out:
        assert o["message"] is not None and "reduce_axis0(reduce_axis1(...))" in o["message"], o["message"]
        assert "inner mesh axis 1 is still P(sum)" in o["message"] and "Fix:" in o["message"]
    assert (
        nesting_conflict(
            TensorMeta((4, 4), torch.float32), parse_placements("P(sum),P(sum)"), parse_placements("R,P(sum)"), (2, 2)
        )
        is None
    )


def test_conflict_checker_names_an_inner_shard():
    """A step list that moves a dim an inner axis still shards (what transitions() gave before it joined
    inner shards first) is named, so the runtime can never silently run one."""
    from autopar.runtime.redistribute import _conflict
    from autopar.transitions import AxisTransition

    src = parse_placements("S(0),S(0)")
    old_steps = [AxisTransition(0, "all_gather", 16, "sum", Shard(0), Replicate())]
    reason = _conflict(old_steps, src, (2, 2), (8, 1))
    assert reason is not None and "inner mesh axis 1 still shards (S(0))" in reason
    assert (
        _conflict(
            transitions(TensorMeta((8, 1), torch.float32), src, parse_placements("R,S(0)"), (2, 2), include_local=True),
            src,
            (2, 2),
            (8, 1),
        )
        is None
    )


def test_conflict_checker_names_a_placement_the_layout_cannot_hold():
    """An all_to_all into S(1)[3] under an outer S(1) of 15 columns (pieces of 8 and 7) has no layout: named
    before any collective runs, so no rank waits in a collective the others refused."""
    from autopar.runtime.redistribute import _conflict
    from autopar.transitions import AxisTransition

    src = parse_placements("S(1),S(0)")
    steps = [AxisTransition(1, "all_to_all", 24, "sum", Shard(0), Shard(1, 3))]
    reason = _conflict(steps, src, (2, 2), (3, 15))
    assert reason is not None and "(S(1), S(1)[3]), which the nested layout cannot hold" in reason
    assert "not a multiple of 3 blocks" in reason
    assert _conflict([], parse_placements("S(1),S(1)[3]"), (2, 2), (3, 15)).startswith("the source placements")


# ---- MeshGroups errors and init_distributed -----------------------------------------------
def _groups_errors_worker(rank: int, world: int) -> dict:
    out = {}
    try:
        MeshGroups(Mesh((1,)))
    except ValueError as e:
        out["no_pg"] = str(e)
    out["backend"] = init_distributed()
    out["again"] = init_distributed()  # idempotent
    try:
        MeshGroups(Mesh((2, 4), ("dp", "tp")))
    except ValueError as e:
        out["mismatch"] = str(e)
    g = MeshGroups(Mesh((world,)))
    out["ok"] = (g.rank, g.coordinate, g.axis_size(0))
    counter = CollectiveCounter()
    x = torch.full((3,), float(rank + 1))
    counter.enabled = False
    redistribute_local(x, TensorMeta((3,), torch.float32), (Partial(),), (Replicate(),), g, counter=counter)
    counter.enabled = True
    y = redistribute_local(x, TensorMeta((3,), torch.float32), (Partial(),), (Replicate(),), g, counter=counter)
    out["sum"], out["summary"] = y.tolist(), dict(counter.summary())
    try:
        redistribute_local(torch.zeros(5), TensorMeta((4 * world,), torch.float32), (Shard(0),), (Replicate(),), g)
    except ValueError as e:
        out["bad_shape"] = str(e)
    return out


def test_mesh_groups_errors_and_init_distributed():
    out = run_ranks(_groups_errors_worker, 2, init=False)
    for rank, o in enumerate(out):
        assert "no default process group" in o["no_pg"] and "init_process_group" in o["no_pg"]
        assert "torchrun" in o["no_pg"]
        assert o["backend"] == o["again"] == "gloo"
        assert "world size 2 != mesh size 8 (mesh Mesh(dp=2, tp=4)" in o["mismatch"]
        assert "--nproc-per-node 8" in o["mismatch"]
        assert o["ok"] == (rank, (rank,), 2)
        assert o["sum"] == [3.0, 3.0, 3.0]
        assert o["summary"] == {("all_reduce", 0, "forward"): 1}
        assert "local piece has shape (5,)" in o["bad_shape"] and "(4,)" in o["bad_shape"]


# ---- process groups shared between meshes --------------------------------------------
def _shared_groups_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    first = MeshGroups(Mesh((world,)))
    second = MeshGroups(Mesh((world,), ("dp",)))  # the same line of ranks under another name
    out = {"shared": first.axis_group(0) is second.axis_group(0)}
    if rank == 1:  # one rank loses the group (as a mesh shut down after a failure on some ranks only)
        dist.destroy_process_group(first.axis_group(0))
    third = MeshGroups(Mesh((world,)))  # every rank makes a new one: rank 0 alone reusing its own would hang rank 1
    out["fresh"] = third.axis_group(0) is not first.axis_group(0)
    x = torch.full((2,), float(rank + 1))
    dist.all_reduce(x, group=third.axis_group(0))
    out["sum"] = x.tolist()
    return out


def test_meshes_share_process_groups_and_remake_the_ones_a_rank_lost():
    """Two meshes over the same lines of ranks share their groups (each gloo group keeps a thread polling every
    10 ms: groups made per compile slowed every later step); a group one rank destroyed is made again on all."""
    for o in run_ranks(_shared_groups_worker, 2, init=True):
        assert o == {"shared": True, "fresh": True, "sum": [3.0, 3.0]}, o
