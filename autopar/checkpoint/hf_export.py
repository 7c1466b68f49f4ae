"""Export a checkpoint's model for serving: Hugging Face safetensors files, one tensor in memory at a time.

    from autopar.checkpoint import export_safetensors

    export_safetensors("ckpt/step-100", "serve/gpt2", dtype=torch.bfloat16)
    # serve/gpt2/model.safetensors, or model-00001-of-0000N.safetensors ... and model.safetensors.index.json

**Layout.** What transformers' ``save_pretrained`` writes and ``from_pretrained``
reads: one ``model.safetensors`` when every tensor fits in ``max_shard_bytes``,
else shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json`` = ``{"metadata": {"total_size": <bytes of every
tensor>}, "weight_map": {name: file}}``.  Shards fill in checkpoint order, a new
one when the next tensor would pass the limit, and a tensor larger than the limit
goes alone into its own, as ``huggingface_hub``'s
``split_state_dict_into_shards_factory`` does.  Names are the model's original
FQNs (the checkpoint's ``model.<fqn>`` keys without ``model.``); the rest of the
checkpoint (optimizer, extras) is not exported.  Tied aliases (GPT-2's
``lm_head.weight``) are stored once in the checkpoint and left out here as
``save_pretrained`` leaves them out: ``from_pretrained`` ties them again.
``include_tied=True`` writes each alias too, a copy of its tensor, from the
``"tied"`` map ``autopar.save`` records in ``autopar.json``.  ``dtype`` casts
floating-point tensors only; integer and bool buffers keep their dtype, as with
``from_pretrained(dtype=...)``.

**Reading, one tensor at a time.** torch 2.13 has three ways out of a DCP
directory, none of which fits: ``format_utils.dcp_to_torch_save`` loads the whole
state dict into memory first; ``_consolidate_hf_safetensors`` streams, but only
from shards DCP wrote as safetensors through ``hf_storage.HuggingFaceStorageWriter``
(the chunks' offsets are in those files' own metadata), not from the ``.distcp``
files of the ``FileSystemWriter`` that ``autopar.save`` uses; and
``HuggingFaceStorageReader`` reads only such safetensors checkpoints too.  So
each tensor is loaded alone with DCP's public
``dcp.load({key: torch.empty(shape, dtype)}, no_dist=True)``: DCP assembles it
from the chunks every rank wrote, whatever mesh and plan saved them, and copies
each chunk into the template (``copy_``, which casts to ``dtype`` on the way).
The peak is therefore the output tensor plus the chunks of it in flight: DCP's
reader drops a chunk only when the next one has been read, so two at most, and
being disjoint parts of the one tensor they are no larger than it.  So no more
than twice the largest tensor (in its saved dtype), however large the model
(``tests/test_checkpoint_export.py`` measures it).  ``_Reader`` parses
``.metadata`` once rather than once per tensor.

**Writing, streamed.** The safetensors format
(https://github.com/huggingface/safetensors#format): an unsigned 64-bit
little-endian header size N; N bytes of UTF-8 JSON,
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
"__metadata__": {"format": "pt"}}`` with offsets counted from the first byte after
the header, padded with spaces so the data starts at a multiple of 8; then every
tensor's bytes, row-major and little-endian, back to back, covering the data part
exactly.  Every shape and dtype is in DCP's metadata, so the header is written
first and each tensor's bytes follow as it is loaded.  Within a file tensors go
by element size, largest first (otherwise in checkpoint order), so each starts at
a multiple of its element size, as the ``safetensors`` writer orders them for
readers that map the file.  Each file is written as ``<name>.partial`` and renamed
when whole, the index last; a failed export removes what it wrote.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .saving import INFO_FILE, CheckpointError, one_process_is_meant, read_metadata, resolve_checkpoint, saved_info

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "ExportError",
    "ExportedFile",
    "SafetensorsExport",
    "export_safetensors",
]

log = logging.getLogger(__name__)

# 5 GiB: about transformers 4's save_pretrained default ("5GB", 5e9 bytes; transformers 5 writes "50GB" shards)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
SINGLE_FILE = "model.safetensors"  # transformers.utils.SAFE_WEIGHTS_NAME
INDEX_FILE = "model.safetensors.index.json"  # transformers.utils.SAFE_WEIGHTS_INDEX_NAME
_SHARD = "model-{index:05d}-of-{count:05d}.safetensors"
_PREFIX = "model."  # the checkpoint's top-level key of the model's state (state.ModelState)

# torch dtype -> safetensors dtype name, the names the safetensors spec lists
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}


class ExportError(ValueError):
    """Bad input to ``export_safetensors``: ``argument`` names the parameter, ``problem`` says what, ``fix`` what to do.

    The parts are kept apart so a front end (the CLI) can name its own flag for ``argument``.
    """

    def __init__(self, argument: str, problem: str, fix: str) -> None:
        super().__init__(f"{argument}: {problem}; {fix}")
        self.argument = argument
        self.problem = problem
        self.fix = fix

    def __reduce__(self):
        return type(self), (self.argument, self.problem, self.fix)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor to write: its name in the output, the checkpoint key it is read from, and what it is written as."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ExportedFile:
    """One safetensors file written: its path, how many tensors it holds and their bytes (header not counted)."""

    path: Path
    tensors: int
    tensor_bytes: int


@dataclass(frozen=True, slots=True)
class SafetensorsExport:
    """What ``export_safetensors`` wrote: the files in order, the index (None for one file), and the totals."""

    files: tuple[ExportedFile, ...]
    index: Path | None
    tensors: int
    total_bytes: int


class _Reader(dcp.FileSystemReader):
    """DCP's file reader with the checkpoint's metadata parsed once, not once per ``dcp.load``."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def export_safetensors(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    include_tied: bool = False,
) -> SafetensorsExport:
    """Write the model of the checkpoint at ``checkpoint_dir`` into ``out_dir`` as Hugging Face safetensors.

    One process, no process group; holds one tensor (and chunks of it being read)
    in memory at a time (module docstring).  ``out_dir`` is created when missing (its parent must exist, as
    for every ``-o`` of the CLI); files beside the weights there (``config.json``, a tokenizer) are kept, but earlier
    weight files are refused, since stale shards would mix with the new ones.
    Raises ``CheckpointError`` for a missing or incomplete checkpoint, or one with
    no model tensors, and ``ExportError`` for the other arguments.
    """
    if sys.byteorder != "little":  # the tensors' bytes are written as they lie in memory
        raise ExportError(
            "out_dir", "safetensors stores little-endian data, this machine is big-endian", "export elsewhere"
        )
    checkpoint_dir, out_dir = resolve_checkpoint(checkpoint_dir), Path(out_dir)
    _check_arguments(max_shard_bytes, dtype)
    metadata = read_metadata(checkpoint_dir)
    entries = _entries(metadata, checkpoint_dir, dtype, include_tied)
    _prepare_out_dir(out_dir, checkpoint_dir)
    shards = _shards(entries, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [_SHARD.format(index=i + 1, count=len(shards)) for i in range(len(shards))]
    )
    reader = _Reader(checkpoint_dir, metadata)
    written: list[Path] = []
    try:
        files = []
        for name, shard in zip(names, shards, strict=True):
            files.append(_write_file(out_dir / name, shard, reader, written))
        index = None
        if len(shards) > 1:
            index = out_dir / INDEX_FILE
            body = {
                "metadata": {"total_size": sum(e.nbytes for e in entries)},
                "weight_map": {e.name: name for name, shard in zip(names, shards, strict=True) for e in shard},
            }
            _replace_when_written(
                index, written, lambda f: f.write(json.dumps(body, indent=2, sort_keys=True).encode())
            )
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    result = SafetensorsExport(tuple(files), index, len(entries), sum(e.nbytes for e in entries))
    log.info(
        "exported %s to %s: %d tensors, %d bytes, %d file(s)",
        checkpoint_dir,
        out_dir,
        result.tensors,
        result.total_bytes,
        len(files),
    )
    return result


