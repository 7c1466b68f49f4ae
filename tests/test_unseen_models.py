"""Architectures autopar was not written against, at sizes the mesh does not divide.

Each case builds a tiny random-weight Hugging Face model from the table
``configs/models/tiny_hf.toml`` (2 layers, vocabulary 1001, 6 heads of width 8,
batch 3, sequence 8: nothing divides evenly by 4 and the batch not by 2) and
plans it on a 2-D mesh and on a mesh of 3.  Every op must get a rule (no replicate
fallback), and the plan under a memory cap must fit it.
Architectures whose blocks differ most from GPT-2/Llama/BERT then train tensor-parallel
on 2 gloo ranks and must match one device: GPT-NeoX (parallel attention + MLP residual,
rotary on a quarter of each head, fused qkv laid out per head), Gemma (decoupled head
width, ``type_as`` casts, tanh-GELU gated MLP, scaled embeddings), Falcon (multi-query),
T5 (encoder-decoder, shared embeddings, relative position bias), ALBERT (one layer's
weights in every layer) and OLMo-2 (RMSNorm over the whole q and k projections).

``scripts/probe_models.py`` runs the same check over more architectures and meshes.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import _assert_trains_alike, _loss_and_logits, _train

from autopar.placement import Replicate, Shard

BATCH, SEQ = 3, 8

#: the architectures of configs/models/tiny_hf.toml whose plans these tests check
PLANNED = (
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "phi",
    "phi3",
    "stablelm",
    "gpt_neox",
    "opt",
    "falcon",
    "falcon_alibi",
    "gptj",
    "bloom",
    "mpt",
    "roberta",
    "distilbert",
    "electra",
)


def build(arch: str, *, device: str = "meta", overrides: dict | None = None):
    """(model, args, kwargs) of the tiny ``arch`` with every dropout off (``overrides``: config entries);
    skips when transformers lacks it."""
    transformers = pytest.importorskip("transformers")
    from autopar.models import TINY_SUFFIX, load_model, model_config

    classes = model_config(arch + TINY_SUFFIX)
    for cls in (classes["config_class"], classes["model_class"]):
        if not hasattr(transformers, cls):
            pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    model, args, kwargs = load_model(
        arch + TINY_SUFFIX, batch=BATCH, seq=SEQ, device=device, no_dropout=True, overrides=overrides
    )
    model.train()
    return model, args, kwargs


def test_table_architectures_are_cli_models_with_bases_resolved():
    """configs/models/tiny_hf.toml is the one table: the CLI names each entry ``<arch>-tiny``."""
    from autopar.models import builtin_models, load_model, model_config, tiny_hf_archs

    archs = tiny_hf_archs()
    assert set(PLANNED) <= set(archs)
    assert {f"{a}-tiny" for a in archs} <= set(builtin_models()) and "tiny_hf" not in builtin_models()
    mistral = model_config("mistral-tiny")["config"]
    assert mistral["num_key_value_heads"] == 2 and mistral["hidden_size"] == 48  # base gqa, its base decoder
    assert "sliding_window" in mistral and mistral["sliding_window"] is None  # `none` list: TOML has no null
    model, (ids,), kwargs = load_model("mistral-tiny", batch=BATCH, seq=SEQ, overrides={"num_hidden_layers": 1})
    assert len(model.model.layers) == 1 and ids.shape == kwargs["labels"].shape == (BATCH, SEQ)


#: every architecture on a 2-D mesh; those that differ most also on 3 ranks (nothing divides by 3)
PLAN_CASES = [(arch, (2, 2)) for arch in PLANNED if arch not in ("qwen2", "phi3", "gemma")]  # ~ mistral, gemma2
PLAN_CASES += [(arch, (3,)) for arch in ("gpt_neox", "falcon", "gptj", "bloom")]


@pytest.mark.parametrize("arch,mesh_shape", PLAN_CASES, ids=[f"{a}-{'x'.join(map(str, m))}" for a, m in PLAN_CASES])
def test_plans_every_op_and_fits_the_cap(arch, mesh_shape):
    import autopar
    from autopar.planner.driver import plan_from_context, prepare

    model, args, kwargs = build(arch)
    ctx = prepare(model, autopar.Mesh(mesh_shape), example_inputs=args, example_kwargs=kwargs)
    whole = plan_from_context(ctx, family="data parallel", compare_families=False)
    cap = int(0.6 * whole.memory.per_device_bytes)  # whole parameters do not fit: they must be sharded
    plan = plan_from_context(ctx, mem_cap=cap, compare_families=False)
    assert plan.fallback_ops == (), f"{arch}: ops with no rule: {sorted({f.op for f in plan.fallback_ops})}"
    assert not any(n.fallback for n in plan.nodes.values())
    assert plan.memory.per_device_bytes <= cap, f"{arch}: {plan.memory} over the cap {cap}"
    assert any(p.placements != (Replicate(),) * len(mesh_shape) for p in plan.params.values())


def test_decompositions_leave_no_type_as_or_inplace_op():
    """RoBERTa's ``type_as`` and Falcon's ``mlp_output += attention_output`` reach the planner out of place."""
    from autopar.capture.export import capture

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
    from autopar.capture.export import capture

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


class _ShiftRight(torch.nn.Module):
    """BART's ``shift_tokens_right``: two in-place writes into one fresh tensor, then a read of it."""

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2  # the decoder start token (T5's is 0, which new_zeros already wrote)
        shifted.masked_fill_(shifted == -100, 1)
        return shifted


