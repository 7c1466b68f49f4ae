"""Hint forms: every way a user writes a placement, turned into one placement per mesh axis.

Placements: a sequence with one entry per mesh axis (printed ``"S(1)"``,
``"S(1)[3]"``, ``"R"``, ``"P(sum)"`` or Placement objects), a comma string
``"R,S(1)"``, a dict ``{axis name: placement}`` (axes not named are R), or a
``Layout`` result (MindSpore's named device axes).

Op-level (matmul) operands, in MindSpore's ``MatMul`` order:

- factor tuples (``MatMul().shard(((a, b), (b, c)))``): per dim of each operand,
  how many slices it is cut into.  **Convention: MindSpore's**: operand 0 is the
  activation ``(rows, in_features)`` (or one factor per dim of the activation),
  operand 1 is the weight as ``(in_features, out_features)`` whatever the module
  stores (``nn.Linear`` stores ``(out, in)``: the placements are transposed onto
  it; GPT-2's ``Conv1D`` stores ``(in, out)``).  The logical dims ``rows..., in,
  out`` get mesh axes from the last to the first (MindSpore's device matrix: the
  last dim varies fastest), each taking the free axes whose sizes multiply to its
  factor, fewest axes first, then the innermost.  1 is not split; a factor no
  combination of free axes makes is an error, and ``in`` must have the same
  factor in both operands.
- ``Layout`` results (``layout("dp", "None")``): per dim of each operand, in the
  same MindSpore convention, the mesh axes (by name) that split it.
- placement lists (``(["S(0)", "R"], ["R", "S(0)"])``): each operand's placements
  on the *real* tensors (the weight as the module stores it).

``fit_problem`` says why a tensor cannot be laid out under placements: one
placement per axis, Shard dims in range, never Partial for stored tensors, and
``layout.unlayable_reason`` (the one layout rule: uneven ``tensor_split`` pieces
are fine) plus no empty pieces.  Problems are ``HintProblem`` (a reason and a
fix); ``autopar.planner.hints`` adds the hint, the tensor and the mesh to the message.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.mesh import Mesh
from autopar.models import tomllib
from autopar.pieces import unlayable_reason
from autopar.placement import Partial, Placement, Replicate, Shard, parse_placement
from autopar.spec import local_shape

__all__ = [
    "Layout",
    "LayoutSpec",
    "HintProblem",
    "fit_problem",
    "hint_from_text",
    "hints_from_file",
    "operand_placements",
    "parse_hint_placements",
]


# ---- MindSpore-style Layout ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Layout:
    """A device matrix with a name per axis, as MindSpore's ``Layout((2, 4), ("dp", "tp"))``.

    Calling it with one entry per tensor dim gives a ``LayoutSpec``: an axis name,
    a tuple of names (the dim is split over those axes, in mesh-axis order), or
    ``"None"`` (not split).  It must describe the mesh the model is planned on
    (same names and sizes).
    """

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]

    def __init__(self, device_matrix, alias_name) -> None:
        dm = tuple(int(s) for s in device_matrix)
        names = tuple(alias_name)
        if len(dm) != len(names) or len(set(names)) != len(names) or "None" in names:
            raise ValueError(
                f"Layout({dm}, {names}): give one distinct name per device-matrix axis (not 'None'), "
                "e.g. Layout((2, 4), ('dp', 'tp'))"
            )
        object.__setattr__(self, "device_matrix", dm)
        object.__setattr__(self, "alias_name", names)

    def __call__(self, *tensor_map) -> LayoutSpec:
        dims = []
        for entry in tensor_map:
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            names = tuple(n for n in names if n != "None")
            for n in names:
                if n not in self.alias_name:
                    raise ValueError(
                        f"Layout axis {n!r} does not exist: this layout's axes are {list(self.alias_name)}; "
                        "use one of them or 'None'"
                    )
            dims.append(names)
        return LayoutSpec(self, tuple(dims))


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """A tensor's layout: per dim, the names of the axes that split it (``()``: not split)."""

    layout: Layout
    tensor_map: tuple[tuple[str, ...], ...]

    def placements(self, mesh: Mesh | None = None) -> tuple[Placement, ...]:
        """One placement per mesh axis (the layout's own axes when ``mesh`` is None)."""
        names = self.layout.alias_name
        if mesh is not None:
            if tuple(mesh.axis_names) != names or tuple(mesh.shape) != self.layout.device_matrix:
                raise HintProblem(
                    f"the Layout is {dict(zip(names, self.layout.device_matrix))} but the mesh is "
                    f"{dict(zip(mesh.axis_names, mesh.shape))}",
                    "build the Layout from the mesh: Layout(mesh.shape, mesh.axis_names)",
                )
        out: list[Placement] = [Replicate()] * len(names)
        for d, axes in enumerate(self.tensor_map):
            order = [names.index(a) for a in axes]
            if order != sorted(order):
                raise HintProblem(
                    f"dim {d} is split over {axes}, not in mesh-axis order {names}",
                    "autopar splits one dim over several axes in mesh order: write "
                    f"{tuple(sorted(axes, key=names.index))}",
                )
            for a in order:
                if not isinstance(out[a], Replicate):
                    raise HintProblem(f"axis {names[a]!r} splits two dims", "give each axis to one dim at most")
                out[a] = Shard(d)
        return tuple(out)


