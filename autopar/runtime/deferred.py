"""The loss's last collective, started without waiting: forward returns a pending loss, backward never waits for it.

Most plans end the forward with one collective that makes the loss whole: an
all-reduce of ``P(sum)`` partial losses, or an all-gather of per-token losses
that are summed after it.  Nothing in the training step needs that value, only
the caller who reads the loss; waiting for it in forward costs every step one
synchronization of all ranks (the slowest rank's lag plus the collective's
latency) that DDP, whose ranks each return their local loss, does not pay.

``defer_loss_tail(g, loss_node, state)`` (called by ``autopar.lower``) finds that
collective in a lowered graph: the last ``MoveStep`` before the loss whose
forward is one ``all_reduce`` or one plain ``all_gather`` (``async_collective``),
whose value reaches only the loss, through ops that are affine in it (sums,
views, scaling by values that do not depend on it: ``_affine``).  It replaces
the move and that tail by one ``DeferredLossStep``:

- forward starts the collective (``async_op=True``) and returns a ``PendingLoss``,
  a tensor subclass that holds only the loss's metadata; the first op that reads
  it (``float(loss)``, ``loss.item()``, ``loss.detach()``, printing) waits for the
  collective and runs the tail on its result (once; the value is kept);
- backward needs no value: the tail is affine in the collective's result, so its
  vector-Jacobian product is the same at every point and is taken at zeros; the
  move's gradient steps then run as before (``Move.local_grad``).  The
  ``torch.ones_like(loss)`` that ``loss.backward()`` creates does not wait.

The collective is recorded in the counter when it starts, as the move would
record it: counts and bytes are the plan's.  A pending collective nobody read is
waited for at the next forward (``wait_pending``).  When a value the tail reads
besides the collective's result requires grad, the step runs the move and the
tail synchronously instead (same result, no deferral).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import fx
from torch.autograd.function import once_differentiable
from torch.utils import _pytree as pytree

from autopar.placement import Shard
from autopar.spec import TensorMeta, local_shape

from .redistribute import Move, nesting_steps, start_collective

__all__ = ["PendingLoss", "DeferredLossStep", "defer_loss_tail", "async_collective", "wait_pending"]

aten = torch.ops.aten
# ops whose first argument is the only one depending on the collective's result, linear in it
_LINEAR_UNARY = {
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.default,
    aten.mean.dim,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.dim,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.neg.default,
    aten.clone.default,
    aten.mul.Scalar,
    aten.div.Scalar,
}
# ops that only read metadata: answered without waiting (loss.backward() creates ones_like(loss))
_METADATA_ONLY = {aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default}

_pending: dict[int, PendingLoss] = {}  # started, not yet read (wait_pending), by id


def async_collective(move: Move) -> str | None:
    """The kind of ``move``'s forward when it is one collective this module can start asynchronously, else None."""
    steps = nesting_steps(TensorMeta(move.shape, move.meta.dtype), move.src, move.dst, move.groups.mesh.shape)[0]
    if len(steps) != 1 or steps[0].kind not in ("all_reduce", "all_gather"):
        return None
    st = steps[0]
    if st.kind == "all_gather" and not (isinstance(st.src, Shard) and st.src.blocks == 1):
        return None
    return st.kind


def _start(move: Move, x: torch.Tensor, counter) -> Callable[[], torch.Tensor]:
    """Start ``move``'s one collective on ``x``; returns the function that waits and gives the moved piece."""
    groups = move.groups
    want = local_shape(move.shape, move.src, groups.mesh.shape, groups.coordinate)
    if tuple(x.shape) != tuple(want):
        raise AssertionError(f"deferred {move.src} -> {move.dst}: piece {tuple(x.shape)} is not this rank's {want}")
    (st,) = nesting_steps(TensorMeta(move.shape, x.dtype), move.src, move.dst, groups.mesh.shape)[0]
    if counter is not None:
        counter.record(st.kind, st.axis, "forward", st.bytes, st.reduce_op)
    return start_collective(x.detach(), st, move.src, move.shape, groups)


class PendingLoss(torch.Tensor):
    """The loss while its collective runs: metadata now, the value on first read (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, dtype, device, resolve: Callable[[], torch.Tensor]):
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        r._resolve, r._value = resolve, None
        return r

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def wait(self) -> torch.Tensor:
        """The loss's value (waits for the collective the first time)."""
        if self._value is None:
            _pending.pop(id(self), None)
            self._value = self._resolve()  # raising (a broken collective): raises again on the next read
            self._resolve = None
        return self._value

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.wait())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_ONLY:
            like, *rest = args
            return func(torch.empty(like.shape, dtype=like.dtype, device=like.device), *rest, **kwargs)
        unwrap = lambda a: a.wait() if isinstance(a, PendingLoss) else a  # noqa: E731
        return func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))


