"""Tests of the cost model: profiles, link selection, collective and roofline times,
flop counts against textbook formulas and torch's FlopCounterMode, model-state bytes."""

from __future__ import annotations

import importlib.resources
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

import costmodel as cm
from autopar.models import config_dir
from autopar.spec import TensorMeta
from autopar.strategies.base import OpCall

aten = torch.ops.aten
GIB = 2**30


# ---------------------------------------------------------------- helpers


def make_call(target, *args, **kwargs) -> OpCall:
    """An OpCall like the planner builds: tensors become TensorMeta, outputs from a meta run."""

    def to_meta_tensor(a):
        return torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, TensorMeta) else a

    out = target(*pytree.tree_map(to_meta_tensor, args), **pytree.tree_map(to_meta_tensor, kwargs))
    outputs = tuple(TensorMeta.of(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    inputs = tuple(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, TensorMeta))
    return OpCall(target, tuple(args), dict(kwargs), inputs, outputs)


def meta(*shape, dtype=torch.float32) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def calls_of(module: nn.Module, *inputs) -> list[OpCall]:
    """Every call_function node of the exported training graph as an OpCall."""
    ep = torch.export.export(module, inputs, strict=False)
    calls = []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue

        def to_meta(a):
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                return TensorMeta.of(a.meta["val"])
            return a

        args, kwargs = pytree.tree_map(to_meta, (node.args, node.kwargs))
        inputs = tuple(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, TensorMeta))
        outputs = tuple(
            TensorMeta.of(t) for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)
        )
        calls.append(OpCall(node.target, tuple(args), dict(kwargs), inputs, outputs))
    return calls


@pytest.fixture
def h100() -> cm.DeviceProfile:
    return cm.load_profile("h100")


# ---------------------------------------------------------------- profiles


def test_bundled_profiles_load_with_datasheet_numbers():
    assert {"h100", "a100", "cpu"} <= set(cm.available_profiles())
    h, a = cm.load_profile("h100"), cm.load_profile("a100")
    assert h.peak_flops_for(torch.bfloat16) == 989e12
    assert h.peak_flops_for(torch.float16) == 989e12
    assert h.peak_flops_for(torch.float32) == 67e12
    assert h.peak_flops_for(torch.int64) == 67e12  # everything else maps to float32
    assert (h.mem_bandwidth_bytes_per_s, h.memory_bytes, h.devices_per_node) == (3.35e12, 80_000_000_000, 8)
    assert (h.intra_node.bandwidth_bytes_per_s, h.inter_node.bandwidth_bytes_per_s) == (450e9, 50e9)
    assert a.peak_flops_for(torch.bfloat16) == 312e12 and a.peak_flops_for(torch.float32) == 19.5e12
    assert (a.mem_bandwidth_bytes_per_s, a.intra_node.bandwidth_bytes_per_s, a.inter_node.bandwidth_bytes_per_s) == (
        2.039e12,
        300e9,
        25e9,
    )
    for p in (h, a, cm.load_profile("cpu")):
        assert p.source and p.intra_node.source and p.inter_node.source