# ---- placements ------------------------------------------------------------------------------
class HintProblem(ValueError):
    """Why one hint value cannot hold (``reason``) and how to fix it (``fix``)."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fix = fix


def parse_hint_placements(value: Any, mesh: Mesh) -> tuple[Placement, ...]:
    """One placement per mesh axis from any accepted form (see the module docstring)."""
    if isinstance(value, LayoutSpec):
        return value.placements(mesh)
    if isinstance(value, Mapping):
        out: list[Placement] = [Replicate()] * mesh.ndim
        for name, p in value.items():
            if name not in mesh.axis_names:
                raise HintProblem(
                    f"axis name {name!r} does not exist",
                    f"name the mesh's axes {list(mesh.axis_names)}, e.g. {{{mesh.axis_names[-1]!r}: 'S(0)'}}",
                )
            out[mesh.axis_names.index(name)] = _one(p)
        return tuple(out)
    items = [s for s in value.split(",") if s.strip()] if isinstance(value, str) else value
    if isinstance(items, (Shard, Replicate, Partial)) or not isinstance(items, Sequence):
        raise HintProblem(
            f"{value!r} is not a list of placements",
            f"give one placement per mesh axis {list(mesh.axis_names)}, e.g. {['R'] * mesh.ndim}",
        )
    parsed = tuple(_one(p) for p in items)
    if len(parsed) != mesh.ndim:
        raise HintProblem(
            f"{len(parsed)} placements for a mesh of {mesh.ndim} axes",
            f"give one placement per mesh axis {list(mesh.axis_names)}, e.g. {['R'] * mesh.ndim}",
        )
    return parsed


def _one(p) -> Placement:
    try:
        return parse_placement(p)
    except (ValueError, TypeError) as e:
        raise HintProblem(str(e), "write placements as 'R', 'S(d)', 'S(d)[blocks]' or 'P(sum)'") from None


def fit_problem(shape: tuple[int, ...], pl: tuple[Placement, ...], mesh: Mesh, *, source: bool) -> HintProblem | None:
    """Why a tensor of ``shape`` cannot be laid out as ``pl`` on ``mesh`` (None: it can)."""
    ndim = len(shape)
    for a, p in enumerate(pl):
        where = f"{p} on mesh axis {mesh.axis_names[a]} (size {mesh.shape[a]})"
        if isinstance(p, Shard) and p.dim >= ndim:
            return HintProblem(f"{where}: the tensor has dims 0..{ndim - 1}", f"shard a dim in 0..{ndim - 1} or use R")
        if isinstance(p, Partial) and source:
            return HintProblem(f"{where}: parameters and inputs are never stored partial", "use R or a Shard")
    reason = unlayable_reason(shape, pl, mesh.shape)
    if reason is not None:
        return HintProblem(reason, "use a block count that divides the dim, or R on that axis")
    smallest = local_shape(shape, pl, mesh.shape, tuple(s - 1 for s in mesh.shape))
    empty = [d for d, (g, n) in enumerate(zip(shape, smallest)) if g > 0 and n == 0]
    if empty:
        return HintProblem(
            f"dim {empty[0]} (size {shape[empty[0]]}) leaves some ranks no element",
            "shard a larger dim, use fewer axes on it, or R",
        )
    return None


def operand_placements(value, mesh: Mesh, x_ndim: int, w_dims: tuple[int, int]):
    """(activation placements, weight placements on the stored tensor) of an op-level hint."""
    x_val, w_val = value
    if all(isinstance(v, (tuple, list)) and v and all(isinstance(f, int) for f in v) for v in value):
        return _factor_placements(tuple(x_val), tuple(w_val), mesh, x_ndim, w_dims)
    if isinstance(x_val, LayoutSpec) and isinstance(w_val, LayoutSpec):
        kd, nd = w_dims
        x_pl = x_val.placements(mesh)
        w_virtual = w_val.placements(mesh)  # MindSpore's (in, out)
        w_pl = tuple(Shard((kd, nd)[p.dim]) if isinstance(p, Shard) else p for p in w_virtual)
        return x_pl, w_pl
    if any(isinstance(v, LayoutSpec) or (v and isinstance(v[0], int)) for v in value):
        raise HintProblem(
            f"operands {value!r} mix forms",
            "give both operands as factor tuples, both as Layout results, or both as placement lists",
        )
    return parse_hint_placements(x_val, mesh), parse_hint_placements(w_val, mesh)


def _factor_placements(fx: tuple[int, ...], fw: tuple[int, ...], mesh: Mesh, x_ndim: int, w_dims: tuple[int, int]):
    """MindSpore factor tuples -> placements (rules in the module docstring)."""
    if len(fw) != 2 or len(fx) not in (2, x_ndim):
        raise HintProblem(
            f"factor tuples {fx}, {fw}: expected ({'rows' if x_ndim > 2 else 'r'}, in) or one factor per "
            f"activation dim ({x_ndim}), and (in, out) for the weight",
            "write ((rows, in), (in, out)) as MindSpore's MatMul().shard does",
        )
    if fx[-1] != fw[0]:
        raise HintProblem(
            f"the contracted dim is cut {fx[-1]} ways in the activation but {fw[0]} in the weight",
            "give the in-features dim the same factor in both operands",
        )
    logical = list(fx) + [fw[1]]  # rows..., in, out
    free = list(range(mesh.ndim))
    axes: list[tuple[int, ...]] = [()] * len(logical)
    for i in reversed(range(len(logical))):
        f = logical[i]
        if f == 1:
            continue
        axes[i] = _axes_for(f, free, mesh)
        free = [a for a in free if a not in axes[i]]
    x_pl: list[Placement] = [Replicate()] * mesh.ndim
    w_pl: list[Placement] = [Replicate()] * mesh.ndim
    kd, nd = w_dims
    for i, group in enumerate(axes):
        for a in group:
            if i < len(fx) - 1:
                x_pl[a] = Shard(i)
            elif i == len(fx) - 1:
                x_pl[a], w_pl[a] = Shard(x_ndim - 1), Shard(kd)
            else:
                w_pl[a] = Shard(nd)
    return tuple(x_pl), tuple(w_pl)


def _axes_for(factor: int, free: list[int], mesh: Mesh) -> tuple[int, ...]:
    for k in range(1, len(free) + 1):
        combos = [c for c in itertools.combinations(free, k) if math.prod(mesh.shape[a] for a in c) == factor]
        if combos:
            return max(combos, key=lambda c: sorted(c, reverse=True))
    sizes = {mesh.axis_names[a]: mesh.shape[a] for a in free}
    raise HintProblem(
        f"factor {factor} is no product of the free mesh axes {sizes}",
        "use factors that are mesh axis sizes or products of them (1: not split), or a Layout",
    )


# ---- hints as text: the command line's --hint and --hints FILE -----------------------------
def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses and brackets (``S(1)[3],R`` -> ``['S(1)[3]', 'R']``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def hint_from_text(text: str) -> tuple[str, object]:
    """(pattern, value) of one hint written ``PATTERN=VALUE``: placements split on top-level commas
    (``'*.mlp.c_fc.weight=R,S(1)'``), ``replicate``, ``recompute``, or a MindSpore tuple
    (``'encoder.layer.0.intermediate.dense=((2,1),(1,4))'``).  ``ValueError`` naming ``text`` otherwise."""
    pattern, sep, value = text.partition("=")
    if not sep or not pattern.strip() or not value.strip():
        raise ValueError(
            f"{text!r}: expected PATTERN=VALUE, e.g. '*.mlp.c_fc.weight=R,S(1)' or 'transformer.h.*=replicate'"
        )
    value = value.strip()
    if value.startswith("(("):
        try:
            return pattern.strip(), ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{text!r}: {value} is not a tuple like ((2, 1), (1, 4))") from None
    return pattern.strip(), value if value.lower() in ("replicate", "recompute") else _split_top_level(value)


def hints_from_file(path: str) -> dict:
    """The table of ``pattern = value`` hints in a JSON or TOML file (lists of placements, ``"replicate"``, or
    ``[[2, 1], [1, 4]]``); ``ValueError`` naming the file, what is wrong and the fix."""
    file = Path(path)
    if not file.is_file():
        why = "is a folder" if file.is_dir() else "no such file"
        raise ValueError(f"{path}: {why}; pass a .json or .toml file of pattern = value")
    try:
        text = file.read_text()
        hints = tomllib.loads(text) if file.suffix == ".toml" else json.loads(text)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file; pass a .json or .toml file of pattern = value") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            'fix the file, e.g. {"*.mlp.c_fc.weight": ["R", "S(1)"]}, or name a .toml file'
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(
            f'{path}: not valid TOML ({e}); fix the file, e.g. \'"*.mlp.c_fc.weight" = ["R", "S(1)"]\''
        ) from None
    if not isinstance(hints, dict):
        raise ValueError(
            f"{path}: expected a table of pattern = value, got a {type(hints).__name__}; "
            'write e.g. {"*.mlp.c_fc.weight": ["R", "S(1)"]}'
        )
    return hints
