"""The calling convention of a captured model: how a call's Python values map to graph inputs and back.

A user calls a model in any way Python allows: positional, positional-only,
``*args``, keyword-only, ``**kwargs``, defaults left out, ``None`` and non-tensor
arguments, nested tuples, lists, dicts and dataclasses of tensors.  ``torch.export``
flattens ``(args, kwargs)`` with ``torch.utils._pytree`` into leaves, records the
tree (its ``in_spec``), and turns every tensor leaf into a graph input (a
placeholder) and every other leaf into a constant the graph is specialized on; the
outputs likewise (``out_spec``).  ``CallSpec`` keeps those trees, so a later call
is flattened by the very same rules and the outputs come back in the model's own
structure (a dict stays a dict, a Hugging Face ``ModelOutput`` its class).

One canonical form per call (``bind_call``): the call is bound to ``forward``'s
signature, and every argument equal to its default is dropped, so ``m(x)``,
``m(x, scale=1.0)`` and ``m(input=x)`` are one call when ``scale`` defaults to 1.0.
Positional parameters are passed positionally up to the first one left out
(``inspect.BoundArguments``), keyword-only ones and ``**kwargs`` by name.

A call whose structure differs from the compiled one (a missing or extra argument,
a list where a tuple was, another value of a non-tensor argument, another dtype or
shape) raises ``InputMismatchError`` naming each argument by its path (e.g.
``batch['extra'][0]``), what was compiled, what was given, and the fix.

Plain dataclasses a model returns or takes are registered with pytree on first
sight (``register_dataclasses``), as torch.export needs; Hugging Face registers
its ``ModelOutput`` classes itself.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "CallSpec",
    "InputLeaf",
    "OutputLeaf",
    "InputMismatchError",
    "bind_call",
    "forward_signature",
    "register_dataclasses",
]

_CONSTANT_TYPES = (int, float, bool, str, type(None))
_MAPPINGS = (dict, OrderedDict)  # one kind: a call may pass either where the other was compiled


class InputMismatchError(ValueError):
    """A call's inputs do not have the structure, values, dtypes or shapes the model was compiled with."""


@dataclasses.dataclass(frozen=True, slots=True)
class InputLeaf:
    """One leaf of the flattened ``(args, kwargs)``: a graph input (``name``) or a constant (``value``).

    ``path`` is how a user names it: ``input_ids``, ``batch['extra'][0]``, ``rest[1]``.
    """

    path: str
    name: str | None
    value: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.name is not None


