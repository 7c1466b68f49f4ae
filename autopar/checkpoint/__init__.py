"""Distributed checkpoints: save a compiled model's shards and load them under any other plan.

``save`` / ``load`` (``saving.py``) write and read a standard
``torch.distributed.checkpoint`` directory; ``ModelState`` / ``OptimizerState``
(``state.py``) are the DCP ``Stateful`` state dicts they use, for a
``ShardedModule`` or a plain ``nn.Module``; ``PieceTensor`` (``piece.py``) is how
one rank's piece of a sharded tensor is described to DCP (the boxes it holds, by
global offsets), so loading under another layout is DCP's own reshard.
"""

from __future__ import annotations

from autopar.layout import Box, piece_boxes

from .piece import PieceTensor
from .saving import INFO_FILE, CheckpointError, load, load_extra, save
from .state import ModelState, OptimizerState, init_optimizer_state, model_pieces, tied_aliases

__all__ = [
    "Box",
    "CheckpointError",
    "INFO_FILE",
    "ModelState",
    "OptimizerState",
    "PieceTensor",
    "init_optimizer_state",
    "load",
    "load_extra",
    "model_pieces",
    "piece_boxes",
    "save",
    "tied_aliases",
]
