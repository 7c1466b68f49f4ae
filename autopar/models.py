"""Model sources for the CLI: built-in names from ``configs/models/`` and user factories.

``load_model(spec, batch=, seq=, device=)`` returns ``(model, args, kwargs)``:

* a built-in name (``gpt2``, ``gpt2-xl``, ``llama-7b-shaped``, ``bert-base``, and the
  tiny test models): a Hugging Face model built from its config class with random
  weights (nothing is downloaded), ``use_cache=False``, with ``input_ids`` and
  ``labels`` of shape (batch, seq) so the graph ends in the loss;
* ``path/to/file.py:factory`` or ``package.module:factory``: ``factory()`` returns
  ``(model, example_inputs)`` (a tuple of positional inputs, or a dict of keyword
  inputs) and receives ``batch=`` and ``seq=`` when its signature accepts them.

``device="meta"`` (the default) builds without allocating weights, so a 7B model
plans on a laptop.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import tomllib
import torch

from costmodel import config_dir

__all__ = ["load_model", "builtin_models", "model_config"]

_HF_MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
}


def builtin_models() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "models").glob("*.toml"))


def model_config(name: str) -> dict[str, Any]:
    path = config_dir() / "models" / f"{name}.toml"
    if not path.is_file():
        raise ValueError(
            f"model {name!r} is not a built-in model ({', '.join(builtin_models())}) nor a factory; "
            "pass a built-in name, path/to/file.py:factory or package.module:factory"
        )
    return tomllib.loads(path.read_text())


def _build_hf(name: str, *, batch: int, seq: int, device: str, seed: int = 0):
    cfg = model_config(name)
    import transformers

    config_cls, model_cls = (getattr(transformers, c) for c in _HF_MODELS[cfg["builder"]])
    kwargs = dict(cfg.get("config", {}))
    kwargs.setdefault("use_cache", False)
    config = config_cls(**kwargs)
    max_pos = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq > max_pos:
        raise ValueError(f"model {name}: --seq {seq} exceeds its {max_pos} positions; pass --seq <= {max_pos}")
    if device != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    if device == "meta":
        ids, labels = ids.to("meta"), labels.to("meta")
    return model, (ids,), {"labels": labels}


def _load_factory(spec: str):
    target, _, fn_name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"model factory file {target!r} not found; pass path/to/file.py:factory")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    factory = getattr(module, fn_name, None)
    if factory is None:
        raise ValueError(f"model factory {spec!r}: {target} has no attribute {fn_name!r}")
    return factory


def load_model(spec: str, *, batch: int = 8, seq: int = 1024, device: str = "meta"):
    """(model, args, kwargs) for a built-in name or a ``module:factory`` spec."""
    if ":" not in spec:
        return _build_hf(spec, batch=batch, seq=seq, device=device)
    factory = _load_factory(spec)
    params = inspect.signature(factory).parameters
    kw = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in params}
    result = factory(**kw)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(f"model factory {spec!r} returned {type(result).__name__}; expected (model, example_inputs)")
    model, inputs = result
    if isinstance(inputs, dict):
        return model, (), inputs
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,), {}
    return model, tuple(inputs), {}
