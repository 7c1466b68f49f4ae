"""Semi-auto mode (issue 4): user shard hints are kept exactly and the search completes the plan."""

from __future__ import annotations

import fnmatch
import json
import re
import types
import warnings
from collections import Counter
from typing import NamedTuple

import pytest
import test_planner
import torch

import autopar
from autopar.capture.export import capture
from autopar.placement import format_placements, parse_placements
from autopar.planner import OpHints
from autopar.planner.driver import plan_from_context, prepare
from autopar.planner.hints import Layout, resolve_hints
from autopar.planner.plan_table import group_name, render_table

GiB = 2**30
gpt2_tp4 = test_planner.gpt2_tp4  # the fixture: GPT-2 small, tp=4, batch 1, seq 1024, h100, fp32
MESH_2x2 = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
MEGATRON = {
    "transformer.h.*.attn.c_attn.weight": ["S(1)[3]"],  # GPT-2's Conv1D weight is (in, out): output features
    "transformer.h.*.attn.c_proj.weight": ["S(0)"],  # input features
    "transformer.h.*.mlp.c_fc.weight": ["S(1)"],
    "transformer.h.*.mlp.c_proj.weight": ["S(0)"],
}


# ---- done-when 1: GPT-2 on tp=4, the setting where the planner finds Megatron by itself -------------
def _per_block(plan) -> Counter:
    """(module group, kind, phase) -> count of collectives."""
    return Counter((group_name(c.module), c.kind, c.phase) for c in plan.collectives)


def test_megatron_hints_give_the_auto_plan(gpt2_tp4):
    cap = int(1.5 * GiB)
    auto = plan_from_context(gpt2_tp4, mem_cap=cap, compare_families=False)
    hinted = plan_from_context(gpt2_tp4, mem_cap=cap, compare_families=False, hints=MEGATRON)
    assert len(hinted.hints.params) == 4 * 12
    assert hinted.params == auto.params
    assert hinted.nodes == auto.nodes
    assert hinted.collectives == auto.collectives
    assert hinted.cost == auto.cost and hinted.memory == auto.memory


def test_opposite_fc_hint_is_valid_costlier_and_its_collectives_show(gpt2_tp4):
    cap = int(1.5 * GiB)
    auto = plan_from_context(gpt2_tp4, mem_cap=cap, compare_families=False)
    opposite = dict(MEGATRON, **{"transformer.h.*.mlp.c_fc.weight": ["S(0)"]})  # split on input features
    plan = plan_from_context(gpt2_tp4, mem_cap=cap, hints=opposite)
    for block in range(12):
        assert plan.params[f"transformer.h.{block}.mlp.c_fc.weight"].placements == parse_placements("S(0)")
        assert plan.params[f"transformer.h.{block}.attn.c_proj.weight"].placements == parse_placements("S(0)")
    assert plan.memory.per_device_bytes <= cap
    assert plan.cost.total_s > auto.cost.total_s
    extra = _per_block(plan) - _per_block(auto)
    assert extra, "the opposite hint must need collectives the auto plan does not"
    assert any(mod == "transformer.h.*.mlp.c_fc" for mod, _, _ in extra)
    text = render_table(plan)
    for mod, kind, phase in extra:
        assert re.search(rf"│ {re.escape(mod)}\s+│ {kind}\s+│ tp\s+│ {phase}\s+│", text), (mod, kind, phase)
    assert re.search(r"│ transformer\.h\.\*\.mlp\.c_fc\.weight\s+│ 12\s+│.*│ S\(0\)\s+│.*│ hint\s+│", text)
    assert re.search(r"│ transformer\.h\.\*\.mlp\.c_fc\.bias\s+│ 12\s+│.*│ search\s+│", text)
    assert "without the hints" in text


# ---- fixtures on the tiny models --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ctx():
    from autopar.models import load_model

    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=32)
    return prepare(model, MESH_2x2, example_inputs=args, example_kwargs=kwargs)


@pytest.fixture(scope="module")
def llama_graph():
    from autopar.models import load_model

    model, args, kwargs = load_model("llama-tiny", batch=4, seq=16)
    return capture(model, args, kwargs)


def _plan(ctx, **kw):
    return plan_from_context(ctx, compare_families=False, **kw)


