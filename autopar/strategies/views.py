"""Rules for view-like ops: reshapes (``*_as`` too), permutations, (un)squeezes, expand, slice, split, cat, repeat, pad.

Every rule here moves data without arithmetic, so on one mesh axis:

* a ``Shard`` follows its dim to where the op puts it (block shards too: a dim
  that maps 1:1 keeps ``S(d)[b]``; an output dim named by ``call.block_hints``
  is also offered block-wise);
* ``Partial`` passes through unchanged (``P(sum) -> P(sum)``, ``P(max) -> P(max)``)
  because a view of a sum is the sum of the views; ``pad`` with a non-zero
  constant is the one exception for ``P(sum)`` (every rank would add the constant).

View/reshape dim mapping (``view_groups``) compares the input and output shapes
the rule is given (local on this axis level) - never the shape arguments, which
are global.  Dims are matched into groups of equal product:

* a group of one dim on each side (1:1) keeps its shard, uneven shards included;
* otherwise only a shard on the group's first (outer) input dim is offered, and
  it lands on the group's first output dim when both dims (per block) divide
  evenly by the axis size: ``768 -> 12 x 64`` moves ``S`` to the 12-dim when
  ``12 % axis_size == 0``; ``(B, S) -> B*S`` moves ``S`` on B to the merged dim
  when ``B % axis_size == 0``.  Anything else is not offered.

Ops whose arguments hold global sizes (``view``, ``reshape``, ``expand``,
``unflatten``, ``split``, ``split_with_sizes``, and the factories ``new_*``,
``zeros``, ``full``, ...) run locally with those sizes replaced by the local
outputs' (``localize_size_args``, which the lowering and the validator call);
the rules promise that this local op, applied to each rank's pieces, yields the
pieces of the full result.
"""

from __future__ import annotations

import math

import torch

from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.spec import TensorMeta

from .base import AxisStrategy, OpCall, hinted_blocks, register

__all__ = ["view_groups", "bound_args", "localize_size_args"]

aten = torch.ops.aten
_R = Replicate()


# ----------------------------------------------------------------------------- shared helpers


def bound_args(call: OpCall) -> dict:
    """The op's arguments by schema name, defaults filled in (``self`` stays ``self``)."""
    schema = call.target._schema
    out: dict = {}
    for i, a in enumerate(schema.arguments):
        if i < len(call.args) and not a.kwarg_only:
            out[a.name] = call.args[i]
        elif a.name in call.kwargs:
            out[a.name] = call.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim > 0 else 0


def _blocks_for(call: OpCall, out_dim: int, *, sizes: tuple[int, ...] = (), output_index: int = 0) -> list[int]:
    """1 plus every hinted block count that divides all ``sizes``."""
    return [1] + [b for b in hinted_blocks(call, output_index, out_dim) if all(s % b == 0 for s in sizes)]


def _partials(n_in: int, n_out: int, ops=("sum", "max")) -> list[AxisStrategy]:
    return [AxisStrategy((Partial(op),) * n_in, (Partial(op),) * n_out) for op in ops]


def _unary(pairs: list[tuple[Placement, Placement]], *, partial_ops=("sum", "max")) -> list[AxisStrategy]:
    """One-input one-output strategies from (input, output) placement pairs, plus Partial pass-through."""
    return [AxisStrategy((i,), (o,)) for i, o in pairs] + _partials(1, 1, partial_ops)


def _map_dims(call: OpCall, mapping: dict[int, int], in_meta: TensorMeta, out_meta: TensorMeta) -> list[AxisStrategy]:
    """Shards following an input->output dim mapping of equal-sized dims (1:1, uneven allowed)."""
    pairs: list[tuple[Placement, Placement]] = []
    for din, dout in sorted(mapping.items()):
        size = in_meta.shape[din]
        if size != out_meta.shape[dout]:
            raise AssertionError(f"{call.name}: dim {din} -> {dout} maps sizes {size} -> {out_meta.shape[dout]}")
        for b in _blocks_for(call, dout, sizes=(size,)):
            pairs.append((Shard(din, b), Shard(dout, b)))
    return _unary(pairs)


