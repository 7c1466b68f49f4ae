"""Any forward a user writes: compiled modules take and return what the model does (issue 15).

Every form of ``tests/call_forms.py`` (positional, positional-only, ``*args``,
keyword-only int/float/bool/str, ``**kwargs``, defaults left out, ``None``
arguments, nested tuples/lists/dicts/dataclasses; outputs as a tensor, tuple,
list, dict, dataclass, ``ModelOutput``, nested) is compiled on 2 gloo ranks under
a data-parallel and a tensor-parallel plan and trained 3 AdamW steps; outputs
(their structure and values), gradients and parameters must equal one device.
Step 1 calls the compiled module with the same call written another way (keywords
for positionals, dict keys reordered, defaults passed explicitly), which must be
taken as the compiled call.  Hugging Face models are trained through a ``*args``
wrapper and with dict batches.  A call whose structure differs gets one
``InputMismatchError`` naming the argument's path.
"""

from __future__ import annotations

import pytest
import torch
from call_forms import FORMS, RESTATED, ROWS, Batch, build, loss_of
from dist_utils import PARTITIONING_PROFILE, run_ranks
from torch.utils import _pytree as pytree
from transformers.utils import ModelOutput

from autopar.capture.call_spec import InputMismatchError
from autopar.capture.export import capture
from autopar.placement import Replicate, Shard

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5
ADAMW = {"lr": 1e-3, "eps": 1e-6}
# each form runs under: its batch split over the ranks (inputs hinted S(0) by path), the same with each rank
# passing only its rows (input_mode='local'), tensor parallel (weights split, inputs whole), and tensor parallel
# compiled lazily on the first call
VARIANTS = ("batch split", "local pieces", "tensor parallel", "lazy")


def _detached(out):
    return pytree.tree_map(lambda v: v.detach().as_subclass(torch.Tensor).clone() if torch.is_tensor(v) else v, out)


def _train(module, args, kwargs, restated=None, piece=None):
    """(first outputs, losses, step-0 grads, params after STEPS steps); step 1 calls in the ``restated`` form.

    ``piece`` maps a call's (args, kwargs) to what this rank passes (its rows, under ``input_mode='local'``).
    """
    opt = torch.optim.AdamW(module.parameters(), **ADAMW)
    first, losses, grads = None, [], None
    for step in range(STEPS):
        a, k = restated(args, kwargs) if restated is not None and step == 1 else (args, kwargs)
        if piece is not None:
            a, k = piece(a, k)
        out = module(*a, **k)
        loss = loss_of(out)
        loss.backward()
        if step == 0:
            first = _detached(out)
            grads = (
                module.full_grads()
                if hasattr(module, "full_grads")
                else {n: p.grad.detach().clone() for n, p in module.named_parameters()}
            )
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = (
        module.full_state_dict()
        if hasattr(module, "full_state_dict")
        else {n: v.detach().clone() for n, v in module.state_dict().items()}
    )
    return first, losses, grads, params


def _assert_same_output(got, want, where: str) -> None:
    """Same structure (types, keys, lengths, constants) and values within tolerance."""
    assert type(got) is type(want), f"{where}: output type {type(got).__name__}, expected {type(want).__name__}"
    got_leaves, got_spec = pytree.tree_flatten_with_path(got)
    want_leaves, want_spec = pytree.tree_flatten_with_path(want)
    assert got_spec == want_spec, f"{where}: output structure\n{got_spec}\nexpected\n{want_spec}"
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        what = f"{where}: output{pytree.keystr(path)}"
        if torch.is_tensor(w):
            torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m, what=what: f"{what}: {m}")
        else:
            assert g == w, f"{what}: {g!r}, expected {w!r}"


def _assert_trains_alike(got, want, where: str) -> None:
    first, losses, grads, params = got
    ref_first, ref_losses, ref_grads, ref_params = want
    _assert_same_output(first, ref_first, where)
    assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), f"{where}: losses {losses} vs {ref_losses}"
    assert grads.keys() == ref_grads.keys(), where
    for name, g in ref_grads.items():
        torch.testing.assert_close(
            grads[name], g, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{where}: grad {n}: {m}"
        )
    assert params.keys() == ref_params.keys(), where
    for name, p in ref_params.items():
        torch.testing.assert_close(
            params[name], p, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{where}: param {n} after {STEPS}: {m}"
        )


