"""What an op keeps for backward, derived from the op itself.

``saved_for_backward(call, requires_grad)`` runs the op once on fake tensors
(``FakeTensorMode``: no memory, no compute) of the call's metas, the inputs that
``requires_grad`` marks requiring grad, inside ``saved_tensors_hooks``, and sorts
every tensor autograd packs:

* one of the op's **inputs** (the tensor itself or a view of it: it shares the
  input's storage) -> its position among the call's tensor inputs;
* one of its **outputs** (or a view of one) -> the output index;
* anything else is an **internal** tensor the op made for backward (a layer
  norm's mean and rstd, a dropout mask, the attention matrix of the math
  attention path ...): its storage's bytes, each storage once.

The answer is what *this* PyTorch runs on CPU tensors, composite ops (linear,
layer_norm, dropout, scaled_dot_product_attention) decomposed exactly as eager
mode decomposes them.  What differs by device is priced from the profile by the
caller (``cost.coster``): scaled_dot_product_attention on CUDA runs a fused kernel
(``attention="flash"``: it keeps q, k, v, its output and a float32 logsumexp per
query row, FlashAttention-2's backward contract) while CPU ranks run what is
traced here (``attention="traced"``: the fused CPU flash kernel without dropout,
the math path, which keeps the attention matrix, with dropout).

Answers are cached by (op, tensor metas, requires-grad flags, non-tensor
arguments, kernel): a model repeats the same few calls layer after layer.  An op
that cannot run on fake tensors (data-dependent output shapes) is assumed to
keep every input that requires grad and nothing else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from autopar.spec import TensorMeta
from autopar.strategies import OpCall
from costmodel import ATTENTION_SAVES

__all__ = ["SavedForBackward", "saved_for_backward", "storage_roots", "memory_layouts", "NOTHING_SAVED"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_ATTENTION = {aten.scaled_dot_product_attention.default}


@dataclass(frozen=True, slots=True)
class SavedForBackward:
    """What one call keeps for backward: input positions, output indices and bytes of its own tensors."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    internal_bytes: int


NOTHING_SAVED = SavedForBackward((), (), 0)


def saved_for_backward(
    call: OpCall,
    requires_grad: tuple[bool, ...],
    *,
    layouts: tuple[tuple[int, ...] | None, ...] | None = None,
    attention: str = "traced",
    kernel: Any = None,
) -> SavedForBackward:
    """What ``call`` (its metas as given: global or one rank's local) keeps for backward.

    ``requires_grad[i]`` says whether tensor input ``i`` requires grad (only float
    inputs can); with none requiring grad the op keeps nothing.  ``layouts[i]``,
    when not None, is input ``i``'s dim order in memory, outermost first (see
    ``memory_layouts``): composite ops copy a non-contiguous input where they
    would view a contiguous one, and the copy is the op's own tensor.  ``kernel``,
    when given, is ``(fn, ctx)``: a local kernel (``kernels.KERNELS``) run instead
    of the op as ``fn(ctx, *args, **kwargs)``, as the executor runs it.
    """
    if attention not in ATTENTION_SAVES:
        raise ValueError(f"attention form {attention!r}: expected one of {ATTENTION_SAVES}")
    if len(requires_grad) != len(call.inputs):
        raise ValueError(
            f"saved_for_backward({call.name}): {len(requires_grad)} requires_grad flags for "
            f"{len(call.inputs)} tensor inputs; pass one flag per tensor input"
        )
    rg = tuple(bool(r) and m.is_float for r, m in zip(requires_grad, call.inputs))
    if not any(rg):
        return NOTHING_SAVED
    if attention == "flash" and call.target in _ATTENTION and kernel is None:
        return _flash_attention(call)
    flat, spec = call.flat_args
    leaves = tuple(_leaf_key(a) for a in flat)
    layouts = tuple(layouts) if layouts is not None else (None,) * len(call.inputs)
    key = (call.target, leaves, spec, rg, layouts, kernel)
    try:
        hash(key)
    except TypeError:
        key = repr(key)
    return _derive(key, call, rg, layouts, kernel)


def _leaf_key(a: Any) -> Any:
    if isinstance(a, torch.device):
        return "device"  # every device is traced as CPU
    return a


def _flash_attention(call: OpCall) -> SavedForBackward:
    q = call.inputs[0]
    rows = 1
    for s in q.shape[:-1]:
        rows *= s
    return SavedForBackward(tuple(range(len(call.inputs))), (0,), rows * torch.float32.itemsize)


_CACHE: dict = {}  # key of a call (see saved_for_backward) -> SavedForBackward


