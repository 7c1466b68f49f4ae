"""Search at scale: repeated blocks found by structure, and the chained search exact
against the flat DP and CP-SAT, to the picosecond."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import transformers
from chain_cases import mixed, owned, rest_variant, variant
from search_problems import chain_problem, transformer_like_problem

from autopar.capture.export import capture
from autopar.capture.repeat import find_blocks
from autopar.mesh import Mesh
from autopar.models import load_model, model_config
from autopar.planner.driver import prepare
from autopar.planner.problem_tables import to_problem
from autopar.search import BeatenError, InfeasibleError, Start, min_memory, solve_cpsat, solve_dp
from autopar.search.chain import ChainError, solve_chain
from autopar.search.problem import INF


def _tiny(name: str, layers: int):
    """A built-in tiny model with ``layers`` layers (meta device), its args and kwargs."""
    cfg = model_config(name)
    kwargs = dict(cfg["config"], use_cache=False)
    key = "n_layer" if cfg["builder"] == "gpt2" else "num_hidden_layers"
    kwargs[key] = layers
    config_cls, model_cls = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[cfg["builder"]]
    with torch.device("meta"):
        model = model_cls(config_cls(**kwargs))
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


@pytest.mark.parametrize("name,layers", [("gpt2-tiny", 2), ("llama-tiny", 2), ("gpt2-tiny", 4), ("llama-tiny", 5)])
def test_block_detection_finds_every_layer(name: str, layers: int) -> None:
    if layers == 2:
        model, args, kwargs = load_model(name, batch=2, seq=16)
    else:
        model, args, kwargs = _tiny(name, layers)
    graph = capture(model, args, kwargs)
    blocks = find_blocks(graph, min_count=2)
    assert blocks is not None and blocks.count == layers
    assert blocks.indices == tuple(range(layers))
    assert len({len(b) for b in blocks.nodes}) == 1
    # every block holds its own layer's parameters, the same number each
    per_block = [sum(graph.nodes[v].kind == "param" for v in b) for b in blocks.nodes]
    assert len(set(per_block)) == 1 and per_block[0] >= 4
    for i, b in enumerate(blocks.nodes):
        fqns = [graph.nodes[v].fqn for v in b if graph.nodes[v].kind == "param"]
        assert all(f".{i}." in f for f in fqns)


class _Distinct(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 12), torch.nn.Linear(12, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_no_blocks_without_repeats() -> None:
    graph = capture(_Distinct(), (torch.randn(4, 8),))
    assert find_blocks(graph, min_count=2) is None


def _chain_case(seed: int):
    """Seeds below 100: 3..6 blocks.  From 100: chains of 9..40 blocks, so the halving tree
    has several levels (the outside bounds O_l, shared by every use of a segment length,
    and the rising targets are exercised)."""
    rng = np.random.default_rng(seed)
    if seed >= 100:
        return chain_problem(seed, int(rng.choice([9, 13, 24, 40])), 2, 3, float(rng.choice([0.02, 0.1, 0.3])))
    blocks_n = int(rng.integers(3, 7))
    size = int(rng.integers(2, 5))
    k = int(rng.integers(2, 4))
    quantile = float(rng.choice([0.01, 0.05, 0.15, 0.3, 0.6]))
    return chain_problem(seed, blocks_n, size, k, quantile)


@pytest.mark.parametrize("seed", [*range(60), *range(100, 108)])
def test_chain_equals_flat_dp_and_cpsat_on_random_chains(seed: int) -> None:
    problem, blocks = _chain_case(seed)
    try:
        want = solve_dp(problem)
    except InfeasibleError as err:
        with pytest.raises(InfeasibleError) as got:
            solve_chain(problem, blocks)
        assert got.value.min_mem_bytes == err.min_mem_bytes
        return
    got = solve_chain(problem, blocks)
    assert got.solver == "chain" and got.optimal
    assert problem.evaluate(got.choice) == (got.time, got.mem_bytes)
    assert problem.forbidden_in(got.choice) == []
    assert got.mem_bytes <= problem.mem_cap_bytes
    assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)
    if seed % 6 == 0 and seed < 100:
        ref = solve_cpsat(problem, time_limit_s=30)
        assert ref.optimal and ref.time == got.time


@pytest.mark.parametrize("seed", [2, 7, 104])
def test_chain_is_exact_at_every_cap_of_a_sweep(seed: int) -> None:
    """Caps in random order on one problem (``with_cap`` shares the chain, and the Lagrange rows start from the
    plans earlier caps met): each the flat DP's optimum at that cap."""
    problem, blocks = _chain_case(seed)
    least, most = min_memory(problem).mem_bytes, solve_dp(problem.with_cap(None)).mem_bytes
    caps = np.random.default_rng(seed).permutation(np.linspace(least, most, 9).astype(int))
    for cap in caps.tolist():
        got, want = solve_chain(problem.with_cap(cap), blocks), solve_dp(problem.with_cap(cap))
        assert got.optimal and (got.time, got.mem_bytes) == (want.time, want.mem_bytes)