# ---- done-when 2: errors name the hint, the tensor and its shape, the mesh, and the fix ---------------
ERRORS = [
    ("dim", {"*.mlp.c_fc.weight": ["R", "S(2)"]}, "transformer.h.0.mlp.c_fc.weight", "(64, 256)", "dims 0..1"),
    ("axis name", {"*.mlp.c_fc.weight": {"mp": "S(1)"}}, "transformer.h.0.mlp.c_fc.weight", "(64, 256)", "'mp'"),
    ("count", {"*.mlp.c_fc.weight": ["S(1)"]}, "transformer.h.0.mlp.c_fc.weight", "(64, 256)", "1 placements"),
    ("blocks", {"*.mlp.c_fc.weight": ["R", "S(1)[3]"]}, "transformer.h.0.mlp.c_fc.weight", "(64, 256)", "3 blocks"),
    ("partial", {"transformer.wpe.weight": ["P(sum)", "R"]}, "transformer.wpe.weight", "(128, 64)", "partial"),
    ("factor", {"transformer.h.0.mlp.c_fc": ((3, 1), (1, 1))}, "addmm_2", "(128, 64)", "factor 3"),
    (
        "layout",
        {"transformer.h.0.mlp.c_fc.weight": Layout((2, 2), ("dp", "mp"))("None", "mp")},
        "transformer.h.0.mlp.c_fc.weight",
        "(64, 256)",
        "'mp': 2",
    ),
]


@pytest.mark.parametrize("kind,hints,tensor,shape,reason", ERRORS, ids=[e[0] for e in ERRORS])
def test_hint_that_cannot_hold_is_a_clear_error(tiny_ctx, kind, hints, tensor, shape, reason):
    with pytest.raises(ValueError) as err:
        _plan(tiny_ctx, hints=hints)
    msg = str(err.value)
    pattern = next(iter(hints))
    assert repr(pattern) in msg and tensor in msg and f"shape {shape}" in msg, msg
    assert "Mesh(dp=2, tp=2)" in msg and "Fix:" in msg and reason in msg, msg


def test_uneven_shards_hold_and_empty_pieces_do_not():
    model, x = torch.nn.Linear(16, 3), torch.randn(8, 16)
    plan = autopar.plan(model, MESH_2x2, example_inputs=(x,), compare_families=False, hints={"weight": ["S(0)", "R"]})
    assert plan.params["weight"].placements == parse_placements("S(0),R") and plan.params["weight"].local_shape == (
        2,
        16,
    )
    with pytest.raises(ValueError) as err:
        autopar.plan(model, MESH_2x2, example_inputs=(x,), hints={"bias": ["S(0)", "S(0)"]})
    msg = str(err.value)
    assert "'bias'" in msg and "parameter bias, shape (3,)" in msg and "leaves some ranks no element" in msg
    assert "Mesh(dp=2, tp=2)" in msg and "Fix:" in msg


def test_contradicting_hints_name_both(tiny_ctx):
    hints = {"*.c_fc.weight": ["R", "S(1)"], "transformer.h.0.*": ["R", "S(0)"]}
    with pytest.raises(ValueError) as err:
        _plan(tiny_ctx, hints=hints)
    msg = str(err.value)
    assert "'*.c_fc.weight'" in msg and "'transformer.h.0.*'" in msg and "contradict" in msg
    assert "transformer.h.0.mlp.c_fc.weight, shape (64, 256)" in msg and "[R, S(1)] vs [R, S(0)]" in msg
    assert "Mesh(dp=2, tp=2)" in msg and "Fix:" in msg
    # a region and a shard of a parameter in it contradict too
    with pytest.raises(ValueError, match="contradict"):
        _plan(tiny_ctx, hints={"transformer.h.0": "replicate", "transformer.h.0.mlp.c_fc.weight": ["R", "S(1)"]})


def test_hints_leaving_an_op_no_strategy_are_an_error(tiny_ctx):
    # the matmul would need its contracted dim (activation S(1)) and its output dim (weight S(1)) on one axis
    hints = {"transformer.h.0.mlp.c_fc": (["R", "S(1)"], ["R", "S(1)"])}
    with pytest.raises(ValueError) as err:
        _plan(tiny_ctx, hints=hints)
    msg = str(err.value)
    assert "no strategy" in msg and "addmm_2" in msg and "transformer.h.0.mlp.c_fc" in msg
    assert "Mesh(dp=2, tp=2)" in msg and "Fix:" in msg and "(64, 256)" in msg