def test_profile_by_path_and_env_dir(tmp_path, monkeypatch):
    src = config_dir() / "devices" / "a100.toml"
    copy = tmp_path / "devices" / "mine.toml"
    copy.parent.mkdir()
    copy.write_text(src.read_text())
    assert cm.load_profile(str(copy)).name == "a100"
    monkeypatch.setenv("AUTOPAR_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path.resolve()
    assert cm.available_profiles() == ["mine"]
    assert cm.load_profile("mine").peak_flops_for(torch.bfloat16) == 312e12


def test_default_config_dir_is_the_configs_package(monkeypatch):
    """Without the override, configs come from the package autopar.configs (importlib.resources);
    the editable install the tests run against maps it to the checkout's top-level configs/."""
    monkeypatch.delenv("AUTOPAR_CONFIG_DIR", raising=False)
    package = importlib.resources.files("autopar.configs")
    assert config_dir() == package
    assert config_dir().resolve() == Path(__file__).resolve().parent.parent / "configs"
    assert cm.profiles_dir() == config_dir() / "devices"  # the cost model reads its profiles from the same folder


def test_unknown_profile_lists_available():
    with pytest.raises(ValueError, match=r"unknown device profile 'tpu9'.*a100.*cpu.*h100"):
        cm.load_profile("tpu9")
    with pytest.raises(ValueError, match="does not exist"):
        cm.load_profile("/nonexistent/x.toml")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.replace("matmul_efficiency = 0.8", ""), r"missing keys \['matmul_efficiency'\]"),
        (lambda t: t + "\nextra = 1\n", r"unknown keys \['extra'\]"),
        (lambda t: t.replace("matmul_efficiency = 0.8", "matmul_efficiency = 1.5"), r"matmul_efficiency must lie in"),
        (lambda t: t.replace("devices_per_node = 8", 'devices_per_node = "8"'), "devices_per_node' must be int"),
        (
            lambda t: t.replace("bfloat16 = 312e12", "bfloat17 = 312e12"),
            r"\[peak_flops\]: missing keys \['bfloat16'\], unknown keys \['bfloat17'\]",
        ),
        (lambda t: t.replace("latency_s = 10e-6", "latency_s = -1.0"), "latency_s must be >= 0"),
        (lambda t: t + "\n[[[", "not valid TOML"),
        (lambda t: t.replace('attention_saves = "flash"', 'attention_saves = "fused"'), "attention_saves must be one"),
        (lambda t: t.replace("memory_bytes", "cores_per_node = -2\nmemory_bytes", 1), "cores_per_node must be an int"),
    ],
)
def test_bad_profile_file_names_the_problem(tmp_path, edit, message):
    text = (config_dir() / "devices" / "a100.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(edit(text))
    with pytest.raises(ValueError, match=message):
        cm.load_profile(str(bad))


@pytest.mark.parametrize(
    "mesh_shape, expected",
    [
        ((8, 8), ("inter", "intra")),  # dp over nodes, tp inside a node
        ((2, 4), ("intra", "intra")),  # axis 0: ranks 0 and 4, span 5 <= 8
        ((64,), ("inter",)),
        ((8,), ("intra",)),
        ((2, 8), ("inter", "intra")),
        ((4, 2, 2), ("inter", "intra", "intra")),  # axis 0 stride 4, span 13
        ((16, 1), ("inter", "intra")),
    ],
)
def test_link_for_axis(h100, mesh_shape, expected):
    """An axis inside a node gets the node's link; one across nodes the fabric as its group sees it
    (``costmodel.fabric``, ``tests/test_fabric.py``)."""

    def kind(link):
        if link is h100.intra_node:
            return "intra"
        return "inter" if link.name.startswith(h100.inter_node.name) else link.name

    for axis, want in enumerate(expected):
        assert kind(h100.link_for_axis(mesh_shape, axis)) == want, (mesh_shape, axis)
    assert kind(h100.link_for_axis(mesh_shape, -1)) == expected[-1]


def test_link_for_axis_rejects_bad_axis(h100):
    with pytest.raises(ValueError, match=r"axis 2 is out of range for mesh shape \(8, 8\)"):
        h100.link_for_axis((8, 8), 2)


def test_cpu_profile_keeps_every_axis_on_the_intra_link():
    cpu = cm.load_profile("cpu")
    for axis in range(3):
        assert cpu.link_for_axis((4, 4, 4), axis) is cpu.intra_node


# ---------------------------------------------------------------- communication


NVLINK = cm.LinkProfile("nvlink", bandwidth_bytes_per_s=450e9, latency_s=1e-6, source="test")


def test_all_reduce_1gib_on_8_ranks():
    # ring: 2 * 7/8 * 2^30 B / 450e9 B/s = 4.1757 ms, plus 14 steps * 1 us
    want = 2 * 7 / 8 * GIB / 450e9 + 14 * 1e-6
    assert cm.collective_time_s("all_reduce", GIB, 8, NVLINK) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(4.1897e-3, rel=1e-4)


@pytest.mark.parametrize(
    "kind, bw_factor, steps",
    [("all_reduce", 2, 2), ("all_gather", 1, 1), ("reduce_scatter", 1, 1), ("all_to_all", 1, 1)],
)
@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_collective_formulas(kind, bw_factor, steps, n):
    nbytes = 3 * 2**20
    want = bw_factor * (n - 1) / n * nbytes / 450e9 + steps * (n - 1) * 1e-6
    assert cm.collective_time_s(kind, nbytes, n, NVLINK) == pytest.approx(want, rel=1e-12)


def test_all_reduce_equals_reduce_scatter_plus_all_gather():
    n, nbytes = 8, 5e8
    ar = cm.collective_time_s("all_reduce", nbytes, n, NVLINK)
    rs_ag = cm.collective_time_s("reduce_scatter", nbytes, n, NVLINK) + cm.collective_time_s(
        "all_gather", nbytes, n, NVLINK
    )
    assert ar == pytest.approx(rs_ag, rel=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_emulated_reduce_scatter_costs_the_all_reduce_it_runs(n):
    """A link whose backend emulates reduce-scatter (gloo: all-reduce + slice) prices it as that all-reduce."""
    gloo = cm.LinkProfile("gloo", bandwidth_bytes_per_s=1e9, latency_s=1e-4, source="test", reduce_scatter="all_reduce")
    native = cm.LinkProfile("ring", bandwidth_bytes_per_s=1e9, latency_s=1e-4, source="test")
    nbytes = 3 * 2**20
    assert cm.collective_time_s("reduce_scatter", nbytes, n, gloo) == cm.collective_time_s(
        "all_reduce", nbytes, n, gloo
    )
    assert cm.collective_time_s("reduce_scatter", nbytes, n, gloo) == pytest.approx(
        2 * cm.collective_time_s("reduce_scatter", nbytes, n, native), rel=1e-12
    )
    assert cm.collective_time_s("all_gather", nbytes, n, gloo) == cm.collective_time_s("all_gather", nbytes, n, native)


def test_profiles_say_how_reduce_scatter_runs():
    """cpu (gloo ranks) emulates reduce-scatter; the GPU profiles (nccl) run it natively; bad values are refused."""
    assert {k: cm.load_profile(k).intra_node.reduce_scatter for k in ("cpu", "h100", "a100")} == {
        "cpu": "all_reduce",
        "h100": "native",
        "a100": "native",
    }
    assert cm.load_profile("cpu").inter_node.reduce_scatter == "all_reduce"
    with pytest.raises(ValueError, match="reduce_scatter must be one of"):
        cm.LinkProfile("x", bandwidth_bytes_per_s=1e9, latency_s=0.0, source="test", reduce_scatter="ring")


def test_collective_edge_cases():
    assert cm.collective_time_s("all_reduce", GIB, 1, NVLINK) == 0.0
    assert cm.collective_time_s("all_gather", 0, 8, NVLINK) == 0.0
    with pytest.raises(ValueError, match=r"unknown collective kind 'broadcast'.*all_reduce"):
        cm.collective_time_s("broadcast", 1.0, 8, NVLINK)
    with pytest.raises(ValueError, match="group_size"):
        cm.collective_time_s("all_reduce", 1.0, 0, NVLINK)
    with pytest.raises(ValueError, match="nbytes"):
        cm.collective_time_s("all_reduce", -1.0, 2, NVLINK)


def test_collective_on_axis_uses_the_axis_link(h100):
    mesh = (8, 8)
    dp = cm.collective_time_on_axis_s("all_reduce", GIB, mesh_shape=mesh, axis=0, profile=h100)
    tp = cm.collective_time_on_axis_s("all_reduce", GIB, mesh_shape=mesh, axis=1, profile=h100)
    assert dp == pytest.approx(cm.collective_time_s("all_reduce", GIB, 8, h100.link_for_axis(mesh, 0)))
    assert tp == pytest.approx(cm.collective_time_s("all_reduce", GIB, 8, h100.intra_node))
    assert dp / tp == pytest.approx(9.0, rel=0.01)  # 450 / 50 GB/s (one NIC per rank), latency negligible at 1 GiB


# ---------------------------------------------------------------- flops


def test_mm_addmm_bmm_baddbmm_are_2mnk():
    m, k, n, b = 64, 128, 32, 3
    assert cm.forward_flops(make_call(aten.mm.default, meta(m, k), meta(k, n))) == 2 * m * n * k
    assert cm.forward_flops(make_call(aten.addmm.default, meta(n), meta(m, k), meta(k, n))) == 2 * m * n * k
    assert cm.forward_flops(make_call(aten.bmm.default, meta(b, m, k), meta(b, k, n))) == 2 * b * m * n * k
    call = make_call(aten.baddbmm.default, meta(b, m, n), meta(b, m, k), meta(b, k, n))
    assert cm.forward_flops(call) == 2 * b * m * n * k
    assert cm.backward_flops(call) == 2 * cm.forward_flops(call)
    assert all(cm.is_matmul_like(c) for c in [call, make_call(aten.mm.default, meta(m, k), meta(k, n))])


@pytest.mark.parametrize("bias", [True, False])
def test_linear_flattens_leading_dims(bias):
    b, s, d_in, d_out = 4, 16, 64, 96
    args = [meta(b, s, d_in), meta(d_out, d_in)] + ([meta(d_out)] if bias else [])
    call = make_call(aten.linear.default, *args)
    assert cm.forward_flops(call) == 2 * b * s * d_in * d_out
    assert cm.backward_flops(call) == 4 * b * s * d_in * d_out
    assert cm.is_matmul_like(call)


def test_local_shapes_scale_flops():
    """A column-parallel shard (weight S(0) on 4 ranks) does a quarter of the work."""
    full = make_call(aten.linear.default, meta(8, 64), meta(256, 64))
    local = full.with_metas((meta(8, 64), meta(64, 64)), (meta(8, 64),))
    assert cm.forward_flops(local) == cm.forward_flops(full) / 4


@pytest.mark.parametrize(
    "a, b",
    [((7,), (7, 5)), ((2, 3, 4, 5), (5, 6)), ((2, 1, 4, 5), (3, 5, 6)), ((4, 5), (2, 5, 6))],
)
def test_matmul_broadcast_matches_flop_counter(a, b):
    call = make_call(aten.matmul.default, meta(*a), meta(*b))
    with FlopCounterMode(display=False) as counter:
        torch.matmul(torch.randn(a), torch.randn(b))
    assert cm.forward_flops(call) == counter.get_total_flops()


def test_matmul_vector_cases_are_textbook():
    # torch runs these as dot / mv, which FlopCounterMode does not count at all
    assert cm.forward_flops(make_call(aten.matmul.default, meta(7), meta(7))) == 2 * 7
    assert cm.forward_flops(make_call(aten.matmul.default, meta(3, 7), meta(7))) == 2 * 3 * 7
    assert cm.forward_flops(make_call(aten.matmul.default, meta(6, 4, 5), meta(5))) == 2 * 6 * 4 * 5


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("ij,jk->ik", [(8, 16), (16, 4)]),
        ("bhsd,bhtd->bhst", [(2, 3, 5, 8), (2, 3, 7, 8)]),
        ("...ij,...jk", [(2, 3, 4), (2, 4, 5)]),
        ("bij,jk->bik", [(3, 4, 5), (5, 6)]),
    ],
)
def test_einsum_two_operands(equation, shapes):
    call = make_call(aten.einsum.default, equation, [meta(*s) for s in shapes])
    sizes: dict[str, int] = {}
    # textbook: 2 * product of every index size
    terms = equation.split("->")[0].replace("...", "").split(",")
    for term, shape in zip(terms, shapes, strict=True):
        for c, d in zip(term, shape[len(shape) - len(term) :], strict=True):
            sizes[c] = d
    ell = max(len(s) - len(t) for t, s in zip(terms, shapes, strict=True))
    ell_size = math.prod(shapes[0][:ell])
    assert cm.forward_flops(call) == 2 * math.prod(sizes.values()) * ell_size
    with FlopCounterMode(display=False) as counter:
        torch.einsum(equation, *[torch.randn(s) for s in shapes])
    assert cm.forward_flops(call) == counter.get_total_flops()
    assert cm.is_matmul_like(call)


