"""``autopar.save`` / ``autopar.load``: a training job's state as a standard torch distributed checkpoint.

    autopar.save("ckpt/step-100", sharded, opt, extra={"scheduler": sched, "train": {"step": 100}})
    autopar.load("ckpt/step-100", sharded2, opt2, extra={"scheduler": sched2, "train": train})

The checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP)
with its ``FileSystemWriter``: DCP's own tools read it
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``).  Its top-level
keys are ``model`` (``state.ModelState``), ``optimizer`` (``state.OptimizerState``,
when one is given) and the caller's ``extra`` entries (``Stateful`` objects such as
LR schedulers, or plain values).  Each rank writes only its own pieces; replicated
pieces are written once (DCP deduplicates equal boxes).  Loading reads, on each
rank, the parts of the saved chunks its own pieces cover, so any plan, mesh or
world size (or one process with a plain ``nn.Module``) loads any checkpoint.

Atomicity: ranks write into ``<path>.partial``; DCP writes the ``.metadata`` file
last, after every rank's data, and only then does rank 0 move the directory to
``<path>`` (replacing an older checkpoint there: renamed aside, then deleted).  A
save killed on any rank leaves ``<path>`` as it was and ``<path>.partial``
without metadata, which ``load`` rejects by name.  ``load`` (and ``export_safetensors``) also take the
directory ``autopar run --save`` writes, holding ``step-<n>`` checkpoints: the latest complete one
(``resolve_checkpoint``).  The directory must be on a
filesystem every rank sees (one machine, or a shared mount across nodes).
Beside DCP's files rank 0 writes ``autopar.json`` (``INFO_FILE``): the model class,
mesh, world size and plan family that saved it (for messages) and its tied aliases,
``"tied": {alias FQN: the FQN its tensor is stored under}`` (for ``export.py``).

Checks before any tensor is read (every rank, the same verdict): the checkpoint is
complete; every model entry (and, with an optimizer, every optimizer entry) the
target holds is in it with the same shape; and nothing in its ``model`` part is
left unread.  The error names the first mismatched key with both shapes, and
lists missing and unexpected keys; ``strict=False`` loads what matches and warns
about the rest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from autopar.compiled import ShardedModule

from .state import ModelState, OptimizerState, init_optimizer_state, tied_aliases

__all__ = [
    "save",
    "load",
    "load_extra",
    "CheckpointError",
    "INFO_FILE",
    "model_mismatch",
    "read_metadata",
    "resolve_checkpoint",
    "saved_info",
    "one_process_is_meant",
]

log = logging.getLogger(__name__)

# what saved the checkpoint (mesh, world size, model class: for messages) and its tied aliases (for export)
INFO_FILE = "autopar.json"
_RESERVED = ("model", "optimizer")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the given module: incomplete, another model, other shapes."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def one_process_is_meant():
    """Without a process group DCP warns that it assumes one process: here that is the intent, not a guess."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _state(module: nn.Module, optimizer, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected the module to checkpoint (a ShardedModule or an nn.Module), got {type(module)}")
    extra = dict(extra or {})
    clash = [k for k in extra if k in _RESERVED]
    if clash:
        raise ValueError(f"extra keys {clash} are reserved for the model and optimizer; rename them")
    state: dict[str, Any] = {"model": ModelState(module)}
    if optimizer is not None:
        state["optimizer"] = OptimizerState(module, optimizer)
    state.update(extra)
    return state


def save(
    path: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    storage_writer: dcp.StorageWriter | None = None,
) -> Path:
    """Write ``module`` (and ``optimizer``, and ``extra``) to the checkpoint directory ``path``; return it.

    Collective: every rank of the default process group calls it (none without a
    process group).  ``storage_writer`` replaces DCP's ``FileSystemWriter`` on the
    staging directory ``<path>.partial`` (tests use it to fail a write).
    """
    path = Path(path)
    staging = path.with_name(path.name + ".partial")
    state = _state(module, optimizer, extra)
    if _rank() == 0:
        if staging.exists():
            shutil.rmtree(staging)  # a save that was interrupted: never a checkpoint
        staging.mkdir(parents=True)
    _barrier()
    with one_process_is_meant():
        dcp.save(state, storage_writer=storage_writer or dcp.FileSystemWriter(staging), no_dist=not _distributed())
    if _rank() == 0:
        (staging / INFO_FILE).write_text(json.dumps(_info(module), indent=1, sort_keys=True) + "\n")
        _replace(staging, path)
    _barrier()
    log.info("saved checkpoint %s", path)
    return path


