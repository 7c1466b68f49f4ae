"""Rules for contractions: mm, addmm, bmm, baddbmm, matmul, linear, einsum, mv, addmv, dot,
and the grouped (per-expert) matmul of Hugging Face mixture-of-experts layers.

Every op is written as an einsum (``EinsumSpec``: one label string per operand,
one for the output, and an optional bias that follows the output) and one
generator, ``einsum_strategies``, lists its strategies on one mesh axis, as
DTensor's ``gen_einsum_strategies`` does:

- an output label (batch, lhs-free ``M`` or rhs-free ``N``): every operand that
  holds it at the output's size is ``S``, operands that lack it or broadcast it
  (size 1) are ``R``, the output is ``S``;
- a contracted label (``K``): every operand that holds it is ``S`` on it, the
  output is ``P(sum)``;
- linearity: one operand ``P(sum)``, the others ``R`` -> output ``P(sum)``;
- block hints ``(0, d, b)`` on an output dim add the output-label strategy with
  ``S(·)[b]`` (GPT-2's fused ``c_attn``: weight ``(768, 2304)`` holding q, k, v side
  by side is split inside each of q, k and v).

The bias (``self`` of addmm/baddbmm/addmv, ``bias`` of linear) follows the output:
the same shard on the dims it has at full size, ``R`` where it broadcasts, and
``P(sum)`` when the output is ``P(sum)`` (``R -> P`` is a free local step: one rank
keeps the bias, the others zero it).  Products of two Partial operands are not
linear and are never offered.
"""

from __future__ import annotations

import string
from collections import Counter
from dataclasses import dataclass

import torch

from autopar.placement import Partial, Placement, Replicate, Shard

from .base import AxisStrategy, OpCall, hinted_blocks, register

__all__ = ["EinsumSpec", "einsum_spec", "einsum_strategies", "parse_einsum"]

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")


@dataclass(frozen=True, slots=True)
class EinsumSpec:
    """An op as an einsum over ``call.inputs``.

    ``operands`` pairs an input index with its dims' labels; ``output`` labels the
    output's dims; ``bias`` is the input index of an addend broadcast to the output
    (None: no bias).  Inputs not named are ``R`` in every strategy.
    """

    operands: tuple[tuple[int, str], ...]
    output: str
    bias: int | None = None


