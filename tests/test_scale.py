"""Search at scale: repeated blocks found by structure, and the chained search exact
against the flat DP and CP-SAT, to the picosecond."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from autopar.capture import capture
from autopar.mesh import Mesh
from autopar.models import load_model, model_config
from autopar.planner import prepare
from autopar.problem_builder import to_problem
from autopar.repeat import find_blocks
from autopar.search import InfeasibleError, min_memory, solve_cpsat, solve_dp
from autopar.search.chain import ChainError, solve_chain
from autopar.search.generate import chain_problem


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
    rng = np.random.default_rng(seed)
    blocks_n = int(rng.integers(3, 7))
    size = int(rng.integers(2, 5))
    k = int(rng.integers(2, 4))
    quantile = float(rng.choice([0.01, 0.05, 0.15, 0.3, 0.6]))
    return chain_problem(seed, blocks_n, size, k, quantile)


@pytest.mark.parametrize("seed", range(60))
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
    if seed % 6 == 0:
        ref = solve_cpsat(problem, time_limit_s=30)
        assert ref.optimal and ref.time == got.time


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
def gpt2_tiny_4():
    """A 4-layer gpt2-tiny on a 2x2 mesh: its problem, blocks, least memory and min-time memory."""
    model, args, kwargs = _tiny("gpt2-tiny", 4)
    ctx = prepare(model, Mesh((2, 2), axis_names=("dp", "tp")), example_inputs=args, example_kwargs=kwargs)
    assert ctx.blocks is not None and ctx.blocks.count == 4
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


def test_chain_names_the_least_memory_when_the_cap_is_too_small(gpt2_tiny_4) -> None:
    problem, blocks, low, _ = gpt2_tiny_4
    with pytest.raises(InfeasibleError) as err:
        solve_chain(problem.with_cap(low - 1), blocks)
    assert err.value.min_mem_bytes == low
    assert solve_chain(problem.with_cap(low), blocks).mem_bytes == low


def test_chained_plan_matches_the_flat_plan_per_block(gpt2_tiny_4) -> None:
    """Same optimum, and the same placement for (almost) every block node: the two solvers
    differ only where the optimum has ties."""
    problem, blocks, _, fastest = gpt2_tiny_4
    got = solve_chain(problem, blocks)
    assert (got.time, got.mem_bytes) == (fastest.time, fastest.mem_bytes)
    same = sum(got.choice[v] == fastest.choice[v] for b in blocks for v in b)
    assert same / sum(map(len, blocks)) > 0.9
