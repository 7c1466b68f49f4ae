"""A compiled module's training step over micro-batches: ``ShardedModule.train_step`` and the pipelined forward.

``MicroBatchSteps`` is the part of ``ShardedModule`` (``module.py``) that runs a plan of several micro-batches
(``Plan.microbatches``): through its pipeline's stages (``pipeline_runner.py``: the stage programs cut from the
whole local program, ``lower.split_program``, driven by ``torch.distributed.pipelining``), or, without a
pipeline, one after another with the gradients accumulating.  Either way each micro-batch's loss is weighted
(``LossWeights``) so the step's loss and gradients are the whole batch's as one device computes them.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from autopar.capture import split_microbatches
from autopar.lower import split_program

from .pipeline_runner import LossWeights, PipelineRunner, stage_owners, train_step_only

__all__ = ["MicroBatchSteps"]


class MicroBatchSteps:
    """``train_step`` and the pipelined plans' runners, mixed into ``ShardedModule`` (the module docstring)."""

    @functools.cached_property
    def _loss_weights(self) -> LossWeights:
        """The micro-batches' loss weights of this module's graph (its denominator program cut once)."""
        return LossWeights(self._graph)

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of the whole batch: the gradients are left in the parameters' ``.grad``
        (accumulated, as ``loss.backward()`` does) and the loss is returned (detached) on every rank.

        A pipelined plan runs its micro-batches through the stages with its schedule
        (``compiled/pipeline_runner.py``); a plan of ``m`` micro-batches without a pipeline runs them one after
        another, each loss scaled by its weight (``LossWeights``) before its backward, so the gradients
        accumulate to the whole batch's; any other plan runs ``self(*args, **kwargs)`` and its backward.
        The loss is the model's output when it returns a scalar, else its ``.loss`` (a ``ModelOutput``)."""
        if self._build is not None:
            self._compile(args, kwargs)
        if self._plan.pipeline is None:
            return self._accumulated_step(args, kwargs)
        self._groups.check_alive("sharded.train_step(...)")
        pieces, weights = self._micro_batches(args, kwargs, training=True)
        with self._groups.collectives("train_step"):
            with self._reducing_once():
                self._zero.sync(self.collective_counter)
                loss = self._runner.step(pieces, weights)
            self._runner.sum_shared_grads(self._arg_params)
        self._values = None
        return loss

    @contextlib.contextmanager
    def _reducing_once(self):
        """The step's bucketed gradients reduced once, after its micro-batches (``GradBuckets.hold``)."""
        if self._buckets is None:
            yield
            return
        params = self._bucket_params
        kept = self._buckets.hold(params)
        self._holding = True
        try:
            yield
        except BaseException:
            for name, p in params.items():  # the step failed: its partial gradients are dropped
                p.grad = kept[name]
            raise
        finally:
            self._holding = False
        self._buckets.reduce_held(params, kept, self.collective_counter)

    @property
    def pipeline_busy_s(self) -> float:
        """Seconds this rank's pipeline stages have spent in forward and backward since compiling (their
        chunks' compute, without the schedule's waits: ``1 - busy / schedule`` is the rank's bubble,
        ``pipeline_schedule_s``); 0.0 for a plan without a pipeline."""
        return self._runner.busy_s if self._runner is not None else 0.0

    @property
    def pipeline_schedule_s(self) -> float:
        """Seconds this rank has spent in its pipeline schedule's steps since compiling (its stages' forward
        and backward, sends and waits; not the optimizer, nor the reductions after the schedule); 0.0 without
        a pipeline."""
        return self._runner.schedule_s if self._runner is not None else 0.0

    def _accumulated_step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """``train_step`` without a pipeline: each micro-batch's forward and its weighted backward in turn."""
        m = self._plan.microbatches
        micro = split_microbatches(args, kwargs, m) if m > 1 else [(args, kwargs)]
        weights = self._loss_weights([self._graph.call.match(a, k) for a, k in micro]) if m > 1 else None
        with self._reducing_once() if m > 1 else contextlib.nullcontext():
            return self._accumulate(micro, weights)

    def _accumulate(self, micro: list, weights: torch.Tensor | None) -> torch.Tensor:
        total = None
        for i, (a, k) in enumerate(micro):
            out = self(*a, **k)
            loss = out if torch.is_tensor(out) else getattr(out, "loss", None)
            if loss is None and isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
                loss = out[0]
            if loss is None or loss.dim() != 0:
                raise TypeError(
                    f"sharded.train_step: {self._graph.model_name} returns {type(out).__name__}, not a loss; "
                    "train_step needs a model that returns its loss (a scalar, or a ModelOutput with .loss): "
                    "pass the labels"
                )
            part = loss if weights is None else loss * weights[i].to(loss.dtype)
            part.backward()
            total = part.detach() if total is None else total + part.detach()
        return total

    def _micro_batches(self, args: tuple, kwargs: dict, *, training: bool) -> tuple[list, torch.Tensor]:
        """A pipelined step's inputs: this rank's pieces of each micro-batch's batch inputs, and the loss weights
        (``compiled/pipeline_runner.py``); sets the step's run state and argument values."""
        micro = split_microbatches(args, kwargs, self._plan.microbatches)
        calls = [self._graph.call.match(a, k, self._expected_micro) for a, k in micro]
        inputs = [n for n in self._graph.nodes if n.kind == "input"]
        pieces = [[self._local_input(n, call[n.fqn]) for n in inputs] for call in calls]
        weights = self._loss_weights(calls).to(self._groups.device, torch.float32)
        self._values = [value for _, value in self._sources]
        st = self._state
        st.counter, st.step, st.trace, st.saved, st.training = self.collective_counter, self._step, None, None, training
        self._step += 1
        return pieces, weights

    def _expected_micro(self, name: str) -> tuple[tuple[int, ...], torch.dtype, str]:
        node = self._input_nodes[name]
        m = self._plan.microbatches
        return (
            node.outputs[0].shape,
            node.outputs[0].dtype,
            f"the plan was compiled for a batch of {m} micro-batches of these shapes; pass a batch of the compiled "
            "size, or compile again with example inputs of the new shape",
        )

    def _pipeline_forward(self, args: tuple, kwargs: dict):
        """``sharded(...)`` on a pipelined plan: a forward-only pipeline over the micro-batches, the outputs in the
        model's structure on every rank, whose backward raises (naming ``train_step``)."""
        if self._eval_runner is None:
            self._eval_runner = self._pipeline_runner(train=False)
        self._groups.check_alive("sharded(...)")
        pieces, weights = self._micro_batches(args, kwargs, training=self.training)
        graph = self._graph
        metas = [
            graph.nodes[graph.outputs[leaf.index][0]].outputs[graph.outputs[leaf.index][1]]
            for leaf in self._tensor_leaves()
        ]
        loss = next((j for j, leaf in enumerate(self._tensor_leaves()) if leaf.index == graph.loss_output), None)
        with self._groups.collectives("forward"):
            self._zero.sync(self.collective_counter)
            per_micro = self._eval_runner.forward_only(pieces)
            flat = iter(self._eval_runner.gather_outputs(per_micro, weights, metas, loss))
        self._values = None
        leaves = [leaf.value if leaf.index is None else train_step_only(next(flat)) for leaf in graph.call.outputs]
        return graph.call.unflatten_outputs(leaves)

    def _tensor_leaves(self) -> list:
        return [leaf for leaf in self._graph.call.outputs if leaf.index is not None]

    def _pipeline_runner(self, *, train: bool) -> PipelineRunner:
        """This rank's stages of the pipelined plan (``compiled/pipeline_runner.py``) over the whole program cut at the
        plan's stage boundaries (``lower.split_program``): the training step's, or (``train=False``) the
        forward-only pipeline's."""
        from autopar.planner import stage_of_nodes

        pipe = self._plan.pipeline
        program = self._lower(instrument=False, defer_loss=False)
        stage_of = stage_of_nodes(self._graph, pipe)
        programs = split_program(program, self._xplan, stage_of, len(pipe.stages), self._coord, train=train)
        axis = self.mesh.axis_index(pipe.axis)
        outputs = None
        if not train:
            graph = self._graph
            outputs = tuple(
                torch.empty(graph.nodes[i].outputs[k].shape, dtype=graph.nodes[i].outputs[k].dtype, device="meta")
                for i, k in (graph.outputs[leaf.index] for leaf in self._tensor_leaves())
            )
        runner = PipelineRunner(
            programs, self._groups, axis, pipe.schedule, self._plan.microbatches, self._step_values, outputs=outputs
        )
        if train:
            self._own_stage_params(programs, axis)
        return runner

    def _own_stage_params(self, programs: list, axis: int) -> None:
        """Keep only the parameters this rank's stages read (the others' data emptied; ``_full`` gets them from
        the first stage holding them), and note which stages read each."""
        params = dict(self.named_parameters())
        sources = [n for n in self._graph.nodes if n.kind != "op"]
        self._arg_params = [params[n.fqn] if n.kind == "param" else None for n in sources]
        owners = stage_owners(programs, self.mesh.shape[axis], [n.fqn if n.kind == "param" else None for n in sources])
        here = self._coord[axis]
        for position, node in enumerate(sources):
            if node.kind == "param" and node.fqn in owners and here not in owners[node.fqn]:
                # another stage's weight: not held here (the first stage holding it has it, ``_full``)
                self._zero.drop(node.name)
                params[node.fqn].data = params[node.fqn].data.new_empty(0)
                self._sources[position] = (None, params[node.fqn])
        self._owners = {fqn: ranks[0] for fqn, ranks in owners.items()}
        self._holders, self._pipeline_axis = owners, axis

    def _step_values(self) -> list:
        return self._values
