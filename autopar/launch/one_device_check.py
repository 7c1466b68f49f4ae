"""``autopar run --check``: a distributed run against the same model trained on one device.

``compare`` takes every rank's ``TrainRecord`` (``runner.py``) and the one-device reference's: the loss of
every step on every rank, rank 0's other outputs (the logits) and gradients of its first step, and every
parameter after the last step must pass ``torch.isclose`` with ``RTOL`` / ``ATOL`` (the tolerances of
tests/test_execution.py); each quantity is one ``Deviation``, its largest absolute difference and worst tensor.
Where parameters fail while the gradients pass, ``_adam_note`` says whether AdamW's eps explains it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = ["ATOL", "Deviation", "RTOL", "compare"]

RTOL, ATOL = 1e-4, 1e-5
_ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the runs use


@dataclass(frozen=True, slots=True)
class Deviation:
    """The largest ``|distributed - reference|`` of one quantity, and whether all of it is within tolerance."""

    quantity: str
    tensors: int
    max_abs: float
    worst: str
    ok: bool
    note: str = ""


def _deviation(quantity: str, pairs: list[tuple[str, Any, Any]]) -> Deviation:
    worst, max_abs, ok = "-", 0.0, True
    for name, got, want in pairs:
        if got is None and want is None:
            continue
        if got is None or want is None or tuple(got.shape) != tuple(want.shape):
            shapes = [None if t is None else tuple(t.shape) for t in (got, want)]
            return Deviation(quantity, len(pairs), math.inf, f"{name} (shape {shapes[0]} vs {shapes[1]})", False)
        got, want = got.detach().double().cpu(), want.detach().double().cpu()
        diff = float((got - want).abs().max()) if got.numel() else 0.0
        if math.isnan(diff):
            diff = math.inf
        ok = ok and bool(torch.isclose(got, want, rtol=RTOL, atol=ATOL).all())
        if diff > max_abs or worst == "-":
            worst, max_abs = name, diff
    return Deviation(quantity, len(pairs), max_abs, worst, ok)


def compare(ranks: tuple, reference) -> list[Deviation]:
    """Losses of every rank and step, step-0 outputs and grads and final params of rank 0."""
    losses = [
        (f"rank {r.rank} step {s}", torch.tensor(a), torch.tensor(reference.losses[s]))
        for r in ranks
        for s, a in enumerate(r.record.losses, start=r.record.first_step)
    ]
    r0 = next(r for r in ranks if r.rank == 0).record
    devs = [_deviation("loss (every step, every rank)", losses)]
    if len(r0.outputs) != len(reference.outputs):
        devs.append(
            Deviation(
                f"outputs (step {r0.first_step})", len(reference.outputs), math.inf, "number of outputs differs", False
            )
        )
    elif reference.outputs:
        names = reference.output_names  # a sharded module returns a flat tuple: the reference names it
        quantity = ", ".join(names) + f" (step {r0.first_step})"
        devs.append(_deviation(quantity, list(zip(names, r0.outputs, reference.outputs))))

    def keyed(quantity: str, got: Mapping, want: Mapping) -> Deviation:
        if got.keys() != want.keys():
            odd = sorted(set(got) ^ set(want))
            return Deviation(quantity, len(want), math.inf, f"names differ: {odd[:3]}", False)
        return _deviation(quantity, [(k, got[k], want[k]) for k in want])

    devs.append(keyed(f"gradients (step {r0.first_step})", r0.grads, reference.grads))
    params = keyed(f"parameters after step {len(reference.losses) - 1}", r0.params, reference.params)
    if not params.ok and devs[-1].ok:
        params = replace(params, note=_adam_note(r0, reference))
    devs.append(params)
    return devs


def _adam_note(got, want) -> str:
    """Why parameters can fail while gradients pass: the worst element's gradient is near AdamW's eps."""
    worst = None  # (excess over tolerance, name, flat index)
    for name, ref in want.params.items():
        mine = got.params.get(name)
        if mine is None or want.grads.get(name) is None or got.grads.get(name) is None or mine.shape != ref.shape:
            continue
        ref = ref.double()
        excess = ((mine.double() - ref).abs() - (ATOL + RTOL * ref.abs())).flatten()
        if excess.numel() and float(excess.max()) > 0 and (worst is None or float(excess.max()) > worst[0]):
            worst = (float(excess.max()), name, int(excess.argmax()))
    if worst is None:
        return ""
    _, name, flat = worst
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), want.params[name].shape))
    g_want, g_got = float(want.grads[name][idx]), float(got.grads[name][idx])
    if abs(g_want) >= 100 * _ADAM_EPS:
        return ""
    return (
        f"{name}{list(idx)} is the worst element outside tolerance; its step-0 gradient, {g_got:.3e} here and "
        f"{g_want:.3e} on one device, is of the order of AdamW's eps ({_ADAM_EPS:g}), where lr*m/(sqrt(v)+eps) "
        "turns a rounding difference into a visible update. The gradients agree within tolerance: this is "
        "most likely rounding, not a sharding error (a smaller or different --seq/--batch usually passes)."
    )
