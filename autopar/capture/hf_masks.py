"""Hugging Face attention masks traced as eager runs them, not as torch.export would keep them.

Hugging Face (``transformers.masking_utils``) decides each forward whether an attention
mask is needed.  In eager, a causal model called without a padding mask and without
``position_ids`` gets no mask at all: its SDPA runs ``is_causal=True`` (the kernel builds
the causal pattern, no tensor).  Under ``torch.export`` it cannot look at values, so it
keeps the general case: it treats the position ids it made itself (``arange``) as maybe
*packed* sequences and materializes a ``[batch, 1, seq, seq]`` boolean mask from them,
read by every layer.  At Llama 3 405B's shapes that tensor is 4 GiB per micro-batch of 64
sequences: it would cross every pipeline stage cut and be held per micro-batch in flight,
for a model whose eager step holds none of it.

autopar traces one training step at fixed shapes (a plan is made for them), so the reason
export keeps the general case (an exported graph replayed at other sequence lengths,
pytorch#108108) does not apply.  While tracing, ``eager_attention_masks`` makes
``masking_utils`` decide as eager does, from what the call really gives:

* ``is_torchdynamo_exporting`` reads False there: a mask is skipped when there is no
  padding mask and the query and key lengths agree (causal) or always (bidirectional).  A
  padding mask the caller passes is a traced tensor, which ``masking_utils`` still never
  skips (its values are data): such a model keeps its mask.
* packed-sequence detection (``find_packed_sequence_indices``) answers "not packed" when
  the call gives no ``position_ids``: the model then numbers positions ``0 .. seq-1`` itself,
  which eager finds unpacked on every batch.  A call that gives ``position_ids`` keeps the
  detection and its mask (packing is in the data).

Nothing changes for a model that does not use ``transformers.masking_utils`` or a
transformers without it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator

import torch

__all__ = ["eager_attention_masks", "gives_position_ids"]


def gives_position_ids(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``model(*args, **kwargs)`` passes ``position_ids`` (by name, by position, or in ``**kwargs``)."""
    if kwargs.get("position_ids") is not None:
        return True
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # export reports a call that does not fit forward
        return False
    return bound.get("position_ids") is not None


@contextlib.contextmanager
def eager_attention_masks(model: torch.nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """While tracing ``model(*args, **kwargs)``, ``transformers.masking_utils`` skips masks as eager does."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "is_torchdynamo_exporting"):
        yield
        return
    patched = {"is_torchdynamo_exporting": lambda: False}
    if hasattr(masking, "find_packed_sequence_indices") and not gives_position_ids(model, args, kwargs):
        patched["find_packed_sequence_indices"] = lambda position_ids: None
    before = {name: getattr(masking, name) for name in patched}
    for name, fn in patched.items():
        setattr(masking, name, fn)
    try:
        yield
    finally:
        for name, fn in before.items():
            setattr(masking, name, fn)