@pytest.mark.parametrize("rel_gap", [0.01, 0.05])
def test_a_search_with_a_gap_returns_a_plan_proven_within_it(rel_gap: float) -> None:
    """``rel_gap`` (the planner's PLAN_GAP): the plan is real, fits, and its time is within the gap of the exact
    optimum, which the reported lower bound does not pass; where the search stopped early it says so."""
    stopped = 0
    cases = [_chain_case(seed) for seed in range(30)]
    cases += [(transformer_like_problem(4, 4, seed=seed, cap_fraction=0.3), None) for seed in range(4)]
    for problem, blocks in cases:
        try:
            exact = solve_dp(problem)
        except InfeasibleError:
            continue
        got = solve_chain(problem, blocks, rel_gap=rel_gap) if blocks else solve_dp(problem, rel_gap=rel_gap)
        assert problem.evaluate(got.choice) == (got.time, got.mem_bytes)
        assert got.mem_bytes <= problem.mem_cap_bytes
        assert got.time_lower_bound <= exact.time <= got.time
        assert got.time - got.time_lower_bound <= rel_gap * got.time
        if got.optimal:
            assert (got.time, got.mem_bytes) == (exact.time, exact.mem_bytes)
        else:
            stopped += 1
            assert got.stats["gap"] == pytest.approx((got.time - got.stats["lower_bound"]) / got.time)
    assert stopped >= 5  # the gap did stop searches early (else this test checks nothing)


def test_chain_rejects_blocks_that_differ() -> None:
    problem, blocks = chain_problem(3, 4, 3, 3, None)
    nt = list(problem.node_time)
    nt[blocks[2][0]] = nt[blocks[2][0]] + 1  # block 2 no longer equals block 1
    changed = type(problem)(
        problem.names, tuple(nt), problem.node_mem, problem.edges, problem.edge_time, problem.edge_mem, None
    )
    with pytest.raises(ChainError, match="tables of block 2"):
        solve_chain(changed, blocks)


@pytest.fixture(scope="module")
def gpt2_tiny_4_ctx():
    """A 4-layer gpt2-tiny on a 2x2 mesh, prepared."""
    model, args, kwargs = _tiny("gpt2-tiny", 4)
    ctx = prepare(model, Mesh((2, 2), axis_names=("dp", "tp")), example_inputs=args, example_kwargs=kwargs)
    assert ctx.blocks is not None and ctx.blocks.count == 4
    return ctx


@pytest.fixture(scope="module")
def gpt2_tiny_4(gpt2_tiny_4_ctx):
    """The 4-layer gpt2-tiny's problem, blocks, least memory and min-time memory."""
    ctx = gpt2_tiny_4_ctx
    problem, _ = to_problem(ctx.tables, None)
    fastest = solve_dp(problem)
    return problem, [list(b) for b in ctx.blocks.nodes], min_memory(problem).mem_bytes, fastest


@pytest.mark.parametrize("fraction", [0.05, 0.4, None])
def test_chain_equals_flat_dp_on_a_model(gpt2_tiny_4, fraction) -> None:
    problem, blocks, low, fastest = gpt2_tiny_4
    assert fastest.mem_bytes > low  # a cap between them really trades time for memory
    if fraction is not None:
        problem = problem.with_cap(int(low + fraction * (fastest.mem_bytes - low)))
    got = solve_chain(problem, blocks)
    want = fastest if fraction is None else solve_dp(problem)
    assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)
    if fraction is not None:
        assert got.time > fastest.time and got.mem_bytes <= problem.mem_cap_bytes


