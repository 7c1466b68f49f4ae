"""The model zoo: built-in models named in ``configs/models/``, and user factories.

``load_model(spec, batch=, seq=, device=)`` returns ``(model, args, kwargs)``:

* a built-in name (``gpt2``, ``gpt2-xl``, ``llama-7b-shaped``, ``bert-base``, the
  tiny test models, and ``<arch>-tiny`` for each architecture of the table
  ``configs/models/tiny_hf.toml``, e.g. ``t5-tiny``): a Hugging Face model built
  from its config class with random weights (nothing is downloaded),
  ``use_cache=False``, with ``input_ids`` and ``labels`` of shape (batch, seq) so
  the graph ends in the loss;
* ``path/to/file.py:factory`` or ``package.module:factory``: ``factory()`` returns
  ``(model, example_inputs)`` (a tuple of positional inputs, or a dict of keyword
  inputs) or ``(model, args, kwargs)`` (the model is called ``model(*args, **kwargs)``:
  any call form, nested inputs included) and receives ``batch=`` and ``seq=`` when its
  signature accepts them.

``batch`` and ``seq`` must be whole numbers >= 1; ``seq=None`` (the default) is
``default_seq(spec)``: 1024, or the model's position count when it has fewer
(``gpt2-tiny``: 128), so the defaults work for every built-in model.
Transformers' warnings about the random configs (out-of-vocabulary special token
ids, GPT-2's unnamed loss type) are silenced while autopar builds a built-in
model; they are about autopar's configs, not the user's model.

``device="meta"`` (the default) builds without allocating weights, so a 7B model
plans on a laptop.  ``no_dropout=True`` zeroes every dropout probability of a
built-in model's config before it is built (numerics that compare exactly), and
``overrides`` replaces config keyword arguments (odd sizes for one run).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .data_files import config_dir, tomllib

__all__ = [
    "load_model",
    "builtin_models",
    "model_config",
    "tiny_hf_archs",
    "default_seq",
    "max_positions",
    "TINY_SUFFIX",
    "DEFAULT_SEQ",
]

#: The sequence length ``load_model`` and ``autopar plan`` use unless told, capped by the model's positions.
DEFAULT_SEQ = 1024
#: Config attributes that bound the sequence length (learned positions, ALiBi/causal-mask tables).
_POSITION_ATTRS = ("n_positions", "max_position_embeddings", "max_seq_len", "n_ctx")

_HF_MODELS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
}


#: The table of tiny architectures (``configs/models/<this>.toml``) and the suffix of their built-in names.
TINY_HF_TABLE, TINY_SUFFIX = "tiny_hf", "-tiny"


def builtin_models() -> list[str]:
    files = [p.stem for p in (config_dir() / "models").glob("*.toml") if p.stem != TINY_HF_TABLE]
    return sorted(files + [f"{arch}{TINY_SUFFIX}" for arch in tiny_hf_archs()])


def tiny_hf_archs() -> dict[str, dict[str, Any]]:
    """Architecture -> ``{"config_class", "model_class", "config"}`` from the tiny table, bases resolved.

    ``config`` holds every keyword argument of the config class (the entry's ``none``
    names become None).  See the table's header for its format.
    """
    path = config_dir() / "models" / f"{TINY_HF_TABLE}.toml"
    if not path.is_file():
        return {}
    table = tomllib.loads(path.read_text())
    bases = table.get("bases", {})

    def resolved(entry: dict[str, Any], seen: tuple[str, ...]) -> dict[str, Any]:
        base = entry.get("base")
        if base is None:
            return {}
        if base not in bases or base in seen:
            raise ValueError(f"{path}: base {base!r} is {'circular' if base in seen else 'not under [bases]'}")
        body = {k: v for k, v in bases[base].items() if k != "base"}
        return resolved(bases[base], seen + (base,)) | body

    out = {}
    for arch, entry in table.get("archs", {}).items():
        config = resolved(entry, ()) | entry.get("config", {}) | dict.fromkeys(entry.get("none", ()))
        out[arch] = {"config_class": entry["config_class"], "model_class": entry["model_class"], "config": config}
    return out


def model_config(name: str) -> dict[str, Any]:
    """A built-in model's config: ``builder`` (or ``config_class``/``model_class``), ``config``, ``description``."""
    arch = name.removesuffix(TINY_SUFFIX) if name.endswith(TINY_SUFFIX) else None
    tiny = tiny_hf_archs().get(arch) if arch else None
    if tiny is not None:
        return dict(tiny, description=f"tiny {tiny['model_class']}, random weights ({TINY_HF_TABLE}.toml)")
    path = config_dir() / "models" / f"{name}.toml"
    if not path.is_file() or name == TINY_HF_TABLE:
        names = builtin_models()
        if name.lower() in names:  # built-in names are lower case
            return model_config(name.lower())
        close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.6)
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        raise ValueError(
            f"model {name!r} is not a built-in model nor a factory; {guess}`autopar models` lists the "
            f"{len(names)} built-in names; or pass path/to/file.py:factory or package.module:factory"
        )
    return tomllib.loads(path.read_text())