def wait_pending() -> None:
    """Wait for every deferred collective not read yet (start of a forward: keeps at most one step in flight)."""
    while _pending:
        loss = next(iter(_pending.values()))
        with contextlib.suppress(RuntimeError, ValueError):  # a broken collective raises where its loss is read
            loss.wait()


class _DeferredLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step: DeferredLossStep, *ext):  # noqa: D102
        ctx.step, ctx.ext, ctx.dtype = step, ext, x.dtype
        finish = _start(step.move, x, step.state.counter)
        ctx.counter = step.state.counter

        def resolve() -> torch.Tensor:
            with step.move.groups.collectives("reading the loss"), torch.no_grad():
                return step.tail(finish(), *ext)

        loss = PendingLoss(step.out_shape, step.out_dtype, x.device, resolve)
        _pending[id(loss)] = loss
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        step = ctx.step
        grad = grad.wait() if isinstance(grad, PendingLoss) else grad
        with torch.enable_grad():  # the tail is affine in its first input: its vjp is the same at zeros
            z = torch.zeros(step.moved_shape, dtype=ctx.dtype, device=grad.device, requires_grad=True)
            (gz,) = torch.autograd.grad(step.tail(z, *ctx.ext), z, grad, allow_unused=True)
        gz = torch.zeros_like(z) if gz is None else gz
        with step.move.groups.collectives("backward"):
            return (step.move.local_grad(gz, ctx.counter), None, *(None for _ in ctx.ext))


class DeferredLossStep:
    """The loss's last move and the ops after it, as one step of the lowered graph (``gm.code`` shows its name)."""

    def __init__(self, name: str, state, move: Move, tail: fx.GraphModule, out_meta: TensorMeta) -> None:
        self.__name__ = self.__qualname__ = name
        self.state, self.move, self.tail = state, move, tail
        self.out_shape, self.out_dtype = tuple(out_meta.shape), out_meta.dtype
        self.moved_shape = local_shape(move.shape, move.dst, move.groups.mesh.shape, move.groups.coordinate)

    def __call__(self, x: torch.Tensor, *ext):
        if any(isinstance(e, torch.Tensor) and e.requires_grad for e in ext) or not torch.is_grad_enabled():
            return self.tail(self.move(x, self.state.counter), *ext)  # the synchronous path, same result
        return _DeferredLoss.apply(x, self, *ext)


def _affine(node: fx.Node, dependent: set[fx.Node]) -> bool:
    """Whether ``node`` is affine in its inputs from ``dependent`` (its vjp to them does not depend on their values)."""
    deps = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node) and a in dependent]
    first = bool(node.args) and node.args[0] in dependent
    t = node.target
    if t in _LINEAR_UNARY:
        return first and len(deps) == 1
    if t is aten.mul.Tensor:
        return len(deps) == 1
    if t is aten.div.Tensor:
        return first and len(deps) == 1
    return t in (aten.add.Tensor, aten.sub.Tensor)


def defer_loss_tail(g: fx.Graph, loss: fx.Node, state, out_meta: TensorMeta) -> bool:
    """Replace the loss's last collective move and its affine tail by a ``DeferredLossStep``; whether it did."""
    ancestors, stack = set(), [loss]
    while stack:
        n = stack.pop()
        if n not in ancestors:
            ancestors.add(n)
            stack.extend(n.all_input_nodes)
    order = [n for n in g.nodes if n in ancestors]
    moves = [
        n
        for n in order
        if n.op == "call_function"
        and isinstance(getattr(n.target, "move", None), Move)
        and getattr(n.target, "shard", 0) is None
        and getattr(n.target, "counted", False)
        and async_collective(n.target.move) is not None
    ]
    if not moves:
        return False
    move_node = moves[-1]
    dependent = {move_node}
    tail = []
    for n in order[order.index(move_node) + 1 :]:
        if any(a in dependent for a in n.all_input_nodes):
            if n.op != "call_function" or not _affine(n, dependent):
                return False
            dependent.add(n)
            tail.append(n)
    output = next(n for n in g.nodes if n.op == "output")
    for n in dependent:
        if any(u is not output and u not in dependent for u in n.users) or (n is not loss and output in n.users):
            return False
    if len([a for a in pytree.tree_leaves(output.args) if a is loss]) != 1:
        return False
    ext = []
    for n in tail:
        ext.extend(a for a in n.all_input_nodes if a not in dependent and a not in ext)
    tg = fx.Graph()
    env = {move_node: tg.placeholder("moved")}
    env.update({a: tg.placeholder(f"ext{i}") for i, a in enumerate(ext)})
    for n in tail:
        env[n] = tg.node_copy(n, lambda a: env[a])
    tg.output(env[loss])
    step = DeferredLossStep(
        f"deferred_{move_node.name}", state, move_node.target.move, fx.GraphModule({}, tg), out_meta
    )
    with g.inserting_before(output):
        new = g.call_function(step, (move_node.args[0], *ext))
    output.replace_input_with(loss, new)
    for n in reversed([move_node, *tail]):
        g.erase_node(n)
    return True