def test_every_inplace_write_into_one_tensor_survives_the_rewrite():
    """BART was silently wrong on every plan: the second write went into a stale alias and was dropped."""
    from autopar.capture.export import capture

    model, ids = _ShiftRight(), torch.randint(3, 9, (2, 5))
    graph = capture(model, (ids,))
    constants = [graph.constants[n.fqn] for n in graph.nodes if n.kind == "buffer"]
    (got,) = graph.gm(*constants, ids)
    torch.testing.assert_close(got, model(ids))


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
        train = _train((sharded, _loss_and_logits(sharded)), args, kwargs)
        out[arch] = (sharded.plan.family, sharded.plan.fallback_ops, train)
    return out


def _reference(arch, overrides: dict | None = None):
    model, args, kwargs = build(arch, device="cpu", overrides=overrides)

    def call(*a, **k):
        out = model(*a, **k)
        return out.loss, out.logits

    return _train((model, call), args, kwargs)


def _assert_trains_like_one_device(archs: tuple[str, ...], family: str) -> None:
    """Loss, logits, every gradient and every parameter after 3 AdamW steps, batch 3 on 2 ranks.

    All architectures run in one spawn of the ranks (starting them is most of the time).
    """
    for arch in archs:
        build(arch)  # skips when transformers lacks one
    results = run_ranks(_rank_fn, 2, archs, family, timeout_s=600)
    for arch in archs:
        ref = _reference(arch)
        for rank, per_arch in enumerate(results):
            plan_family, fallback, got = per_arch[arch]
            where = f"{arch} on 2 ranks, rank {rank}, plan {plan_family}"
            assert family in plan_family and not fallback, where
            _assert_trains_alike(got, ref, where)


def test_tensor_parallel_training_matches_one_device():
    # falcon (multi-query): forward makes constants export lifts
    _assert_trains_like_one_device(("gpt_neox", "gemma", "falcon"), "tensor parallel")


def test_shared_weights_and_encoder_decoder_train_like_one_device():
    """T5: encoder-decoder, one embedding shared by encoder, decoder and head, relative position
    bias; ALBERT: one layer's weights used by every layer (their gradients sum over the uses);
    OLMo-2: RMSNorm of the whole q and k projections, which tensor parallelism shards by head."""
    _assert_trains_like_one_device(("t5", "albert", "olmo2"), "tensor parallel")


class _CopyInto(torch.nn.Module):
    """DeepSeek-V3's pattern: ``copy_`` of a computed value into a slice of a fresh tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        out = x.new_zeros(x.shape[0], 6)
        out[:, :3].copy_(self.proj(x))
        out[:, 3:].copy_(self.proj(x).exp()[:, :1])  # broadcast along the slice
        return out.sum(-1)


def test_copy_into_an_intermediate_is_rewritten_with_gradients():
    """``copy_`` became ``aten.copy``, which has no derivative; it is now a cast and a broadcast."""
    from autopar.capture.export import capture

    model, x = _CopyInto(), torch.randn(2, 4, requires_grad=True)
    graph = capture(model, (x,))
    calls = [n.target for n in graph.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.copy.default not in calls and torch.ops.aten.copy_.default not in calls
    params = [dict(model.named_parameters())[n.fqn] for n in graph.nodes if n.kind == "param"]
    (got,) = graph.gm(*params, x)
    want = model(x)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(g_got, g_want)


def _resnet():
    """Hugging Face's ResNet (batch norm: running statistics and a counter the forward updates in place)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 12], depths=[1, 1], num_labels=5, layer_type="basic")
    model = ResNetForImageClassification(config)
    gen = torch.Generator().manual_seed(1)
    pixels, labels = torch.randn(BATCH, 3, 20, 20, generator=gen), torch.randint(0, 5, (BATCH,), generator=gen)
    return model, (pixels,), {"labels": labels}


