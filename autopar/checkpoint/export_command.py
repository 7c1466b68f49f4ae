"""The ``autopar export`` subcommand (``autopar.cli`` adds it): a checkpoint's model as safetensors for serving.

    autopar export CHECKPOINT_DIR -o OUT_DIR [--max-shard-size 5GiB] [--dtype fp32|bf16|fp16] [--include-tied]

It runs ``export.export_safetensors`` into a new or empty ``OUT_DIR`` and prints the
files, tensors and bytes it wrote.  Bad input exits with code 2 and one
``autopar: error:`` line naming the flag and the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from autopar.units import format_bytes

from .hf_export import ExportError, export_safetensors
from .saving import CheckpointError

__all__ = ["add_export_parser", "cmd_export"]

_EXPORT_DTYPES = ("fp32", "bf16", "fp16")
# export_safetensors' arguments in the CLI's words
_EXPORT_FLAGS = {
    "checkpoint_dir": "CHECKPOINT_DIR",
    "out_dir": "-o",
    "max_shard_bytes": "--max-shard-size",
    "dtype": "--dtype",
    "include_tied": "--include-tied",
}


def add_export_parser(sub, *, bytes_arg) -> None:
    """The ``export`` subparser, on ``sub`` (argparse subparsers), with the main CLI's byte-size type."""
    e = sub.add_parser("export", help="write a checkpoint's model as Hugging Face safetensors for serving")
    e.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint directory autopar.save wrote")
    e.add_argument(
        "-o", "--output", required=True, metavar="OUT_DIR", help="where to write the weights: a new or empty directory"
    )
    e.add_argument(
        "--max-shard-size",
        type=bytes_arg,
        default="5GiB",
        metavar="SIZE",
        help="largest file before the weights are split into shards and an index: bytes or 5GiB, 500MB (default 5GiB)",
    )
    e.add_argument(
        "--dtype",
        default=None,
        choices=_EXPORT_DTYPES,
        help="cast floating-point tensors to fp32, bf16 or fp16 (default: keep the checkpoint's dtypes)",
    )
    e.add_argument(
        "--include-tied",
        action="store_true",
        help="also write tied aliases (GPT-2's lm_head.weight) as copies; by default from_pretrained ties them",
    )


def _check_empty_dir(path: Path, flag: str) -> None:
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: is a file; name a new or empty directory")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():  # every -o alike: the output is created, the folder it goes in must exist
        raise ValueError(f"{flag} {str(path)!r}: folder {str(folder)!r} does not exist; create it or pass another path")
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if held:
        few = ", ".join(held[:3]) + (f", ... ({len(held) - 3} more)" if len(held) > 3 else "")
        raise ValueError(
            f"{flag} {path}: exists and is not empty (holds {few}); name a new or empty directory, or empty this one"
        )


def cmd_export(args) -> int:
    """Run ``autopar export``; exit code 0, or 2 after one ``autopar: error:`` line."""

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    out = Path(args.output)
    try:
        _check_empty_dir(out, "-o")
        result = export_safetensors(
            args.checkpoint,
            out,
            max_shard_bytes=args.max_shard_size,
            dtype=dtype,
            include_tied=args.include_tied,
        )
    except ExportError as e:  # the API names its arguments; here they are flags
        print(f"autopar: error: {_EXPORT_FLAGS.get(e.argument, e.argument)}: {e.problem}; {e.fix}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"autopar: error: CHECKPOINT_DIR: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # what was written is removed
        print(
            f"autopar: error: -o {out}: the export failed ({e}); check that CHECKPOINT_DIR is readable and that "
            "OUT_DIR is writable with room for the weights",
            file=sys.stderr,
        )
        return 2

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    for f in result.files:
        print(f"wrote {f.path}: {count(f.tensors, 'tensor')}, {format_bytes(f.tensor_bytes)} ({f.tensor_bytes} bytes)")
    if result.index is not None:
        print(f"wrote {result.index}: weight_map of {count(result.tensors, 'tensor')}, total_size {result.total_bytes}")
    print(
        f"exported {count(result.tensors, 'tensor')}, {format_bytes(result.total_bytes)} ({result.total_bytes} bytes), "
        f"in {count(len(result.files), 'file')} from {args.checkpoint} to {out}"
    )
    return 0