def test_chain_stops_early_only_when_its_bound_beats_the_plan_in_hand(gpt2_tiny_4) -> None:
    """``above`` (a time another search met): the chain gives up when its lower bound is above it, and solves
    exactly otherwise (the planner's recompute modes use it to skip a mode that cannot win)."""
    problem, blocks, low, fastest = gpt2_tiny_4
    capped = problem.with_cap(int(low + 0.4 * (fastest.mem_bytes - low)))
    want = solve_dp(capped)
    with pytest.raises(BeatenError) as err:
        solve_chain(capped, blocks, start=Start(above=fastest.time // 2))
    assert fastest.time // 2 < err.value.lower_bound_ps <= want.time
    got = solve_chain(capped, blocks, start=Start(above=want.time))  # the optimum itself is not beaten by it
    assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)


def test_chain_deepening_stops_once_a_pass_proves_every_plan_slower_than_the_plan_in_hand(gpt2_tiny_4) -> None:
    """``above`` between the Lagrange bound and the optimum: the first check passes, and the deepening's targets
    stop at ``above`` (``deepen``, Beaten): a pass there finds no plan within it, so every plan is slower and the
    search raises with a bound no lower than ``above``; at the optimum itself it returns the optimum."""
    problem, blocks, low, fastest = gpt2_tiny_4
    capped = problem.with_cap(int(low + 0.4 * (fastest.mem_bytes - low)))
    want = solve_chain(capped, blocks)
    lagrange = want.stats["lower_bound"]
    assert lagrange < want.time - 2  # the cap binds: the first check alone cannot stop a search above it
    for above in (int(lagrange) + 1, int((lagrange + want.time) / 2), want.time - 1):
        with pytest.raises(BeatenError) as err:
            solve_chain(capped, blocks, start=Start(above=above))
        assert above <= err.value.lower_bound_ps <= want.time
    got = solve_chain(capped, blocks, start=Start(above=want.time))
    assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)


def test_chain_names_the_least_memory_when_the_cap_is_too_small(gpt2_tiny_4) -> None:
    problem, blocks, low, _ = gpt2_tiny_4
    with pytest.raises(InfeasibleError) as err:
        solve_chain(problem.with_cap(low - 1), blocks)
    assert err.value.min_mem_bytes == low
    # the chain's least-memory plan (the optimum under cap = least memory) breaks ties by time, as the flat one
    flat = min_memory(problem)
    got = err.value.min_mem_solution
    assert (got.mem_bytes, got.time) == (flat.mem_bytes, flat.time) == problem.evaluate(got.choice)[::-1]
    assert solve_chain(problem.with_cap(low), blocks).mem_bytes == low


def test_chained_plan_matches_the_flat_plan_per_block(gpt2_tiny_4) -> None:
    """Same optimum, and the same placement for (almost) every block node: the two solvers
    differ only where the optimum has ties."""
    problem, blocks, _, fastest = gpt2_tiny_4
    got = solve_chain(problem, blocks)
    assert (got.time, got.mem_bytes) == (fastest.time, fastest.mem_bytes)
    same = sum(got.choice[v] == fastest.choice[v] for b in blocks for v in b)
    assert same / sum(map(len, blocks)) > 0.9


def test_another_cap_reuses_the_block_tables(gpt2_tiny_4) -> None:
    """Plan reuse: a cap copy shares the arrays and the chain's tables; the plans equal cold ones."""
    problem, blocks, low, fastest = gpt2_tiny_4
    base = problem.with_cap(None)
    base.forget()
    caps = [None, int(low + 0.4 * (fastest.mem_bytes - low)), int(low + 0.05 * (fastest.mem_bytes - low))]
    warm = [solve_chain(base.with_cap(c), blocks) for c in caps]
    assert [s.stats["tables_reused"] for s in warm] == [False, True, True]
    for cap, sol in zip(caps, warm):
        cold = to_problem_cold(problem, cap)
        want = solve_chain(cold, blocks)
        assert not want.stats["tables_reused"]
        assert (sol.time, sol.mem_bytes) == (want.time, want.mem_bytes)


def to_problem_cold(problem, cap):
    """The same problem rebuilt from its arrays (nothing derived shared), under ``cap``."""
    return type(problem)(
        problem.names, problem.node_time, problem.node_mem, problem.edges, problem.edge_time, problem.edge_mem, cap
    )