def test_a_family_that_excludes_the_hints_is_an_error(tiny_ctx):
    with pytest.raises(ValueError, match=r"family 'data parallel' and the hints on transformer\.h\.0\.mlp\.c_fc"):
        _plan(tiny_ctx, family="data parallel", hints={"*.mlp.c_fc.weight": ["R", "S(1)"]})
    plan = _plan(tiny_ctx, family="tensor parallel", hints={"*.mlp.c_fc.weight": ["R", "S(1)"]})
    assert plan.params["transformer.h.1.mlp.c_fc.weight"].placements == parse_placements("R,S(1)")


def test_unmatched_pattern_warns_unless_strict(tiny_ctx):
    auto = _plan(tiny_ctx)
    with pytest.warns(UserWarning, match=r"'nothing\.\*' = R,S\(1\) matches no parameter"):
        plan = _plan(tiny_ctx, hints={"nothing.*": ["R", "S(1)"]})
    assert plan.params == auto.params and not plan.hints
    with pytest.raises(ValueError, match=r"matches no parameter.*Fix: correct the pattern"):
        _plan(tiny_ctx, hints={"nothing.*": ["R", "S(1)"]}, strict=True)
    with pytest.raises(ValueError, match="matches no module"):
        _plan(tiny_ctx, hints={"encoder.*": "replicate"}, strict=True)


# ---- kinds of hints ------------------------------------------------------------------------------------
def test_manual_mode_every_parameter_hinted_reproduces_the_plan(tiny_ctx):
    """A fully manual plan: every parameter's placement given, the search only places the collectives."""
    auto = _plan(tiny_ctx, mem_cap=2_500_000)
    assert len({tuple(p.placements) for p in auto.params.values()}) > 1  # a mixed plan, not all-R
    manual = {fqn: format_placements(p.placements) for fqn, p in auto.params.items()}
    plan = _plan(tiny_ctx, mem_cap=2_500_000, hints=manual)
    assert plan.hints.params == {fqn: p.placements for fqn, p in auto.params.items()}
    assert plan.params == auto.params and plan.collectives == auto.collectives and plan.cost == auto.cost


def test_tied_alias_resolves_to_the_canonical_parameter(tiny_ctx):
    plan = _plan(tiny_ctx, hints={"lm_head.weight": ["R", "S(0)"]})
    assert plan.params["transformer.wte.weight"].placements == parse_placements("R,S(0)")
    assert plan.hints.params == {"transformer.wte.weight": parse_placements("R,S(0)")}


def test_region_hint_keeps_the_region_replicated(tiny_ctx):
    from autopar.planner.driver import MemoryCapError

    hint = {"transformer.h.0": "replicate"}
    with pytest.raises(MemoryCapError) as least:  # the least memory reachable with h.0 kept replicated
        _plan(tiny_ctx, mem_cap=1, hints=hint)
    # under a cap where the free search shards h.0 and the hinted plan cannot fit, the hint is kept: an error,
    # never a plan that drops it
    tight = int(least.value.min_mem_bytes * 0.9)
    free = _plan(tiny_ctx, mem_cap=tight)
    assert any(
        p.placements != parse_placements("R,R") for k, p in free.params.items() if k.startswith("transformer.h.0.")
    )
    with pytest.raises(MemoryCapError):
        _plan(tiny_ctx, mem_cap=tight, hints=hint)
    cap = int(least.value.min_mem_bytes * 1.05)
    plan = _plan(tiny_ctx, mem_cap=cap, hints={"transformer.h.0": "replicate"})
    assert plan.memory.per_device_bytes <= cap
    for fqn, p in plan.params.items():
        if fqn.startswith("transformer.h.0."):
            assert p.placements == parse_placements("R,R") and p.state_placements == parse_placements("R,R"), fqn
    inside = [n for n in plan.nodes.values() if n.module.startswith("transformer.h.0.")]
    assert inside and all(pl == parse_placements("R,R") for n in inside for pl in n.inputs + n.outputs)
    assert plan.hints.replicate == ("transformer.h.0",)