def _batch_norm_run(model, call, args, kwargs, state):
    """Two SGD steps in train mode, then two eval-mode forwards: (state after training, eval logits, state after)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        call(*args, **kwargs)[0].backward()
        opt.step()
        opt.zero_grad()
    trained = state()
    model.eval()
    with torch.no_grad():
        logits = [call(*args, **kwargs)[1] for _ in range(2)]
    return trained, logits, state()


def _batch_norm_rank_fn(rank, world):
    import autopar

    model, args, kwargs = _resnet()
    sharded = autopar.compile(
        model, autopar.Mesh((world,)), example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE
    )
    return _batch_norm_run(sharded, _loss_and_logits(sharded), args, kwargs, sharded.full_state_dict)


def test_batch_norm_running_statistics_train_and_evaluate_like_one_device():
    """Buffers the forward updates (running mean/var, num_batches_tracked) keep their updates on the ranks and in
    full_state_dict; eval mode normalizes with them and updates nothing, as model.eval() does."""
    model, args, kwargs = _resnet()

    def call(*a, **k):
        out = model(*a, **k)
        return out.loss, out.logits

    want = _batch_norm_run(model, call, args, kwargs, lambda: {k: v.clone() for k, v in model.state_dict().items()})
    assert int(want[0]["resnet.embedder.embedder.normalization.num_batches_tracked"]) == 2
    for rank, (trained, logits, after_eval) in enumerate(run_ranks(_batch_norm_rank_fn, 2, timeout_s=300)):
        for got, ref, when in ((trained, want[0], "after training"), (after_eval, want[2], "after eval")):
            assert got.keys() == ref.keys(), rank
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {k} {when}")
        for got in logits:
            torch.testing.assert_close(got, want[1][0], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: eval logits")


def _vision_audio(arch: str):
    """Hugging Face architectures beyond text: a convolution front end autopar has no sharding rule for."""
    import transformers as tf

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if arch == "vit":  # patch embedding: a Conv2d
        config = tf.ViTConfig(
            image_size=16, patch_size=4, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
            intermediate_size=50, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        pixels = torch.randn(BATCH, 3, 16, 16, generator=gen)
        return tf.ViTForImageClassification(config), (pixels,), {"labels": torch.randint(0, 5, (BATCH,), generator=gen)}
    config = tf.WhisperConfig(  # audio encoder-decoder: two Conv1d, frozen sinusoidal positions
        vocab_size=101, d_model=24, encoder_layers=1, decoder_layers=1, encoder_attention_heads=3,
        decoder_attention_heads=3, encoder_ffn_dim=40, decoder_ffn_dim=40, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, dropout=0.0, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    features, labels = torch.randn(BATCH, 8, 16, generator=gen), torch.randint(3, 101, (BATCH, 6), generator=gen)
    return tf.WhisperForConditionalGeneration(config), (features,), {"labels": labels}


def _vision_audio_rank_fn(rank, world, archs):
    import autopar

    out = {}
    for arch in archs:
        model, args, kwargs = _vision_audio(arch)
        sharded = autopar.compile(
            model,
            autopar.Mesh((world,)),
            example_inputs=args,
            example_kwargs=kwargs,
            family="tensor parallel",
            profile=PARTITIONING_PROFILE,
        )
        sharded_params = [k for k, v in sharded.plan.params.items() if any(isinstance(p, Shard) for p in v.placements)]
        out[arch] = (sharded_params, _train((sharded, _loss_and_logits(sharded)), args, kwargs))
    return out


def test_vision_and_audio_models_train_tensor_parallel_like_one_device():
    """ViT and Whisper under the forced tensor-parallel family: their projections shard and training matches one
    device.  The family used to have no plan at all for them: it required every matrix some op could hold sharded
    to be stored sharded, and their convolutions had no rule to read a sharded weight."""
    archs = ("vit", "whisper")
    results = run_ranks(_vision_audio_rank_fn, 2, archs, timeout_s=600)
    for arch in archs:
        model, args, kwargs = _vision_audio(arch)

        def call(*a, model=model, **k):
            out = model(*a, **k)
            return out.loss, out.logits

        want = _train((model, call), args, kwargs)
        for rank, per_arch in enumerate(results):
            sharded_params, got = per_arch[arch]
            assert any(k.endswith("proj.weight") for k in sharded_params), f"{arch}: no projection sharded"
            _assert_trains_alike(got, want, f"{arch} tensor parallel, rank {rank}")


class _Norms(torch.nn.Module):
    """Every norm and dropout eval mode changes: batch norm with and without running statistics, instance norm
    with them, channel dropout (Dropout1d: aten.feature_dropout) and alpha dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 6, 3)
        self.bn = torch.nn.BatchNorm1d(6)
        self.bn_batch_stats = torch.nn.BatchNorm1d(6, track_running_stats=False)
        self.inorm = torch.nn.InstanceNorm1d(6, affine=True, track_running_stats=True)
        self.drop, self.alpha = torch.nn.Dropout1d(0.3), torch.nn.AlphaDropout(0.2)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x, target):
        h = self.alpha(self.drop(self.inorm(self.bn_batch_stats(self.bn(self.conv(x))))))
        out = self.head(h.mean(-1))
        return (out - target).pow(2).mean(), out