def test_breakdown_reads_the_search_tables(gpt2_tiny_4_ctx, gpt2_tiny_4) -> None:
    """The plan's breakdown is the objective the search minimized: memory to the byte, time
    to the picosecond per term (it reads the ProblemTables, it prices nothing again)."""
    from autopar.planner.assemble import breakdown

    ctx = gpt2_tiny_4_ctx
    problem, blocks, low, fastest = gpt2_tiny_4
    for cap in (None, int(low + 0.05 * (fastest.mem_bytes - low))):
        sol = solve_chain(problem.with_cap(cap), blocks)
        b = breakdown(ctx, list(sol.choice))
        assert b.memory.search_bytes == sol.mem_bytes  # the additive bound the search kept
        assert b.memory.per_device_bytes >= b.memory.params_bytes + b.memory.optimizer_bytes  # the peak
        terms = problem.n_nodes + len(problem.edges)
        assert abs(b.cost.total_s * 1e12 - sol.time) <= 0.5 * terms
        assert b.cost.comm_s >= 0 and b.cost.compute_s > 0


def test_a_plan_stopped_within_the_planners_gap_says_how_close(gpt2_tiny_4_ctx, monkeypatch) -> None:
    """planner.solving.PLAN_GAP: a search stopped once its plan is proven close reports that bound, in the plan
    and its table, and the plan is within it of the exact optimum (PLAN_GAP 0)."""
    from autopar.planner import solving
    from autopar.planner.driver import plan_from_context
    from autopar.planner.plan_table import render_table

    ctx = gpt2_tiny_4_ctx
    free = plan_from_context(ctx, compare_families=False, recompute="none")
    cap = int(free.memory.per_device_bytes * 0.8)
    monkeypatch.setattr(solving, "PLAN_GAP", 0.0)
    monkeypatch.setattr(solving, "PROBE_GAP", 0.0)  # the peak loop's searches too: a bisected plan keeps its probe
    exact = plan_from_context(ctx, mem_cap=cap, compare_families=False, recompute="none")
    assert exact.search.optimal and exact.search.gap is None
    monkeypatch.setattr(solving, "PLAN_GAP", 0.25)
    near = plan_from_context(ctx, mem_cap=cap, compare_families=False, recompute="none")
    s = near.search
    assert not s.optimal and 0 < s.gap <= 0.25
    assert s.lower_bound_ps <= exact.search.objective_ps <= s.objective_ps
    assert s.gap == pytest.approx(1 - s.lower_bound_ps / s.objective_ps)
    assert near.memory.per_device_bytes <= cap
    assert f"within {100 * s.gap:.3f}% of the optimum" in " ".join(render_table(near).split())


def test_a_plan_past_its_search_budget_says_so(gpt2_tiny_4_ctx) -> None:
    """search_budget_s: a budget spent before the first search still gives a plan under the cap (the searches
    return the plans they hold), marked in the plan and its table, no faster than the exact plan."""
    from autopar.planner.driver import plan_from_context
    from autopar.planner.plan_table import render_table

    ctx = gpt2_tiny_4_ctx
    free = plan_from_context(ctx, compare_families=False, recompute="none")
    cap = int(free.memory.per_device_bytes * 0.8)
    exact = plan_from_context(ctx, mem_cap=cap, compare_families=False)
    rushed = plan_from_context(ctx, mem_cap=cap, compare_families=False, search_budget_s=1e-9)
    assert rushed.search.budget_hit and rushed.search.budget_s == 1e-9
    assert rushed.memory.per_device_bytes <= cap
    assert rushed.search.objective_ps >= exact.search.objective_ps * (1 - 2.0**-12)
    assert "the search stopped at its time budget (1e-09 s)" in " ".join(render_table(rushed).split())
    assert not exact.search.budget_hit


