"""Models to plan and train: the built-in zoo (``load_model("gpt2")``), user factories, and autopar's data files.

``from autopar.models import load_model`` is the quickstart's entry: a name from
``autopar models`` (Hugging Face architectures built from their config classes with
random weights, never downloaded) or ``file.py:factory``; ``zoo`` holds the rules.
``data_files`` finds the ``configs/`` folder (``config_dir``) the zoo and the
benchmarks are read from.
"""

from __future__ import annotations

from .data_files import CONFIG_ENV, config_dir, tomllib
from .zoo import TINY_SUFFIX, builtin_models, default_seq, load_model, max_positions, model_config, tiny_hf_archs

__all__ = [
    "CONFIG_ENV",
    "TINY_SUFFIX",
    "builtin_models",
    "config_dir",
    "default_seq",
    "load_model",
    "max_positions",
    "model_config",
    "tiny_hf_archs",
    "tomllib",
]