def test_input_and_output_placements(tiny_ctx):
    plan = _plan(tiny_ctx, input_placements={"input_ids": ["R", "S(0)"]}, output_placements=[None, ["S(0)", "R"]])
    assert plan.inputs["input_ids"].placements == parse_placements("R,S(0)")
    logits = plan.nodes[tiny_ctx.graph.nodes[tiny_ctx.graph.outputs[1][0]].name]
    assert logits.outputs[0] == parse_placements("S(0),R")
    with pytest.raises(ValueError, match=r"'ids'.*input_ids"):
        _plan(tiny_ctx, input_placements={"ids": ["R", "S(0)"]})


class _ShardedMLP(torch.nn.Module):
    """An MLP whose hidden activation carries an ``autopar.shard`` hint in the model code."""

    def __init__(self, spec=("S(0)", "S(1)")) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 8)
        self.spec = list(spec)

    def forward(self, x, y):
        h = autopar.shard(torch.relu(self.up(x)), self.spec)
        return torch.nn.functional.mse_loss(self.down(h), y)


def test_activation_hint_is_identity_unpartitioned_and_fixed_when_planned():
    torch.manual_seed(0)
    model = _ShardedMLP()
    x, y = torch.randn(8, 16, requires_grad=True), torch.randn(8, 8)
    loss = model(x, y)
    loss.backward()
    plain = torch.nn.functional.mse_loss(model.down(torch.relu(model.up(x))), y)
    assert torch.equal(loss, plain)
    grad = x.grad.clone()
    x.grad = None
    plain.backward()
    assert torch.equal(grad, x.grad)  # the gradient passes through unchanged
    plan = autopar.plan(model, MESH_2x2, example_inputs=(x.detach(), y), compare_families=False)
    shard_nodes = [n for n in plan.nodes.values() if n.op == "autopar.shard.default"]
    assert len(shard_nodes) == 1
    tiles = parse_placements("S(0),S(1)")
    assert shard_nodes[0].inputs == (tiles,) and shard_nodes[0].outputs == (tiles,)
    assert list(plan.hints.ops.values()) == [OpHints(outputs={0: parse_placements("S(0),S(1)")})]
    with pytest.raises(ValueError, match=r"(?s)autopar\.shard.*activation shard, shape \(8, 64\).*dims 0\.\.1"):
        autopar.plan(_ShardedMLP(("S(0)", "S(2)")), MESH_2x2, example_inputs=(x.detach(), y))


@pytest.mark.parametrize("spec", ["S(0),S(1)", "S(1)[2],P(sum)", "R,S(0)"])
def test_shard_rule_is_the_identity_at_the_spec(spec):
    from autopar.shard_op import SHARD_OP
    from autopar.strategies.validate import assert_rule_valid

    checks = assert_rule_valid(SHARD_OP, (torch.randn(4, 8), spec), mesh_shape=(2, 2))
    labels = {c.strategy.label() for c in checks}
    assert f"({spec}) -> ({spec})" in labels  # the hinted spec is offered, and every offered one is right
    assert all(s.inputs == s.outputs for s in (c.strategy for c in checks))


# ---- op-level hints: MindSpore's tuple form, Layout and placements --------------------------------------
def _fixed(graph, mesh, hints):
    r = resolve_hints(graph, mesh, hints)
    return {graph.nodes[i].fqn: list(map(str, pl)) for i, pl in r.sources.items()}, r


def test_factor_tuples_follow_mindspore_convention_on_linear_and_conv1d(tiny_ctx, llama_graph):
    # GPT-2's Conv1D stores (in, out): out features is dim 1; nn.Linear stores (out, in): dim 0
    column = ((1, 1), (1, 2))
    fixed, _ = _fixed(tiny_ctx.graph, MESH_2x2, {"transformer.h.0.mlp.c_fc": column})
    assert fixed == {"transformer.h.0.mlp.c_fc.weight": ["R", "S(1)"]}
    fixed, r = _fixed(llama_graph, MESH_2x2, {"model.layers.0.mlp.up_proj": column})
    assert fixed == {"model.layers.0.mlp.up_proj.weight": ["R", "S(0)"]}
    row = ((2, 2), (2, 1))  # rows on dp, the contracted dim on tp (the innermost free axis)
    fixed, r = _fixed(llama_graph, MESH_2x2, {"model.layers.0.mlp.down_proj": row})
    assert fixed == {"model.layers.0.mlp.down_proj.weight": ["R", "S(1)"]}
    acts = [v for (i, pos), v in r.op_inputs.items() if llama_graph.nodes[i].call.inputs[pos].ndim == 3]
    assert [list(map(str, a)) for a in acts] == [["S(0)", "S(2)"]]
    four = ((1, 4), (4, 1))  # one dim over both axes (nested in mesh order)
    fixed, _ = _fixed(llama_graph, MESH_2x2, {"model.layers.0.mlp.down_proj": four})
    assert fixed == {"model.layers.0.mlp.down_proj.weight": ["S(1)", "S(1)"]}
    with pytest.raises(ValueError, match="cut 2 ways in the activation but 1 in the weight"):
        resolve_hints(llama_graph, MESH_2x2, {"model.layers.0.mlp.down_proj": ((1, 2), (1, 2))})