def test_cap_sweep_walks_the_trade_off_until_infeasible(gpt2_tiny_4_ctx) -> None:
    """Issue 5, done-when 3: lowering the cap step by step (the prepared context reused)
    gives plans no faster and no larger, each within its cap, until no plan fits; the
    error then names the smallest memory reachable, and that cap is feasible."""
    from autopar.planner.driver import MemoryCapError, plan_from_context

    ctx = gpt2_tiny_4_ctx
    plans, cap, error = [], None, None
    while error is None:
        try:
            plan = plan_from_context(ctx, mem_cap=cap, compare_families=False)
        except MemoryCapError as err:
            error = err
            continue
        assert cap is None or plan.memory.per_device_bytes <= cap
        plans.append(plan)
        cap = int(plan.memory.per_device_bytes * 0.7)
    times = [p.search.objective_ps for p in plans]
    mems = [p.memory.per_device_bytes for p in plans]
    assert len(plans) >= 3 and times == sorted(times) and mems == sorted(mems, reverse=True)
    assert mems[-1] > cap and error.min_mem_bytes > cap
    assert "smallest per-device memory any plan reaches" in str(error)
    at_least = plan_from_context(ctx, mem_cap=error.min_mem_bytes, compare_families=False)
    assert at_least.memory.per_device_bytes <= error.min_mem_bytes  # reachable (the peak of the least-memory
    # plan of the search's additive bound; another plan may peak lower: autopar.cost.peak)


@pytest.mark.parametrize("k", [1, 3, 7, 48])
def test_triples_from_nonempty_entries_equal_the_dense_grid(k: int) -> None:
    from autopar.search.segments import _triples

    rng = np.random.default_rng(k)
    for density in (0.0, 0.05, 0.5, 1.0):
        ca, cb = rng.random((k, k)) < density, rng.random((k, k)) < density
        ia, ib, ic = np.nonzero(ca[:, :, None] & cb[None, :, :])
        ea, eb = _triples(np.flatnonzero(ca.reshape(-1)), np.flatnonzero(cb.reshape(-1)), k)
        assert np.array_equal(ea, ia * k + ib) and np.array_equal(eb, ib * k + ic)


@pytest.mark.parametrize("n_blocks", [1, 2, 3, 7, 13, 96])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_equals_flat_dp_at_any_depth_under_tight_caps(n_blocks: int, seed: int) -> None:
    """Odd and even block counts (the halving tree's lengths l//2 and l - l//2 differ), caps
    between the least memory and the fastest plan's: the chained optimum is the flat one.
    Under 3 blocks the chain refuses (the planner then solves flat)."""
    problem, blocks = chain_problem(seed, n_blocks, 3, 3, None)
    if n_blocks < 3:
        with pytest.raises(ChainError, match="need >= 3 blocks"):
            solve_chain(problem, blocks)
        return
    fastest, low = solve_dp(problem), min_memory(problem).mem_bytes
    for fraction in (0.0, 0.05, 0.4, None):
        capped = problem if fraction is None else problem.with_cap(int(low + fraction * (fastest.mem_bytes - low)))
        want, got = solve_dp(capped), solve_chain(capped, blocks)
        assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)
        assert capped.evaluate(got.choice) == (got.time, got.mem_bytes)


@pytest.mark.parametrize("seed", [0, 1, 2, 100, 101, 103])
def test_chain_is_exact_whichever_bound_rows_the_products_test(monkeypatch, seed: int) -> None:
    """The products test the first bound row on every combination and the others only where a sample says they
    cut (``segments._survivors``).  With a sample of 4 and a row kept only when it cuts every sampled combination,
    almost every row is skipped: the optimum must still be the flat DP's (skipping a row keeps pairs, never
    loses one), and the lead row's prefixes (``segments._LeadOrder``) must not drop a pair it passes."""
    from autopar.search import segments

    monkeypatch.setattr(segments, "_SAMPLE", 4)
    monkeypatch.setattr(segments, "_MIN_CUT", 1.0)
    problem, blocks = _chain_case(seed)
    fastest, low = solve_dp(problem.with_cap(None)), min_memory(problem).mem_bytes
    for fraction in (0.0, 0.1, 0.5):
        capped = problem.with_cap(int(low + fraction * (fastest.mem_bytes - low)))
        want, got = solve_dp(capped), solve_chain(capped, blocks)
        assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)


