"""The compiled module, the last stage: ``autopar.compile`` turns a plan into an ``nn.Module`` on each rank.

``compile`` plans (or loads a plan), lowers it, loads this rank's pieces of the
weights and returns a ``ShardedModule``: called like the model, trained with any
optimizer, its gradients reduced and its ZeRO state gathered by the runtime.
"""

from __future__ import annotations

from .build import compile, default_profile, training_precision
from .module import LocalState, NotCompiledError, ShardedModule

__all__ = ["LocalState", "NotCompiledError", "ShardedModule", "compile", "default_profile", "training_precision"]