def _batch_split(model, args, kwargs) -> dict:
    """Hints that split dim 0 of every batch-shaped tensor input, named by their paths (``batch['x']``)."""
    graph = capture(model, args, kwargs)
    shapes = {n.fqn: n.outputs[0].shape for n in graph.nodes if n.kind == "input"}
    return {leaf.path: ["S(0)"] for leaf in graph.call.inputs if leaf.is_tensor and shapes[leaf.name][:1] == (ROWS,)}


def _variants(model, args, kwargs) -> dict[str, dict]:
    """The plans and modes each form runs under (see VARIANTS)."""
    split = {"input_placements": _batch_split(model, args, kwargs)}
    return {
        "batch split": split,
        "local pieces": {**split, "input_mode": "local"},
        "tensor parallel": {"family": "tensor parallel"},
        "lazy": {"family": "tensor parallel", "lazy": True},
    }


def _rows_of(rank: int, world: int):
    """(args, kwargs) -> this rank's rows of every batch-shaped tensor (what ``input_mode='local'`` takes)."""

    def piece(args, kwargs):
        def rows(v):
            return v.tensor_split(world)[rank] if torch.is_tensor(v) and v.shape[:1] == (ROWS,) else v

        return pytree.tree_map(rows, (args, kwargs))

    return piece


def _compile(model, args, kwargs, world: int, lazy: bool = False, **options):
    """``autopar.compile`` on a 1-D mesh of ``world``; ``lazy`` plans on the first call instead."""
    import autopar

    mesh = autopar.Mesh((world,), axis_names=("x",))
    if lazy:
        args = kwargs = None
    return autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, **options
    )


def _forms_rank_fn(rank, world, form):
    out = {}
    for variant in VARIANTS:
        model, args, kwargs = build(form)
        options = _variants(model, args, kwargs)[variant]
        sharded = _compile(model, args, kwargs, world, **options)
        piece = _rows_of(rank, world) if options.get("input_mode") == "local" else None
        result = _train(sharded, args, kwargs, RESTATED.get(form), piece)
        split = sorted(k for k, v in sharded.plan.inputs.items() if v.placements == (Shard(0),))
        sharded_params = sorted(k for k, v in sharded.plan.params.items() if v.placements != (Replicate(),))
        out[variant] = (split, sharded_params, result)
    return out


@pytest.mark.parametrize("form", list(FORMS))
def test_every_call_form_trains_like_one_device_on_two_ranks(form):
    model, args, kwargs = build(form)
    want = _train(model, args, kwargs, RESTATED.get(form))
    for rank, per_variant in enumerate(run_ranks(_forms_rank_fn, 2, form, timeout_s=300)):
        for variant, (split, sharded_params, got) in per_variant.items():
            if variant in ("batch split", "local pieces"):  # the plan really splits the inputs: each rank its rows
                assert split and not sharded_params, (form, split, sharded_params)
            else:
                assert sharded_params, (form, variant)
            _assert_trains_alike(got, want, f"{form}, rank {rank}, {variant}")


# ---- Hugging Face models through a *args wrapper and with dict batches -------------------------------


class ArgsWrapper(torch.nn.Module):
    """forward(*args) around a Hugging Face model: (input_ids, labels) by position."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args):
        input_ids, labels = args
        return self.model(input_ids=input_ids, labels=labels)


class BatchWrapper(torch.nn.Module):
    """forward(batch) around a Hugging Face model: one dict of every input, as a DataLoader yields."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict):
        return self.model(**batch)


