"""Why no plan: the errors the planner raises when nothing fits, naming the least memory any plan reaches."""

from __future__ import annotations

from autopar.search import InfeasibleError
from autopar.units import format_bytes

from .assemble import breakdown

__all__ = ["MemoryCapError", "cap_error", "no_plan_error"]


class MemoryCapError(ValueError):
    """No plan fits the per-device memory cap; the message says the smallest reachable and the fix.

    ``problem`` is the message without the fix and ``min_mem_bytes`` the smallest
    per-device memory found, so a front end (the CLI) can word the fix in its own
    terms (``--mem-cap``, ``--dtype``) instead of the API's (``mem_cap=``, ``dtype=``).
    ``whole_batch``: the plans searched ran the batch whole and activations dominate the
    least one, so micro-batches (gradient accumulation, or a pipeline) are the first fix
    to offer: they divide the activations by their count for the same batch.
    """

    def __init__(self, problem: str, min_mem_bytes: int, whole_batch: bool = False) -> None:
        micro = 'run the batch in micro-batches (microbatches=N, or pipeline="auto" to let the search choose), '
        super().__init__(
            f"{problem}\n  Fix: {micro if whole_batch else ''}raise mem_cap= to at least that, use more devices, "
            'a smaller batch or sequence, or bf16 (dtype="bf16").'
        )
        self.problem = problem
        self.min_mem_bytes = min_mem_bytes
        self.whole_batch = whole_batch

    def __reduce__(self):  # pickles (to another rank) as it was built
        return type(self), (self.problem, self.min_mem_bytes, self.whole_batch)


def no_plan_error(ctx, family: str | None, allow_state_sharding: bool) -> ValueError:
    """No plan exists under the restriction at any memory (a family or state rule no strategy set meets)."""
    what = f"the {family!r} family" if family else "the restriction"
    if not allow_state_sharding:
        what += " with every parameter's state kept with it (allow_state_sharding=False)"
    return ValueError(
        f"no plan of {ctx.graph.model_name} on {ctx.mesh} exists within {what}: every such plan needs a "
        "move between placements autopar cannot make.\n"
        "Fix: plan without family= (autopar run: --family auto; the search may mix families), or on another mesh."
    )


def cap_error(ctx, cap: int | None, err: InfeasibleError, keep) -> MemoryCapError:
    sol = err.min_mem_solution
    approximate = getattr(err, "approximate", False)
    if approximate:  # too wide to search exactly: the least memory found, not proven the least
        lines = [
            f"no plan of {ctx.graph.model_name} on {ctx.mesh} was found under the memory cap of {format_bytes(cap)} "
            "per device by the approximate search (the problem is too wide to search exactly, so this is not "
            "proven: a plan under the cap may exist)."
        ]
        reaches = "the least per-device memory of the plans it found is"
    else:
        lines = [
            f"no plan of {ctx.graph.model_name} on {ctx.mesh} fits the memory cap of {format_bytes(cap)} per device."
        ]
        reaches = "the smallest per-device memory any plan reaches is"
    smallest, whole_batch = err.min_mem_bytes, False
    if sol is not None:
        choice = [int(keep[i][c]) for i, c in enumerate(sol.choice)]
        mem = breakdown(ctx, choice).memory
        smallest = max(smallest, mem.per_device_bytes)  # that plan's step peaks there (autopar.cost.peak)
        parts = {
            "params": mem.params_bytes,
            "grads": mem.grads_bytes,
            "optimizer": mem.optimizer_bytes,
            "activations": mem.activations_bytes,
        }
        top = max(parts, key=parts.get)
        # a context plans its batch whole (``check_no_pipeline``; ``PipelineChoice`` plans each micro-batch count
        # in a context of its own), so where activations dominate, micro-batches are the fix; a caller that ran
        # micro-batches already (``PipelineChoice``) raises its misses without it
        whole_batch = top == "activations"
        lines.append(
            f"  {reaches} {format_bytes(smallest)}: "
            + ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
            + f" ({top} {'dominates' if top == 'optimizer' else 'dominate'})."
        )
    else:
        lines.append(f"  {reaches} {format_bytes(smallest)}.")
    return MemoryCapError("\n".join(lines), int(smallest), whole_batch)
