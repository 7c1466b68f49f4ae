"""The CLI: a thin shell over autopar.plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autopar.cli import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True, text=True, timeout=600)


def test_same_command_twice_gives_byte_identical_json(tmp_path):
    outs = []
    for i in range(2):
        out = tmp_path / f"plan{i}.json"
        r = _run(
            "plan",
            "gpt2-tiny",
            "--mesh",
            "2",
            "--axis-names",
            "tp",
            "--batch",
            "4",
            "--seq",
            "32",
            "--format",
            "json",
            "-o",
            str(out),
            "--timings",
        )
        assert r.returncode == 0, r.stderr
        outs.append(out.read_bytes())
        timings = json.loads(r.stderr.strip().splitlines()[-1])
        assert set(timings) == {"capture_s", "strategies_s", "search_s", "total_s", "peak_rss_bytes"}
        assert r.stdout.encode() == out.read_bytes()
    assert outs[0] == outs[1]
    plan = json.loads(outs[0])
    assert plan["mesh"]["shape"] == [2] and plan["mesh"]["axis_names"] == ["tp"]


def test_table_and_mem_cap_units(capsys):
    assert main(["plan", "gpt2-tiny", "--mesh", "2", "--batch", "4", "--seq", "32", "--mem-cap", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert "cap 512.00 MiB" in out and "why this plan" in out


def test_bad_inputs_are_clear_errors(capsys):
    assert main(["plan", "no-such-model", "--mesh", "2"]) == 2
    assert "not a built-in model" in capsys.readouterr().err
    assert (
        main(["plan", "gpt2-tiny", "--mesh", "2", "--batch", "2", "--seq", "16", "--mem-cap", "1KiB", "--no-compare"])
        == 2
    )
    err = capsys.readouterr().err
    assert "smallest per-device memory any plan reaches" in err and "raise --mem-cap" in err and "mem_cap=" not in err
    with pytest.raises(SystemExit):
        main(["plan", "gpt2-tiny", "--mesh", "2x"])


def test_factory_models(tmp_path, capsys):
    f = tmp_path / "mymodel.py"
    f.write_text(
        "import torch\n"
        "def build(batch, seq):\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(seq, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))\n"
        "    return m, (torch.randn(batch, seq),)\n"
    )
    assert (
        main(["plan", f"{f}:build", "--mesh", "2", "--batch", "8", "--seq", "16", "--format", "json", "--no-compare"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["params"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_models_lists_builtins(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("gpt2", "gpt2-xl", "llama-7b-shaped", "bert-base"):
        assert name in out


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_recompute_option_forces_the_mode_in_table_and_json(mode, capsys):
    """``--recompute``: the JSON marks each recomputed op with its region, the table names them."""
    common = ["plan", "gpt2-tiny", "--mesh", "2", "--batch", "4", "--seq", "16", "--no-compare", "--recompute", mode]
    assert main([*common, "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    regions = {e["recompute"] for e in plan["nodes"].values() if "recompute" in e}
    assert plan["settings"]["recompute"] == mode and plan["search"]["recompute_mode"] == mode
    want = {
        "none": set(),
        "selective": {f"transformer.h.{i}.{part}" for i in (0, 1) for part in ("attn", "mlp")},
        "full": {"transformer.h.0", "transformer.h.1"},
    }[mode]
    assert regions == want
    assert main(common) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("recompute:"))
    assert line.startswith(
        {"none": "recompute: none", "selective": "recompute: 4 selective", "full": "recompute: 2 blocks"}[mode]
    )
