"""Distributed checkpoints: save a compiled model's shards and load them under any other plan.

``save`` / ``load`` (``saving.py``) write and read a standard
``torch.distributed.checkpoint`` directory; ``ModelState`` / ``OptimizerState``
(``state.py``) are the DCP ``Stateful`` state dicts they use, for a
``ShardedModule`` or a plain ``nn.Module``; ``PieceTensor`` (``piece.py``) is how
one rank's piece of a sharded tensor is described to DCP (the boxes it holds, by
global offsets), so loading under another layout is DCP's own reshard;
``export_safetensors`` (``export.py``) writes a checkpoint's model as Hugging Face
safetensors files for serving, one tensor in memory at a time.
"""

from __future__ import annotations

from autopar.pieces import Box, piece_boxes

from .export_command import add_export_parser, cmd_export
from .hf_export import DEFAULT_MAX_SHARD_BYTES, ExportedFile, ExportError, SafetensorsExport, export_safetensors
from .piece import PieceTensor
from .saving import (
    INFO_FILE,
    CheckpointError,
    load,
    load_extra,
    model_mismatch,
    read_metadata,
    resolve_checkpoint,
    save,
    saved_info,
)
from .state import ModelState, OptimizerState, init_optimizer_state, model_pieces, tied_aliases

__all__ = [
    "add_export_parser",
    "cmd_export",
    "Box",
    "CheckpointError",
    "DEFAULT_MAX_SHARD_BYTES",
    "ExportError",
    "ExportedFile",
    "INFO_FILE",
    "ModelState",
    "OptimizerState",
    "PieceTensor",
    "SafetensorsExport",
    "export_safetensors",
    "init_optimizer_state",
    "load",
    "load_extra",
    "model_pieces",
    "piece_boxes",
    "model_mismatch",
    "read_metadata",
    "resolve_checkpoint",
    "save",
    "saved_info",
    "tied_aliases",
]