def test_einsum_three_operands_contracts_pairwise():
    # (i,j)x(j,k) -> keep i,k (needed later) ; then (i,k)x(k,l)
    call = make_call(aten.einsum.default, "ij,jk,kl->il", [meta(2, 3), meta(3, 4), meta(4, 5)])
    assert cm.forward_flops(call) == 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5


def test_einsum_single_operand_is_elementwise():
    call = make_call(aten.einsum.default, "ij->j", [meta(4, 6)])
    assert cm.forward_flops(call) == 24
    assert not cm.is_matmul_like(call)


@pytest.mark.parametrize("gqa_heads", [8, 2])
def test_sdpa_flops(gqa_heads):
    b, h, s, d = 2, 8, 128, 64
    q, k, v = meta(b, h, s, d), meta(b, gqa_heads, s, d), meta(b, gqa_heads, s, d)
    kwargs = {"enable_gqa": True} if gqa_heads != h else {}
    call = make_call(aten.scaled_dot_product_attention.default, q, k, v, None, 0.0, True, **kwargs)
    assert cm.forward_flops(call) == 4 * b * h * s * s * d  # QK^T and PV, 2*s*s*d each
    assert cm.backward_flops(call) == 10 * b * h * s * s * d  # registry: 5 bmms
    assert cm.backward_flops(call) == 2.5 * cm.forward_flops(call)
    assert cm.is_matmul_like(call)
    fused = make_call(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v)
    if gqa_heads == h:
        assert cm.forward_flops(fused) == cm.forward_flops(call)