def _no_dropout(config) -> None:
    """Every dropout probability of a Hugging Face config to 0 (its modules copy them when built)."""
    for attr, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in attr or "pdrop" in attr or attr == "layerdrop"):
            setattr(config, attr, 0.0)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Transformers' logging at error level for the duration (its config/model-building warnings)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


def _max_positions(config) -> int | None:
    return next((v for a in _POSITION_ATTRS if isinstance(v := getattr(config, a, None), int) and v > 0), None)


def _hf_config(name: str, *, overrides=None):
    """(config class instance, model class) of a built-in model; transformers' config warnings silenced."""
    cfg = model_config(name)
    import transformers

    classes = _HF_MODELS[cfg["builder"]] if "builder" in cfg else (cfg["config_class"], cfg["model_class"])
    missing = [c for c in classes if not hasattr(transformers, c)]
    if missing:
        raise ValueError(
            f"model {name}: transformers {transformers.__version__} has no {', '.join(missing)}; "
            "install a transformers that has it or pick another model (autopar models)"
        )
    config_cls, model_cls = (getattr(transformers, c) for c in classes)
    kwargs = dict(cfg.get("config", {})) | dict(overrides or {})
    kwargs.setdefault("use_cache", False)
    with _quiet_transformers():
        return config_cls(**kwargs), model_cls


def max_positions(spec: str) -> int | None:
    """The longest sequence a built-in model takes (its position count); None for factories and models without."""
    return None if ":" in spec else _max_positions(_hf_config(spec)[0])


def default_seq(spec: str) -> int:
    """``DEFAULT_SEQ``, or a built-in model's position count when it has fewer (``gpt2-tiny``: 128)."""
    max_pos = max_positions(spec)
    return DEFAULT_SEQ if max_pos is None else min(DEFAULT_SEQ, max_pos)


def _build_hf(name: str, *, batch: int, seq: int, device: str, seed: int = 0, no_dropout: bool = False, overrides=None):
    config, model_cls = _hf_config(name, overrides=overrides)
    if no_dropout:
        _no_dropout(config)
    max_pos = _max_positions(config)
    if max_pos is not None and seq > max_pos:
        raise ValueError(f"model {name}: seq={seq} exceeds its {max_pos} positions; pass seq <= {max_pos}")
    if device != "meta":
        torch.manual_seed(seed)
    with _quiet_transformers(), torch.device(device):
        model = model_cls(config)
        if getattr(model, "loss_type", "") is None and hasattr(type(model), "loss_function"):
            # GPT-2's class name maps to no loss type: transformers warns on the first forward that it takes
            # ForCausalLM's loss, which is the right one.  Resolve it here, quietly, once.
            model.loss_function = model.loss_function
    if no_dropout:  # a dropout probability set outside the config
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    if device == "meta":
        ids, labels = ids.to("meta"), labels.to("meta")
    return model, (ids,), {"labels": labels}