def test_lead_order_prefix_counts_the_pairs_within_the_slack() -> None:
    """Per query, the pairs of its entry whose row value is <= the slack, against counting them directly."""
    from autopar.search.segments import _LeadOrder

    rng = np.random.default_rng(7)
    counts = rng.integers(0, 6, 20)
    off = np.concatenate([[0], np.cumsum(counts)])
    bval = rng.integers(0, 9, (3, int(off[-1]))).astype(float)
    lead = _LeadOrder(off, bval, 1)
    e = rng.integers(0, 20, 200)
    s = rng.integers(-1, 10, 200).astype(float)
    got = lead.prefix(e, s)
    want = [int((bval[1, off[x] : off[x + 1]] <= y).sum()) for x, y in zip(e, s)]
    assert got.tolist() == want
    for x in range(20):  # the order lists the entry's pairs, by value
        seg = lead.order[off[x] : off[x + 1]]
        assert sorted(seg.tolist()) == list(range(off[x], off[x + 1]))
        assert np.all(np.diff(bval[1, seg]) >= 0)


def _with_folds(seed: int, n_blocks: int, *, differ: int | None = None):
    """chain_problem with a second one-strategy node ``C2`` feeding node 1 of every block
    (so node 1 folds two edges, C's and C2's, the second with a forbidden entry), every
    fold edge a separate copy of equal values (equal blocks not seen by identity);
    ``differ``: that block's C2 edge costs one more."""
    problem, blocks = chain_problem(seed, n_blocks, 3, 3, None)
    at = problem.names.index("C") + 1  # C2 goes right after C: later nodes shift by one
    shift = np.arange(problem.n_nodes) + (np.arange(problem.n_nodes) >= at)
    fed = {int(shift[b[1]]) for b in blocks}
    k1 = problem.num_choices[blocks[0][1]]
    row = np.arange(1, k1 + 1, dtype=np.int64)[None, :] * 7
    row[0, -1] = INF if k1 > 1 else row[0, -1]  # choice 0 stays allowed: a plan exists
    edges, et, em = [], [], []
    for (u, v), t, m in zip(problem.edges, problem.edge_time, problem.edge_mem):
        edges.append((int(shift[u]), int(shift[v])))
        et.append(t.copy() if int(shift[v]) in fed else t)
        em.append(None if m is None else (m.copy() if int(shift[v]) in fed else m))
    for i, v in enumerate(sorted(fed)):
        edges.append((at, v))
        et.append(np.where(row >= INF, INF, row + (i == differ)))
        em.append(np.full((1, k1), 3, np.int64))
    order = sorted(range(len(edges)), key=lambda e: (edges[e][1], edges[e][0]))
    names = list(problem.names)
    names.insert(at, "C2")
    one = np.zeros(1, np.int64)
    folded = type(problem)(
        tuple(names),
        (*problem.node_time[:at], one, *problem.node_time[at:]),
        (*problem.node_mem[:at], one, *problem.node_mem[at:]),
        tuple(edges[e] for e in order),
        tuple(et[e] for e in order),
        tuple(em[e] for e in order),
        None,
        problem.base_mem_bytes,
    )
    return folded, [[int(shift[v]) for v in b] for b in blocks]


@pytest.mark.parametrize("n_blocks", [3, 13, 40])
def test_folds_of_copies_and_of_two_producers_chain_exactly(n_blocks: int) -> None:
    """One-strategy producers outside the blocks fold into the blocks' costs by value (the
    copies are equal tables, not the same arrays), two into one node one after the other,
    INF kept; the chained optimum is the flat one at every cap."""
    problem, blocks = _with_folds(5, n_blocks)
    fastest, low = solve_dp(problem), min_memory(problem).mem_bytes
    for fraction in (0.05, 0.4, None):
        capped = problem if fraction is None else problem.with_cap(int(low + fraction * (fastest.mem_bytes - low)))
        want, got = solve_dp(capped), solve_chain(capped, blocks)
        assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)
        assert capped.forbidden_in(got.choice) == []


def test_a_fold_that_differs_in_one_block_is_refused() -> None:
    problem, blocks = _with_folds(5, 7, differ=4)  # the 5th block fed (block 4) gets other costs
    with pytest.raises(ChainError, match="tables of block 4"):
        solve_chain(problem, blocks)


@pytest.mark.parametrize("k", [1, 2, 9, 63])
def test_minplus_equals_the_dense_product(k: int) -> None:
    from autopar.search.minplus import minplus

    rng = np.random.default_rng(k)
    x, y = rng.integers(0, 1000, (3, k, k)).astype(float), rng.integers(0, 1000, (3, k, k)).astype(float)
    x[rng.random(x.shape) < 0.3], y[rng.random(y.shape) < 0.3] = np.inf, np.inf
    dense = (x[:, :, :, None] + y[:, None, :, :]).min(axis=2)
    assert np.array_equal(minplus(x, y), dense)


