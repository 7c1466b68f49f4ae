"""Architectures autopar was not written against, at sizes the mesh does not divide.

Each case builds a tiny random-weight Hugging Face model (2 layers, vocabulary
1001, 6 heads of width 8, batch 3, sequence 8: nothing divides evenly by 4 and
the batch not by 2) and plans it on a 2-D mesh and on a mesh of 3.  Every op must
get a rule (no replicate fallback), and the plan under a memory cap must fit it.
Two architectures whose blocks differ most from GPT-2/Llama/BERT then train on 2
gloo ranks and must match one device: GPT-NeoX (parallel attention + MLP residual,
rotary on a quarter of each head, fused qkv laid out per head) and Gemma (decoupled
head width, ``type_as`` casts, tanh-GELU gated MLP, scaled embeddings).

``scripts/probe_models.py`` runs the same check over more architectures and meshes.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import ATOL, RTOL, STEPS, _train

VOCAB, BATCH, SEQ = 1001, 3, 8
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=6,
    intermediate_size=100,
    num_hidden_layers=2,
    max_position_embeddings=32,
)
_GQA = dict(_DECODER, num_key_value_heads=2)

#: id -> (config class, model class, config kwargs); every class ships with transformers 5.
ARCHS: dict[str, tuple[str, str, dict]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_GQA, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _GQA),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_GQA, head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_GQA, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_GQA, head_dim=8, sliding_window=4)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_DECODER, partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_GQA, pad_token_id=0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_GQA, partial_rotary_factor=0.25)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_DECODER, rotary_pct=0.25, use_parallel_residual=True)),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, ffn_dim=100, num_hidden_layers=2),
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=48, num_attention_heads=6, num_hidden_layers=2, multi_query=True),
    ),
    "falcon-alibi": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            num_attention_heads=6,
            num_hidden_layers=2,
            multi_query=False,
            parallel_attn=False,
            alibi=True,
        ),
    ),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=VOCAB, n_embd=48, n_head=6, n_layer=2, rotary_dim=4)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=48, n_head=6, n_layer=2)),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        dict(vocab_size=VOCAB, d_model=48, n_heads=6, n_layers=2, expansion_ratio=2),
    ),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", _DECODER),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(vocab_size=VOCAB, dim=48, n_heads=6, n_layers=2, hidden_dim=100, max_position_embeddings=32),
    ),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(_DECODER, embedding_size=32)),
}


def build(arch: str, *, device: str = "meta", seed: int = 0):
    """(model, args, kwargs) of a tiny ``arch`` with every dropout off; skips when transformers lacks it."""
    transformers = pytest.importorskip("transformers")
    cfg_name, model_name, kwargs = ARCHS[arch]
    if not hasattr(transformers, cfg_name) or not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, cfg_name)(**dict(kwargs, use_cache=False))
    for attr, value in list(vars(config).items()):  # dropout off: the numerics compare exactly
        if isinstance(value, float) and ("dropout" in attr or "pdrop" in attr or attr == "layerdrop"):
            setattr(config, attr, 0.0)
    if device != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_name)(config)
    model.train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)
    return model, (ids,), {"labels": labels}


#: every architecture on a 2-D mesh; those that differ most also on 3 ranks (nothing divides by 3)
PLAN_CASES = [(arch, (2, 2)) for arch in ARCHS if arch not in ("qwen2", "phi3", "gemma")]  # ~ mistral, gemma2
PLAN_CASES += [(arch, (3,)) for arch in ("gpt_neox", "falcon", "gptj", "bloom")]


@pytest.mark.parametrize("arch,mesh_shape", PLAN_CASES, ids=[f"{a}-{'x'.join(map(str, m))}" for a, m in PLAN_CASES])
def test_plans_every_op_and_fits_the_cap(arch, mesh_shape):
    import autopar
    from autopar.planner import plan_from_context, prepare

    model, args, kwargs = build(arch)
    ctx = prepare(model, autopar.Mesh(mesh_shape), example_inputs=args, example_kwargs=kwargs)
    whole = plan_from_context(ctx, family="data parallel", compare_families=False)
    cap = int(0.6 * whole.memory["per_device_bytes"])  # whole parameters do not fit: they must be sharded
    plan = plan_from_context(ctx, mem_cap=cap, compare_families=False)
    assert plan.fallback_ops == [], f"{arch}: ops with no rule: {sorted({f['op'] for f in plan.fallback_ops})}"
    assert not any(n["fallback"] for n in plan.nodes.values())
    assert plan.memory["per_device_bytes"] <= cap, f"{arch}: {plan.memory} over the cap {cap}"
    assert any(p["placements"] != ["R"] * len(mesh_shape) for p in plan.params.values())


def test_decompositions_leave_no_type_as_or_inplace_op():
    """RoBERTa's ``type_as`` and Falcon's ``mlp_output += attention_output`` reach the planner out of place."""
    from autopar.capture import capture

    for arch, gone in (("roberta", "type_as"), ("falcon", "add_")):
        model, args, kwargs = build(arch)
        graph = capture(model, args, kwargs)
        targets = {str(n.fx_node.target) for n in graph.nodes if n.kind == "op"}
        assert not any(t.split(".")[-2] == gone for t in targets), f"{arch}: {gone} left in {sorted(targets)}"


class _AddInPlace(torch.nn.Module):
    """An in-place add on a linear's output ``y``, read afterwards in one of three ways.

    ``plain``: ``y += x; y.sum()``; ``view``: a view of ``y`` taken before is read after;
    ``slice``: the add writes through a slice of ``y`` and ``y`` is read (T5's shift-right).
    """

    def __init__(self, how: str):
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        if self.how == "slice":
            v = y[:, :2]
            v += 1.0
            return (y * y).sum()
        v = y.view(-1)
        y += 1.0
        return (v * v).sum() if self.how == "view" else (y * y).sum()


@pytest.mark.parametrize("how", ["plain", "view", "slice"])
def test_inplace_op_is_made_out_of_place_and_later_reads_see_the_update(how):
    from autopar.capture import capture

    model, x = _AddInPlace(how), torch.randn(3, 4)
    graph = capture(model, (x,))
    ops = [n.fx_node for n in graph.nodes if n.kind == "op"]
    targets = [str(fx.target) for fx in ops]
    assert "aten.add.Tensor" in targets and "aten.add_.Tensor" not in targets, targets
    (square,) = (fx for fx in ops if str(fx.target) == "aten.mul.Tensor")
    read = str(square.args[0].target)
    want = {"plain": "aten.add.Tensor", "view": "aten.view.default", "slice": "aten.slice_scatter.default"}[how]
    assert read == want, f"the product reads {read}, not the updated value ({want})"
    # the rewritten graph (placeholders: weight, bias, x) computes what the module computes
    gm = ops[0].graph.owning_module
    (got,) = gm(model.lin.weight.detach(), model.lin.bias.detach(), x)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- numerics on 2 gloo ranks

# the numerics settings and training loop of tests/test_execution.py (why AdamW eps 1e-6: see there)


def _rank_fn(rank, world, archs, family):
    import autopar

    out = {}
    for arch in archs:
        model, args, kwargs = build(arch, device="cpu")
        mesh = autopar.Mesh((world,), axis_names=("tp",))
        sharded = autopar.compile(
            model, mesh, example_inputs=args, example_kwargs=kwargs, family=family, profile=PARTITIONING_PROFILE
        )
        out[arch] = (sharded.plan.family, sharded.plan.fallback_ops, _train((sharded, sharded), args, kwargs))
    return out


def _reference(arch):
    model, args, kwargs = build(arch, device="cpu")

    def call(*a, **k):
        out = model(*a, **k)
        return out.loss, out.logits

    return _train((model, call), args, kwargs)


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def test_tensor_parallel_training_matches_one_device():
    """Loss, logits, every gradient and every parameter after 3 AdamW steps, batch 3 on 2 ranks.

    All architectures run in one spawn of the ranks (starting them is most of the time).
    """
    archs = ("gpt_neox", "gemma", "falcon")  # falcon (multi-query): forward makes constants export lifts
    for arch in archs:
        build(arch)  # skips when transformers lacks one
    results = run_ranks(_rank_fn, 2, archs, "tensor parallel", timeout_s=600)
    for arch in archs:
        ref_losses, ref_logits, ref_grads, ref_params = _reference(arch)
        for rank, per_arch in enumerate(results):
            family, fallback, (losses, logits, grads, params) = per_arch[arch]
            where = f"{arch} on 2 ranks, rank {rank}, plan {family}"
            assert "tensor parallel" in family and not fallback, where
            for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
                _close(a, b, f"{where}: loss {step}")
            _close(logits, ref_logits, f"{where}: logits")
            assert grads.keys() == ref_grads.keys()
            for k in ref_grads:
                _close(grads[k], ref_grads[k], f"{where}: grad {k}")
            assert params.keys() == ref_params.keys()
            for k in ref_params:
                _close(params[k], ref_params[k], f"{where}: param {k} after {STEPS} steps")