def test_tuple_layout_and_placement_forms_give_byte_identical_json(tiny_ctx):
    layout = autopar.Layout((2, 2), ("dp", "tp"))
    forms = [
        {"transformer.h.*.mlp.c_fc": ((2, 1), (1, 2)), "transformer.h.*.mlp.c_proj": ((2, 2), (2, 1))},
        {
            "transformer.h.*.mlp.c_fc": (layout("dp", "None"), layout("None", "tp")),
            "transformer.h.*.mlp.c_proj": (layout("dp", "tp"), layout("tp", "None")),
        },
        {
            "transformer.h.*.mlp.c_fc": (["S(0)", "R"], ["R", "S(1)"]),
            "transformer.h.*.mlp.c_proj": (["S(0)", "S(1)"], ["R", "S(0)"]),
        },
    ]
    texts = [_plan(tiny_ctx, hints=h).to_json() for h in forms]
    assert texts[0] == texts[1] == texts[2]
    plan = autopar.Plan.from_json(texts[0])
    assert plan.params["transformer.h.1.mlp.c_fc.weight"].placements == parse_placements("R,S(1)")
    assert plan.params["transformer.h.1.mlp.c_proj.weight"].placements == parse_placements("R,S(0)")
    c_fc = next(n for n in plan.nodes.values() if n.module == "transformer.h.1.mlp.c_fc")
    assert c_fc.inputs[1:] == (parse_placements("S(0),R"), parse_placements("R,S(1)"))
    assert autopar.Plan.from_json(texts[0]).to_json() == texts[0]  # the hints survive the round trip


# ---- CLI -----------------------------------------------------------------------------------------------
def test_cli_hint_flags_and_files(tmp_path, capsys):
    from autopar.cli import main

    base = [
        "plan",
        "gpt2-tiny",
        "--mesh",
        "2x2",
        "--axis-names",
        "dp,tp",
        "--batch",
        "4",
        "--seq",
        "32",
        "--no-compare",
    ]
    assert main(base + ["--hint", "*.mlp.c_fc.weight=R,S(1)", "--hint", "*.attn.c_attn.weight=R,S(1)[3]"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"│ transformer\.h\.\*\.mlp\.c_fc\.weight\s+│ 2\s+│.*│ R,S\(1\)\s+│.*│ hint\s+│", out)
    assert re.search(r"│ transformer\.h\.\*\.attn\.c_attn\.weight\s+│ 2\s+│.*│ R,S\(1\)\[3\]\s+│.*│ hint\s+│", out)
    assert "hints: 4 parameters" in out
    toml = tmp_path / "hints.toml"
    toml.write_text('"transformer.h.0.mlp.c_fc" = [[2, 1], [1, 2]]\n"transformer.h.1" = "replicate"\n')
    js = tmp_path / "hints.json"
    as_placements = {"transformer.h.0.mlp.c_fc": [["S(0)", "R"], ["R", "S(1)"]], "transformer.h.1": "replicate"}
    js.write_text(json.dumps(as_placements))
    outs = []
    for f in (toml, js):
        assert main(base + ["--hints", str(f), "--format", "json"]) == 0
        outs.append(capsys.readouterr().out)
    tuple_flags = ["--hint", "transformer.h.0.mlp.c_fc=((2, 1), (1, 2))", "--hint", "transformer.h.1=replicate"]
    assert main(base + tuple_flags + ["--format", "json"]) == 0
    outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2]
    assert autopar.Plan.from_json(outs[0]).hints.replicate == ("transformer.h.1",)
    assert main(base + ["--hint", "*.c_fc.weight=R,S(7)"]) == 2
    err = capsys.readouterr().err
    assert "'*.c_fc.weight'" in err and "shape (64, 256)" in err and "Fix:" in err
    assert main(base + ["--hint", "nothing=R,S(1)", "--strict-hints"]) == 2
    assert "matches no parameter" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SystemExit):
            main(base + ["--hint", "no-equals-sign"])