def test_conv2d_matches_flop_counter():
    x, w = meta(2, 3, 16, 16), meta(8, 3, 3, 3)
    call = make_call(aten.conv2d.default, x, w, None, [1, 1], [1, 1])
    ho = wo = 16
    assert cm.forward_flops(call) == 2 * 2 * 8 * 3 * 9 * ho * wo
    with FlopCounterMode(display=False) as counter:
        F.conv2d(torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3), padding=1)
    assert cm.forward_flops(call) == counter.get_total_flops()
    core = make_call(aten.convolution.default, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert cm.forward_flops(core) == cm.forward_flops(call)


def test_embedding_costs_rows_not_table():
    weight, idx = meta(50_000, 512), meta(4, 128, dtype=torch.int64)
    call = make_call(aten.embedding.default, weight, idx)
    out_bytes = 4 * 128 * 512 * 4
    assert cm.forward_flops(call) == 0
    assert cm.bytes_moved(call) == 2 * out_bytes + 4 * 128 * 8
    assert cm.backward_flops(call) == 4 * 128 * 512
    assert not cm.is_matmul_like(call)


def test_elementwise_and_norms():
    x = meta(4, 16, 64)
    add = make_call(aten.add.Tensor, x, meta(64))
    assert cm.forward_flops(add) == 4 * 16 * 64
    assert cm.bytes_moved(add) == (2 * 4 * 16 * 64 + 64) * 4
    ln = make_call(aten.layer_norm.default, x, [64], meta(64), meta(64))
    sm = make_call(aten.softmax.int, x, -1)
    assert cm.forward_flops(ln) > cm.forward_flops(sm) > cm.forward_flops(add)
    assert 1 <= cm.backward_flops(ln) / cm.forward_flops(ln) <= 2
    assert not cm.is_matmul_like(ln)


def test_views_are_free_and_integer_ops_cost_bytes_only():
    view = make_call(aten.view.default, meta(4, 16), [64])
    assert (cm.forward_flops(view), cm.bytes_moved(view)) == (0, 0)
    mask = meta(128, 128, dtype=torch.bool)
    tril = make_call(aten.tril.default, mask)
    assert cm.forward_flops(tril) == 0 and cm.backward_flops(tril) == 0
    assert cm.bytes_moved(tril) == 2 * 128 * 128
    cat = make_call(aten.cat.default, [meta(4, 8), meta(4, 8)])
    assert cm.forward_flops(cat) == 0 and cm.bytes_moved(cat) == 2 * 4 * 8 * 4 * 2


def test_a_to_that_changes_nothing_is_a_view_and_a_cast_or_copy_moves_bytes():
    """``aten.to`` to the tensor's own dtype returns the tensor itself (Hugging Face's ``logits.float()`` on float32
    logits): no kernel, no bytes, as eager runs it.  A cast, or ``copy=True``, reads and writes the tensor."""
    x = meta(256, 4096)
    same = make_call(aten.to.dtype, x, torch.float32)
    assert cm.op_family(same) == "view" and cm.bytes_moved(same) == 0 and cm.backward_bytes_moved(same) == 0
    real = torch.randn(2, 3)
    assert aten.to.dtype(real, torch.float32) is real  # what the pricing rests on
    layout = make_call(aten.to.dtype_layout, x, dtype=torch.float32, layout=torch.strided)
    assert cm.op_family(layout) == "view"
    cast = make_call(aten.to.dtype, x, torch.bfloat16)
    assert cm.op_family(cast) == "data" and cm.bytes_moved(cast) == 256 * 4096 * (4 + 2)
    copied = make_call(aten.to.dtype, x, torch.float32, False, True)
    assert cm.op_family(copied) == "data" and cm.bytes_moved(copied) == 2 * 256 * 4096 * 4
    # planned in bf16, the planner gives every float meta bfloat16: the upcast the call asks for is still a cast
    upcast = OpCall(
        aten.to.dtype,
        (meta(256, 4096, dtype=torch.bfloat16), torch.float32),
        {},
        (meta(256, 4096, dtype=torch.bfloat16),),
        (meta(256, 4096, dtype=torch.bfloat16),),
    )
    assert cm.op_family(upcast) == "data" and cm.bytes_moved(upcast) == 2 * 256 * 4096 * 2


def test_inconsistent_local_shapes_name_the_op():
    call = OpCall(aten.mm.default, (meta(4, 8), meta(6, 2)), {}, (meta(4, 8), meta(6, 2)), (meta(4, 2),))
    with pytest.raises(ValueError, match=r"aten\.mm\.default: inconsistent local shapes"):
        cm.forward_flops(call)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.conv = nn.Conv1d(32, 16, 3, padding=1)
        self.proj = nn.Parameter(torch.randn(32, 8))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.emb(idx))
        h = self.down(F.gelu(self.up(x)))
        scores = torch.einsum("bsd,btd->bst", h, x)
        y = scores.softmax(-1) @ x @ self.proj
        return y.sum() + self.conv(x.transpose(1, 2)).sum()