@dataclasses.dataclass(frozen=True, slots=True)
class OutputLeaf:
    """One leaf of the flattened outputs: ``OpGraph.outputs[index]`` or the constant ``value``."""

    path: str
    index: int | None
    value: Any = None


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """The input and output trees ``torch.export`` recorded for one model and call form.

    ``in_spec`` is the tree of the canonical ``(args, kwargs)`` (``bind_call``) and
    ``inputs`` its leaves in flattening order; ``out_spec`` and ``outputs`` the same
    for what ``forward`` returns.  ``signature`` is ``forward``'s (None when Python
    cannot give one: calls are then taken as given).
    """

    model_name: str
    signature: inspect.Signature | None
    in_spec: pytree.TreeSpec
    inputs: tuple[InputLeaf, ...]
    out_spec: pytree.TreeSpec
    outputs: tuple[OutputLeaf, ...]

    @property
    def input_paths(self) -> dict[str, str]:
        """Graph input name -> the path a user knows it by."""
        return {leaf.name: leaf.path for leaf in self.inputs if leaf.is_tensor}

    def match(
        self,
        args: tuple,
        kwargs: dict,
        expected: Callable[[str], tuple[tuple[int, ...], torch.dtype, str]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Graph input name -> the tensor this call passes for it; ``InputMismatchError`` listing every difference.

        ``expected(name)`` gives the shape and dtype the input must have and the fix
        to print when its shape differs (the global shape, or a rank's piece under
        ``input_mode='local'``); None checks neither.
        """
        args, kwargs = bind_call(self.signature, args, kwargs, model_name=self.model_name)
        given = _by_name(self.signature, args, kwargs)
        problems: list[str] = []
        values: list = []
        for name, spec in self.named_specs:  # by name: a positional passed by keyword is the same argument
            if name in given:
                values.extend(_flatten_along(spec, given[name], _render, problems, (name,)))
            else:
                problems.append(f"{name}: compiled with it, not given")
        compiled = {name for name, _ in self.named_specs}
        problems.extend(f"{name}: given, but not in the compiled call" for name in given if name not in compiled)
        out: dict[str, torch.Tensor] = {}
        if not problems:
            for leaf, value in zip(self.inputs, values):
                problem = _leaf_problem(leaf, value, expected)
                if problem:
                    problems.append(problem)
                elif leaf.is_tensor:
                    out[leaf.name] = value
        if problems:
            raise InputMismatchError(self._message(problems))
        return out

    @functools.cached_property
    def named_specs(self) -> list[tuple[str, pytree.TreeSpec]]:
        """(argument name, the tree compiled for it) in flattening order: positionals, then keywords."""
        args_spec, kwargs_spec = self.in_spec.child(0), self.in_spec.child(1)
        named = [(_positional_name(self.signature, i), args_spec.child(i)) for i in range(args_spec.num_children)]
        return named + [(str(k), kwargs_spec.child(j)) for j, k in enumerate(kwargs_spec.context)]

    def unflatten_outputs(self, flat: list) -> Any:
        """The model's output structure holding ``flat`` (one value per leaf of ``out_spec``)."""
        return pytree.tree_unflatten(list(flat), self.out_spec)

    def _message(self, problems: list[str]) -> str:
        shown = problems[:8]
        more = f"\n  - ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        compiled = ", ".join(f"{leaf.path}={_describe_compiled(leaf)}" for leaf in self.inputs)
        return (
            f"this call does not match the one {self.model_name} was compiled with:"
            + "".join(f"\n  - {p}" for p in shown)
            + more
            + f"\nThe compiled call: {self.model_name}({compiled})."
            + "\nFix: call with the compiled structure, dtypes and shapes (non-tensor arguments are fixed at compile "
            "time, as torch.export specializes them), or compile again with example inputs of this call's form."
        )


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """``model.forward``'s signature without ``self``; None when Python cannot tell it."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _is_default(value: Any, default: Any) -> bool:
    if default is inspect.Parameter.empty:
        return False
    if value is default:
        return True
    return type(value) is type(default) and isinstance(value, _CONSTANT_TYPES) and value == default


def bind_call(
    signature: inspect.Signature | None, args: tuple, kwargs: dict, *, model_name: str = "the model"
) -> tuple[tuple, dict]:
    """The canonical ``(args, kwargs)`` of a call (see the module docstring).

    Raises ``InputMismatchError`` when the call does not fit the signature at all
    (a missing required argument, an unknown keyword, too many positionals).
    """
    args, kwargs = tuple(args), dict(kwargs)
    if signature is None:
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise InputMismatchError(
            f"the inputs do not fit {model_name}.forward{signature}: {e}.\n"
            "Fix: pass the arguments forward() takes, by position or by name, as you would call the model itself."
        ) from None
    params = signature.parameters
    var_positional = any(
        params[name].kind is inspect.Parameter.VAR_POSITIONAL and value for name, value in bound.arguments.items()
    )
    kept_positional_only = False
    for name in reversed(list(bound.arguments)):
        param, value = params[name], bound.arguments[name]
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if not value:  # an empty *args or **kwargs is no argument
                del bound.arguments[name]
            continue
        positional = param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        # a positional argument before a non-empty *args, or a positional-only one before a kept one, stays
        droppable = _is_default(value, param.default) and not (positional and var_positional)
        if param.kind is inspect.Parameter.POSITIONAL_ONLY and kept_positional_only:
            droppable = False
        if droppable:
            del bound.arguments[name]
        elif param.kind is inspect.Parameter.POSITIONAL_ONLY:
            kept_positional_only = True
    return tuple(bound.args), dict(bound.kwargs)


def render_input_path(signature: inspect.Signature | None, keys: tuple) -> str:
    """How a user names the leaf at key path ``keys`` of ``(args, kwargs)``: ``batch['extra'][0]``, ``rest[1]``."""
    if len(keys) < 2:
        raise AssertionError(f"key path {keys} names no argument of (args, kwargs)")
    name = _positional_name(signature, keys[1]) if keys[0] == 0 else str(keys[1])
    return _render((name, *keys[2:]))


def _render(keys: tuple) -> str:
    """``keys`` = (argument name, key, key, ...) as a user writes it: ``batch['extra'][0]``, ``aux.tag``."""
    return keys[0] + "".join(_key_str(k) for k in keys[1:])


def _by_name(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A canonical call's arguments by name (``_positional_name`` for positionals), positionals first."""
    named = {_positional_name(signature, i): v for i, v in enumerate(args)}
    return named | {str(k): v for k, v in kwargs.items()}


def _positional_name(signature: inspect.Signature | None, index: int) -> str:
    if signature is None:
        return f"args[{index}]"
    params = list(signature.parameters.values())
    positional = [
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if index < len(positional):
        return positional[index]
    star = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), "args")
    return f"{star}[{index - len(positional)}]"


def _key_str(key: Any) -> str:
    if isinstance(key, str):
        return f"[{key!r}]"
    if isinstance(key, int):
        return f"[{key}]"
    return str(key)  # pytree keys print themselves: [0], ['k'], .field


def _describe(value: Any) -> str:
    """A short description of a given value: ``a tensor (2, 8) int64``, ``a list of 2``, ``3``."""
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {list(value)}"
    if isinstance(value, _CONSTANT_TYPES):
        return repr(value)
    return f"a {type(value).__name__}"


def _describe_compiled(leaf: InputLeaf) -> str:
    return "<tensor>" if leaf.is_tensor else repr(leaf.value)


def _describe_spec(spec: pytree.TreeSpec) -> str:
    if spec.is_leaf():
        return "one value"
    if spec.type in (list, tuple):
        return f"a {spec.type.__name__} of {spec.num_children}"
    if spec.type in _MAPPINGS:
        return f"a {spec.type.__name__} with keys {list(spec.context)}"
    return f"a {spec.type.__name__}"


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    return [spec.child(i) for i in range(spec.num_children)]


def _flatten_along(
    spec: pytree.TreeSpec, value: Any, render: Callable[[tuple], str], problems: list[str], keys: tuple = ()
) -> list:
    """``value``'s leaves in ``spec``'s order (dict keys in any order); each structural difference -> ``problems``."""
    if spec.is_leaf():
        return [value]
    path = render(keys)
    if spec.type in _MAPPINGS:
        if type(value) not in _MAPPINGS:
            problems.append(f"{path}: compiled with {_describe_spec(spec)}, given {_describe(value)}")
            return []
        compiled, given = list(spec.context), set(value)
        missing = [k for k in compiled if k not in given]
        extra = [k for k in value if k not in set(compiled)]
        problems.extend(f"{render(keys + (k,))}: compiled with it, not given" for k in missing)
        problems.extend(f"{render(keys + (k,))}: given, but not in the compiled call" for k in extra)
        out: list = []
        for k, child in zip(compiled, _children(spec)):
            if k in given:
                out.extend(_flatten_along(child, value[k], render, problems, keys + (k,)))
        return out
    if type(value) is not spec.type:
        problems.append(f"{path}: compiled with {_describe_spec(spec)}, given {_describe(value)}")
        return []
    node = pytree.SUPPORTED_NODES[spec.type]
    if node.flatten_with_keys_fn is not None:
        keyed, context = node.flatten_with_keys_fn(value)
        child_keys = [k for k, _ in keyed]
        children = [v for _, v in keyed]
    else:
        children, context = node.flatten_fn(value)
        child_keys = list(range(len(children)))
    if spec.type in (list, tuple):
        child_keys = list(range(len(children)))
        if len(children) != spec.num_children:  # name each missing or extra element
            problems.extend(
                f"{render(keys + (i,))}: compiled with it, not given" for i in range(len(children), spec.num_children)
            )
            problems.extend(
                f"{render(keys + (i,))}: given, but not in the compiled call"
                for i in range(spec.num_children, len(children))
            )
            return []
    if len(children) != spec.num_children or context != spec.context:
        problems.append(f"{path}: compiled with {_describe_spec(spec)}, given {_describe(value)}")
        return []
    out = []
    for key, child_spec, child in zip(child_keys, _children(spec), children):
        key = key.idx if isinstance(key, pytree.SequenceKey) else key
        out.extend(_flatten_along(child_spec, child, render, problems, keys + (key,)))
    return out


def _leaf_problem(
    leaf: InputLeaf, given: Any, expected: Callable[[str], tuple[tuple[int, ...], torch.dtype, str]] | None
) -> str | None:
    """What is wrong with ``given`` for ``leaf`` (None: nothing)."""
    if not leaf.is_tensor:
        same = given is leaf.value or (type(given) is type(leaf.value) and given == leaf.value)
        if same:
            return None
        if isinstance(given, torch.Tensor):
            return (
                f"{leaf.path}: compiled with {leaf.value!r} (the graph was traced without a tensor here), "
                f"given {_describe(given)}"
            )
        return f"{leaf.path}: compiled with {leaf.value!r}, given {_describe(given)} (a non-tensor argument is fixed)"
    if not isinstance(given, torch.Tensor):
        return f"{leaf.path}: compiled with a tensor, given {_describe(given)}"
    if expected is None:
        return None
    shape, dtype, fix = expected(leaf.name)
    if given.dtype != dtype:
        return (
            f"{leaf.path}: dtype {str(given.dtype).removeprefix('torch.')} given, compiled with "
            f"{str(dtype).removeprefix('torch.')} (pass it .to(torch.{str(dtype).removeprefix('torch.')}))"
        )
    if tuple(given.shape) != tuple(shape):
        return f"{leaf.path}: shape {tuple(given.shape)} given, expected {tuple(shape)}; {fix}"
    return None


def register_dataclasses(value: Any) -> None:
    """Register with pytree every plain dataclass type found in ``value`` (nested), as torch.export needs.

    Each field is a child (``.name`` in paths); instances are rebuilt without
    calling ``__init__``, so frozen classes and ``init=False`` fields round-trip.
    """
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        cls = type(v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            if cls not in pytree.SUPPORTED_NODES:
                _register_dataclass(cls)
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _register_dataclass(cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]

    def flatten(obj):
        return [getattr(obj, n) for n in names], names

    def flatten_with_keys(obj):
        return [(pytree.GetAttrKey(n), getattr(obj, n)) for n in names], names

    def unflatten(values, context):
        obj = object.__new__(cls)
        for n, v in zip(context, values):
            object.__setattr__(obj, n, v)
        return obj

    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