def _check_arguments(max_shard_bytes: int, dtype: torch.dtype | None) -> None:
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ExportError(
            "max_shard_bytes",
            f"expected a whole number of bytes >= 1, got {max_shard_bytes!r}",
            f"pass e.g. {DEFAULT_MAX_SHARD_BYTES} (5 GiB, the default)",
        )
    if dtype is not None and (
        not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in _DTYPES
    ):
        floats = ", ".join(str(d) for d in _DTYPES if d.is_floating_point)
        raise ExportError(
            "dtype", f"expected None (keep) or a floating-point dtype, got {dtype!r}", f"pass one of {floats}"
        )


def _entries(metadata: Metadata, checkpoint_dir: Path, dtype: torch.dtype | None, include_tied: bool) -> list[_Entry]:
    """The tensors to write, in checkpoint order, each alias (with ``include_tied``) right after its tensor."""
    entries: list[_Entry] = []
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(_PREFIX):
            continue
        if not isinstance(md, TensorStorageMetadata):  # autopar's ModelState holds tensors only
            log.warning("export: %s in %s is not a tensor; not exported", key, checkpoint_dir)
            continue
        saved = md.properties.dtype
        out = dtype if dtype is not None and saved.is_floating_point else saved
        if out not in _DTYPES:
            raise CheckpointError(
                f"{checkpoint_dir}: {key} has dtype {saved}, which safetensors cannot store; "
                f"convert it before saving (safetensors stores {', '.join(str(d) for d in _DTYPES)})"
            )
        entries.append(_Entry(key[len(_PREFIX) :], key, tuple(md.size), out))
    if not entries:
        raise CheckpointError(
            f"{checkpoint_dir} holds no model tensors (no '{_PREFIX}*' entries): it was not written by autopar.save "
            "with a model; name a checkpoint autopar.save wrote"
        )
    if include_tied:
        entries = _with_aliases(entries, checkpoint_dir)
    return entries