def _hf(name: str, wrap: str):
    """(model, args, kwargs) of built-in ``name`` (dropout off) called as ``wrap``: args | kwargs | batch."""
    from autopar.models import load_model

    model, (ids,), kwargs = load_model(name, batch=4, seq=16, device="cpu", no_dropout=True)
    labels = kwargs["labels"]
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # padding on one row: the mask must reach the model
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if wrap == "args":
        return ArgsWrapper(model), (ids, labels), {}
    if wrap == "kwargs":
        return model, (), batch
    return BatchWrapper(model), (batch,), {}


HF_CASES = [("gpt2-tiny", "args"), ("llama-tiny", "kwargs"), ("bert-tiny", "batch"), ("gpt2-tiny", "batch")]


def _hf_rank_fn(rank, world, name, wrap, family):
    model, args, kwargs = _hf(name, wrap)
    sharded = _compile(model, args, kwargs, world, family=family)
    return sharded.plan.family, _train(sharded, args, kwargs)


@pytest.mark.parametrize("name,wrap", HF_CASES, ids=[f"{n}-{w}" for n, w in HF_CASES])
def test_hugging_face_models_train_through_wrappers_and_dict_batches(name, wrap):
    model, args, kwargs = _hf(name, wrap)
    want = _train(model, args, kwargs)
    family = "tensor parallel" if wrap != "batch" else "data parallel"
    for rank, (label, got) in enumerate(run_ranks(_hf_rank_fn, 2, name, wrap, family, timeout_s=300)):
        assert family in label, (name, wrap, label)
        _assert_trains_alike(got, want, f"{name} via {wrap}, rank {rank}")
        assert isinstance(got[0], ModelOutput), type(got[0])  # the model's own output class, not a tuple


# ---- calls whose structure differs from the compiled one ---------------------------------------------


def _mismatch(form: str, args, kwargs) -> str:
    model, cargs, ckwargs = build(form)
    graph = capture(model, cargs, ckwargs)
    with pytest.raises(InputMismatchError) as info:
        graph.call.match(args, kwargs, lambda name: (_shape(graph, name), _dtype(graph, name), "compile again"))
    return str(info.value)


def _shape(graph, name):
    return next(n.outputs[0].shape for n in graph.nodes if n.kind == "input" and n.fqn == name)


def _dtype(graph, name):
    return next(n.outputs[0].dtype for n in graph.nodes if n.kind == "input" and n.fqn == name)


def _nested_call():
    _, args, kwargs = build("nested")
    return args[0], kwargs["aux"]


def test_a_call_of_another_structure_names_each_argument_by_its_path():
    batch, aux = _nested_call()
    x = batch["x"]
    cases = {
        # a list where a tuple was compiled
        "batch['extra']: compiled with a tuple of 2, given a list of 2": (
            ({**batch, "extra": list(batch["extra"])},),
            {"aux": aux},
        ),
        # a nested element missing, and one extra
        "batch['extra'][1][1]: compiled with it, not given": (
            ({**batch, "extra": (batch["extra"][0], [batch["extra"][1][0]])},),
            {"aux": aux},
        ),
        "batch['meta']['mask']: given, but not in the compiled call": (
            ({**batch, "meta": {**batch["meta"], "mask": x}},),
            {"aux": aux},
        ),
        # another dtype and another shape of one leaf
        "batch['extra'][0]: dtype float64 given, compiled with float32": (
            ({**batch, "extra": (batch["extra"][0].double(), batch["extra"][1])},),
            {"aux": aux},
        ),
        "batch['x']: shape (2, 16) given, expected (4, 16); compile again": (({**batch, "x": x[:2]},), {"aux": aux}),
        # a tensor where a dataclass was
        "aux: compiled with a Batch, given a tensor (4, 16) float32": ((batch,), {"aux": x}),
    }
    for expected, (args, kwargs) in cases.items():
        message = _mismatch("nested", args, kwargs)
        assert expected in message, (expected, message)
        assert "Fix:" in message and "compiled call: Nested(batch['x']=<tensor>" in message, message
    # a dataclass field of another value is a constant of the compiled call
    other = Batch(aux.x, aux.target)
    object.__setattr__(other, "tag", "c")
    assert "aux.tag: compiled with 'b', given 'c'" in _mismatch("nested", (batch,), {"aux": other})