def test_exported_graph_matmul_flops_match_flop_counter():
    """Every node of a real export gets a count; matmul-like forward and backward flops
    summed over the graph equal FlopCounterMode's count of the eager run."""
    model, idx = _Block(), torch.randint(0, 100, (2, 12))
    calls = calls_of(model, idx)
    fwd = sum(cm.forward_flops(c) for c in calls if cm.is_matmul_like(c))
    bwd = sum(cm.backward_flops(c) for c in calls if cm.is_matmul_like(c))
    for c in calls:  # every op gets finite, non-negative numbers
        for value in (cm.forward_flops(c), cm.backward_flops(c), cm.bytes_moved(c), cm.backward_bytes_moved(c)):
            assert value >= 0 and math.isfinite(value), c.name
    with FlopCounterMode(display=False) as counter:
        out = model(idx)
    assert fwd == counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        out.backward()
    # every matmul here has two operands that need grads, so backward is exactly 2x
    assert bwd == counter.get_total_flops()


# ---------------------------------------------------------------- compute


def test_roofline_picks_the_bound(h100):
    n = 8192
    matmul_flops, matmul_bytes = 2 * n**3, 3 * n * n * 2
    t = cm.op_time_s(matmul_flops, matmul_bytes, h100, torch.bfloat16, matmul=True)
    assert t == pytest.approx(matmul_flops / (989e12 * h100.matmul_efficiency) + h100.kernel_overhead_s)
    add_bytes = 3 * 2**28 * 2
    t = cm.op_time_s(2**28, add_bytes, h100, torch.bfloat16, matmul=False)
    assert t == pytest.approx(add_bytes / (3.35e12 * h100.memory_efficiency) + h100.kernel_overhead_s)
    assert cm.op_time_s(0, 0, h100, torch.float32, matmul=False) == 0.0
    assert cm.op_time_s(1, 0, h100, torch.float32, matmul=False) == pytest.approx(h100.kernel_overhead_s, rel=1e-6)
    # fp32 matmul runs at the (much lower) fp32 peak
    overhead = h100.kernel_overhead_s
    t32 = cm.op_time_s(matmul_flops, 2 * matmul_bytes, h100, torch.float32, matmul=True) - overhead
    t16 = cm.op_time_s(matmul_flops, matmul_bytes, h100, torch.bfloat16, matmul=True) - overhead
    assert t32 / t16 == pytest.approx(989 / 67, rel=1e-9)
    with pytest.raises(ValueError, match="flops must be"):
        cm.op_time_s(-1, 0, h100, torch.float32, matmul=False)


