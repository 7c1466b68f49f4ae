"""Export for serving (autopar/checkpoint/hf_export.py): a checkpoint's model as Hugging Face safetensors.

Truth comes from comparison with the reference readers and writers: ``safetensors``'
own ``load_file`` reads back every tensor of ``model.state_dict()`` bit for bit;
the shards are the ones ``huggingface_hub.split_torch_state_dict_into_shards`` cuts
from the same state dict, and their index is what it writes; ``from_pretrained``
builds a model whose logits equal the saved one's.  Memory is measured, not
assumed: torch's CPU allocator, seen through the profiler, shows the export never
holds more than the tensor being written and the one chunk being read, while
loading the whole state dict (DCP's own ``dcp_to_torch_save``) under the same
meter holds all of it.  Single process, tiny models built from configs (random
weights, nothing downloaded).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import autopar
from autopar.checkpoint import Box, CheckpointError, ExportError, PieceTensor, export_safetensors, read_metadata
from autopar.cli import main

ALIAS, CANONICAL = "lm_head.weight", "transformer.wte.weight"


def _gpt2(n_layer: int = 1, n_embd: int = 32) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, n_positions=16, vocab_size=101)
    return GPT2LMHeadModel(config).eval()


def _saved(tmp_path, model: nn.Module, name: str = "ckpt") -> str:
    path = str(tmp_path / name)
    autopar.save(path, model)
    return path


def _expected(model: nn.Module, include_tied: bool = False) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {k: v for k, v in sd.items() if include_tied or k != ALIAS}


def _read_header(path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


# ---- (a) one file, bit for bit --------------------------------------------------------------------


@pytest.mark.parametrize("include_tied", [False, True])
def test_one_file_holds_every_tensor_bit_equal_and_the_alias_only_when_asked(tmp_path, include_tied):
    model = _gpt2()
    result = export_safetensors(_saved(tmp_path, model), tmp_path / "out", include_tied=include_tied)
    want = _expected(model, include_tied)
    assert [f.path.name for f in result.files] == ["model.safetensors"] and result.index is None
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]  # no index, no .partial left
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(want) and (ALIAS in got) == include_tied
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert result.tensors == len(want) == 17 - (not include_tied)
    assert result.total_bytes == result.files[0].tensor_bytes == sum(v.nbytes for v in want.values())
    # the layout the spec fixes: header size, JSON padded to 8, data exactly covered, each tensor aligned
    n, header = _read_header(result.files[0].path)
    assert n % 8 == 0 and os.path.getsize(result.files[0].path) == 8 + n + result.total_bytes
    with safe_open(result.files[0].path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    spans = sorted(tuple(h["data_offsets"]) for k, h in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == result.total_bytes
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(h["data_offsets"][0] % want[k].element_size() == 0 for k, h in header.items() if k != "__metadata__")


def test_the_checkpoint_records_its_tied_aliases(tmp_path):
    path = _saved(tmp_path, _gpt2())
    info = json.loads((tmp_path / "ckpt" / "autopar.json").read_text())
    assert info["tied"] == {ALIAS: CANONICAL}
    assert f"model.{CANONICAL}" in read_metadata(path).state_dict_metadata
    assert f"model.{ALIAS}" not in read_metadata(path).state_dict_metadata


# ---- (b) shards and their index -------------------------------------------------------------------


@pytest.mark.parametrize("max_shard_bytes", [4096, 12928, 20000])  # under, at and over wte's 12928 bytes
def test_shards_and_index_are_those_huggingface_cuts(tmp_path, max_shard_bytes):
    from huggingface_hub import split_torch_state_dict_into_shards

    model = _gpt2()
    want = _expected(model)
    result = export_safetensors(_saved(tmp_path, model), tmp_path / "out", max_shard_bytes=max_shard_bytes)
    split = split_torch_state_dict_into_shards(
        want, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_bytes
    )
    count = len(result.files)
    assert count >= 3 and count == len(split.filename_to_tensors)
    assert [f.path.name for f in result.files] == [
        f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, 1 + count)
    ]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == split.tensor_to_filename
    assert index["metadata"]["total_size"] == split.metadata["total_size"] == result.total_bytes
    assert result.total_bytes == sum(f.tensor_bytes for f in result.files) == sum(v.nbytes for v in want.values())
    seen: dict[str, torch.Tensor] = {}
    for f in result.files:
        shard = load_file(f.path)
        assert all(index["weight_map"][k] == f.path.name for k in shard)
        assert len(shard) == f.tensors and sum(v.nbytes for v in shard.values()) == f.tensor_bytes
        assert f.tensor_bytes <= max_shard_bytes or f.tensors == 1  # only a tensor over the limit passes it, alone
        seen.update(shard)
    assert sorted(seen) == sorted(want) and all(torch.equal(seen[k], v) for k, v in want.items())
    assert not [p for p in os.listdir(tmp_path / "out") if p.endswith(".partial")]


# ---- (c) from_pretrained ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_shard_bytes", [None, 8192], ids=["one-file", "shards"])
def test_from_pretrained_gives_the_same_logits(tmp_path, max_shard_bytes):
    model = _gpt2(n_layer=2)
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    result = export_safetensors(_saved(tmp_path, model), tmp_path / "out", **kwargs)
    assert (result.index is None) == (max_shard_bytes is None)
    model.config.save_pretrained(tmp_path / "out")
    served = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert served.lm_head.weight.data_ptr() == served.transformer.wte.weight.data_ptr()  # tied again on load
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(served(ids).logits, model(ids).logits)


# ---- (d) memory: one tensor at a time --------------------------------------------------------------


@contextlib.contextmanager
def _cpu_peak_bytes():
    """Most bytes of CPU tensor memory allocated inside the block and alive at once (``out["peak"]``).

    Every allocation and free of torch's CPU allocator is an event of the profiler's
    memory profiling; their running sum, in time order, is the live total.
    """
    from torch._C._profiler import _EventType

    out: dict[str, int] = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    out["peak"], out["events"] = peak, len(events)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_export_holds_one_tensor_at_a_time_while_loading_the_whole_model_holds_it_all(tmp_path, dtype):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = _gpt2(n_layer=4, n_embd=64)
    sizes = [v.nbytes for v in _expected(model).values()]
    largest, total = max(sizes), sum(sizes)  # 65536 bytes (c_fc, c_proj), of 829,952
    assert total > 10 * largest
    path = _saved(tmp_path, model)
    with _cpu_peak_bytes() as whole:  # the meter sees a loader that holds everything
        dcp_to_torch_save(path, tmp_path / "whole.pt")
    assert whole["peak"] >= total
    with _cpu_peak_bytes() as export:
        export_safetensors(path, tmp_path / "out", dtype=dtype)
    assert export["events"] >= 2 * len(sizes)  # it saw every tensor and chunk come and go
    # the output tensor plus the chunk copied into it (saved whole by one process: the tensor in float32)
    out_bytes = largest if dtype is None else largest // 2
    assert export["peak"] <= out_bytes + largest, (export["peak"], out_bytes + largest)
    assert whole["peak"] > 5 * export["peak"]


def test_a_tensor_saved_in_chunks_is_assembled_holding_one_chunk_at_a_time(tmp_path):
    """As a mesh saves it: the tensor in three row blocks, each a chunk of its own; DCP assembles them."""
    full = torch.randn(96, 64)
    rows = 32
    boxes = tuple(Box((r, 0), (rows, 64), (r, 0)) for r in range(0, 96, rows))
    with warnings.catch_warnings():  # DCP's notice that it assumes one process: it is one
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"w": PieceTensor(full, tuple(full.shape), boxes)}}, checkpoint_id=tmp_path / "ck", no_dist=True
        )
    (chunks,) = [md.chunks for k, md in read_metadata(tmp_path / "ck").state_dict_metadata.items() if k == "model.w"]
    assert len(chunks) == 3
    with _cpu_peak_bytes() as export:
        export_safetensors(tmp_path / "ck", tmp_path / "out")
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], full)
    # the tensor plus two chunks: DCP's reader drops a chunk once the next one is read
    chunk = full.nbytes // 3
    assert export["peak"] <= full.nbytes + 2 * chunk, (export["peak"], full.nbytes + 2 * chunk)


# ---- (e) dtype ---------------------------------------------------------------------------------------


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("scale", torch.tensor(0.1, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_casts_floating_point_tensors_and_keeps_the_others(tmp_path, dtype):
    torch.manual_seed(0)
    model = _WithBuffers()
    result = export_safetensors(_saved(tmp_path, model), tmp_path / "out", dtype=dtype)
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = model.state_dict()
    assert sorted(got) == sorted(want) == ["mask", "proj.bias", "proj.weight", "scale", "steps"]
    for k, v in want.items():
        cast = v.to(dtype) if v.is_floating_point() else v
        assert got[k].dtype == cast.dtype and torch.equal(got[k], cast), k
    assert result.total_bytes == sum(v.element_size() * v.numel() for v in got.values())
    assert result.total_bytes == 32 * 2 + 4 * 2 + 2 + 5 * 8 + 3  # (weight, bias, scale) in 2 bytes, int64, bool


def test_bad_arguments_name_the_argument_and_the_fix(tmp_path):
    path = _saved(tmp_path, _gpt2())
    with pytest.raises(ExportError, match=r"max_shard_bytes: expected a whole number of bytes >= 1, got 0; pass"):
        export_safetensors(path, tmp_path / "out", max_shard_bytes=0)
    with pytest.raises(ExportError, match=r"dtype: expected None \(keep\) or a floating-point dtype, got torch.int8"):
        export_safetensors(path, tmp_path / "out", dtype=torch.int8)
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ExportError, match=r"out_dir: .*stale already holds weights \(model.safetensors\)"):
        export_safetensors(path, tmp_path / "stale")
    with pytest.raises(ExportError, match="out_dir: .* is the checkpoint itself"):
        export_safetensors(path, path)
    assert not (tmp_path / "out").exists()  # nothing is created before the arguments are checked


# ---- (f) the CLI ---------------------------------------------------------------------------------------


def test_cli_export_writes_shards_and_says_what_it_wrote(tmp_path, capsys):
    model = _gpt2()
    path = _saved(tmp_path, model)
    out = tmp_path / "serve"
    argv = ["export", path, "-o", str(out), "--max-shard-size", "8KiB", "--dtype", "bf16", "--include-tied"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(os.listdir(out)) == [*files, "model.safetensors.index.json"]
    want = {k: v.to(torch.bfloat16) for k, v in _expected(model, include_tied=True).items()}
    total = sum(v.nbytes for v in want.values())
    assert [line.split(":")[0] for line in lines[:-2]] == [f"wrote {out / f}" for f in files]
    assert lines[-2] == f"wrote {out / 'model.safetensors.index.json'}: weight_map of 17 tensors, total_size {total}"
    assert lines[-1].startswith("exported 17 tensors, ") and f"({total} bytes), in {len(files)} files" in lines[-1]
    got = {k: v for f in files for k, v in load_file(out / f).items()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error: "), err
    return err[0]


def test_cli_export_errors_name_the_argument_and_write_nothing(tmp_path, capsys):
    model = _gpt2()
    path = _saved(tmp_path, model)
    out = str(tmp_path / "out")

    assert main(["export", str(tmp_path / "missing"), "-o", out]) == 2
    assert "CHECKPOINT_DIR: no checkpoint at" in _error(capsys)

    # an interrupted save: <path>.partial without .metadata, and no <path>
    os.rename(path, path + ".partial")
    os.remove(path + ".partial/.metadata")
    assert main(["export", path, "-o", out]) == 2
    assert "ckpt.partial holds an unfinished save" in _error(capsys)
    assert main(["export", path + ".partial", "-o", out]) == 2
    line = _error(capsys)
    assert "is not a complete checkpoint: it holds checkpoint data but no .metadata" in line
    assert line.startswith("autopar: error: CHECKPOINT")

    path = _saved(tmp_path, model, "ckpt2")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep")
    assert main(["export", path, "-o", str(tmp_path / "busy")]) == 2
    assert "-o " in _error(capsys) and sorted(os.listdir(tmp_path / "busy")) == ["notes.txt"]

    info = json.loads((tmp_path / "ckpt2" / "autopar.json").read_text())
    del info["tied"]  # as a checkpoint saved before aliases were recorded
    (tmp_path / "ckpt2" / "autopar.json").write_text(json.dumps(info))
    assert main(["export", path, "-o", out, "--include-tied"]) == 2
    assert _error(capsys).startswith("autopar: error: --include-tied: ")

    with pytest.raises(SystemExit) as exit_info:
        main(["export", path, "-o", out, "--max-shard-size", "lots"])
    assert exit_info.value.code == 2 and "--max-shard-size" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert main(["export", path, "-o", out]) == 0  # the same checkpoint exports without the aliases
    assert len(load_file(os.path.join(out, "model.safetensors"))) == 16


def test_export_and_load_take_the_latest_step_of_a_save_directory_and_name_what_is_not_one(tmp_path, capsys):
    """Issue 29, item 2: the folder ``autopar run --save`` writes (``step-<n>`` inside) exports and loads its
    latest complete step, as ``--resume`` takes it; a folder that never was a checkpoint is called that, not
    "an interrupted save"; step folders that are all incomplete are listed."""
    first, second = _gpt2(), _gpt2()
    with torch.no_grad():
        for p in second.parameters():
            p.add_(1.0)
    autopar.save(tmp_path / "run" / "step-1", first)
    autopar.save(tmp_path / "run" / "step-2", second)
    os.makedirs(tmp_path / "run" / "step-3.partial")  # an interrupted save never counts
    assert main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(exported["transformer.wpe.weight"], second.state_dict()["transformer.wpe.weight"])
    target = _gpt2()
    autopar.load(tmp_path / "run", target)
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in target.state_dict().items())

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a checkpoint")
    assert main(["export", str(tmp_path / "notes"), "-o", str(tmp_path / "out2")]) == 2
    line = _error(capsys)
    assert "is not a checkpoint: it holds no .metadata and no checkpoint data (readme.txt)" in line
    assert "interrupted" not in line
    (tmp_path / "unfinished" / "step-4.partial").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"holds step folders step-4\.partial but none is a complete"):
        autopar.load(tmp_path / "unfinished", _gpt2())
