"""Flop and memory-traffic counts of one op call on LOCAL (per-device) shapes.

Every function takes an ``OpCall``-like ``call`` (``autopar.strategies.base.OpCall``):
``.target`` (an aten OpOverload or a python callable), ``.args``/``.kwargs`` with
each tensor replaced by a meta object (``.shape`` tuple, ``.dtype``), ``.inputs`` and
``.outputs`` (those metas, flattened).  The planner calls these once per strategy,
with the local metas that strategy leaves on a device.

Op families and how each is counted:

* matmul-like (mm, addmm, bmm, baddbmm, _scaled_mm, convolution and its aliases):
  the formula ``torch.utils.flop_counter`` registers for the op, called on shapes;
  ``linear`` (mm on the flattened leading dims), ``matmul`` (bmm on the broadcast
  batch), ``conv{1,2,3}d``/``conv_transpose{1,2,3}d`` (the registry's convolution
  formula) and ``einsum`` (2 x the product of every index size per contracted
  pair) are reduced to those.  Backward = 2 x forward (one matmul per input grad).
* attention (scaled_dot_product_attention and its fused variants): the registry's
  sdpa forward and backward formulas (4bhsd / 10bhsd: backward = 2.5 x forward).
  Causal masking is not discounted, as in the registry.
* embedding: 0 flops; traffic = the indices plus the gathered rows read and written
  (not the whole table).  Backward: one add per output element (scatter-add).
* views (view, permute, slice, ...): free, no flops and no traffic.
* data movement (cat, clone, repeat, gather, ...): 0 flops, traffic only.
* factories (ones, arange, ...): 0 flops, the output written.
* everything else (elementwise, reductions, norms, softmax, losses): flops = the
  numel of the largest tensor x a per-element count (``_PER_ELEMENT_FLOPS``, 1
  forward / 1 backward when the op is not listed).
* ops with no floating-point tensor (integer mask building) cost their traffic only.

Traffic (``bytes_moved``) is the sum of the input and output bytes unless the
family says otherwise: what a kernel that reads each input once and writes each
output once moves through device memory.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

__all__ = [
    "forward_flops",
    "op_family",
    "backward_flops",
    "bytes_moved",
    "backward_bytes_moved",
    "is_matmul_like",
    "compute_dtype",
    "op_key",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_SDPA = frozenset(
    f"aten.{n}"
    for n in (
        "scaled_dot_product_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
)
# composite convolutions -> transposed flag for the registry's convolution formula
_CONV = {
    "aten.conv1d": False,
    "aten.conv2d": False,
    "aten.conv3d": False,
    "aten.conv_transpose1d": True,
    "aten.conv_transpose2d": True,
    "aten.conv_transpose3d": True,
}
_MATMUL = frozenset({"aten.linear", "aten.matmul", "aten.einsum", *_CONV})

_VIEWS = frozenset(
    f"aten.{n}"
    for n in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "flatten", "unflatten", "view_as",
        "permute", "transpose", "t", "numpy_T", "mT", "movedim", "swapaxes", "swapdims", "expand",
        "expand_as", "squeeze", "unsqueeze", "select", "slice", "narrow", "split", "split_with_sizes",
        "chunk", "unbind", "tensor_split", "alias", "detach", "lift_fresh", "as_strided", "diagonal",
        "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
        "sym_size", "sym_stride", "sym_numel", "_assert_tensor_metadata",
    )
)  # fmt: skip
_DATA_MOVEMENT = frozenset(
    f"aten.{n}"
    for n in (
        "clone", "contiguous", "_to_copy", "to", "copy", "copy_", "cat", "concat", "stack",
        "repeat", "tile", "repeat_interleave", "index_select", "gather", "index", "_unsafe_index",
        "index_put", "scatter", "slice_scatter", "select_scatter", "constant_pad_nd", "pad", "roll", "flip",
    )
)  # fmt: skip
_FACTORIES = frozenset(
    f"aten.{n}"
    for n in (
        "ones", "zeros", "full", "arange", "linspace", "scalar_tensor", "rand", "randn", "randint",
        "ones_like", "zeros_like", "full_like", "rand_like", "randn_like", "new_ones", "new_zeros",
        "new_full", "lift_fresh_copy",
    )
)  # fmt: skip

# (forward, backward) flops per element of the op's largest tensor, counted from the
# op's defining arithmetic (not measured: these ops are memory-bound, so the counts
# only need the right order of magnitude).
_NORM = (8.0, 12.0)  # layer_norm: mean 1, centre 1, square 1, var 1, rsqrt-scale 2, affine 2
_RMS = (4.0, 8.0)  # rms_norm: square 1, mean 1, rsqrt-scale 1, weight 1
_SOFTMAX = (5.0, 4.0)  # max 1, sub 1, exp 1, sum 1, div 1; backward y*(g - sum(g*y))
_PER_ELEMENT_FLOPS: dict[str, tuple[float, float]] = {
    "aten.layer_norm": _NORM,
    "aten.native_layer_norm": _NORM,
    "aten.group_norm": _NORM,
    "aten.native_group_norm": _NORM,
    "aten.batch_norm": _NORM,
    "aten._native_batch_norm_legit_functional": _NORM,
    "aten._native_batch_norm_legit_no_training": _NORM,
    "aten.rms_norm": _RMS,
    "aten._fused_rms_norm": _RMS,
    "aten.softmax": _SOFTMAX,
    "aten._softmax": _SOFTMAX,
    "aten._safe_softmax": _SOFTMAX,
    "aten.log_softmax": _SOFTMAX,
    "aten._log_softmax": _SOFTMAX,
    "aten.cross_entropy_loss": (6.0, 5.0),  # log_softmax + pick + mean
    "aten.nll_loss": (1.0, 1.0),
    "aten.nll_loss_forward": (1.0, 1.0),
    "aten.gelu": (8.0, 10.0),  # tanh/erf polynomial; derivative of the same size
    "aten.silu": (4.0, 6.0),  # sigmoid (exp, add, div) + mul
    "aten.sigmoid": (3.0, 2.0),
    "aten.tanh": (3.0, 2.0),
    "aten.dropout": (2.0, 1.0),  # random compare + scale; backward: mask-scale
    "aten.native_dropout": (2.0, 1.0),
    "aten.var": (3.0, 3.0),
    "aten.std": (4.0, 4.0),
    "aten.var_mean": (3.0, 3.0),
    "aten.logsumexp": (4.0, 3.0),
}
_DEFAULT_PER_ELEMENT = (1.0, 1.0)


def op_key(target: Any) -> str:
    """The name the tables here use for an op: ``aten.mm`` for any overload of mm."""
    return str(getattr(target, "overloadpacket", target))


def _is_meta(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _numel(m: Any) -> int:
    return math.prod(int(s) for s in m.shape)


def _nbytes(m: Any) -> int:
    itemsize = m.dtype.itemsize if m.dtype is not None else 4
    return _numel(m) * itemsize


def _is_float(m: Any) -> bool:
    return m.dtype is not None and (m.dtype.is_floating_point or m.dtype.is_complex)


def _metas(call: Any) -> tuple:
    return tuple(call.inputs) + tuple(call.outputs)


def _arg(call: Any, index: int, name: str, default: Any = None) -> Any:
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


def _returns_its_input(call: Any) -> bool:
    """``aten.to`` that changes nothing (the dtype it asks for is its input's, the shape stays, and not
    ``copy=True``): it returns the input itself, no kernel (Hugging Face's ``logits.float()`` on float32 logits).
    The dtype asked for is read from the call's arguments, not its output's meta: the planner gives every float
    meta the training precision's dtype, and under bf16 that upcast is a real cast."""
    if op_key(call.target) != "aten.to" or not call.inputs or not call.outputs:
        return False
    schema = getattr(call.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []

    def given(name: str, default: Any) -> Any:
        return _arg(call, names.index(name), name, default) if name in names else call.kwargs.get(name, default)

    src, out = call.inputs[0], call.outputs[0]
    asked = given("dtype", None)
    dtype = asked if isinstance(asked, torch.dtype) else out.dtype
    return not given("copy", False) and _is_meta(src) and src.dtype == dtype and _shape(src) == _shape(out)


def _family(call: Any) -> str:
    key = op_key(call.target)
    if call.target is operator.getitem or key in _VIEWS or not call.outputs or _returns_its_input(call):
        return "view"
    if key in _FACTORIES:
        return "factory"
    if key in _DATA_MOVEMENT:
        return "data"
    if not any(_is_float(m) for m in _metas(call)):
        return "nonfloat"
    if key == "aten.embedding":
        return "embedding"
    if key in _SDPA:
        return "sdpa"
    if key == "aten.einsum":
        return "matmul" if len(_arg(call, 1, "tensors", ())) >= 2 else "elementwise"
    if key in _MATMUL or getattr(call.target, "overloadpacket", None) in flop_registry:
        return "matmul"
    return "elementwise"


def op_family(call: Any) -> str:
    """What an op is to the cost model: ``matmul`` (matmuls, convolutions, einsum), ``sdpa`` (fused
    attention), ``embedding``, ``elementwise``, ``view``, ``factory``, ``data`` (data movement) or ``nonfloat``."""
    return _family(call)


def is_matmul_like(call: Any) -> bool:
    """True for ops whose time the matmul efficiency governs: matmuls, convolutions, attention."""
    return _family(call) in ("matmul", "sdpa")


def compute_dtype(call: Any) -> torch.dtype:
    """The dtype an op computes in: its first floating input's (else output's), else float32."""
    for m in _metas(call):
        if _is_float(m):
            return m.dtype
    return torch.float32


def forward_flops(call: Any) -> float:
    """Flops of the op's forward on the call's (local) shapes."""
    family = _family(call)
    if family == "matmul":
        return float(_matmul_flops(call))
    if family == "sdpa":
        return float(_registry(call, aten._scaled_dot_product_efficient_attention, *_sdpa_shapes(call)))
    if family == "elementwise":
        return _PER_ELEMENT_FLOPS.get(op_key(call.target), _DEFAULT_PER_ELEMENT)[0] * _largest_numel(call)
    return 0.0  # view, factory, data movement, embedding, integer-only


def backward_flops(call: Any) -> float:
    """Flops of the op's backward (the gradient of every floating input), local shapes.

    Matmul-like: 2 x forward.  Attention: the registry's sdpa backward formula.
    Embedding: one add per output element.  Elementwise: the per-element backward
    count.  Views, data movement, factories and integer-only ops: 0.
    """
    family = _family(call)
    if family == "matmul":
        return 2.0 * _matmul_flops(call)
    if family == "sdpa":
        q, k, v = _sdpa_shapes(call)
        grad_out = (*q[:3], v[3])
        return float(_registry(call, aten._scaled_dot_product_efficient_attention_backward, grad_out, q, k, v))
    if family == "embedding":
        return float(_numel(call.outputs[0]))
    if family == "elementwise":
        return _PER_ELEMENT_FLOPS.get(op_key(call.target), _DEFAULT_PER_ELEMENT)[1] * _largest_numel(call)
    return 0.0


def bytes_moved(call: Any) -> float:
    """Bytes the op's forward reads and writes in device memory (local shapes).

    The sum of input and output bytes; views move nothing, factories only write
    their output, embedding reads the indices and the gathered rows (not the table).
    """
    family = _family(call)
    if family == "view":
        return 0.0
    if family == "factory":
        return float(sum(_nbytes(m) for m in call.outputs))
    if family == "embedding":
        indices = _arg(call, 1, "indices")
        idx_bytes = _nbytes(indices) if _is_meta(indices) else 0
        return float(idx_bytes + 2 * _nbytes(call.outputs[0]))
    return float(sum(_nbytes(m) for m in _metas(call)))


def backward_bytes_moved(call: Any) -> float:
    """Bytes the op's backward reads and writes: ~2 x forward traffic (grads in and out).

    Ops without a floating tensor, views and factories have no backward (0);
    embedding reads the output grad and writes a dense grad of the table.
    """
    family = _family(call)
    if family in ("view", "factory", "nonfloat"):
        return 0.0
    if family == "embedding":
        weight = _arg(call, 0, "weight")
        return float(_nbytes(call.outputs[0]) + (_nbytes(weight) if _is_meta(weight) else 0))
    return 2.0 * bytes_moved(call)


def _largest_numel(call: Any) -> int:
    return max((_numel(m) for m in _metas(call)), default=0)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _registry(call: Any, packet: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """Call torch's registered flop formula for ``packet`` on shape tuples.

    Shape mismatches surface as ``ValueError`` naming the op (the registry raises
    ``AssertionError``).
    """
    try:
        return flop_registry[packet](*args, out_val=out_val, **kwargs)
    except AssertionError as e:
        raise ValueError(
            f"{call.target}: inconsistent local shapes for the flop formula of {packet} "
            f"(inputs {[_shape(m) for m in call.inputs]}): {e}; check the strategy's placements"
        ) from e


def _matmul_flops(call: Any) -> int:
    key = op_key(call.target)
    if key == "aten.linear":
        x, w = _shape(_arg(call, 0, "input")), _shape(_arg(call, 1, "weight"))
        out_features, in_features = w if len(w) == 2 else (1, w[0])
        return _registry(call, aten.mm, (math.prod(x[:-1]), x[-1]), (in_features, out_features))
    if key == "aten.matmul":
        return _matmul_broadcast_flops(call, _shape(_arg(call, 0, "input")), _shape(_arg(call, 1, "other")))
    if key == "aten.einsum":
        return _einsum_flops(call, _arg(call, 0, "equation"), [_shape(m) for m in _arg(call, 1, "tensors")])
    if key in _CONV:
        x, w, out = _shape(_arg(call, 0, "input")), _shape(_arg(call, 1, "weight")), _shape(call.outputs[0])
        if len(x) == len(w) - 1:  # unbatched input
            x, out = (1, *x), (1, *out)
        return _registry(call, aten.convolution, x, w, None, None, None, None, _CONV[key], out_val=out)
    packet = call.target.overloadpacket
    args, kwargs = pytree.tree_map(lambda a: _shape(a) if _is_meta(a) else a, (tuple(call.args), dict(call.kwargs)))
    out_val = _shape(call.outputs[0]) if len(call.outputs) == 1 else tuple(_shape(m) for m in call.outputs)
    try:
        return _registry(call, packet, *args, out_val=out_val, **kwargs)
    except (AttributeError, TypeError):
        pass  # a get_raw formula: it wants objects with .shape, which the metas are
    try:
        return _registry(call, packet, *call.args, out_val=call.outputs, **call.kwargs)
    except (AttributeError, TypeError) as e:
        log.debug("flop formula of %s failed on metas (%s); counting it elementwise", packet, e)
        return _largest_numel(call)


def _matmul_broadcast_flops(call: Any, a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """torch.matmul semantics: 1-D operands get a unit dim, batch dims broadcast."""
    if len(a) == 1 and len(b) == 1:
        return 2 * a[0]
    if len(a) == 1:
        a = (1, *a)
    if len(b) == 1:
        b = (*b, 1)
    try:
        batch = tuple(torch.broadcast_shapes(a[:-2], b[:-2]))
    except RuntimeError as e:
        raise ValueError(f"{call.target}: batch dims of {a} and {b} do not broadcast: {e}") from e
    n_batch = math.prod(batch)
    return _registry(call, aten.bmm, (n_batch, *a[-2:]), (n_batch, *b[-2:]))


def _einsum_flops(call: Any, equation: str, shapes: list[tuple[int, ...]]) -> int:
    """Pairwise left-to-right contraction: 2 x product of the index sizes of each pair.

    For two operands this is 2 x the product of every index size; with more, each
    step keeps only the indices the output or a later operand still needs.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ValueError(f"einsum {equation!r}: {len(terms)} subscript terms but {len(shapes)} operands")
    ell_ndim = max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes, strict=True) if "..." in t), default=0)
    ell = [chr(0x3B1 + i) for i in range(ell_ndim)]  # greek: never valid einsum subscripts
    sizes: dict[str, int] = {}
    expanded: list[str] = []
    for term, shape in zip(terms, shapes, strict=True):
        if "..." in term:
            pre, post = term.split("...")
            n_ell = len(shape) - len(pre) - len(post)
            term = pre + "".join(ell[ell_ndim - n_ell :]) + post
        if len(term) != len(shape):
            raise ValueError(
                f"einsum {equation!r}: term {term!r} names {len(term)} dims but its operand has shape {shape}"
            )
        for c, d in zip(term, shape, strict=True):
            sizes[c] = max(sizes.get(c, 1), d)  # size-1 dims broadcast
        expanded.append(term)
    if arrow:
        out = set(rhs.replace("...", "".join(ell)))
    else:
        counts = "".join(expanded)
        out = {c for c in counts if counts.count(c) == 1} | set(ell)
    if len(expanded) == 1:  # a permutation, diagonal or reduction of one operand
        reduced = set(expanded[0]) - out
        return math.prod(shapes[0]) if reduced else 0
    total = 0
    current = set(expanded[0])
    for i in range(1, len(expanded)):
        pair = current | set(expanded[i])
        total += 2 * math.prod(sizes[c] for c in pair)
        later = set("".join(expanded[i + 1 :]))
        current = pair & (out | later)
    return total


def _sdpa_shapes(call: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """q, k, v shapes as (batch, heads, seq, head_dim): leading dims fold into batch."""
    q, k, v = (_shape(_arg(call, i, n)) for i, n in enumerate(("query", "key", "value")))
    batch = math.prod(q[:-3]) if len(q) > 3 else 1

    def four_d(s: tuple[int, ...]) -> tuple[int, ...]:
        heads = s[-3] if len(s) >= 3 else 1
        return (batch, heads, s[-2], s[-1])

    return four_d(q), four_d(k), four_d(v)
