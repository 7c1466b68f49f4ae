"""Wide blocks (three-axis meshes): the chain past the flat search's width budget, min-sum passes in slices, the
min-plus product on torch's kernels, and the chain without a cap on its time row alone: each the same optimum
as the flat DP, to the picosecond, and the same floats as the one-shot passes."""

from __future__ import annotations

import numpy as np
import pytest
from search_problems import chain_problem, transformer_like_problem

import autopar.search.chain_tables as chain_tables
import autopar.search.dp as dp_module
import autopar.search.elimination as elimination
from autopar.search import solve_dp
from autopar.search.chain import ChainError, solve_chain
from autopar.search.elimination import EliminationModel, inside, outside
from autopar.search.minplus import _TORCH_CELLS, minplus


@pytest.mark.parametrize("seed", range(8))
def test_min_sum_passes_in_slices_give_the_same_floats(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside values, argmins and outside values of every table, one-shot against slices of a few cells (torch's
    kernels), on a transformer-like problem and on a chain part with its ports kept (a final table, not a
    scalar)."""
    problem = transformer_like_problem(3, 5 + seed % 3, seed, cap_fraction=None)
    chained, blocks = chain_problem(seed, 4, 6, 4, cap_quantile=None)
    ports = frozenset(blocks[1][:2])
    rng = np.random.default_rng(seed)
    w = np.stack([[1.0, 0.0], [0.0, 1.0], rng.random(2)])
    for prob, keep in ((problem, frozenset()), (chained, ports)):
        model = EliminationModel(prob, keep=keep)
        whole_vals, whole_args = inside(model, w)
        whole_outs = outside(model, whole_vals)
        monkeypatch.setattr(elimination, "SLICE_CELLS", 8)
        assert any(len(elimination._slices(st, len(w))) > 1 for st in model.steps)  # the sliced path ran
        vals, args = inside(model, w)
        outs = outside(model, vals)
        monkeypatch.undo()
        for a, b in zip(whole_vals + whole_outs, vals + outs):
            assert (a is None and b is None) or np.array_equal(np.asarray(a), np.asarray(b))
        assert whole_args.keys() == args.keys()
        assert all(np.array_equal(whole_args[t], args[t]) for t in args)


@pytest.mark.parametrize("seed", range(8))
def test_steps_of_two_sides_as_min_plus_products_give_the_min_sum_values(seed: int, monkeypatch) -> None:
    """A step whose inputs lie on two sides of its node (``elimination._sides``) runs as a min-plus product in
    both passes: its inside and outside values equal the joint's (exactly on the integer rows, to float rounding
    on a mixed one: the sides are summed before they meet), and the capped chained search finds the same plan."""
    problem = transformer_like_problem(3, 5 + seed % 3, seed, cap_fraction=None)
    chained, blocks = chain_problem(seed, 4, 6, 4, cap_quantile=None)
    rng = np.random.default_rng(seed)
    w = np.stack([[1.0, 0.0], [0.0, 1.0], rng.random(2)])
    ran = 0
    for prob, keep in ((problem, frozenset()), (chained, frozenset(blocks[1][:2]))):
        model = EliminationModel(prob, keep=keep)
        joint_vals, _ = inside(model, w, argmins=False)
        joint_outs = outside(model, joint_vals)
        monkeypatch.setattr(elimination, "PRODUCT_CELLS", 1)
        monkeypatch.setattr(elimination, "PASS_CELLS", 1)
        ran += sum(elimination._sides(model, st) is not None for st in model.steps)
        vals, _ = inside(model, w, argmins=False)
        outs = outside(model, vals)
        monkeypatch.undo()
        for a, b in zip(joint_vals + joint_outs, vals + outs):
            if a is not None:
                assert np.array_equal(a[:2], b[:2]) and np.allclose(a[2], b[2], rtol=1e-12)
    assert ran  # the product ran
    fastest, least = solve_dp(chained), dp_module.min_memory(chained).mem_bytes
    capped = chained.with_cap((fastest.mem_bytes + least) // 2)
    want = solve_chain(capped, blocks)
    capped.forget()
    monkeypatch.setattr(elimination, "PRODUCT_CELLS", 1)
    monkeypatch.setattr(elimination, "PASS_CELLS", 1)
    got = solve_chain(capped, blocks)
    assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)


@pytest.mark.parametrize("k", [80, 160])
def test_minplus_on_torch_equals_the_dense_product(k: int) -> None:
    """Past ``_TORCH_CELLS`` the product runs on torch: the same floats as the dense min, ``inf`` kept."""
    rng = np.random.default_rng(k)
    x, y = rng.integers(0, 10**12, (3, k, k)).astype(float), rng.integers(0, 10**12, (3, k, k)).astype(float)
    assert x.size >= _TORCH_CELLS
    x[rng.random(x.shape) < 0.3], y[rng.random(y.shape) < 0.3] = np.inf, np.inf
    x[0, 0, :] = np.inf  # a state with no way out
    dense = (x[:, :, :, None] + y[:, None, :, :]).min(axis=2)
    got = minplus(x, y.transpose(0, 2, 1).copy().transpose(0, 2, 1))  # a strided operand too
    assert isinstance(got, np.ndarray) and np.array_equal(got, dense)


@pytest.mark.parametrize("seed", range(12))
def test_chain_without_a_cap_equals_the_flat_optimum(seed: int) -> None:
    """No cap: the chain's bounds come from the time row alone; the plan is the flat DP's, ties by memory."""
    problem, blocks = chain_problem(seed, 3 + seed % 5, 5, 2 + seed % 3, cap_quantile=None)
    assert problem.mem_cap_bytes is None
    got, want = solve_chain(problem, blocks), solve_dp(problem)
    assert got.optimal and got.stats["rows"] == 1
    assert problem.evaluate(got.choice) == (got.time, got.mem_bytes) == (want.time, want.mem_bytes)


def test_a_block_past_the_flat_budget_chains_within_the_block_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's budget is its own: a block wider than the flat search's budget (which would approximate) still
    chains exactly; wider than the block budget, it does not."""
    problem, blocks = chain_problem(3, 5, 6, 4, cap_quantile=0.3)
    want = solve_dp(problem)
    monkeypatch.setattr(dp_module, "WIDTH_BUDGET", 8)
    got = solve_chain(problem, blocks)
    assert got.optimal and (got.time, got.mem_bytes) == (want.time, want.mem_bytes)
    monkeypatch.setattr(chain_tables, "BLOCK_WIDTH_BUDGET", 8)
    fresh, fresh_blocks = chain_problem(3, 5, 6, 4, cap_quantile=0.3)  # the same, its tables not yet built
    with pytest.raises(ChainError, match="width budget of 8"):
        solve_chain(fresh, fresh_blocks)