def test_a_host_that_runs_ahead_overlaps_its_overhead_with_the_kernels(h100):
    """GPU: an op takes max(kernel + the device's gap, the host's overhead); CPU: kernel + host overhead."""
    from dataclasses import replace

    gap, host = h100.kernel_overhead_s, 40e-6
    gpu = replace(h100, forward_op_overhead_s=host, backward_op_overhead_s=2 * host)
    assert gpu.host_runs_ahead
    small_bytes = 3 * 2**16 * 4  # an add of 64 Ki floats: ~0.1 us of memory time, the host binds
    kernel = small_bytes / (h100.mem_bandwidth_bytes_per_s * h100.memory_efficiency)
    assert cm.op_time_s(2**16, small_bytes, gpu, torch.float32, matmul=False) == pytest.approx(host)
    assert cm.op_time_s(2**16, small_bytes, gpu, torch.float32, matmul=False, backward=True) == pytest.approx(2 * host)
    n = 8192  # a large matmul: the kernel binds, the host's overhead is hidden, the gap is not
    flops = 2 * n**3
    big = flops / (989e12 * h100.matmul_efficiency)
    assert cm.op_time_s(flops, 3 * n * n * 2, gpu, torch.bfloat16, matmul=True) == pytest.approx(big + gap)
    cpu = replace(gpu, host_runs_ahead=False)
    assert cm.op_time_s(2**16, small_bytes, cpu, torch.float32, matmul=False) == pytest.approx(kernel + host)


