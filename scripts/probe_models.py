"""Probe autopar on Hugging Face architectures and odd sizes it has not been tuned on.

For each architecture (a tiny random-weight config: odd vocabulary, head counts and
widths the mesh does not divide, batch 3) and each mesh shape, plan with no memory
cap and with a tight one, and print one line: plan ok / the ops that fell back to
replicate / the error.  Nothing is downloaded; architectures this transformers lacks
are reported as missing.

    python3 scripts/probe_models.py [--arch mistral,opt] [--mesh 2,4,2x2,3] [--profile h100]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Shared tiny sizes: vocab 1001 (odd), hidden 48 with 6 heads (4 does not divide 6), ffn 100.
TINY = {"vocab_size": 1001, "hidden_size": 48, "num_attention_heads": 6, "intermediate_size": 100}
LLAMA_LIKE = dict(TINY, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=64)

#: name -> (config class, model class, config kwargs)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA_LIKE, sliding_window=None)),
    # nothing divides: 5 heads of width 8 (= kv heads: uneven head splits), ffn 97, vocab 1001
    "mistral_odd": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            LLAMA_LIKE,
            hidden_size=40,
            num_attention_heads=5,
            num_key_value_heads=5,
            intermediate_size=97,
            sliding_window=None,
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(LLAMA_LIKE)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA_LIKE, head_dim=8, sliding_window=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(LLAMA_LIKE, pad_token_id=0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(LLAMA_LIKE, partial_rotary_factor=0.25)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(LLAMA_LIKE, partial_rotary_factor=0.5)),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(TINY, num_hidden_layers=2, rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=True),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            vocab_size=1001,
            hidden_size=48,
            num_attention_heads=6,
            ffn_dim=100,
            num_hidden_layers=2,
            max_position_embeddings=64,
            word_embed_proj_dim=48,
        ),
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=1001,
            hidden_size=48,
            num_attention_heads=6,
            num_hidden_layers=2,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
            alibi=False,
        ),
    ),
    "falcon_alibi": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=1001,
            hidden_size=48,
            num_attention_heads=6,
            num_hidden_layers=2,
            multi_query=False,
            parallel_attn=False,
            alibi=True,
        ),
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(vocab_size=1001, n_embd=48, n_head=6, n_layer=2, rotary_dim=4, n_positions=64),
    ),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=1001, hidden_size=48, n_head=6, n_layer=2)),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        dict(vocab_size=1001, d_model=48, n_heads=6, n_layers=2, max_seq_len=64, expansion_ratio=2),
    ),
    "roberta": (
        "RobertaConfig",
        "RobertaForMaskedLM",
        dict(TINY, num_hidden_layers=2, max_position_embeddings=64),
    ),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(vocab_size=1001, dim=48, n_heads=6, n_layers=2, hidden_dim=100, max_position_embeddings=64),
    ),
    "electra": (
        "ElectraConfig",
        "ElectraForMaskedLM",
        dict(TINY, embedding_size=32, num_hidden_layers=2, max_position_embeddings=64),
    ),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(vocab_size=1001, n_embd=48, n_head=6, n_layer=2, n_positions=64, multi_query=True),
    ),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        # CodeGen's fused qkv is laid out for 4 model-parallel groups: heads must divide by 4
        dict(vocab_size=1001, n_embd=64, n_head=8, n_layer=2, rotary_dim=4, n_positions=64, n_ctx=64),
    ),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(LLAMA_LIKE)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(LLAMA_LIKE)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(LLAMA_LIKE)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(LLAMA_LIKE, sliding_window=None)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(LLAMA_LIKE)),
    "persimmon": (
        "PersimmonConfig",
        "PersimmonForCausalLM",
        dict(TINY, num_hidden_layers=2, max_position_embeddings=64),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(LLAMA_LIKE, num_local_experts=3, num_experts_per_tok=2)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(TINY, embedding_size=32, num_hidden_layers=2)),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", dict(TINY, num_hidden_layers=2)),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(TINY, num_hidden_layers=2)),
    "mobilebert": (
        "MobileBertConfig",
        "MobileBertForMaskedLM",
        dict(TINY, num_hidden_layers=2, embedding_size=32, intra_bottleneck_size=24, true_hidden_size=24),
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(vocab_size=1001, d_model=48, d_kv=8, d_ff=100, num_layers=2, num_heads=6, decoder_start_token_id=0),
    ),
}


def build(name: str, *, batch: int = 3, seq: int = 12, device: str = "cpu", seed: int = 0):
    """(model, args, kwargs) of a tiny random-weight ``name``; raises AttributeError when missing."""
    import transformers

    cfg_cls, model_cls, kwargs = ARCHS[name]
    config = getattr(transformers, cfg_cls)(**dict(kwargs, use_cache=False))
    for attr, value in list(vars(config).items()):  # every dropout off: the numerics compare exactly
        if isinstance(value, float) and ("dropout" in attr or "pdrop" in attr or attr == "layerdrop"):
            setattr(config, attr, 0.0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    return model, (ids.to(device),), {"labels": labels.to(device)}


def probe(name: str, mesh_shape: tuple[int, ...], profile: str) -> dict:
    import autopar
    from autopar.planner import MemoryCapError, plan_from_context, prepare

    model, args, kwargs = build(name, device="meta")
    mesh = autopar.Mesh(mesh_shape)
    t0 = time.perf_counter()
    ctx = prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=profile)
    plan = plan_from_context(ctx, compare_families=False)
    fb = collections.Counter(f["op"] for f in plan.fallback_ops)
    mem = plan.memory["per_device_bytes"]
    tight = int(mem * 0.7)
    try:
        capped = plan_from_context(ctx, mem_cap=tight, compare_families=False)
        cap_result = f"cap ok ({capped.family}, {capped.memory['per_device_bytes'] / mem:.2f}x)"
        if capped.memory["per_device_bytes"] > tight:
            cap_result = f"CAP EXCEEDED {capped.memory['per_device_bytes']} > {tight}"
    except MemoryCapError as e:
        cap_result = f"cap infeasible ({str(e).splitlines()[0][:80]})"
    return {"family": plan.family, "fallback": dict(fb), "cap": cap_result, "s": time.perf_counter() - t0}


STEPS = 3
ADAMW = {"lr": 1e-3, "eps": 1e-6}  # as tests/test_execution.py
CHEAP_COMM = str(Path(__file__).resolve().parents[1] / "tests" / "profiles" / "cheap_comm.toml")


def train(model, call, args, kwargs) -> tuple:
    """(losses, step-0 logits, step-0 grads, params after STEPS AdamW steps) of a model callable."""
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, logits0, grads0 = [], None, None
    for step in range(STEPS):
        loss, logits = call(*args, **kwargs)
        loss.backward()
        if step == 0:
            logits0 = logits.detach()
            grads0 = (
                model.full_grads()
                if hasattr(model, "full_grads")
                else {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
            )
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = (
        model.full_state_dict()
        if hasattr(model, "full_state_dict")
        else {k: v.detach().clone() for k, v in model.state_dict().items()}
    )
    return losses, logits0, grads0, params


def reference(name: str, batch: int = 3, seq: int = 12) -> tuple:
    model, args, kwargs = build(name, batch=batch, seq=seq)

    def call(*a, **k):
        o = model(*a, **k)
        return o.loss, o.logits

    return train(model, call, args, kwargs)


def rank_fn(rank: int, world: int, name: str, mesh_shape: tuple, family: str | None, batch: int = 3, seq: int = 12):
    """On one gloo rank: compile ``name`` under ``family`` (None: auto) and train; returns (plan family, train())."""
    import autopar

    model, args, kwargs = build(name, batch=batch, seq=seq)
    mesh = autopar.Mesh(mesh_shape)
    sharded = autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, family=family, profile=CHEAP_COMM
    )
    return sharded.plan.family, train(sharded, sharded, args, kwargs)


def worst_deviation(ref: tuple, got: tuple) -> tuple[float, str]:
    """The largest |got - ref| / (atol + rtol |ref|) over losses, logits, grads and params (<= 1: passes)."""
    rtol, atol = 1e-4, 1e-5
    worst, where = 0.0, ""
    pairs = [(f"loss{i}", a, b) for i, (a, b) in enumerate(zip(got[0], ref[0]))] + [("logits", got[1], ref[1])]
    pairs += [(f"grad {k}", got[2].get(k), v) for k, v in ref[2].items()]
    pairs += [(f"param {k}", got[3].get(k), v) for k, v in ref[3].items()]
    for what, a, b in pairs:
        if a is None or a.shape != b.shape:
            return float("inf"), f"{what}: missing or shape {None if a is None else tuple(a.shape)}"
        r = float(((a - b).abs() / (atol + rtol * b.abs())).max()) if b.numel() else 0.0
        if r > worst:
            worst, where = r, what
    return worst, where


def numerics(name: str, mesh_shape: tuple[int, ...], families: list) -> None:
    from autopar.runtime.spawn import spawn_ranks

    world = 1
    for s in mesh_shape:
        world *= s
    ref = reference(name)
    for family in families:
        key = f"{name} {'x'.join(map(str, mesh_shape))} {family or 'auto'}"
        try:
            results, _ = spawn_ranks(rank_fn, world, name, mesh_shape, family, timeout_s=600)
            devs = [(worst_deviation(ref, res), label) for label, res in results]
            (dev, where), label = max(devs, key=lambda x: x[0][0])
            verdict = "PASS" if dev <= 1.0 else "FAIL"
            print(f"{key:40s} {verdict} ({label}) worst {dev:.3g} at {where}", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe reports every failure
            print(f"{key:40s} ERROR {type(e).__name__}: {str(e)[-400:]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--mesh", default="2,4,2x2,3")
    ap.add_argument("--profile", default="tests/profiles/cheap_comm.toml")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--numerics", action="store_true", help="train on gloo ranks vs one device instead")
    ap.add_argument("--families", default="auto,tensor parallel")
    ns = ap.parse_args()
    if ns.numerics:
        fams = [None if f == "auto" else f for f in ns.families.split(",")]
        for name in ns.arch.split(","):
            for m in ns.mesh.split(","):
                numerics(name, tuple(int(x) for x in m.split("x")), fams)
        return
    meshes = [tuple(int(x) for x in m.split("x")) for m in ns.mesh.split(",")]
    results = {}
    for name in ns.arch.split(","):
        for mesh_shape in meshes:
            key = f"{name} {'x'.join(map(str, mesh_shape))}"
            try:
                r = probe(name, mesh_shape, ns.profile)
                line = f"ok {r['family']}; fallback {r['fallback'] or 'none'}; {r['cap']}; {r['s']:.1f}s"
            except AttributeError as e:
                r, line = {"error": f"missing: {e}"}, f"MISSING {e}"
            except Exception as e:  # noqa: BLE001 - a probe reports every failure
                tb = traceback.format_exc().strip().splitlines()
                r = {"error": f"{type(e).__name__}: {e}"[:300], "where": tb[-3:]}
                line = f"ERROR {type(e).__name__}: {str(e)[:200]} @ {tb[-3].strip() if len(tb) > 2 else ''}"
            results[key] = r
            print(f"{key:24s} {line}", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
