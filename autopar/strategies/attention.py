"""Rules for fused attention: ``aten.scaled_dot_product_attention``.

``sdpa(q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), attn_mask, dropout_p,
is_causal, scale, enable_gqa) -> (B, H, Sq, Dv)``; the mask broadcasts to
``(B, H, Sq, Sk)`` and may have fewer dims or size-1 dims.  Each output row
depends on one (batch, head, query) and on every key of that (batch, kv head),
so on one mesh axis:

* batch: q, k, v ``S(0)`` -> out ``S(0)``; the mask ``S`` on its batch dim when that
  dim is > 1, else ``R``;
* heads: q, k, v ``S(1)`` -> out ``S(1)`` when H and Hkv both divide evenly by the
  axis size, so rank r's query heads use exactly rank r's kv heads (GQA groups
  stay whole); with H == Hkv uneven head splits are offered too (same split on
  all four).  The mask ``S`` on its head dim when > 1, else ``R``;
* query sequence: q ``S(2)`` -> out ``S(2)`` with k, v ``R``; the mask ``S`` on its Sq
  dim when > 1.  With ``is_causal`` the op itself would be wrong on a query shard:
  it builds the causal pattern from *local* positions, putting the diagonal at the
  shard's row 0.  The strategy then names the kernel ``causal_query_rows``: the
  rank's query rows keep their global positions (``KernelContext.shard_ranges``)
  and attend keys ``0 .. position`` through an explicit boolean mask (the same
  values as the whole op's rows; upper-left alignment, as SDPA's ``is_causal``).
  This is context parallelism with gathered keys and values (Llama 3's form).
  Sharding keys (ring attention) would need an online-softmax kernel and
  collectives; not offered.

Partial is never offered: softmax is not linear.  With ``dropout_p > 0`` every
strategy is still correct in distribution; bitwise equality with one device
needs rank-aware RNG (a lowering concern).

Training IR keeps ``aten.scaled_dot_product_attention.default`` (checked with
torch 2.13 on CPU: ``torch.export`` non-strict exports of GPT-2, Llama (GQA) and
BERT); the ``_scaled_dot_product_*`` backend ops appear only after
``run_decompositions`` and get no rule here.
"""

from __future__ import annotations

import torch

from autopar.placement import Placement, Replicate, Shard
from autopar.spec import TensorMeta

from .base import AxisStrategy, OpCall, register
from .kernels import KernelContext, register_kernel
from .views import bound_args

__all__: list[str] = []

aten = torch.ops.aten
_R = Replicate()


def _mask_placement(mask: TensorMeta, dim_from_end: int, size: int) -> Placement | None:
    """The mask's placement when q's dim ``-dim_from_end`` is sharded (None: not possible).

    A mask dim of size 1 (or absent) broadcasts: ``R``.  A mask dim equal to the
    sharded size is split the same way: ``S``.
    """
    d = mask.ndim - dim_from_end
    if d < 0 or mask.shape[d] == 1:
        return _R
    if mask.shape[d] == size:
        return Shard(d)
    return None


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Batch, head and query-sequence sharding; see the module doc."""
    args = bound_args(call)
    q, k, v = call.inputs[:3]
    mask = call.inputs[3] if len(call.inputs) > 3 else None
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return []  # unbatched or extra-batch-dim forms: replicate
    B, H, Sq, _ = q.shape
    Hkv = k.shape[1]
    strategies: list[AxisStrategy] = []

    def add(
        qkv: tuple[Placement, Placement, Placement], dim_from_end: int, size: int, out: Placement, kernel=None
    ) -> None:
        ins: tuple[Placement, ...] = qkv
        if mask is not None:
            mp = _mask_placement(mask, dim_from_end, size)
            if mp is None:
                return
            ins = qkv + (mp,)
        strategies.append(AxisStrategy(ins, (out,), kernel=kernel))

    if k.shape[0] == B and v.shape[0] == B:
        add((Shard(0),) * 3, 4, B, Shard(0))
    if v.shape[1] == Hkv and (H == Hkv or (H % axis_size == 0 and Hkv % axis_size == 0)):
        add((Shard(1),) * 3, 3, H, Shard(1))
    add((Shard(2), _R, _R), 2, Sq, Shard(2), CAUSAL_QUERY_ROWS if args["is_causal"] else None)
    return strategies


#: The kernel of a causal attention whose queries are sharded (module docstring).
CAUSAL_QUERY_ROWS = "causal_query_rows"


@register_kernel(CAUSAL_QUERY_ROWS)
def causal_query_rows(
    ctx: KernelContext,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    **options,
) -> torch.Tensor:
    """Causal SDPA on this rank's query rows: row at global position i attends keys 0 .. i.

    ``q`` is the local piece of a query tensor sharded on dim 2 (``ctx.shard_ranges(0, 2)`` are
    the global positions it holds, in local order); ``k`` and ``v`` are whole; ``options`` are the op's
    keywords (``scale``, ``enable_gqa``).  The explicit mask is what ``is_causal`` builds on the whole op
    (upper-left: key j is seen by query i iff j <= i).
    """
    if attn_mask is not None or not is_causal:
        raise AssertionError("causal_query_rows runs a causal attention without an explicit mask")
    held = [torch.arange(a, b, device=q.device) for a, b in ctx.shard_ranges(0, 2)]
    # a rank of an uneven split may hold no rows
    rows = torch.cat(held) if held else torch.zeros(0, dtype=torch.long, device=q.device)
    keys = torch.arange(k.shape[-2], device=q.device)
    mask = keys.unsqueeze(0) <= rows.unsqueeze(1)
    return aten.scaled_dot_product_attention.default(q, k, v, mask, dropout_p, False, **options)