def parse_einsum(equation: str, ndims: list[int]) -> tuple[list[str], str] | None:
    """Operand and output labels of an einsum equation, ``...`` expanded; None if unsupported.

    Unsupported: a label repeated within one operand or the output (diagonals),
    and equations whose terms do not match the operands' ranks.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None
    used = {c for c in eq if c.isalpha()}
    pool = [c for c in string.ascii_letters if c not in used]
    n_ell = max((nd - (len(t) - 3) for t, nd in zip(terms, ndims, strict=True) if "..." in t), default=0)
    if n_ell < 0:
        return None
    ell = "".join(pool[:n_ell])
    ops = []
    for t, nd in zip(terms, ndims, strict=True):
        if "..." in t:
            k = nd - (len(t) - 3)
            t = t.replace("...", ell[n_ell - k :] if k > 0 else "")
        if len(t) != nd or len(set(t)) != len(t):
            return None
        ops.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:  # implicit output: broadcast dims, then labels seen once, alphabetically
        counts = Counter("".join(ops))
        out = ell + "".join(sorted(c for c in counts if counts[c] == 1 and c not in ell))
    if len(set(out)) != len(out) or any(c not in "".join(ops) for c in out):
        return None
    return ops, out


def _matmul_labels(a_nd: int, b_nd: int) -> tuple[str, str, str] | None:
    """torch.matmul as an einsum: 1-D operands, broadcast batch dims aligned from the right."""
    if a_nd == 0 or b_nd == 0:
        return None
    batch = "abcdefghij"
    nb = max(a_nd - 2, b_nd - 2, 0)
    if nb > len(batch):
        return None
    lab_b = batch[:nb]
    a = "k" if a_nd == 1 else lab_b[nb - (a_nd - 2) :] + "mk"
    b = "k" if b_nd == 1 else lab_b[nb - (b_nd - 2) :] + "kn"
    out = lab_b + ("m" if a_nd >= 2 else "") + ("n" if b_nd >= 2 else "")
    return a, b, out


def einsum_spec(call: OpCall) -> EinsumSpec | None:
    """The ``EinsumSpec`` of a registered contraction, or None for shapes this module does not cover."""
    t = call.target
    nd = [m.ndim for m in call.inputs]
    spec: EinsumSpec | None
    if t is aten.mm.default:
        spec = EinsumSpec(((0, "mk"), (1, "kn")), "mn")
    elif t is aten.addmm.default:
        spec = EinsumSpec(((1, "mk"), (2, "kn")), "mn", bias=0)
    elif t is aten.bmm.default:
        spec = EinsumSpec(((0, "bmk"), (1, "bkn")), "bmn")
    elif t is aten.baddbmm.default:
        spec = EinsumSpec(((1, "bmk"), (2, "bkn")), "bmn", bias=0)
    elif t is aten.mv.default:
        spec = EinsumSpec(((0, "mk"), (1, "k")), "m")
    elif t is aten.addmv.default:
        spec = EinsumSpec(((1, "mk"), (2, "k")), "m", bias=0)
    elif t is aten.dot.default:
        spec = EinsumSpec(((0, "k"), (1, "k")), "")
    elif t is aten.matmul.default:
        labels = _matmul_labels(nd[0], nd[1])
        if labels is None:
            return None
        spec = EinsumSpec(((0, labels[0]), (1, labels[1])), labels[2])
    elif t is aten.linear.default:
        if nd[1] != 2 or nd[0] == 0 or nd[0] > 11:
            return None
        batch = "abcdefghij"[: nd[0] - 1]
        spec = EinsumSpec(((0, batch + "k"), (1, "nk")), batch + "n", bias=2 if len(nd) == 3 else None)
    elif t is aten.einsum.default:
        parsed = parse_einsum(call.args[0], nd)
        if parsed is None:
            return None
        spec = EinsumSpec(tuple(enumerate(parsed[0])), parsed[1])
    else:
        return None
    if any(len(lab) != nd[i] for i, lab in spec.operands) or len(spec.output) != call.outputs[0].ndim:
        return None
    return spec


def _bias_placement(call: OpCall, bias: int, out_p: Placement) -> Placement:
    if not isinstance(out_p, Shard):
        return out_p
    out, b = call.outputs[0], call.inputs[bias]
    bd = out_p.dim - (out.ndim - b.ndim)
    if bd >= 0 and b.shape[bd] == out.shape[out_p.dim]:
        return Shard(bd, out_p.blocks)
    return R


def einsum_strategies(call: OpCall, axis_size: int, spec: EinsumSpec) -> list[AxisStrategy]:
    """Strategies of ``spec`` on one mesh axis of ``axis_size`` ranks (module docstring), each listed once."""
    out = call.outputs[0]
    result: list[AxisStrategy] = []
    seen: set = set()

    def add(placed: dict[int, Placement], out_p: Placement) -> None:
        ins = [placed.get(i, R) for i in range(len(call.inputs))]
        if spec.bias is not None:
            ins[spec.bias] = _bias_placement(call, spec.bias, out_p)
        s = AxisStrategy(tuple(ins), (out_p,))
        if (s.inputs, s.outputs) not in seen:
            seen.add((s.inputs, s.outputs))
            result.append(s)

    for d, label in enumerate(spec.output):
        size = out.shape[d]
        if size < axis_size:
            continue
        for blocks in [1] + hinted_blocks(call, 0, d):
            if size % blocks or size // blocks < axis_size:
                continue
            placed = {
                i: Shard(lab.index(label), blocks)
                for i, lab in spec.operands
                if label in lab and call.inputs[i].shape[lab.index(label)] == size
            }
            if placed:
                add(placed, Shard(d, blocks))

    contracted = [c for c in dict.fromkeys("".join(lab for _, lab in spec.operands)) if c not in spec.output]
    for label in contracted:
        holders = {i: lab.index(label) for i, lab in spec.operands if label in lab}
        sizes = {call.inputs[i].shape[pos] for i, pos in holders.items()}
        if len(sizes) == 1 and sizes.pop() >= axis_size:
            add({i: Shard(pos) for i, pos in holders.items()}, PSUM)

    for i, _ in spec.operands:
        add({i: PSUM}, PSUM)
    return result


_OPS = [
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.matmul.default,
    aten.linear.default,
    aten.einsum.default,
    aten.mv.default,
    aten.addmv.default,
    aten.dot.default,
]


@register(*_OPS)
def matmul_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Contractions as einsums (module docstring); [] (replicate only) for shapes not covered."""
    spec = einsum_spec(call)
    return [] if spec is None else einsum_strategies(call, axis_size, spec)


#: Hugging Face's grouped matmul for experts (``transformers.integrations.moe``), a custom op
#: that exists once transformers has registered it: named, not imported.
GROUPED_MM = "transformers.grouped_mm_fallback.default"


@register(GROUPED_MM)
def grouped_mm_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """grouped_mm_fallback(input (S, K), weight (E, K, N), offs (E,)) -> (S, N).

    Rows ``offs[e-1]:offs[e]`` of input (sorted by expert) multiply ``weight[e]``, so
    on one axis, with ``offs`` always ``R``:

    1. weight ``S(2)``, input ``R`` -> out ``S(1)`` (each rank its columns of every expert);
    2. input ``S(1)``, weight ``S(1)`` -> out ``P(sum)`` (each rank its part of K);
    3. linearity: input or weight ``P(sum)``, the other ``R`` -> out ``P(sum)``.

    Rows (``S``) and experts (``E``) are never split: ``offs`` holds global row offsets
    for every expert, and an expert's rows must meet its weight.
    """
    x, weight, _ = call.inputs
    if x.ndim != 2 or weight.ndim != 3:
        return []
    out = [AxisStrategy((R, Shard(2), R), (Shard(1),))]
    if x.shape[1] == weight.shape[1]:
        out.append(AxisStrategy((Shard(1), Shard(1), R), (PSUM,)))
    return out + [AxisStrategy((PSUM, R, R), (PSUM,)), AxisStrategy((R, PSUM, R), (PSUM,))]