# ---- done-when 3: hinted plans run under autopar.compile and match one device -------------------------
class _Out(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class _HintedMLP(torch.nn.Module):
    """A model with an ``autopar.shard`` activation hint, for the execution test (see ``hinted_mlp``)."""

    config = types.SimpleNamespace()

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x, y):
        h = autopar.shard(torch.relu(self.up(x)), ["S(0)", "S(1)"])  # batch on dp, hidden on tp
        logits = self.down(h)
        return _Out(torch.nn.functional.mse_loss(logits, y), logits)


def hinted_mlp(batch: int, seq: int):
    """Factory for ``load_model("test_hints:hinted_mlp")`` (seeded weights and inputs)."""
    torch.manual_seed(0)
    return _HintedMLP(), (torch.randn(batch * seq, 16), torch.randn(batch * seq, 16))


LLAMA_MEGATRON_BLOCK_1 = {
    "model.layers.1.self_attn.[qkv]_proj.weight": ["R", "S(0)"],  # nn.Linear is (out, in): output features
    "model.layers.1.mlp.gate_proj.weight": ["R", "S(0)"],
    "model.layers.1.mlp.up_proj.weight": ["R", "S(0)"],
    "model.layers.1.self_attn.o_proj.weight": ["R", "S(1)"],  # input features
    "model.layers.1.mlp.down_proj.weight": ["R", "S(1)"],
}
HINTED_CASES = [
    (
        "gpt2-tiny",
        {
            "hints": {
                "transformer.h.*.attn.c_attn.weight": ["R", "S(1)[3]"],
                "transformer.h.*.mlp.c_fc": ((2, 1), (1, 2)),
                "transformer.h.*.mlp.c_proj": ((2, 2), (2, 1)),
            },
            "input_placements": {"input_ids": ["S(0)", "R"], "labels": ["S(0)", "R"]},
        },
    ),
    (
        "llama-tiny",
        {"hints": {**LLAMA_MEGATRON_BLOCK_1, "model.layers.0": "replicate", "lm_head.weight": ["R", "S(0)"]}},
    ),
    ("test_hints:hinted_mlp", {}),
]


def _hinted_rank_fn(rank, world, cases):
    from test_execution import _model, _train

    out = []
    for name, options in cases:
        model, args, kwargs = _model(name)
        sharded = autopar.compile(model, MESH_2x2, example_inputs=args, example_kwargs=kwargs, **options)
        out.append((sharded.plan.params, sharded.plan.nodes, _train((sharded, sharded), args, kwargs)))
    return out


def test_hinted_plans_train_like_one_device():
    from dist_utils import run_ranks
    from test_execution import ATOL, RTOL, _reference

    results = run_ranks(_hinted_rank_fn, 4, HINTED_CASES, timeout_s=900)
    for k, (name, options) in enumerate(HINTED_CASES):
        ref = _reference(name)
        for rank, per_case in enumerate(results):
            params, nodes, got = per_case[k]
            where = f"{name} case {k}, rank {rank}"
            for pattern, value in options.get("hints", {}).items():
                if isinstance(value, list):  # placement hints hold in the executed plan
                    matched = [
                        p
                        for fqn, p in params.items()
                        if any(fnmatch.fnmatchcase(f, pattern) for f in [fqn, *p.tied_to])
                    ]
                    assert matched and all(p.placements == parse_placements(value) for p in matched), (where, pattern)
            if name.endswith("hinted_mlp"):
                shard = next(n for n in nodes.values() if n.op == "autopar.shard.default")
                assert shard.outputs == (parse_placements("S(0),S(1)"),), where
            for what, a, b in zip(("losses", "logits", "grads", "params"), got, ref):
                if isinstance(a, dict):
                    assert a.keys() == b.keys(), (where, what)
                    a, b = list(a.values()), list(b.values())
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, w=where, x=what: f"{w}: {x}: {m}")