def test_a_call_missing_or_adding_arguments_or_changing_constants_names_them():
    _, args, kwargs = build("keyword-only")
    assert "the inputs do not fit KeywordOnly.forward" in _mismatch("keyword-only", args, {})
    assert "missing a required argument: 'target'" in _mismatch("keyword-only", args, {"repeat": 2})
    message = _mismatch("keyword-only", args, {**kwargs, "scale": 0.25})
    assert "scale: compiled with 0.5, given 0.25 (a non-tensor argument is fixed)" in message, message
    message = _mismatch("keyword-only", args, {**kwargs, "residual": False})  # the default: left out of the call
    assert "residual: compiled with it, not given" in message, message
    message = _mismatch("keyword-only", args, {**kwargs, "reduce": torch.zeros(1)})
    assert "reduce: compiled with 'sum' (the graph was traced without a tensor here)" in message, message
    _, args, kwargs = build("var-args")
    assert "xs[3]: given, but not in the compiled call" in _mismatch("var-args", (*args, args[0]), {})
    assert "xs[2]: compiled with it, not given" in _mismatch("var-args", args[:2], {})
    _, args, kwargs = build("var-kwargs")
    message = _mismatch("var-kwargs", args, {"a": kwargs["a"], "c": kwargs["b"]})
    assert "b: compiled with it, not given" in message and "c: given, but not in the compiled call" in message
    _, args, kwargs = build("none-arguments")
    message = _mismatch("none-arguments", (args[0], args[0], args[2]), kwargs)
    assert "mask: given, but not in the compiled call" in message, message
    message = _mismatch("none-arguments", args, {"bias": None})
    assert "bias: compiled with it, not given" in message, message


def test_canonical_form_drops_defaults_and_keeps_positionals_before_var_args():
    import inspect

    from autopar.capture.call_spec import bind_call

    def f(a, b=1, /, c=2.0, *rest, d=None, e="x", **kw):
        pass

    sig = inspect.signature(f)
    x = torch.zeros(1)
    assert bind_call(sig, (x,), {}) == ((x,), {})
    assert bind_call(sig, (x, 1, 2.0), {"d": None, "e": "x"}) == ((x,), {})
    assert bind_call(sig, (x, 1, 3.0), {}) == ((x,), {"c": 3.0})  # c may go by keyword: b drops
    assert bind_call(sig, (x, 2, 3.0), {}) == ((x, 2, 3.0), {})
    assert bind_call(sig, (x, 2), {"c": 2.0}) == ((x, 2), {})
    assert bind_call(sig, (x, 1, 2.0, x), {}) == ((x, 1, 2.0, x), {})  # before a non-empty *rest nothing drops
    assert bind_call(sig, (x,), {"e": "y", "z": x}) == ((x,), {"e": "y", "z": x})


def test_the_plan_names_each_input_by_its_path_and_takes_hints_by_path():
    import autopar

    model, args, kwargs = build("nested")
    plan = autopar.plan(
        model,
        autopar.Mesh((2,)),
        example_inputs=args,
        example_kwargs=kwargs,
        input_placements={"batch['extra'][1][0]": ["S(0)"], "aux.x": ["S(1)"]},
        compare_families=False,
    )
    paths = {k: v.path for k, v in plan.inputs.items() if v.kind == "input"}
    assert sorted(paths.values()) == sorted(
        ["batch['x']", "batch['extra'][0]", "batch['extra'][1][0]", "batch['extra'][1][1]", "batch['meta']['target']"]
        + ["aux.x", "aux.target"]
    ), paths
    by_path = {v.path: v.placements for v in plan.inputs.values() if v.kind == "input"}
    assert by_path["batch['extra'][1][0]"] == (Shard(0),) and by_path["aux.x"] == (Shard(1),), by_path
    with pytest.raises(ValueError, match=r"batch_extra_1_0 or batch\['extra'\]\[1\]\[0\]"):
        autopar.plan(
            model, autopar.Mesh((2,)), example_inputs=args, example_kwargs=kwargs, input_placements={"y": ["R"]}
        )