def test_profile_switches_must_be_booleans(tmp_path):
    from costmodel import load_profile

    text = (config_dir() / "devices" / "h100.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("host_runs_ahead = true", 'host_runs_ahead = "yes"'))
    with pytest.raises(ValueError, match="host_runs_ahead must be true or false"):
        load_profile(str(bad))


def test_call_time_uses_call_dtype_and_family(h100):
    mm = make_call(aten.mm.default, meta(4096, 4096, dtype=torch.bfloat16), meta(4096, 4096, dtype=torch.bfloat16))
    want = 2 * 4096**3 / (989e12 * h100.matmul_efficiency) + h100.kernel_overhead_s
    assert cm.call_time_s(mm, h100) == pytest.approx(want)
    assert cm.call_time_s(mm, h100, backward=True) == pytest.approx(
        2 * (want - h100.kernel_overhead_s) + h100.kernel_overhead_s
    )


# ---------------------------------------------------------------- memory


def test_adamw_model_state_bytes_per_param():
    adamw = cm.optimizer_spec("adamw")
    fp32 = cm.model_state_bytes(1000, 1000, cm.precision("fp32"), adamw)
    assert (fp32.params, fp32.grads, fp32.optimizer, fp32.total) == (4000, 4000, 8000, 16000)
    bf16 = cm.model_state_bytes(1000, 1000, cm.precision("bf16"), adamw)
    assert (bf16.params, bf16.grads, bf16.optimizer, bf16.total) == (2000, 2000, 12000, 16000)
    pure = cm.model_state_bytes(1000, 1000, cm.precision("bf16-pure"), adamw)  # AdamW state like the bf16 params
    assert (pure.params, pure.grads, pure.optimizer, pure.total) == (2000, 2000, 4000, 8000)


def test_zero_shards_state_not_params():
    """ZeRO on 8 data-parallel ranks: params whole, grads and optimizer state 1/8."""
    st = cm.model_state_bytes(8000, 1000, cm.precision("bf16"), cm.optimizer_spec("adamw"))
    assert (st.params, st.grads, st.optimizer) == (16000, 2000, 12000)


@pytest.mark.parametrize("name, states", [("adam", 2), ("sgd", 0), ("sgd_momentum", 1), ("none", 0)])
def test_optimizer_specs(name, states):
    spec = cm.optimizer_spec(name)
    assert spec.states_per_param == states
    assert cm.model_state_bytes(10, 10, cm.precision("fp32"), spec).optimizer == 10 * 4 * states


def test_unknown_precision_and_optimizer():
    with pytest.raises(ValueError, match=r"unknown training precision 'fp8'.*\['bf16', 'bf16-pure', 'fp32'\]"):
        cm.precision("fp8")
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'.*adamw"):
        cm.optimizer_spec("lion")


def test_activation_bytes():
    assert cm.activation_bytes(1024, torch.bfloat16) == 2048
    assert cm.activation_bytes(1024, torch.float32) == 4096


# ---------------------------------------------------------------- saved for backward (autopar.cost.saved)


def test_saved_for_backward_sorts_inputs_outputs_and_own_tensors():
    from autopar.cost.saved import saved_for_backward

    x, w, b = meta(4, 16, 64), meta(64), meta(64)
    ln = saved_for_backward(make_call(aten.layer_norm.default, x, [64], w, b), (True, True, True))
    assert (ln.inputs, ln.outputs, ln.internal_bytes) == ((0, 1, 2), (), 2 * 4 * 16 * 4)  # mean and rstd, fp32
    tanh = saved_for_backward(make_call(aten.tanh.default, x), (True,))
    assert (tanh.inputs, tanh.outputs, tanh.internal_bytes) == ((), (0,), 0)
    # the weight's grad needs x, x's grad needs the weight: what is kept follows requires_grad
    lin = make_call(aten.linear.default, x, meta(32, 64))
    assert saved_for_backward(lin, (True, True)).inputs == (0, 1)
    assert saved_for_backward(lin, (False, True)).inputs == (0,)
    assert saved_for_backward(lin, (True, False)).inputs == (1,)
    assert saved_for_backward(lin, (False, False)).inputs == ()
    # a non-contiguous input is copied by the composite (its reshape cannot view): the copy is the op's own
    xt = make_call(aten.linear.default, meta(4, 16, 64), meta(32, 64))
    copied = saved_for_backward(xt, (True, True), layouts=((1, 0, 2), None))
    assert (copied.inputs, copied.internal_bytes) == ((1,), 4 * 16 * 64 * 4)


def test_attention_saves_by_device_form():
    """CPU math path with dropout keeps the attention matrix; CUDA's fused kernels keep a logsumexp row."""
    from autopar.cost.saved import saved_for_backward

    q = meta(2, 4, 32, 16)
    call = make_call(aten.scaled_dot_product_attention.default, q, q, q, dropout_p=0.1, is_causal=True)
    traced = saved_for_backward(call, (True,) * 3)
    flash = saved_for_backward(call, (True,) * 3, attention="flash")
    assert traced.internal_bytes >= 2 * 4 * 32 * 32 * 4  # (B, H, L, L) fp32 probabilities, at least once
    assert (flash.inputs, flash.outputs, flash.internal_bytes) == ((0, 1, 2), (0,), 2 * 4 * 32 * 4)
    no_dropout = saved_for_backward(
        make_call(aten.scaled_dot_product_attention.default, q, q, q, is_causal=True), (True,) * 3
    )
    assert no_dropout.internal_bytes < 2 * 4 * 32 * 32  # the fused CPU kernel: no attention matrix


class _SavesAcrossOps(nn.Module):
    """Views of a fused output (split), CPU attention with dropout, a dropout mask, and a tensor saved twice."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out, self.drop, self.heads = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1), heads

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, n, d)))
        y = torch.tanh(self.fc(x)) * (x * torch.sigmoid(x)).mean(-1, keepdim=True)  # x: saved by fc and by mul
        return (x + self.out(y)).pow(2).mean()


def test_plan_activations_equal_bytes_saved_on_one_device():
    """The plan's activations on a 1-device mesh are exactly the distinct storages autograd keeps (CPU profile)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    import autopar

    torch.manual_seed(0)
    model = _SavesAcrossOps().train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    kept: dict = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in params:
            kept[ref] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    plan = autopar.plan(model, autopar.Mesh((1,), axis_names=("dp",)), example_inputs=(x,), profile="cpu", dtype="fp32")
    assert sum(kept.values()) > 30_000
    assert plan.memory.activations_bytes == sum(kept.values())


def test_fused_attention_is_priced_at_its_measured_rate_over_the_matmuls(h100):
    """``attention_efficiency`` scales attention's forward, ``attention_backward_efficiency`` its backward; a
    matmul keeps the matmul rate."""
    import dataclasses

    q = meta(4, 32, 4096, 128, dtype=torch.bfloat16)
    sdpa = make_call(aten.scaled_dot_product_attention.default, q, q, q, None, 0.0, True)
    mm = make_call(aten.mm.default, meta(4096, 4096, dtype=torch.bfloat16), meta(4096, 4096, dtype=torch.bfloat16))
    slow = dataclasses.replace(h100, attention_efficiency=0.5, attention_backward_efficiency=0.25)
    rate = 989e12 * h100.matmul_efficiency
    overhead = h100.kernel_overhead_s
    assert cm.call_time_s(sdpa, h100) == pytest.approx(cm.forward_flops(sdpa) / rate + overhead)
    assert cm.call_time_s(sdpa, slow) == pytest.approx(cm.forward_flops(sdpa) / (0.5 * rate) + overhead)
    assert cm.call_time_s(sdpa, slow, backward=True) == pytest.approx(
        cm.backward_flops(sdpa) / (0.25 * rate) + overhead
    )
    assert cm.call_time_s(mm, slow) == cm.call_time_s(mm, h100)


@pytest.mark.parametrize(
    "key, value",
    [("attention_efficiency", 0), ("attention_backward_efficiency", -0.5), ("optimizer_bandwidth_bytes_per_s", 0)],
)
def test_a_measured_rate_must_be_positive(tmp_path, key, value):
    from costmodel import load_profile

    bad = tmp_path / "bad.toml"
    bad.write_text(f"{key} = {value}\n" + (config_dir() / "devices" / "cpu.toml").read_text())
    with pytest.raises(ValueError, match=f"{key} must be a positive finite number"):
        load_profile(str(bad))


def test_the_optimizer_step_is_priced_at_the_measured_optimizer_rates(tmp_path):
    """AdamW on one device: per parameter, 8 kernels at ``optimizer_op_overhead_s`` and 20 passes over its
    float32 state shard at ``optimizer_bandwidth_bytes_per_s`` (costmodel.memory's count)."""
    import autopar
    from autopar.mesh import Mesh

    path = tmp_path / "measured.toml"
    text = (config_dir() / "devices" / "cpu.toml").read_text()
    path.write_text("optimizer_bandwidth_bytes_per_s = 2e9\noptimizer_op_overhead_s = 1e-5\n" + text)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    plans = {
        p: autopar.plan(model, Mesh((1,)), example_inputs=(torch.randn(8, 64),), profile=p, optimizer="adamw")
        for p in ("cpu", str(path))
    }
    numels = [p.numel() for p in model.parameters()]
    want = sum(8 * 1e-5 + 20 * 4 * n / 2e9 for n in numels)
    assert plans[str(path)].cost.terms["optimizer step"] == pytest.approx(want)
    cpu = cm.load_profile("cpu")
    assert plans["cpu"].cost.terms["optimizer step"] == pytest.approx(
        sum(
            8 * cpu.op_overhead_s() + 20 * 4 * n / (cpu.mem_bandwidth_bytes_per_s * cpu.memory_efficiency)
            for n in numels
        )
    )
