"""What a newcomer meets first (issue 29): one-line CLI errors, checked node sizes, output paths, names that say
what a plan does, family rows that never claim a fit they do not have, and the costliest line pointed out."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import autopar
from autopar.cli import main, one_line
from autopar.models import load_model
from autopar.placement import Replicate
from autopar.planner.plan_table import describe_output_gather, render_table
from costmodel import axis_crosses_nodes, check_devices_per_node

# ---------------------------------------------------------------- errors in one line


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plan", "gpt2-tiny", "--mem-cap", "-1GiB"], "argument --mem-cap: memory size '-1GiB': expected a positive"),
        (["plan", "gpt2-tiny", "--mesh", "2y2"], "argument --mesh: --mesh '2y2': expected sizes joined by 'x'"),
        (["plan", "gpt2-tiny", "--frob"], "unrecognized arguments: --frob"),
        (["run", "gpt2-tiny", "--steps", "0"], "argument --steps"),
    ],
)
def test_argparse_errors_are_one_line_and_a_hint_not_the_usage(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = _stderr_lines(capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith("autopar: error: ") and says in lines[0], lines
    assert lines[1].startswith("autopar: hint: `autopar") and "--help" in lines[1]
    assert not any(line.startswith("usage:") for line in lines)


def test_devices_per_node_must_fill_whole_nodes(capsys):
    assert main(["plan", "gpt2-tiny", "--mesh", "4", "--devices-per-node", "3"]) == 2
    (line,) = _stderr_lines(capsys)
    assert line.startswith("autopar: error: --devices-per-node 3: the mesh (4,) has 4 ranks")
    assert "pass one of 1, 2, 4, or a number >= 4" in line
    with pytest.raises(ValueError, match="devices_per_node 3: the mesh \\(2, 2\\) has 4 ranks"):
        check_devices_per_node((2, 2), 3)
    check_devices_per_node((2, 2), 8)  # one node holds the job: fine
    # a group that straddles a node boundary crosses nodes though it spans fewer ranks than a node holds
    assert axis_crosses_nodes((4, 3), 1, 4) and not axis_crosses_nodes((4, 3), 1, 6)
    assert axis_crosses_nodes((4, 3), 0, 6) and not axis_crosses_nodes((2, 2), 1, 2)


def test_a_plan_on_nodes_says_which_axes_cross_them(capsys):
    assert main(["plan", "gpt2-tiny", "--mesh", "2x2", "--devices-per-node", "2", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "nodes of 2 rank(s): axis axis0 crosses nodes" in out and "axis1 stays within a node" in out


def test_an_unexpected_failure_is_one_line_and_verbose_shows_the_traceback(capsys, monkeypatch):
    import autopar.cli as cli

    def broken(args):
        raise RuntimeError("something inside broke\nwith a second line")

    monkeypatch.setattr(cli, "_dispatch", broken)
    assert main(["models"]) == 1
    assert _stderr_lines(capsys) == [
        "autopar: error: something inside broke",
        "autopar: hint: --verbose prints the traceback",
    ]
    with pytest.raises(RuntimeError, match="something inside broke"):
        main(["models", "--verbose"])


def test_a_ranks_traceback_is_said_in_one_line():
    text = (
        "_rank_entry on 2 ranks: rank 0 failed (failed ranks [0, 1]):\nTraceback (most recent call last):\n"
        '  File "x.py", line 3, in f\n    g()\nautopar.checkpoint.saving.CheckpointError: cannot load ck\n'
    )
    assert one_line(RuntimeError(text)) == (
        "_rank_entry on 2 ranks: rank 0 failed (failed ranks [0, 1]): "
        "autopar.checkpoint.saving.CheckpointError: cannot load ck"
    )


def test_resuming_another_models_checkpoint_is_refused_before_the_ranks_start(tmp_path, capsys):
    model, _, _ = load_model("gpt2-tiny", batch=1, seq=8, device="cpu")
    autopar.save(tmp_path / "ck" / "step-1", model, extra={"train": {"step": 1}})
    assert main(["run", "llama-tiny", "--mesh", "2", "--steps", "3", "--resume", str(tmp_path / "ck")]) == 2
    (line,) = _stderr_lines(capsys)
    assert line.startswith(f"autopar: error: --resume {tmp_path / 'ck'}: ") and "(saved from GPT2LMHeadModel" in line
    assert "does not hold this model" in line and "resume with the model that saved it" in line
    assert "strict=False" not in line


def test_every_output_path_needs_its_folder(tmp_path, capsys):
    model, _, _ = load_model("gpt2-tiny", batch=1, seq=8, device="cpu")
    autopar.save(tmp_path / "ck", model)
    missing = tmp_path / "no" / "such"
    assert main(["export", str(tmp_path / "ck"), "-o", str(missing / "out")]) == 2
    assert main(["plan", "gpt2-tiny", "-o", str(missing / "plan.json")]) == 2
    for line in _stderr_lines(capsys):
        assert f"folder {str(missing)!r} does not exist; create it or pass another path" in line
    assert not (tmp_path / "no").exists()


# ---------------------------------------------------------------- names


def test_default_axis_names_are_the_same_everywhere():
    from autopar.cli import build_parser
    from autopar.launch import RunConfig

    assert autopar.Mesh((4,)).axis_names == ("axis0",)
    assert RunConfig(model="gpt2-tiny", mesh_shape=(2, 2)).mesh().axis_names == ("axis0", "axis1")
    parser = build_parser()
    plan_args = parser.parse_args(["plan", "gpt2-tiny"])
    run_args = parser.parse_args(["run", "gpt2-tiny"])
    assert plan_args.mesh == run_args.mesh == (2,)
    help_text = subprocess.run(
        [sys.executable, "-m", "autopar.cli", "plan", "--help"], capture_output=True, text=True, check=True
    ).stdout
    flat = " ".join(help_text.split())
    assert "fp32 (the default)" in flat and "(default adamw)" in flat


def test_a_family_label_names_what_most_of_the_model_does_and_the_exceptions():
    """GPT-2 on 2x4 at batch 8: the blocks' weights are data parallel (R,R, the batch split on both axes), only
    the embeddings are split: the label leads with data parallel and lists tensor parallelism as the exception,
    with the parameters and their share of the bytes."""
    model, args, kwargs = load_model("gpt2", batch=8, seq=1024)
    mesh = autopar.Mesh((2, 4), axis_names=("dp", "tp"))
    plan = autopar.plan(
        model, mesh, example_inputs=args, example_kwargs=kwargs, mem_cap="40GiB", dtype="bf16", compare_families=False
    )
    blocks = [p.placements for k, p in plan.params.items() if k.startswith("transformer.h.")]
    assert all(p == (Replicate(), Replicate()) for p in blocks)  # what the label must reflect
    main_part, _, exceptions = plan.family.partition(" (also ")
    assert "data parallel" in main_part and "tensor parallel" not in main_part, plan.family
    assert re.search(r"tensor parallel on transformer\.wte\.weight.*: \d+% of the parameter bytes\)$", exceptions)


# ---------------------------------------------------------------- the family comparison


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_a_family_row_fits_only_when_its_peak_is_under_the_cap(name):
    """Over a sweep of caps: every family row that says it fits has its step's peak within the cap (each row went
    through the peak loop), and the chosen plan is at least as fast as every row that fits."""
    model, args, kwargs = load_model(name, batch=8, seq=32)
    ctx = autopar.prepare(model, autopar.Mesh((2, 2)), example_inputs=args, example_kwargs=kwargs, profile="cpu")
    free = autopar.plan_from_context(ctx, compare_families=False).memory.per_device_bytes
    checked = 0
    for fraction in (0.7, 0.5):
        cap = int(free * fraction)
        try:
            plan = autopar.plan_from_context(ctx, mem_cap=cap)
        except autopar.MemoryCapError:
            continue
        for row in plan.alternatives:
            if row.feasible:
                checked += 1
                assert row.per_device_bytes <= cap, (name, fraction, row.family, row.per_device_bytes, cap)
                assert plan.cost.total_s <= row.total_s * (1 + 1e-9), (name, fraction, row.family)
    assert checked >= 3


# ---------------------------------------------------------------- the costliest line


def test_a_large_output_gather_is_pointed_out_with_the_ways_out():
    """A model whose output is cheaper to gather than to compute whole on every rank: the gather is a large
    share of the step, and the table names it and the two ways out; a plan returning its loss has no such note."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 8192))
    x = torch.zeros((4096, 8192), device="meta")
    plan = autopar.plan(
        model, autopar.Mesh((8,)), example_inputs=(x,), profile="a100", dtype="bf16", compare_families=False
    )
    gathered = sum(c.time_s for c in plan.collectives if c.output)
    assert gathered >= 0.1 * plan.cost.total_s
    note = describe_output_gather(plan)
    assert f"({gathered / plan.cost.total_s:.0%})" in note
    assert "return the loss from the model (pass labels)" in note and "output_placements=" in note
    assert note.split(":")[0] in " ".join(render_table(plan).split())
    gpt, args, kwargs = load_model("gpt2-tiny", batch=8, seq=32)
    with_loss = autopar.plan(gpt, autopar.Mesh((4,)), example_inputs=args, example_kwargs=kwargs, profile="a100")
    assert describe_output_gather(with_loss) == ""