def _norms():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return _Norms(), (torch.randn(BATCH, 3, 9, generator=gen), torch.randn(BATCH, 2, generator=gen)), {}


def _forward_then_eval(model, args, state):
    """A train-mode forward (running statistics move; dropout masks differ by design, so no optimizer step),
    then two eval-mode forwards: (their outputs, the state after)."""
    with torch.no_grad():
        model(*args)
        model.eval()
        outs = [model(*args)[1] for _ in range(2)]
    return outs, state()


def _norms_rank_fn(rank, world):
    import autopar

    model, args, _ = _norms()
    sharded = autopar.compile(model, autopar.Mesh((world,)), example_inputs=args, profile=PARTITIONING_PROFILE)
    return _forward_then_eval(sharded, args, sharded.full_state_dict)


def test_eval_mode_switches_every_norm_and_dropout_like_the_model():
    model, args, _ = _norms()
    want_outs, want_state = _forward_then_eval(model, args, lambda: dict(model.state_dict()))
    assert int(want_state["bn.num_batches_tracked"]) == 1
    for rank, (outs, state) in enumerate(run_ranks(_norms_rank_fn, 2, timeout_s=300)):
        assert torch.equal(outs[0], outs[1]), f"rank {rank}: eval mode still draws dropout masks"
        torch.testing.assert_close(outs[0], want_outs[0], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: eval outputs")
        assert state.keys() == want_state.keys(), rank
        for k in want_state:
            torch.testing.assert_close(state[k], want_state[k], rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {k}")


def _recompute_rank_fn(rank, world, arch, family, depths):
    from test_recompute import _compile_recomputed, _recomputed_blocks

    import autopar

    out = []
    for depth in depths:
        model, args, kwargs = build(arch, device="cpu", overrides={"num_layers": depth})
        sharded = _compile_recomputed(model, args, kwargs, autopar.Mesh((world,), axis_names=("tp",)), family)
        train = _train((sharded, _loss_and_logits(sharded)), args, kwargs)
        again = sum(1 for c in sharded.plan.collectives if c.recompute)
        out.append((sharded.plan.family, _recomputed_blocks(sharded.plan), again, train))
    return out


def test_layers_that_are_not_alike_recompute_each_and_train_like_one_device():
    """Issue 31, item 7: T5's first block carries the relative-attention bias, so its layers are not all alike:
    with two blocks per stack there is no run of alike layers at all (``recompute="full"`` used to be refused:
    "no repeated blocks"), with three the chain is the decoder's last two, and "full" recomputed only those.
    Every layer of both stacks is now a region (``capture.find_layers``), as a user of
    ``torch.utils.checkpoint`` wraps them, and the plan trains on 2 gloo ranks under tensor parallelism like one
    device, its forward collectives run again in backward."""
    depths = (2, 3)
    results = run_ranks(_recompute_rank_fn, 2, "t5", "tensor parallel", depths)
    for d, depth in enumerate(depths):
        layers = {f"{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(depth)}
        ref = _reference("t5", overrides={"num_layers": depth})
        for rank, per_depth in enumerate(results):
            family, regions, again, got = per_depth[d]
            where = f"t5 ({depth} layers per stack) on 2 ranks, rank {rank}, plan {family}, every layer recomputed"
            assert regions == layers, (where, sorted(regions))
            assert again > 0, f"{where}: the plan lists no collective run again by the recomputation"
            _assert_trains_alike(got, ref, where)