def _derive(key, call: OpCall, rg: tuple[bool, ...], layouts: tuple, kernel) -> SavedForBackward:
    hit = _CACHE.get(key)
    if hit is None:
        try:
            hit = _trace(call, rg, layouts, kernel)
        except Exception as e:  # data-dependent shapes and ops without a fake kernel
            log.debug(
                "saved_for_backward(%s): cannot run on fake tensors (%s); assuming it keeps its grad inputs",
                call.name,
                e,
            )
            hit = SavedForBackward(tuple(i for i, r in enumerate(rg) if r), (), 0)
        _CACHE[key] = hit
    return hit


def _trace(call: OpCall, rg: tuple[bool, ...], layouts: tuple, kernel) -> SavedForBackward:
    from torch._subclasses.fake_tensor import FakeTensorMode

    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with _quiet_fake_errors(), FakeTensorMode():
        it = iter(zip(call.inputs, rg, layouts))
        tensors = []

        def make(a: Any) -> Any:
            if isinstance(a, TensorMeta):
                meta, r, order = next(it)
                dtype = meta.dtype if meta.dtype is not None else torch.float32
                if order is not None and len(order) == len(meta.shape):
                    t = torch.empty_permuted(meta.shape, order, dtype=dtype)
                else:
                    t = torch.empty(meta.shape, dtype=dtype)
                tensors.append(t.requires_grad_(r))
                return t
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        flat, spec = call.flat_args
        args, kwargs = pytree.tree_unflatten([make(a) for a in flat], spec)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if kernel is not None:
                fn, ctx = kernel
                out = fn(ctx, *args, **kwargs)
            else:
                out = call.target(*args, **kwargs)
        ins = [StorageWeakRef(t.untyped_storage()) for t in tensors]
        outs = [StorageWeakRef(t.untyped_storage()) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        inputs, outputs, internal = set(), set(), {}
        for t in packed:
            ref = StorageWeakRef(t.untyped_storage())
            if ref in ins:
                inputs.add(ins.index(ref))
            elif ref in outs:
                outputs.add(outs.index(ref))
            else:
                internal[ref] = t.untyped_storage().nbytes()
    return SavedForBackward(tuple(sorted(inputs)), tuple(sorted(outputs)), int(sum(internal.values())))


class _quiet_fake_errors:
    """Silence FakeTensorMode's error log while tracing: a failing op is handled by the caller."""

    _logger = logging.getLogger("torch._subclasses.fake_tensor")

    def __enter__(self) -> None:
        self._level = self._logger.level
        self._logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc) -> None:
        self._logger.setLevel(self._level)


def _output_values(node) -> list[torch.Tensor] | None:
    """The fake values torch.export recorded for ``node``'s outputs (None when they do not match them)."""
    val = node.fx_node.meta.get("val") if node.fx_node is not None else None
    leaves = [t for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]
    return leaves if len(leaves) == len(node.outputs) else None


def memory_layouts(graph) -> dict[tuple[int, int], tuple[int, ...]]:
    """(node, output) -> dim order in memory (outermost first) of every output that is not contiguous.

    From the strides torch.export recorded; a rank's local piece keeps its global
    tensor's dim order (sharding shortens dims, it does not reorder them).
    """
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for n in graph.nodes:
        for o, t in enumerate(_output_values(n) or ()):
            if t.layout is torch.strided and not t.is_contiguous():
                stride = t.stride()
                out[(n.index, o)] = tuple(sorted(range(t.dim()), key=lambda d: (-stride[d], d)))
    return out


def storage_roots(graph) -> dict[tuple[int, int], tuple[int, int]]:
    """(node, output) -> the (node, output) that owns its storage, for every output that is a view.

    A view (``view``, ``transpose``, ``split``, a no-op ``to`` or ``contiguous`` ...)
    keeps its base's whole storage alive, so a saved view costs its base's bytes,
    and views of one base saved by several ops cost them once.  Read from the fake
    values torch.export recorded (``node.meta["val"]``), which share storage exactly
    where eager mode does; the owner is the first node in topological order.
    Outputs that own their storage are not listed.
    """
    owner: dict = {}
    roots: dict[tuple[int, int], tuple[int, int]] = {}
    for n in graph.nodes:
        for o, t in enumerate(_output_values(n) or ()):
            try:
                ref = StorageWeakRef(t.untyped_storage())
            except (NotImplementedError, RuntimeError):  # a tensor subclass without storage
                continue
            first = owner.setdefault(ref, (n.index, o))
            if first != (n.index, o):
                roots[(n.index, o)] = first
    return roots
