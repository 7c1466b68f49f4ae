"""Capture, the first stage: a model and an example call in, the ``OpGraph`` every later stage reads out.

``capture(model, args, kwargs)`` traces with ``torch.export`` (``export``) and cleans
the graph for planning: cross-entropy decomposed so generic rules shard it
(``decompose``), the call's input and output trees kept (``call_spec``).  Analyses of
the captured graph that the strategies and the search use live here too: repeated
blocks (``repeat``), packed qkv-style dims (``blocks``), and one capture with a
symbolic batch re-used at any batch size (``batch``).

Hands on: ``OpGraph`` (``graph``): nodes in topological order, each op's ``OpCall``.
"""

from __future__ import annotations

from .batch import BatchTemplate, batch_of, capture_template, specialize, split_microbatches, static_template
from .blocks import block_hints
from .call_spec import CallSpec, InputMismatchError, bind_call, register_dataclasses
from .decompose import DECOMPOSED, LOGIT_ROLES, CrossEntropyPart
from .export import CaptureError, canonical_param_names, capture
from .graph import OpCall, OpGraph, OpNode
from .repeat import Blocks, find_blocks, find_layers
from .with_loss import TARGET, attach_loss

__all__ = [
    "TARGET",
    "attach_loss",
    "canonical_param_names",
    "BatchTemplate",
    "batch_of",
    "Blocks",
    "CallSpec",
    "CaptureError",
    "CrossEntropyPart",
    "DECOMPOSED",
    "InputMismatchError",
    "LOGIT_ROLES",
    "OpCall",
    "OpGraph",
    "OpNode",
    "bind_call",
    "block_hints",
    "capture",
    "capture_template",
    "find_blocks",
    "find_layers",
    "register_dataclasses",
    "specialize",
    "split_microbatches",
    "static_template",
]
