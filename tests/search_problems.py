"""Synthetic search problems for tests and benchmarks.

* :func:`random_problem`: small random DAGs (a chain backbone, skip edges, sources)
  with small integer costs, so ties are common and exactness is really tested.
* :func:`chain_problem`: a prefix, ``L`` blocks with equal random tables joined
  through port nodes, constants feeding every block, and a suffix tied to the prefix:
  the repeated structure :mod:`.chain` solves once per block.
* :func:`transformer_like_problem`: the structure the cost model produces for a
  GPT-style training graph: parameters as sources (one consumer each, the tied
  embedding two: the first and the very last op), q/k/v fan-out, residual adds
  around every block, per-strategy shard factors and resharding matrices, a few
  forbidden strategies, and a memory cap placed between the min-memory plan and the
  min-time plan's memory so that it binds.

The magnitudes (tokens, hidden size, 100 TFLOP/s, 100 GB/s) are plausible shapes,
not calibrated data; they only need to make time and memory trade against each other.
"""

from __future__ import annotations

import logging

import numpy as np

from autopar.search import INF, SearchProblem

__all__ = ["random_problem", "chain_problem", "transformer_like_problem"]

logger = logging.getLogger(__name__)


def random_problem(
    seed: int,
    n_nodes: int,
    max_k: int,
    edge_prob: float = 0.2,
    cap_quantile: float | None = 0.3,
    *,
    inf_prob: float = 0.05,
    max_value: int = 100,
) -> SearchProblem:
    """A random DAG: node v reads v-1 with probability 0.8 (so some nodes are sources),
    and any earlier u with probability ``edge_prob`` (skip edges).

    Costs are integers below ``max_value``; with probability ``inf_prob`` a choice or a
    pair is forbidden (``INF``), never choice 0 nor pair (0, 0), so a plan always exists.
    The cap is the ``cap_quantile`` quantile of the memory of 256 random plans
    (``None``: no cap).
    """
    rng = np.random.default_rng(seed)
    ks = [int(x) for x in rng.integers(1, max_k + 1, n_nodes)]
    edges = [(v - 1, v) for v in range(1, n_nodes) if rng.random() < 0.8]
    edges += [(u, v) for v in range(2, n_nodes) for u in range(v - 1) if rng.random() < edge_prob]
    edges.sort(key=lambda e: (e[1], e[0]))

    def forbid(arr: np.ndarray) -> np.ndarray:
        mask = rng.random(arr.shape) < inf_prob
        mask.flat[0] = False
        return np.where(mask, INF, arr).astype(np.int64)

    node_time = tuple(forbid(rng.integers(0, max_value, k)) for k in ks)
    node_mem = tuple(rng.integers(0, max_value, k).astype(np.int64) for k in ks)
    edge_time = tuple(forbid(rng.integers(0, max_value, (ks[u], ks[v]))) for u, v in edges)
    edge_mem = tuple(
        None if rng.random() < 0.4 else rng.integers(0, max_value // 2 + 1, (ks[u], ks[v])).astype(np.int64)
        for u, v in edges
    )
    base = int(rng.integers(0, max_value))
    problem = SearchProblem(
        tuple(f"n{i}" for i in range(n_nodes)), node_time, node_mem, tuple(edges), edge_time, edge_mem, None, base
    )
    return _cap_at_quantile(problem, rng, cap_quantile)


def _cap_at_quantile(problem: SearchProblem, rng: np.random.Generator, quantile: float | None) -> SearchProblem:
    """The problem with its cap at the ``quantile`` of 256 random plans' memory (and the all-0 plan's)."""
    if quantile is None:
        return problem
    ks = problem.num_choices
    mems = []
    for _ in range(256):
        c = [int(rng.integers(0, k)) for k in ks]
        if not problem.forbidden_in(c):
            mems.append(problem.evaluate(c)[1])
    mems.append(problem.evaluate([0] * problem.n_nodes)[1])
    return problem.with_cap(int(np.quantile(mems, quantile)))


def chain_problem(
    seed: int,
    n_blocks: int,
    block_nodes: int,
    max_k: int,
    cap_quantile: float | None = 0.3,
    *,
    edge_prob: float = 0.3,
    inf_prob: float = 0.05,
    max_value: int = 100,
) -> tuple[SearchProblem, list[list[int]]]:
    """A random chain of ``n_blocks`` equal blocks and the blocks' node lists.

    Nodes: a tied source ``T``, an input, a one-strategy constant ``C`` and an op ``E``
    (reads ``T`` and the input); then the blocks (node 0 reads the previous block's port,
    the last node; the port also feeds a random later node; ``C`` feeds node 1; random
    forward edges inside); then ``H`` (reads the last port and ``T``) and a loss.  Block
    tables are drawn once and shared, the first block's in-edges from ``E`` separately.
    Choice 0 and pair (0, 0) are never forbidden, so a plan always exists.
    """
    if n_blocks < 1 or block_nodes < 2:
        raise ValueError(f"chain_problem(n_blocks={n_blocks}, block_nodes={block_nodes}): need >= 1 and >= 2")
    rng = np.random.default_rng(seed)

    def forbid(arr: np.ndarray) -> np.ndarray:
        mask = rng.random(arr.shape) < inf_prob
        mask.flat[0] = False
        return np.where(mask, INF, arr).astype(np.int64)

    def costs(ku: int, kv: int) -> tuple[np.ndarray, np.ndarray | None]:
        mem = None if rng.random() < 0.4 else rng.integers(0, max_value // 2 + 1, (ku, kv)).astype(np.int64)
        return forbid(rng.integers(0, max_value, (ku, kv))), mem

    names, node_time, node_mem = [], [], []
    edges: list[tuple[int, int]] = []
    edge_time, edge_mem = [], []

    def node(name: str, k: int, t: np.ndarray | None = None, m: np.ndarray | None = None) -> int:
        names.append(name)
        node_time.append(forbid(rng.integers(0, max_value, k)) if t is None else t)
        node_mem.append(rng.integers(0, max_value, k).astype(np.int64) if m is None else m)
        return len(names) - 1

    def edge(u: int, v: int, tm: tuple[np.ndarray, np.ndarray | None]) -> None:
        edges.append((u, v))
        edge_time.append(tm[0])
        edge_mem.append(tm[1])

    ks = [int(x) for x in rng.integers(1, max_k + 1, block_nodes)]
    port = block_nodes - 1
    ks[port] = max(ks[port], 2)
    tied = node("T", int(rng.integers(1, max_k + 1)))
    ids = node("input", int(rng.integers(1, max_k + 1)))
    const = node("C", 1)
    emb = node("E", int(rng.integers(2, max_k + 1)))
    edge(tied, emb, costs(node_time[tied].size, node_time[emb].size))
    edge(ids, emb, costs(node_time[ids].size, node_time[emb].size))
    bt = [forbid(rng.integers(0, max_value, k)) for k in ks]
    bm = [rng.integers(0, max_value, k).astype(np.int64) for k in ks]
    inner = [(u, v) for v in range(1, block_nodes) for u in range(v) if u == v - 1 or rng.random() < edge_prob]
    inner_costs = {(u, v): costs(ks[u], ks[v]) for u, v in inner}
    skip = int(rng.integers(1, block_nodes)) if block_nodes > 2 else 0
    link = {0: costs(ks[port], ks[0])}
    if skip:
        link[skip] = costs(ks[port], ks[skip])
    first = {v: costs(node_time[emb].size, ks[v]) for v in link}
    const_cost = costs(1, ks[min(1, block_nodes - 1)])
    blocks: list[list[int]] = []
    prev = emb
    for b in range(n_blocks):
        ids_b = [node(f"b{b}.{j}", ks[j], bt[j], bm[j]) for j in range(block_nodes)]
        for v, tm in (first if b == 0 else link).items():
            edge(prev, ids_b[v], tm)
        edge(const, ids_b[min(1, block_nodes - 1)], const_cost)
        for u, v in inner:
            edge(ids_b[u], ids_b[v], inner_costs[(u, v)])
        blocks.append(ids_b)
        prev = ids_b[port]
    head = node("H", int(rng.integers(1, max_k + 1)))
    edge(prev, head, costs(ks[port], node_time[head].size))
    edge(tied, head, costs(node_time[tied].size, node_time[head].size))
    loss = node("loss", 1)
    edge(head, loss, costs(node_time[head].size, 1))
    merged: dict[tuple[int, int], list] = {}
    for (u, v), t, m in zip(edges, edge_time, edge_mem):
        if (u, v) in merged:  # C feeding node 1 twice, or a skip onto node 0: add the matrices
            old = merged[(u, v)]
            old[0] = np.where((old[0] >= INF) | (t >= INF), INF, old[0] + t)
            old[1] = m if old[1] is None else (old[1] if m is None else old[1] + m)
        else:
            merged[(u, v)] = [t, m]
    order = sorted(merged, key=lambda e: (e[1], e[0]))
    problem = SearchProblem(
        tuple(names),
        tuple(node_time),
        tuple(node_mem),
        tuple(order),
        tuple(merged[e][0] for e in order),
        tuple(merged[e][1] for e in order),
        None,
        int(rng.integers(0, max_value)),
    )
    return _cap_at_quantile(problem, rng, cap_quantile), blocks


class _Builder:
    """Accumulates nodes (in topological order) and edges of a transformer-like graph."""

    def __init__(self, k: int, rng: np.random.Generator, chain_ops: float) -> None:
        self.k, self.rng, self.chain_ops = k, rng, chain_ops
        # One vocabulary of layouts shared by all nodes (same id = same layout, free edge).
        self.shard = np.concatenate([[1.0], rng.choice([2.0, 4.0, 8.0], k - 1)]) if k > 1 else np.ones(1)
        inv = 1.0 / self.shard
        self.reshard = np.abs(inv[:, None] - inv[None, :]) + 0.5 * rng.uniform(0.5, 1.5, (k, k)) * np.minimum(
            inv[:, None], inv[None, :]
        )
        np.fill_diagonal(self.reshard, 0.0)
        self.op_comm = rng.uniform(0.0, 1.0, k) * (rng.random(k) < 0.5)
        self.op_comm[0] = 0.0
        self.param_gather = rng.uniform(0.5, 1.5, k)
        self.names: list[str] = []
        self.layouts: list[np.ndarray] = []
        self.sizes: list[float] = []
        self.node_time: list[np.ndarray] = []
        self.node_mem: list[np.ndarray] = []
        self.edges: list[tuple[int, int]] = []
        self.edge_time: list[np.ndarray] = []
        self.edge_mem: list[np.ndarray] = []

    def _layouts(self, k: int) -> np.ndarray:
        k = max(1, min(k, self.k))
        return (
            np.sort(np.concatenate([[0], self.rng.choice(np.arange(1, self.k), k - 1, replace=False)])).astype(int)
            if k > 1
            else np.zeros(1, int)
        )

    def _add(
        self, name: str, layouts: np.ndarray, size_bytes: float, t: np.ndarray, m: np.ndarray, inputs: tuple[int, ...]
    ) -> int:
        node = len(self.names)
        forbid = (self.rng.random(layouts.size) < 0.03) & (layouts != 0)
        self.names.append(name)
        self.layouts.append(layouts)
        self.sizes.append(size_bytes)
        self.node_time.append(np.where(forbid, INF, np.rint(t).astype(np.int64)))
        self.node_mem.append(np.rint(m).astype(np.int64))
        for u in inputs:
            bytes_u = self.sizes[u]
            lu, lv = self.layouts[u], layouts
            noise = self.rng.uniform(0.9, 1.1, (lu.size, lv.size))
            moved = self.reshard[np.ix_(lu, lv)] * bytes_u * noise
            latency = np.where(lu[:, None] != lv[None, :], 5e6, 0.0)
            et = np.rint(moved / 1e11 * 1e12 + latency).astype(np.int64)
            et = np.where((self.rng.random(et.shape) < 0.01) & (lu[:, None] != lv[None, :]), INF, et)
            self.edges.append((u, node))
            self.edge_time.append(et)
            buffer = np.where(lu[:, None] != lv[None, :], bytes_u / self.shard[lv][None, :], 0.0)
            self.edge_mem.append(np.rint(buffer * 0.25).astype(np.int64))
        return node

    def param(self, name: str, numel: float, k: int | None = None) -> int:
        lay = self._layouts(self.k if k is None else k)
        size = numel * 2.0
        noise = self.rng.uniform(0.9, 1.1, lay.size)
        # ZeRO-style trade: the gradient reduction costs the same for every layout, a
        # sharded parameter is also all-gathered before use but holds 1/f of the state.
        gather = self.param_gather[lay] * (1.0 - 1.0 / self.shard[lay])
        sync = size * (1.0 + gather) * noise / 1e11 * 1e12
        state = 8.0 * size / self.shard[lay]  # bf16 weight + fp32 master, grad, two Adam moments
        return self._add(name, lay, size, sync, state, ())

    def op(self, name: str, inputs: tuple[int, ...], flops: float, out_bytes: float, k: int | None = None) -> int:
        lay = self._layouts(self.k if k is None else k)
        noise = self.rng.uniform(0.9, 1.1, lay.size)
        compute = flops / (1e14 * self.shard[lay]) * 1e12 * noise
        comm = self.op_comm[lay] * out_bytes / 1e11 * 1e12
        saved = out_bytes / self.shard[lay] * noise
        node = self._add(name, lay, out_bytes, compute + comm, saved, inputs)
        for j in range(self.rng.poisson(self.chain_ops)):  # views, casts, dropout, copies
            node = self._add(
                f"{name}.view{j}", self.layouts[node], out_bytes, np.full(lay.size, 1e5), np.zeros(lay.size), (node,)
            )
        return node


def transformer_like_problem(
    layers: int,
    k: int,
    seed: int = 0,
    *,
    tied: bool = True,
    cap_fraction: float | None = 0.5,
    hidden: int = 1024,
    tokens: int = 8192,
    vocab: int = 32000,
    chain_ops: float = 3.5,
) -> SearchProblem:
    """A GPT-like training graph of ``layers`` blocks with up to ``k`` strategies per node.

    ``cap_fraction`` places the cap at ``min_mem + cap_fraction * (mem(min-time plan) -
    min_mem)`` (both found with :mod:`.dp`), so values in (0, 1) make it bind; ``None``
    leaves the problem uncapped.  Each op is followed by Poisson(``chain_ops``) chain
    ops (views, casts, dropout): the default gives about 80 nodes per block.
    """
    if layers < 1 or k < 1:
        raise ValueError(f"transformer_like_problem(layers={layers}, k={k}): expected layers >= 1 and k >= 1")
    rng = np.random.default_rng(seed)
    b = _Builder(k, rng, chain_ops)
    h, act = hidden, tokens * hidden * 2.0
    ids = b.op("input_ids", (), 0.0, tokens * 8.0, k=1)
    wte = b.param("wte", vocab * h)
    x = b.op("embedding", (wte, ids), 0.0, act)
    wpe = b.param("wpe", 2048 * h, k=4)
    x = b.op("add_pos", (x, wpe), tokens * h, act)
    for layer in range(layers):
        p = f"h{layer}"
        ln = b.op(f"{p}.ln1", (x, b.param(f"{p}.ln1.w", h, k=3), b.param(f"{p}.ln1.b", h, k=3)), 5 * tokens * h, act)
        qkv = []
        for name in "qkv":
            lin = b.op(
                f"{p}.{name}",
                (ln, b.param(f"{p}.{name}.w", h * h), b.param(f"{p}.{name}.b", h, k=4)),
                2 * tokens * h * h,
                act,
            )
            qkv.append(lin)
        scores = b.op(f"{p}.scores", (qkv[0], qkv[1]), 2 * tokens * 1024 * h, act * 2)
        mask = b.param(f"{p}.mask", 1024 * 1024 / 2, k=1)
        probs = b.op(f"{p}.softmax", (scores, mask), 5 * tokens * 1024, act * 2)
        ctx = b.op(f"{p}.ctx", (probs, qkv[2]), 2 * tokens * 1024 * h, act)
        o = b.op(f"{p}.o", (ctx, b.param(f"{p}.o.w", h * h), b.param(f"{p}.o.b", h, k=4)), 2 * tokens * h * h, act)
        x = b.op(f"{p}.add1", (x, o), tokens * h, act)
        ln = b.op(f"{p}.ln2", (x, b.param(f"{p}.ln2.w", h, k=3), b.param(f"{p}.ln2.b", h, k=3)), 5 * tokens * h, act)
        fc1 = b.op(
            f"{p}.fc1",
            (ln, b.param(f"{p}.fc1.w", 4 * h * h), b.param(f"{p}.fc1.b", 4 * h, k=4)),
            8 * tokens * h * h,
            4 * act,
        )
        gelu = b.op(f"{p}.gelu", (fc1,), 8 * tokens * h, 4 * act)
        fc2 = b.op(
            f"{p}.fc2", (gelu, b.param(f"{p}.fc2.w", 4 * h * h), b.param(f"{p}.fc2.b", h, k=4)), 8 * tokens * h * h, act
        )
        x = b.op(f"{p}.add2", (x, fc2), tokens * h, act)
    ln = b.op("ln_f", (x, b.param("ln_f.w", h, k=3), b.param("ln_f.b", h, k=3)), 5 * tokens * h, act)
    head = wte if tied else b.param("lm_head.w", vocab * h)
    logits = b.op("lm_head", (ln, head), 2 * tokens * h * vocab, tokens * vocab * 2.0)
    labels = b.op("labels", (), 0.0, tokens * 8.0, k=1)
    b.op("loss", (logits, labels), 5 * tokens * vocab, 4.0, k=1)
    order = sorted(range(len(b.edges)), key=lambda e: (b.edges[e][1], b.edges[e][0]))
    problem = SearchProblem(
        tuple(b.names),
        tuple(b.node_time),
        tuple(b.node_mem),
        tuple(b.edges[e] for e in order),
        tuple(b.edge_time[e] for e in order),
        tuple(b.edge_mem[e] for e in order),
        None,
        int(2e9),
    )
    if cap_fraction is None:
        return problem
    from autopar.search import min_memory, solve_dp  # the generator uses the solver only to place the cap

    low = min_memory(problem).mem_bytes
    high = solve_dp(problem).mem_bytes
    cap = int(low + cap_fraction * (high - low))
    logger.info(
        "transformer_like_problem(%d layers, k=%d): min mem %d B, min-time plan mem %d B, cap %d B",
        layers,
        k,
        low,
        high,
        cap,
    )
    return problem.with_cap(cap)
