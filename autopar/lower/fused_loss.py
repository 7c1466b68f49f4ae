"""Lowering a decomposed cross-entropy back into one log-softmax where the plan keeps the classes whole.

``decompose.py`` rewrites ``cross_entropy_loss`` before planning into its
log-sum-exp pieces, so the search can shard the class dim (Megatron's
vocab-parallel loss).  When the plan does not, every rank runs those pieces on
whole rows of the logits, about twice as slowly as PyTorch's fused kernels, and
keeps two (N, C) tensors for backward (``exp``'s output and the ``gather`` input)
where a log-softmax keeps one.  Lowering (``rewrite.py``) then runs the group's
logit roles (``decompose.LOGIT_ROLES``: from the logits ``x`` to the masked
per-row loss ``nll * valid``) as

    lsm  = _log_softmax(x, 1)
    nll  = -gather(lsm, 1, t')                          # t' = where(valid, t, 0), unsqueezed
    nll  = nll * (1 - eps) - mean_c(lsm) * eps          # only with label_smoothing eps > 0
    out  = squeeze(nll, 1) * valid

the same value (``log(s) - zt`` is ``-lsm[t']``, ``log(s) - mean_c(z)`` is
``-mean_c(lsm)``) and the same gradient, in the logits' dtype.  The target
chain (``valid``, ``t'``, ``valid_float``) and the reduction (``sum(out)``, the
mean's ``/ sum(valid)``) stay the plan's own nodes: their placements carry the
plan's collectives (e.g. the loss's all-gather or all-reduce).

The rule (``fusable_groups``): a group is fused when

* every logit role is in the graph and no node outside them reads one of them
  except the result (``masked``);
* on every mesh axis, every input and output of every logit role is placed the
  same, ``R`` or ``S(0)`` (whole rows: the class dim is never sharded and nothing
  is ``Partial``), no node of them runs a kernel or has ``partial_grad_axes``, and
  so no edge between two of them moves anything (forward or gradient);
* no input from outside is a parameter (no FSDP re-gather to keep).

Inputs from outside the group (the logits, ``t'``, ``valid_float``) go through
the edges the plan gives them, lowered by the executor exactly as unfused (a
move the plan counts runs and is counted), so the collectives are unchanged.

What the cost model prices for a fused group (one (N, C) tensor kept, not two)
is ``strategies/fuse.py``'s (``prices_as_fused``, ``fused_keeps``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from autopar.capture import DECOMPOSED, LOGIT_ROLES, CrossEntropyPart
from autopar.placement import Replicate, Shard

__all__ = ["FusedLoss", "fusable_groups", "emit_fused_loss", "decomposed_values"]

aten = torch.ops.aten

#: (role, tensor input position) of the external inputs the fused form reads: logits, index, valid mask
_INPUTS = (("shifted", 0), ("target_logit", 1), ("masked", 1))


@dataclass(frozen=True, slots=True)
class FusedLoss:
    """One decomposed cross-entropy lowered as a fused log-softmax (see the module docstring)."""

    part: CrossEntropyPart
    members: dict[str, fx.Node]  # role -> captured fx node (the logit roles)

    @property
    def result(self) -> fx.Node:
        return self.members["masked"]

    def input_key(self, role: str, pos: int) -> tuple[str, int]:
        return self.members[role].name, pos

    def inputs(self) -> tuple[tuple[str, int], ...]:
        """(member fx name, tensor input position) of the logits, the index and the valid mask."""
        return tuple(self.input_key(role, pos) for role, pos in _INPUTS)


def fusable_groups(xplan, by_fx: dict, identity_edge: Callable) -> dict[fx.Node, FusedLoss]:
    """Member fx node -> its ``FusedLoss``, for every group the rule admits (module docstring).

    ``by_fx``: captured fx node -> ``OpNode``; ``identity_edge(opnode, ex, pos)``:
    whether the executor lowers that edge as plain data flow (no move either way).
    """
    groups: dict[str, dict[str, fx.Node]] = {}
    parts: dict[str, CrossEntropyPart] = {}
    for fxn in xplan.graph.gm.graph.nodes:
        part = fxn.meta.get(DECOMPOSED)
        if isinstance(part, CrossEntropyPart) and part.role in LOGIT_ROLES:
            groups.setdefault(part.group, {})[part.role] = fxn
            parts[part.group] = part
    out: dict[fx.Node, FusedLoss] = {}
    for name, members in groups.items():
        group = FusedLoss(parts[name], members)
        if _admits(xplan, by_fx, group, identity_edge):
            out.update(dict.fromkeys(members.values(), group))
    return out


def _admits(xplan, by_fx: dict, group: FusedLoss, identity_edge: Callable) -> bool:
    """Whether the rule (module docstring) admits ``group``: every role present, read only inside, whole rows."""
    members = set(group.members.values())
    needed = {"max_input", "max", "shifted", "exp", "sum_exp", "log_sum_exp", "target_logit", "nll", "rows", "masked"}
    if group.part.label_smoothing > 0:
        needed |= {"sum_logit", "mean_logit", "smooth", "nll_part", "smooth_part", "smoothed"}
    if set(group.members) != needed:
        return False
    if any(u not in members for n in members if n is not group.result for u in n.users):
        return False
    opnodes = [by_fx.get(n) for n in members]
    if any(o is None or o.kind != "op" or o.name not in xplan.nodes for o in opnodes):
        return False
    axes = range(len(xplan.mesh_shape))
    seen: list[set] = [set() for _ in axes]
    for o in opnodes:
        ex = xplan.nodes[o.name]
        if any(ex.kernels) or any(ex.partial_grad):
            return False
        for placements in ex.inputs + ex.outputs:
            for a in axes:
                seen[a].add(placements[a])
        for pos, (src, _) in enumerate(o.inputs):
            producer = xplan.graph.nodes[src]
            if producer.fx_node in members:
                if not identity_edge(o, ex, pos):
                    return False
            elif producer.kind == "param":
                return False
    return all(len(s) == 1 and isinstance(next(iter(s)), (Replicate, Shard)) for s in seen) and all(
        not isinstance(p, Shard) or p.dim == 0 for s in seen for p in s
    )


def emit_fused_loss(group: FusedLoss, x, index, valid, node: Callable) -> object:
    """Emit the fused rows (module docstring) with ``node(name, target, *args)``; returns the result node.

    ``x``, ``index``, ``valid``: this rank's logits, ``t'`` (N, 1) and float valid
    mask as the plan's edges deliver them.  The result is named as the group's
    ``masked`` node, so it stands for that node in the lowered program.
    """
    eps, prefix = group.part.label_smoothing, group.part.group
    lsm = node(f"{prefix}_log_softmax", aten._log_softmax.default, x, 1, False)
    nll = node(f"{prefix}_nll", aten.neg.default, node(f"{prefix}_target", aten.gather.default, lsm, 1, index))
    if eps > 0.0:
        total = node(f"{prefix}_sum_lsm", aten.sum.dim_IntList, lsm, [1], True)
        mean = node(f"{prefix}_mean_lsm", aten.div.Tensor, total, -group.part.num_classes)  # -mean_c(lsm)
        nll = node(
            f"{prefix}_smoothed",
            aten.add.Tensor,
            node(f"{prefix}_nll_part", aten.mul.Tensor, nll, 1.0 - eps),
            node(f"{prefix}_smooth_part", aten.mul.Tensor, mean, eps),
        )
    rows = node(f"{prefix}_rows", aten.squeeze.dim, nll, 1)
    return node(group.result.name, aten.mul.Tensor, rows, valid)


def decomposed_values(group: FusedLoss, x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> dict:
    """Member fx name -> the value its unfused op would compute here (the instrumented trace's entries).

    All but the result, which the fused program computes and records itself.

    Computed without autograd, so it keeps nothing for backward: the fused program
    has no such tensors, and what it saves is what is measured.
    """
    eps, c = group.part.label_smoothing, group.part.num_classes
    with torch.no_grad():
        v = {"max_input": x.detach()}
        v["max"] = v["max_input"].amax(1, keepdim=True)
        v["shifted"] = x - v["max"]
        v["exp"] = v["shifted"].exp()
        v["sum_exp"] = v["exp"].sum(1, keepdim=True)
        v["log_sum_exp"] = v["sum_exp"].log()
        v["target_logit"] = v["shifted"].gather(1, index)
        nll = v["nll"] = v["log_sum_exp"] - v["target_logit"]
        if eps > 0.0:
            v["sum_logit"] = v["shifted"].sum(1, keepdim=True)
            v["mean_logit"] = v["sum_logit"] / c
            v["smooth"] = v["log_sum_exp"] - v["mean_logit"]
            v["nll_part"], v["smooth_part"] = nll * (1.0 - eps), v["smooth"] * eps
            nll = v["smoothed"] = v["nll_part"] + v["smooth_part"]
        v["rows"] = nll.squeeze(1)
        v["masked"] = v["rows"] * valid
    return {group.members[role].name: [t.clone()] for role, t in v.items() if role != "masked"}