def _with_aliases(entries: list[_Entry], checkpoint_dir: Path) -> list[_Entry]:
    tied = saved_info(checkpoint_dir).get("tied")
    if not isinstance(tied, dict):
        raise ExportError(
            "include_tied",
            f"{checkpoint_dir / INFO_FILE} records no tied aliases (the checkpoint was saved before autopar recorded "
            "them)",
            "export without the aliases (from_pretrained ties them again on load), or load the checkpoint and save "
            "it again",
        )
    by_name = {e.name: e for e in entries}
    unknown = sorted(c for c in tied.values() if c not in by_name)
    if unknown:
        raise CheckpointError(
            f"{checkpoint_dir / INFO_FILE} ties aliases to {unknown}, which the checkpoint does not hold: the file "
            "belongs to another checkpoint; export without tied aliases"
        )
    aliases: dict[str, list[str]] = {}
    for alias, canon in tied.items():
        aliases.setdefault(canon, []).append(alias)
    out = []
    for e in entries:
        out.append(e)
        out += [_Entry(alias, e.key, e.shape, e.dtype) for alias in aliases.get(e.name, ())]
    return out


def _prepare_out_dir(out_dir: Path, checkpoint_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError("out_dir", f"{out_dir} is a file", "name a directory (created when missing)")
    if out_dir.is_dir() and out_dir.resolve() == checkpoint_dir.resolve():
        raise ExportError("out_dir", f"{out_dir} is the checkpoint itself", "name another directory")
    if not out_dir.parent.is_dir():
        raise ExportError("out_dir", f"folder {out_dir.parent} does not exist", "create it or pass another path")
    out_dir.mkdir(exist_ok=True)
    stale = sorted(
        p.name
        for p in out_dir.iterdir()
        if p.name == INDEX_FILE or (p.name.startswith("model") and ".safetensors" in p.name)
    )
    if stale:
        raise ExportError(
            "out_dir",
            f"{out_dir} already holds weights ({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}), which would "
            "mix with the exported ones",
            "remove them or name another directory",
        )


def _shards(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    """Entries split into files as huggingface_hub splits a state dict (module docstring)."""
    shards: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for e in entries:
        if e.nbytes > max_shard_bytes:
            shards.append([e])
            continue
        if current and size + e.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        shards.append(current)
    return shards


def _header(entries: list[_Entry]) -> tuple[bytes, list[tuple[_Entry, int]]]:
    """The file's first bytes (size and JSON header) and each entry with its data offset, in the order data goes."""
    ordered = sorted(entries, key=lambda e: -e.dtype.itemsize)  # stable: checkpoint order within an element size
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    starts = []
    begin = 0
    for e in ordered:
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [begin, begin + e.nbytes]}
        starts.append((e, begin))
        begin += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, starts


def _write_file(path: Path, entries: list[_Entry], reader: _Reader, written: list[Path]) -> ExportedFile:
    head, starts = _header(entries)
    data_bytes = sum(e.nbytes for e in entries)

    def write(f: BinaryIO) -> None:
        f.write(head)
        for entry, begin in starts:
            if f.tell() != len(head) + begin:
                raise AssertionError(
                    f"{path}: {entry.name} starts at byte {f.tell() - len(head)}, the header says {begin}"
                )
            tensor = _load(reader, entry)
            if tensor.numel():  # a uint8 view of the tensor's own memory: no copy
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor  # freed before the next one is allocated
        if f.tell() != len(head) + data_bytes:
            raise AssertionError(f"{path}: the data ends at byte {f.tell() - len(head)}, the header says {data_bytes}")

    _replace_when_written(path, written, write)
    log.info("wrote %s: %d tensors", path, len(entries))
    return ExportedFile(path, len(entries), data_bytes)


def _load(reader: _Reader, entry: _Entry) -> torch.Tensor:
    """The whole tensor ``entry.key``, assembled from its chunks by DCP and cast to ``entry.dtype``."""
    tensor = torch.empty(entry.shape, dtype=entry.dtype)
    with one_process_is_meant():
        dcp.load({entry.key: tensor}, storage_reader=reader, no_dist=True)
    return tensor


def _replace_when_written(path: Path, written: list[Path], write) -> None:
    """Write ``path`` through ``<path>.partial``, renamed once ``write(file)`` has returned."""
    partial = path.with_name(path.name + ".partial")
    written.append(partial)
    with open(partial, "wb") as f:
        write(f)
    os.replace(partial, path)
    written.append(path)
