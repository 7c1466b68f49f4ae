"""Checkpoints of ``autopar run``: ``--save DIR`` writes ``DIR/step-<n>``; ``--resume PATH`` continues from one.

    autopar run gpt2-tiny --mesh 2x2 --steps 4 --save ckpt --save-every 2     # ckpt/step-2, ckpt/step-4
    autopar run gpt2-tiny --mesh 4 --steps 6 --resume ckpt --check            # from step-4, on another mesh

A checkpoint is ``autopar.save``'s (model, AdamW state, and ``train = {"step": n}``,
the number of steps done), written after step ``n`` when ``n`` is a multiple of
``--save-every`` and after the last step; each is a directory named ``step-<n>``
as torchtitan names them.  ``--resume`` takes one checkpoint, or a directory of
``step-<n>`` checkpoints, of which it takes the latest complete one (an interrupted
save, ``step-<n>.partial``, never counts).  The run then trains from step ``n`` to
``--steps``; any mesh, plan and world size load it (``autopar.load`` reshards).
With ``--check`` the one-device reference trains every step from 0, so the check
holds the resumed run to an uninterrupted one; a checkpoint records how it was
trained (``train.run``: model, seed, batch, sequence, learning rate, dropout off
or on), and ``check_replayable`` refuses a ``--check`` the reference cannot replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from autopar.checkpoint import CheckpointError, load, load_extra, resolve_checkpoint, save

__all__ = ["check_replayable", "resolve_checkpoint", "saved_step", "resume", "save_if_due"]


def saved_step(path: str | Path) -> int:
    """The number of steps the run that saved checkpoint ``path`` had done."""
    return int(load_extra(path, {"train": {"step": -1}})["train"]["step"])


def resume(config: Any, module: nn.Module, optimizer) -> int:
    """Load ``config.resume_dir``'s checkpoint into ``module`` and ``optimizer``; return its step (0 without one).

    Collective on a ``ShardedModule``: every rank calls it.
    """
    if not config.resume_dir:
        return 0
    train = {"step": -1}
    load(resolve_checkpoint(config.resume_dir), module, optimizer, extra={"train": train})
    return int(train["step"])


def save_if_due(config: Any, module: nn.Module, optimizer, steps_done: int) -> str | None:
    """Save after ``steps_done`` steps when ``--save-every`` or the last step asks; return the path written."""
    if not config.save_dir:
        return None
    every = config.save_every
    if steps_done != config.steps and not (every and steps_done % every == 0):
        return None
    path = Path(config.save_dir) / f"step-{steps_done}"
    save(path, module, optimizer, extra={"train": {"step": steps_done, "run": _trained_as(config)}})
    return str(path)


_TRAINED_AS = ("model", "seed", "batch", "seq", "lr", "check")  # what a one-device check replays


def _trained_as(config: Any) -> dict[str, Any]:
    return {k: getattr(config, k) for k in _TRAINED_AS}


def check_replayable(config: Any, path: str | Path) -> None:
    """Raise unless the run that saved ``path`` is the one ``config``'s one-device check replays.

    ``--check`` compares with one device trained from step 0 with dropout off on the
    same model, weights, batch and learning rate: a checkpoint trained otherwise
    (without ``--check``, dropout on) cannot match it, whatever the sharding did.
    """
    template = {"train": {"run": {k: type(getattr(config, k))() for k in _TRAINED_AS}}}
    try:
        saved = load_extra(path, template)["train"]["run"]
    except CheckpointError as e:
        raise CheckpointError(
            f"--resume {path} with --check: the checkpoint does not say how it was trained ({e}); --check needs "
            "a checkpoint written by autopar run --save"
        ) from None
    differ = [f"{k} {saved[k]!r} (now {getattr(config, k)!r})" for k in _TRAINED_AS if saved[k] != getattr(config, k)]
    if differ:
        raise ValueError(
            f"--resume {path} with --check: the checkpoint was trained with {', '.join(differ)}, so no one-device "
            "run of this command replays it; resume with the settings it was saved with"
            + (", and save with --check (dropout off)" if not saved["check"] else "")
        )