# (op, argument name, what it becomes): "shape" = the local output's shape,
# "split" = the local outputs' sizes on the split dim, "unflatten" = the local
# output's sizes of the unflattened dims.
_SIZE_ARGS = {
    aten.view.default: ("size", "shape"),
    aten._unsafe_view.default: ("size", "shape"),
    aten.reshape.default: ("shape", "shape"),
    aten.expand.default: ("size", "shape"),
    aten.unflatten.int: ("sizes", "unflatten"),
    aten.split.Tensor: ("split_size", "split"),
    aten.split_with_sizes.default: ("split_sizes", "split"),
    aten.new_ones.default: ("size", "shape"),
    aten.new_zeros.default: ("size", "shape"),
    aten.new_full.default: ("size", "shape"),
    aten.new_empty.default: ("size", "shape"),
    aten.zeros.default: ("size", "shape"),
    aten.ones.default: ("size", "shape"),
    aten.full.default: ("size", "shape"),
    aten.empty.memory_format: ("size", "shape"),
}


def localize_size_args(
    target, args: tuple, kwargs: dict, local_output_shapes: list[tuple[int, ...]]
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one rank's local call, with global size arguments made local.

    ``local_output_shapes`` are the shapes this rank's outputs must have (from the
    strategy's output placements).  Ops that take no size argument are returned
    unchanged, so callers may apply this to every op.
    """
    entry = _SIZE_ARGS.get(target)
    if entry is None or not local_output_shapes:
        return tuple(args), dict(kwargs)
    name, how = entry
    arguments = target._schema.arguments
    pos = next(i for i, a in enumerate(arguments) if a.name == name)
    args, kwargs = list(args), dict(kwargs)
    held = args[pos] if pos < len(args) else kwargs.get(name)
    out0 = tuple(local_output_shapes[0])
    if how == "shape":
        new = list(out0)
    else:
        dim_pos = next(i for i, a in enumerate(arguments) if a.name == "dim")
        dim = args[dim_pos] if dim_pos < len(args) else kwargs.get("dim", arguments[dim_pos].default_value)
        if how == "unflatten":
            d = _norm(dim, len(out0) - len(held) + 1)
            new = list(out0[d : d + len(held)])
        else:
            d = _norm(dim, len(out0))
            sizes = [s[d] for s in local_output_shapes]
            new = sizes if target is aten.split_with_sizes.default else sizes[0]
    if pos < len(args):
        args[pos] = new
    else:
        kwargs[name] = new
    return tuple(args), kwargs


# ----------------------------------------------------------------------------- view / reshape


def view_groups(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Match the non-singleton dims of two shapes of equal numel into groups of equal product.

    Returns ``[(input dims, output dims), ...]`` in order, or None when the shapes
    hold different numbers of elements or a zero-size dim.  Size-1 dims belong to
    no group (they are never sharded).
    """
    if math.prod(in_shape) != math.prod(out_shape) or 0 in in_shape or 0 in out_shape:
        return None
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, go = [ins[i]], [outs[j]]
        pi, po = in_shape[ins[i]], out_shape[outs[j]]
        while pi != po:
            if pi < po:
                i += 1
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
            else:
                j += 1
                go.append(outs[j])
                po *= out_shape[outs[j]]
        groups.append((tuple(gi), tuple(go)))
        i += 1
        j += 1
    return groups


def _reshape_strategies(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Shards through a reshape of ``call.inputs[0]`` into ``call.outputs[0]`` (see module doc)."""
    src, dst = call.inputs[0], call.outputs[0]
    groups = view_groups(src.shape, dst.shape)
    if groups is None:
        return _partials(1, 1)
    pairs: list[tuple[Placement, Placement]] = []
    for gin, gout in groups:
        din, dout = gin[0], gout[0]
        n_in, n_out = src.shape[din], dst.shape[dout]
        one_to_one = len(gin) == 1 and len(gout) == 1
        for b in _blocks_for(call, dout, sizes=(n_in, n_out)):
            if one_to_one or ((n_in // b) % axis_size == 0 and (n_out // b) % axis_size == 0):
                pairs.append((Shard(din, b), Shard(dout, b)))
    return _unary(pairs)


@register(
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.flatten.using_ints, aten.unflatten.int
)
def view_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """view/reshape/flatten/unflatten: shards follow ``view_groups``; Partial passes through."""
    return _reshape_strategies(call, axis_size)


@register(aten.reshape_as.default, aten.view_as.default)
def view_as_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """reshape_as/view_as(self, other): a reshape of self to ``other``'s shape (RoFormer's rotary).

    Locally the op takes the shape of ``other``'s piece, so ``other`` must be laid out
    as the output is: the output's ``S`` when it is sharded, ``R`` otherwise (only
    its shape is read, so ``R`` serves a Partial output too).
    """
    return [
        AxisStrategy((s.inputs[0], s.outputs[0] if isinstance(s.outputs[0], Shard) else _R), s.outputs)
        for s in _reshape_strategies(call, axis_size)
    ]


# ----------------------------------------------------------------------------- permutations


_SWAPS = (aten.transpose.int, aten.swapaxes.default, aten.swapdims.default)


def _permutation(call: OpCall, nd: int) -> list[int]:
    """``perm`` with output dim ``k`` = input dim ``perm[k]``, for every op ``permute_rule`` covers."""
    args = bound_args(call)
    perm = list(range(nd))
    t = call.target
    if t is aten.permute.default:
        return [_norm(d, nd) for d in args["dims"]]
    if t is aten.numpy_T.default:  # ``x.T``: every dim reversed
        return perm[::-1]
    if t is aten.movedim.int or t is aten.movedim.intlist:
        src = args["source"] if isinstance(args["source"], (list, tuple)) else [args["source"]]
        dst = args["destination"] if isinstance(args["destination"], (list, tuple)) else [args["destination"]]
        src, dst = [_norm(d, nd) for d in src], [_norm(d, nd) for d in dst]
        out: list[int | None] = [None] * nd
        for s, d in zip(src, dst, strict=True):
            out[d] = s
        rest = iter(d for d in range(nd) if d not in src)
        return [o if o is not None else next(rest) for o in out]
    if nd < 2:
        return perm
    if t in _SWAPS:
        d0, d1 = (_norm(args[k], nd) for k in (("axis0", "axis1") if "axis0" in args else ("dim0", "dim1")))
    elif t is aten.t.default:
        d0, d1 = 0, 1
    else:  # mT: the last two dims
        d0, d1 = nd - 2, nd - 1
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


@register(
    *_SWAPS,
    aten.t.default,
    aten.permute.default,
    aten.numpy_T.default,
    aten.mT.default,
    aten.movedim.int,
    aten.movedim.intlist,
)
def permute_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """transpose/swapaxes/t/permute/movedim/``.T``/``.mT``: ``S(perm[k]) -> S(k)``; Partial passes through."""
    src, dst = call.inputs[0], call.outputs[0]
    nd = src.ndim
    perm = _permutation(call, nd)
    return _map_dims(call, {perm[k]: k for k in range(nd)}, src, dst)


# ----------------------------------------------------------------------------- (un)squeeze


@register(aten.unsqueeze.default)
def unsqueeze_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """unsqueeze: dims at or after the new one move up by one."""
    src, dst = call.inputs[0], call.outputs[0]
    new = _norm(bound_args(call)["dim"], dst.ndim)
    return _map_dims(call, {d: d if d < new else d + 1 for d in range(src.ndim)}, src, dst)


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """squeeze: a kept dim keeps its shard.

    A dim the op *may* squeeze (every dim for ``squeeze.default``, the named ones
    otherwise) but whose size is not 1 is sharded only when every rank keeps at
    least 2 elements of it: a local piece of size 1 would be squeezed locally.
    ``(size - 1) // axis_size`` bounds the smallest piece from below even when
    earlier axes rounded the size the rule sees up.
    """
    src, dst = call.inputs[0], call.outputs[0]
    nd = src.ndim
    args = bound_args(call)
    if call.target is aten.squeeze.default:
        named = set(range(nd))
    elif call.target is aten.squeeze.dim:
        named = {_norm(args["dim"], nd)} if nd else set()
    else:
        named = {_norm(d, nd) for d in args["dim"]} if nd else set()
    kept = [d for d in range(nd) if not (d in named and src.shape[d] == 1)]
    if len(kept) != dst.ndim:
        raise AssertionError(f"{call.name}: input {src.shape} squeezed to {dst.shape}, expected {len(kept)} dims")
    mapping = {d: k for k, d in enumerate(kept) if d not in named or (src.shape[d] - 1) // axis_size >= 2}
    return _map_dims(call, mapping, src, dst)


# ----------------------------------------------------------------------------- expand


@register(aten.expand.default)
def expand_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """expand: a kept dim keeps its shard; a broadcast dim (new, or size 1 -> n) may be
    sharded on the output with the input replicated (each rank expands to its piece)."""
    src, dst = call.inputs[0], call.outputs[0]
    off = dst.ndim - src.ndim
    pairs: list[tuple[Placement, Placement]] = []
    for dout in range(dst.ndim):
        din = dout - off
        n_out = dst.shape[dout]
        for b in _blocks_for(call, dout, sizes=(n_out,)):
            if din >= 0 and src.shape[din] == n_out:
                pairs.append((Shard(din, b), Shard(dout, b)))
            elif n_out > 1:
                pairs.append((_R, Shard(dout, b)))
    return _unary(pairs)


# ----------------------------------------------------------------------------- slice / select


@register(aten.slice.Tensor)
def slice_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """slice: shards on the other dims; the sliced dim only when the slice keeps all of it."""
    src, dst = call.inputs[0], call.outputs[0]
    dim = _norm(bound_args(call)["dim"], src.ndim)
    full = src.shape[dim] == dst.shape[dim]  # step 1 over the whole range: the identity on this dim
    return _map_dims(call, {d: d for d in range(src.ndim) if d != dim or full}, src, dst)


@register(aten.select.int)
def select_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """select: shards on the other dims (those after ``dim`` move down by one)."""
    src, dst = call.inputs[0], call.outputs[0]
    dim = _norm(bound_args(call)["dim"], src.ndim)
    return _map_dims(call, {d: d if d < dim else d - 1 for d in range(src.ndim) if d != dim}, src, dst)


# ----------------------------------------------------------------------------- split / chunk / unbind


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """split/split_with_sizes/chunk: one placement per output.

    * ``S(d) -> S(d)`` on every output for ``d`` other than the split dim;
    * ``S(dim)[b] -> S(dim)`` on every output when the split makes exactly ``b``
      equal pieces: rank r holds piece r of every block, i.e. piece r of every
      output (GPT-2's fused qkv ``(B, S, 2304)`` split into q, k, v);
    * one output equal to the input: ``S(dim) -> S(dim)``;
    * Partial passes through to every output.
    """
    src = call.inputs[0]
    outs = call.outputs
    n = len(outs)
    dim = _norm(bound_args(call)["dim"], src.ndim)
    strategies: list[AxisStrategy] = []
    for d in range(src.ndim):
        if d == dim:
            continue
        blocks = [1] + sorted({b for o in range(n) for b in hinted_blocks(call, o, d) if src.shape[d] % b == 0})
        strategies += [AxisStrategy((Shard(d, b),), (Shard(d, b),) * n) for b in blocks]
    pieces = {o.shape[dim] for o in outs}
    if n > 1 and len(pieces) == 1 and n * pieces.pop() == src.shape[dim]:
        strategies.append(AxisStrategy((Shard(dim, n),), (Shard(dim),) * n))
    if n == 1 and outs[0].shape == src.shape:
        strategies.append(AxisStrategy((Shard(dim),), (Shard(dim),)))
    return strategies + _partials(1, n)


@register(aten.unbind.int)
def unbind_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """unbind: every output is a select; shards on the other dims, Partial passes through."""
    src = call.inputs[0]
    n = len(call.outputs)
    dim = _norm(bound_args(call)["dim"], src.ndim)
    strategies = [AxisStrategy((Shard(d),), (Shard(d if d < dim else d - 1),) * n) for d in range(src.ndim) if d != dim]
    return strategies + _partials(1, n)


# ----------------------------------------------------------------------------- cat / stack


@register(aten.cat.default, aten.concat.default, aten.concatenate.default)
def cat_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """cat: every input ``S(d)`` -> ``S(d)`` for ``d`` other than the cat dim.

    When all k > 1 inputs have the same size on the cat dim, inputs ``S(dim)`` give
    the block-wise output ``S(dim)[k]`` (the inverse of the qkv split).  All inputs
    ``P(op)`` give ``P(op)``.  Inputs of another rank (legacy empty 1-D tensors)
    disable the shard strategies.
    """
    ins, dst = call.inputs, call.outputs[0]
    k = len(ins)
    if any(m.ndim != dst.ndim for m in ins):
        return _partials(k, 1)
    dim = _norm(bound_args(call)["dim"], dst.ndim)
    strategies = []
    for d in range(dst.ndim):
        if d == dim:
            continue
        for b in _blocks_for(call, d, sizes=(dst.shape[d],)):
            strategies.append(AxisStrategy((Shard(d, b),) * k, (Shard(d, b),)))
    if k > 1 and len({m.shape[dim] for m in ins}) == 1:
        strategies.append(AxisStrategy((Shard(dim),) * k, (Shard(dim, k),)))
    return strategies + _partials(k, 1)


@register(aten.stack.default)
def stack_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """stack: every input ``S(d)`` -> ``S(d)`` before the new dim, ``S(d + 1)`` after; Partial passes."""
    ins, dst = call.inputs, call.outputs[0]
    k = len(ins)
    new = _norm(bound_args(call)["dim"], dst.ndim)
    strategies = [AxisStrategy((Shard(d),) * k, (Shard(d if d < new else d + 1),)) for d in range(dst.ndim - 1)]
    return strategies + _partials(k, 1)


# ----------------------------------------------------------------------------- scatters (inverse views)


@register(aten.slice_scatter.default, aten.select_scatter.default)
def view_scatter_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """slice_scatter / select_scatter(self, src, dim, ...): self with one slice / index of ``dim`` replaced by src.

    ``S(d)`` on self, src (its matching dim: one lower past ``dim`` for select) and
    the output for every ``d != dim``; self and src ``P(sum)`` (or ``P(max)``) ->
    the output likewise, as every element is one of theirs.  What in-place writes
    through a view become (``decompose``: T5's shift-right).
    """
    src, piece = call.inputs[0], call.inputs[1]
    dim = _norm(bound_args(call)["dim"], src.ndim)
    select = call.target is aten.select_scatter.default
    strategies = []
    for d in range(src.ndim):
        if d == dim:
            continue
        dp = d - 1 if select and d > dim else d
        if piece.ndim > dp and piece.shape[dp] == src.shape[d]:
            strategies.append(AxisStrategy((Shard(d), Shard(dp)), (Shard(d),)))
    return strategies + _partials(2, 1)


# ----------------------------------------------------------------------------- repeat


@register(aten.repeat.default)
def repeat_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """repeat (tile): input dim ``d`` becomes output dim ``d + lead`` (``lead`` new leading dims).

    A dim repeated once keeps its shard.  A dim repeated ``k > 1`` times holds ``k``
    copies of the input side by side: ``S(d) -> S(d + lead)[k]``, rank r's piece of
    every copy is the repeat of its own piece (the inverse view of a fused-qkv split).
    New leading dims are not sharded (the local ``repeats`` would differ by rank).
    Partial passes through: a copy of a sum is the sum of the copies.
    """
    src = call.inputs[0]
    repeats = list(bound_args(call)["repeats"])
    lead = len(repeats) - src.ndim
    pairs: list[tuple[Placement, Placement]] = []
    for d in range(src.ndim):
        k = repeats[d + lead]
        if k == 1:
            pairs += [(Shard(d, b), Shard(d + lead, b)) for b in _blocks_for(call, d + lead, sizes=(src.shape[d],))]
        elif k > 1:
            pairs.append((Shard(d), Shard(d + lead, k)))
    return _unary(pairs)


@register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """repeat_interleave(self, k: int, dim): each element of ``dim`` repeated ``k`` times in place.

    Dims other than ``dim`` keep their shard.  ``dim`` itself: rank r's rows
    ``[a, b)`` give output rows ``[k a, k b)``, the same rank's shard of the output
    exactly when the axis divides the dim evenly (uneven pieces would round
    differently) and no global ``output_size`` is pinned.  ``dim=None`` (flattened)
    offers only Partial, which passes through (a copy of a sum is the sum of the copies).
    """
    src, dst = call.inputs[0], call.outputs[0]
    args = bound_args(call)
    if args["dim"] is None:
        return _partials(1, 1)
    dim = _norm(args["dim"], src.ndim)
    mapping = {d: d for d in range(src.ndim) if d != dim}
    strategies = _map_dims(call, mapping, src, dst)
    if args.get("output_size") is None and src.shape[dim] % axis_size == 0:
        strategies.append(AxisStrategy((Shard(dim),), (Shard(dim),)))
    return strategies


# ----------------------------------------------------------------------------- pad


@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """pad/constant_pad_nd: shards on the dims the op does not pad (any mode).

    Partial: reflect/replicate/circular copy values, so both ``P(sum)`` and
    ``P(max)`` pass; constant padding passes ``P(max)`` (every rank writes the same
    constant) and ``P(sum)`` only when the constant is 0.
    """
    src = call.inputs[0]
    args = bound_args(call)
    pad = list(args["pad"])
    mode = args.get("mode", "constant") or "constant"
    value = args.get("value") or 0
    padded = {src.ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    pairs = [
        (Shard(d, b), Shard(d, b))
        for d in range(src.ndim)
        if d not in padded
        for b in _blocks_for(call, d, sizes=(src.shape[d],))
    ]
    ops = ("sum", "max") if mode != "constant" or value == 0 else ("max",)
    return _unary(pairs, partial_ops=ops)