def _info(module: nn.Module) -> dict[str, Any]:
    info: dict[str, Any] = {
        "format": 1,
        "torch": torch.__version__,
        "world_size": dist.get_world_size() if _distributed() else 1,
    }
    if isinstance(module, ShardedModule):
        plan = module.plan
        info.update(mesh=list(module.mesh.shape), model=plan.model, family=plan.family)
    else:
        info.update(mesh=[], model=type(module).__name__, family="one process")
    info["tied"] = tied_aliases(module)  # alias FQN -> the name its tensor is stored under (export writes both)
    return info


def _replace(staging: Path, path: Path) -> None:
    """Move the finished ``staging`` directory to ``path``; an old checkpoint there is renamed aside first."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    if old.exists():
        shutil.rmtree(old)


def load(
    path: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> None:
    """Load the checkpoint at ``path`` into ``module`` (and ``optimizer`` and ``extra``), in place.

    ``module`` is a ``ShardedModule`` of any plan and mesh (collective: every rank
    calls it) or a plain ``nn.Module`` in one process.  ``extra`` holds the same
    kinds of entries ``save`` took: ``Stateful`` objects get ``load_state_dict``,
    dicts are filled in place.  Raises ``CheckpointError`` (module docstring).
    """
    path = resolve_checkpoint(path)
    metadata = read_metadata(path)
    if optimizer is not None:
        init_optimizer_state(optimizer)  # the template DCP loads into is the optimizer's own state
    state = _state(module, optimizer, extra)
    templates = {k: state[k].state_dict() for k in ("model", "optimizer") if k in state}
    problems = _check(metadata, templates, path, strict)
    if problems and strict:
        raise CheckpointError(problems)
    if problems:
        log.warning("%s", problems)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    with one_process_is_meant():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=planner, no_dist=not _distributed())
    log.info("loaded checkpoint %s", path)


def load_extra(path: str | os.PathLike, extra: Mapping[str, Any]) -> Mapping[str, Any]:
    """Fill ``extra`` (plain values or ``Stateful`` objects, as ``save`` took them) from the checkpoint, in place.

    Reads nothing else, in this process alone (no collective): for what a launcher
    needs to know before building the model, such as the step a job saved at.
    Raises ``CheckpointError`` when the checkpoint is incomplete or lacks a key.
    """
    path = resolve_checkpoint(path)
    metadata = read_metadata(path)
    want: dict[str, Any] = {}
    for k, v in extra.items():
        _flat(k, v.state_dict() if hasattr(v, "state_dict") else v, want)
    missing = sorted(k for k in want if k not in metadata.state_dict_metadata)
    if missing:
        raise CheckpointError(
            f"{path}{_saved_by(path)} holds no {_few(missing)}: it was not saved with these extra entries; "
            "pass the extra= keys the saving job used"
        )
    with one_process_is_meant():
        dcp.load(dict(extra), storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return extra


_STEP_DIR = re.compile(r"^step-(\d+)$")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names: ``path`` itself when it is one, or the latest complete ``step-<n>`` in it
    (the directory ``autopar run --save`` writes); ``CheckpointError`` saying what ``path`` holds otherwise."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    steps = sorted(
        (int(m.group(1)), child)
        for child in (path.iterdir() if path.is_dir() else ())
        if (m := _STEP_DIR.match(child.name)) and (child / ".metadata").is_file()
    )
    if steps:
        log.info("%s holds %d checkpoints; taking the latest, %s", path, len(steps), steps[-1][1].name)
        return steps[-1][1]
    raise CheckpointError(_not_a_checkpoint(path))


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The DCP metadata of the complete checkpoint at ``path``; ``CheckpointError`` naming what is wrong otherwise."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(_not_a_checkpoint(path))
    return dcp.FileSystemReader(path).read_metadata()


def _not_a_checkpoint(path: Path) -> str:
    """Why ``path`` is no loadable checkpoint: missing, an interrupted save (data files but no ``.metadata``),
    a ``--save`` directory whose step folders are all incomplete, or a directory with no checkpoint at all."""
    fix = "name a directory autopar.save wrote, or the --save directory of autopar run (its latest step-<n>)"
    if not path.is_dir():
        partial = path.with_name(path.name + ".partial")
        hint = f"; {partial} holds an unfinished save (interrupted before it completed)" if partial.is_dir() else ""
        return f"no checkpoint at {path}: not a directory{hint}; {fix}"
    children = sorted(child.name for child in path.iterdir())
    if any(name.endswith(".distcp") for name in children):
        staged = " (autopar.save writes into <path>.partial and renames it when complete)"
        return (
            f"{path} is not a complete checkpoint: it holds checkpoint data but no .metadata, which "
            "torch.distributed.checkpoint writes last, once every rank's data is on disk, so the save that wrote "
            f"it was interrupted{staged if path.name.endswith('.partial') else ''}; use the previous checkpoint instead"
        )
    steps = [name for name in children if _STEP_DIR.match(name.removesuffix(".partial"))]
    if steps:
        return (
            f"{path} holds step folders {', '.join(steps)} but none is a complete checkpoint (no .metadata: their "
            f"saves were interrupted); {fix}"
        )
    shown = ", ".join(children[:5]) + (f" and {len(children) - 5} more" if len(children) > 5 else "")
    return f"{path} is not a checkpoint: it holds no .metadata and no checkpoint data ({shown or 'it is empty'}); {fix}"


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """DCP's flattened keys of a template: nested mappings joined with dots (lists of mappings by index)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    elif isinstance(value, list) and any(isinstance(v, Mapping) for v in value):
        for i, v in enumerate(value):
            _flat(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = value


def _check(metadata: Metadata, templates: dict[str, Any], path: Path, strict: bool) -> str:
    """What stops ``templates`` loading from ``metadata``, as one message ('' when nothing)."""
    saved = metadata.state_dict_metadata
    lines: list[str] = []
    for part, template in templates.items():
        want: dict[str, Any] = {}
        _flat(part, template, want)
        want = {k: v for k, v in want.items() if torch.is_tensor(v)}
        have = {k: md for k, md in saved.items() if k.startswith(part + ".") and isinstance(md, TensorStorageMetadata)}
        if part == "optimizer" and not have and want:
            lines.append(
                "- the checkpoint holds no optimizer state: it was saved without an optimizer; load with "
                "optimizer=None and start the optimizer afresh"
            )
            continue
        shape = [
            (k, tuple(have[k].size), tuple(v.shape))
            for k, v in want.items()
            if k in have and tuple(have[k].size) != tuple(v.shape)
        ]
        if shape:
            k, s, t = shape[0]
            more = f" (and {len(shape) - 1} more)" if len(shape) > 1 else ""
            lines.append(f"- {k}: the checkpoint holds shape {s}, this {part} {t}{more}")
        missing = sorted(k for k in want if k not in have)
        if missing:
            lines.append(f"- {len(missing)} key(s) of this {part} are not in the checkpoint: {_few(missing)}")
        unexpected = sorted(k for k in have if k not in want) if part == "model" else []
        if unexpected:
            lines.append(
                f"- {len(unexpected)} key(s) in the checkpoint's model are not in this module: {_few(unexpected)}"
            )
    if not lines:
        return ""
    fix = "load into the model (and parameter shapes) that saved it" + (
        ", or pass strict=False to load what matches" if strict else ""
    )
    return f"cannot load {path}{_saved_by(path)}:\n" + "\n".join(lines) + f"\nFix: {fix}"


def model_mismatch(path: str | os.PathLike, module: nn.Module) -> str:
    """Why the checkpoint at ``path`` does not hold ``module``'s model (its first problem, one line; '' when it
    does): for a launcher to refuse a resume in its own words before any rank starts."""
    path = resolve_checkpoint(path)
    problems = _check(read_metadata(path), {"model": ModelState(module).state_dict()}, path, strict=False)
    if not problems:
        return ""
    first = problems.splitlines()[1].removeprefix("- ")
    return f"{path}{_saved_by(path)} does not hold this model: {first}"


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f", ... ({len(keys) - 5} more)" if len(keys) > 5 else "")


def saved_info(path: str | os.PathLike) -> dict[str, Any]:
    """What ``autopar.json`` of the checkpoint at ``path`` records (the module docstring); {} without one."""
    try:
        info = json.loads((Path(path) / INFO_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _saved_by(path: Path) -> str:
    info = saved_info(path)
    if not info:
        return ""
    mesh = "x".join(map(str, info.get("mesh") or [])) or "one process"
    return f" (saved from {info.get('model')} on mesh {mesh})"