def test_chain_with_variants_picks_each_blocks_variant_as_brute_force_does() -> None:
    """Each block may take the terms of either problem (recompute a layer or not, per layer): the chain's optimum
    equals the best flat optimum over every assignment of variants to blocks, and its plan re-evaluates to it."""
    mixes = 0
    for seed, fraction in itertools.product(range(6), (0.2, 0.5)):
        problem, blocks = chain_problem(seed, n_blocks=3, block_nodes=3, max_k=3, cap_quantile=None)
        other = variant(problem, blocks, seed)
        least = min(min_memory(problem).mem_bytes, min_memory(other).mem_bytes)
        capped = problem.with_cap(int(least + fraction * (solve_dp(problem).mem_bytes - least)))
        best = None
        for picks in itertools.product((0, 1), repeat=len(blocks)):
            try:
                sol = solve_dp(mixed(capped, other, blocks, picks))
            except InfeasibleError:
                continue
            if best is None or (sol.time, sol.mem_bytes) < best[:2]:
                best = (sol.time, sol.mem_bytes, picks)
        got = solve_chain(capped, blocks, variants=(other.with_cap(capped.mem_cap_bytes),))
        where = f"seed {seed}, cap at {fraction}: chain {got.stats['block_variants']}, brute force {best}"
        assert (got.time, got.mem_bytes) == best[:2], where
        picks = got.stats["block_variants"]
        assert mixed(capped, other, blocks, picks).evaluate(got.choice) == (got.time, got.mem_bytes), where
        mixes += len(set(picks)) > 1
    assert mixes >= 4  # the optimum really mixes the variants across blocks, not only all of one


def test_chain_with_rest_variants_picks_the_rest_and_each_block_as_brute_force_does() -> None:
    """The rest of the graph may be recomputed too (its own terms change) while each block picks its variant:
    the chain's optimum equals the best flat optimum over every assignment of a rest option and a variant per
    block, its plan re-evaluates to it, and a rest variant that changes the blocks is refused."""
    used_rest = 0
    for seed, fraction in itertools.product(range(6), (0.15, 0.5)):
        problem, blocks = chain_problem(seed, n_blocks=3, block_nodes=3, max_k=3, cap_quantile=None)
        other = variant(problem, blocks, seed)
        by_rest = [problem, other, rest_variant(problem, blocks, seed), rest_variant(other, blocks, seed)]
        least = min(min_memory(p).mem_bytes for p in by_rest)
        cap = int(least + fraction * (solve_dp(problem).mem_bytes - least))
        best = None
        for rest, *picks in itertools.product((0, 1), repeat=len(blocks) + 1):
            # the rest and B_0 from one problem, blocks 1.. each from its own variant
            mixed = owned(by_rest, blocks, (2 * rest + picks[0], *picks[1:])).with_cap(cap)
            try:
                sol = solve_dp(mixed)
            except InfeasibleError:
                continue
            if best is None or (sol.time, sol.mem_bytes) < best[:2]:
                best = (sol.time, sol.mem_bytes, rest, picks)
        got = solve_chain(
            problem.with_cap(cap),
            blocks,
            variants=(other.with_cap(cap),),
            rest_variants=tuple(p.with_cap(cap) for p in by_rest[2:]),
        )
        picks = got.stats["block_variants"]
        where = f"seed {seed}, cap at {fraction}: chain {picks}, brute force {best}"
        assert (got.time, got.mem_bytes) == best[:2], where
        assert owned(by_rest, blocks, picks).evaluate(got.choice) == best[:2], where
        used_rest += picks[0] >= 2
    assert used_rest >= 3  # the optimum recomputes the rest in some cases, not in all
    problem, blocks = chain_problem(0, n_blocks=3, block_nodes=3, max_k=3, cap_quantile=None)
    changes_blocks = variant(rest_variant(problem, blocks, 0), blocks, 7)
    with pytest.raises(ChainError, match="rest variant 0 changes the terms of blocks 1"):
        solve_chain(problem, blocks, rest_variants=(changes_blocks,))