def _load_factory(spec: str):
    target, _, fn_name = spec.rpartition(":")
    if not target or not fn_name:
        raise ValueError(f"model {spec!r}: expected a built-in name, path/to/file.py:factory or package.module:factory")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"model factory file {target!r} not found; pass path/to/file.py:factory")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(
                f"model factory file {target!r} failed to run: {type(e).__name__}: {e}; fix that file"
            ) from e
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name is not None and target.startswith(e.name):  # the module itself, not one it imports
                if target in builtin_models():
                    raise ValueError(
                        f"model {spec!r}: {target!r} is a built-in model, not a module; pass it as {target!r}"
                    ) from None
                raise ValueError(
                    f"model {spec!r}: no module named {target!r} (nor a built-in model {target!r}, see "
                    "`autopar models`); pass path/to/file.py:factory or an importable package.module:factory"
                ) from None
            raise ValueError(f"model factory module {target!r} failed to import: {e}; install what it needs") from e
        except Exception as e:
            raise ValueError(
                f"model factory module {target!r} failed to import: {type(e).__name__}: {e}; fix that module"
            ) from e
    factory = getattr(module, fn_name, None)
    if factory is None:
        raise ValueError(f"model factory {spec!r}: {target} has no attribute {fn_name!r}")
    if not callable(factory):
        raise ValueError(f"model factory {spec!r}: {target}.{fn_name} is a {type(factory).__name__}, not a function")
    return factory


def _whole_number(value, name: str, meaning: str) -> int:
    """``value`` if it is an int >= 1; else a TypeError/ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"load_model {name}={value!r}: expected a whole number >= 1 ({meaning}), e.g. {name}=8")
    if value < 1:
        raise ValueError(f"load_model {name}={value}: expected a whole number >= 1 ({meaning}), e.g. {name}=8")
    return value


def load_model(
    spec: str,
    *,
    batch: int = 8,
    seq: int | None = None,
    device: str = "meta",
    no_dropout: bool = False,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
):
    """(model, args, kwargs) for a built-in name or a ``module:factory`` spec.

    ``no_dropout``, ``overrides`` (config keyword arguments) and ``seed`` (of the random weights and token ids:
    every process building with one seed gets the same model) apply to built-in models only.
    ``seq=None`` is ``default_seq(spec)``.
    """
    if not isinstance(spec, str):
        raise TypeError(f"load_model({spec!r}): expected a model name or 'module:factory' string")
    batch = _whole_number(batch, "batch", "the global batch")
    seq = default_seq(spec) if seq is None else _whole_number(seq, "seq", "the sequence length")
    if ":" not in spec:
        return _build_hf(
            spec, batch=batch, seq=seq, device=device, seed=seed, no_dropout=no_dropout, overrides=overrides
        )
    if no_dropout or overrides or seed:
        raise ValueError(f"model factory {spec!r}: no_dropout, overrides and seed apply to built-in models only")
    factory = _load_factory(spec)
    params = inspect.signature(factory).parameters
    kw = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in params}
    try:
        result = factory(**kw)
    except Exception as e:
        raise ValueError(f"model factory {spec!r} raised {type(e).__name__}: {e}; fix the factory") from e
    if isinstance(result, tuple) and len(result) == 3:  # (model, args, kwargs): any call form, nested inputs
        model, args, kwargs = result
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
            raise ValueError(
                f"model factory {spec!r} returned (model, {type(args).__name__}, {type(kwargs).__name__}); expected "
                "(model, args tuple, kwargs dict): the model is called as model(*args, **kwargs)"
            )
        return model, tuple(args), dict(kwargs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(
            f"model factory {spec!r} returned {type(result).__name__}; expected (model, example_inputs) or "
            "(model, args, kwargs)"
        )
    model, inputs = result
    if isinstance(inputs, dict):
        return model, (), inputs
    if isinstance(inputs, torch.Tensor):
        return model, (inputs,), {}
    return model, tuple(inputs), {}
