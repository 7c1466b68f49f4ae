"""The measuring tools behind ``autopar calibrate`` and ``autopar fidelity`` (autopar/measure/).

The statistics and fits are checked against values worked out by hand; the
memory peak against tensors of known size; a calibrated profile round-trips
through TOML into the cost model; and both commands run end to end on 2 gloo
ranks in their quick forms (the figures of a real run are in the issue notes,
not asserted here: the tests do not time anything).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autopar.measure import stats
from autopar.measure.fit import fit_latency_bandwidth, fit_rate
from autopar.measure.peak_memory import held_bytes, step_peak_bytes
from costmodel import CoreLending


def test_spearman_matches_hand_computed_values():
    assert stats.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert stats.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # ranks (1, 2, 3, 4) vs (1, 3, 2, 4): 1 - 6 * 2 / (4 * 15) = 0.8
    assert stats.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    # ties share their mean rank: x ranks (1.5, 1.5, 3), y (1, 2, 3) -> Pearson of those = sqrt(3)/2
    assert stats.spearman([5, 5, 7], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(stats.spearman([1], [2])) and math.isnan(stats.spearman([1, 1], [2, 3]))
    assert stats.ranks([3.0, 1.0, 3.0]) == [2.5, 1.0, 2.5]


def test_spread_and_relative_error():
    assert stats.spread([1.0, 1.1, 0.9]) == pytest.approx(0.2)
    assert stats.relative_error(1.2, 1.0) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="measured"):
        stats.relative_error(1.0, 0.0)


def test_median_of_passes_takes_each_number_s_median_and_keeps_labels():
    """``autopar calibrate --passes``: the passes' nested measurements merged number by number."""
    passes = [
        {"matmul": {"float32": [("256x256", 3.0), ("512x512", 10.0)]}, "ops": 40, "dtype": "float32", "x": 1.0},
        {"matmul": {"float32": [("256x256", 1.0), ("512x512", 30.0)]}, "ops": 40, "dtype": "float32", "x": 2.0},
        {"matmul": {"float32": [("256x256", 2.0), ("512x512", 20.0)]}, "ops": 40, "dtype": "float32", "x": 9.0},
    ]
    merged = stats.median_of(passes)
    assert merged == {
        "matmul": {"float32": [("256x256", 2.0), ("512x512", 20.0)]}, "ops": 40, "dtype": "float32", "x": 2.0
    }  # fmt: skip
    assert isinstance(merged["ops"], int) and stats.median_of([{"a": (1, 4)}, {"a": (3, 4)}]) == {"a": (2.0, 4)}
    with pytest.raises(ValueError, match="labels differ"):
        stats.median_of([("256x256", 1.0), ("512x512", 1.0)])
    with pytest.raises(ValueError, match="other keys"):
        stats.median_of([{"a": 1.0}, {"b": 1.0}])
    with pytest.raises(ValueError, match="other lengths"):
        stats.median_of([[1.0], [1.0, 2.0]])


def test_latency_bandwidth_fit_recovers_the_line_and_reports_residuals():
    latency, bandwidth = 50e-6, 2e9
    points = [(x, latency + x / bandwidth) for x in (1e4, 1e5, 1e6, 1e7)]
    fit = fit_latency_bandwidth(points)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fit.worst_residual < 1e-9
    noisy = [(x, t * (1.1 if i == 0 else 1.0)) for i, (x, t) in enumerate(points)]
    assert fit_latency_bandwidth(noisy).residuals[0] > 0.02  # the outlier shows in its residual
    with pytest.raises(ValueError, match="at least 2"):
        fit_latency_bandwidth(points[:1])
    rate = fit_rate([("a", 1.0), ("b", 2.0), ("c", 4.0)])
    assert rate.rate == 2.0 and rate.residuals == (-0.5, 0.0, 1.0)


def test_peak_memory_of_a_step_counts_what_it_allocates_on_top_of_what_is_held():
    held = [torch.zeros(1 << 18)]  # 1 MiB held across steps

    def step():
        a = torch.ones(1 << 20)  # 4 MiB
        b = torch.ones(1 << 19)  # 2 MiB, while a lives: 6 MiB at the peak
        del a, b
        c = torch.ones(1 << 18)  # 1 MiB after both are freed
        return c.sum()

    peak = step_peak_bytes(step, held, torch.device("cpu"))
    assert peak.held_bytes == 1 << 20
    assert (1 << 20) + 6 * (1 << 20) <= peak.peak_bytes <= (1 << 20) + 6 * (1 << 20) + (64 << 10)
    # a view and its base are one storage
    base = torch.zeros(1000)
    assert held_bytes([base, base[10:], None]) == 4000


def test_peak_composition_takes_apart_the_peak_the_fidelity_harness_measures():
    """A log-softmax head at its backward: three (N, C) buffers live at the peak, each named by its op."""
    from autopar.measure.peak_memory import peak_composition, step_peak_bytes

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 4096)
    x, target = torch.randn(64, 16), torch.randint(0, 4096, (64,))

    def step():
        torch.nn.functional.cross_entropy(head(x), target).backward()
        head.zero_grad(set_to_none=True)

    step()
    parts = peak_composition(step, torch.device("cpu"))
    peak = step_peak_bytes(step, [], torch.device("cpu"))
    assert parts.rise_bytes == peak.peak_bytes
    assert sum(parts.by_category.values()) == parts.rise_bytes
    rows = 64 * 4096 * 4
    big = [(n, op) for n, _, op in parts.largest if n == rows]
    assert len(big) == 3 and any(op == "LogSoftmaxBackward0" for _, op in big), parts.largest


def test_calibrate_writes_a_profile_the_cost_model_prices_with(tmp_path):
    """A quick calibration on 2 gloo ranks: every key measured, the TOML loads, comm.py uses the fits."""
    from autopar.measure.calibrate import calibrate
    from autopar.measure.calibration_report import render_calibration, write_profile
    from costmodel import collective_time_s, load_profile

    cal = calibrate(ranks=2, trials=2, quick=True, passes=2)
    assert cal.passes == 2 and "each number the median of 2 passes" in render_calibration(cal)
    assert set(cal.matmul) == {"float32", "bfloat16", "float16"} and all(f.rate > 0 for f in cal.matmul.values())
    assert cal.bandwidth.rate > 0 and cal.forward_op_s > 0 and cal.backward_op_s > 0
    assert set(cal.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    # every point timed twice in each pass: its spread measured, and the machine's load before
    assert len(cal.spreads) > 20 and all(x >= 0 for x in cal.spreads) and cal.spread == statistics.median(cal.spreads)
    assert cal.load_before is not None and cal.cores == len(os.sched_getaffinity(0))
    text = render_calibration(cal)
    assert "residual" in text and "all_reduce" in text and "noise: the repeats of" in text
    path = tmp_path / "mine.toml"
    write_profile(cal, str(path))
    prof = load_profile(str(path))
    assert prof.name == "mine" and prof.peak_flops["float32"] == pytest.approx(cal.matmul["float32"].rate)
    assert prof.op_overhead_s(backward=True) == pytest.approx(cal.backward_op_s)
    # attention's rate over the matmul rate, AdamW's per-kernel overhead and bandwidth: measured and written
    assert 0 < prof.attention_efficiency == pytest.approx(cal.attention_efficiency("forward"))
    assert 0 < prof.attention_backward_efficiency == pytest.approx(cal.attention_efficiency("backward"))
    assert 0 < prof.optimizer_bandwidth_bytes_per_s == pytest.approx(cal.optimizer["bandwidth_bytes_per_s"])
    assert 0 <= prof.optimizer_op_overhead_s == pytest.approx(cal.optimizer["op_overhead_s"])
    assert "fused attention (float32) over the matmul rate" in text and "optimizer step (AdamW)" in text
    assert prof.cores_per_node == len(os.sched_getaffinity(0))  # CPU ranks share this machine's cores
    # core lending is measured only where the ranks outnumber the cores; the base's table never carries over
    assert (cal.lending is None) == (2 <= cal.cores) and load_profile("cpu").core_lending is not None
    if cal.lending is None:
        assert prof.core_lending is None and "core_lending" not in cal.profile_dict("mine")
    measured = CoreLending(4, (0.001, 0.01), ((0.9, 2.0), (0.9, 1.8), (0.9, 1.3)))
    lent = tmp_path / "lent.toml"
    write_profile(dataclasses.replace(cal, lending=measured), str(lent))
    assert load_profile(str(lent)).core_lending == measured
    # the profile follows the measured points (CollectiveFit.time_s): at each measured size the running maximum
    # of the measured times, half-way between two sizes the mean of theirs, past the last its segment extended
    points = cal.collective_points["all_reduce"][2]
    (x0, t0), (x1, t1) = points  # quick: two sizes
    t1 = max(t0, t1)
    price = lambda nbytes: collective_time_s("all_reduce", nbytes, 2, prof.intra_node)  # noqa: E731
    assert price(x0) == pytest.approx(t0, rel=1e-9) and price(x1) == pytest.approx(t1, rel=1e-9)
    assert price(x0 / 2) == pytest.approx(t0, rel=1e-9)  # below the smallest size: latency-bound
    assert price((x0 + x1) / 2) == pytest.approx((t0 + t1) / 2, rel=1e-9)
    assert price(2 * x1 - x0) == pytest.approx(2 * t1 - t0, rel=1e-9)
    # a group size beyond the measured ones scales the nearest fit as the ring does
    assert collective_time_s("all_reduce", x1, 4, prof.intra_node) > price(x1)


def _lending_rank(rank, world):
    from autopar.measure.lending_ring import measure_lending

    torch.set_num_threads(1)
    return measure_lending(rank, world, (0.5, 32.0), rounds=2)


def test_core_lending_is_measured_on_a_ring_of_waiting_ranks():
    """``measure_lending`` on 4 gloo ranks: one table, the same on every rank, a row per count of busy ranks and
    a figure per length.  Where 4 ranks share fewer than 4 cores, one rank computing 32 ms actions alone runs
    faster than with all 4 busy (2x on 2 idle cores; 1.13x measured in CI on 2026-11-29 while the other test
    worker used a core, so the bound is only "faster")."""
    from dist_utils import run_ranks

    tables = run_ranks(_lending_rank, 4, timeout_s=300)
    lending = tables[0]
    assert all(t == lending for t in tables) and lending.ranks == 4
    assert len(lending.action_s) == 2 and lending.action_s[0] < lending.action_s[1]
    assert len(lending.speed) == 3 and all(len(row) == 2 and min(row) > 0 for row in lending.speed)
    if len(os.sched_getaffinity(0)) < 4:
        assert lending.speed[0][1] > 1.0, lending


def _calibrate_here_rank(rank, world, path):
    from autopar.measure.calibrate import calibrate_here
    from autopar.measure.calibration_report import write_profile

    cal = calibrate_here(rank, world, "cpu", trials=2, quick=True, passes=1)
    if cal is not None:
        write_profile(cal, path)
    return None if cal is None else cal.spread


def test_fidelity_calibrates_on_its_own_ranks_before_a_case(tmp_path):
    """``autopar fidelity --calibrate``'s step: the job's ranks calibrate together, rank 0 gets the calibration (its
    profile keeps the base's keys); the CLI refuses a folder that is not there."""
    from dist_utils import run_ranks

    from autopar.measure.commands import cmd_fidelity
    from costmodel import load_profile

    path = str(tmp_path / "case.toml")
    spreads = run_ranks(_calibrate_here_rank, 2, path, timeout_s=300)
    assert spreads[0] is not None and spreads[0] >= 0 and spreads[1] is None
    prof = load_profile(path)
    assert prof.peak_flops["float32"] > 0 and prof.memory_bytes == load_profile("cpu").memory_bytes
    args = SimpleNamespace(
        json=None, benchmark=None, models=None, mesh=None, rounds=None, contest_rounds=None, profile="cpu", ranks=2,
        timeout=60.0, calibrate=str(tmp_path / "missing"), calibrate_passes=3,
    )  # fmt: skip
    assert cmd_fidelity(args) == 2


def test_calibrate_on_one_rank_keeps_the_base_profiles_links(tmp_path):
    """One rank (a 1-GPU job) has no group to time: no collective fits, the profile keeps the base's links."""
    from autopar.measure.calibrate import calibrate
    from autopar.measure.calibration_report import render_calibration, write_profile
    from costmodel import load_profile

    cal = calibrate(ranks=1, trials=1, quick=True, passes=1)
    assert cal.collectives == {} and cal.overlap is None and cal.forward_op_s > 0
    assert "one rank, nothing to measure" in render_calibration(cal)
    path = tmp_path / "one.toml"
    write_profile(cal, str(path))
    prof, base = load_profile(str(path)), load_profile("cpu")
    assert prof.intra_node.bandwidth_bytes_per_s == base.intra_node.bandwidth_bytes_per_s
    assert prof.peak_flops["float32"] == pytest.approx(cal.matmul["float32"].rate)


def test_a_contest_retimes_the_plans_near_the_fastest_and_the_searchs_own():
    from autopar.measure.rounds import contenders

    labels = [("family:tensor parallel",), ("auto",), ("poor hint",), ("pipeline:auto", "pipeline:tp/1f1b/m4")]
    times = [[1.0, 1.2, 1.1], [2.0, 2.0, 2.0], [1.3, 1.4, 1.2], [5.0, 5.0, 5.0]]
    assert contenders(labels, times, 0.25) == [0, 1, 2, 3]  # 1.3 <= 1.25 x 1.1
    assert contenders(labels, times, 0.1) == [0, 1, 3]
    assert contenders(labels[:1] + [("poor hint",)], [[1.0], [1.0]], 0.0) == [0, 1]  # a tie is near


def test_benchmark_variants_force_recomputation():
    from autopar.measure.benchmark import BenchModel, Variant

    model = BenchModel("gpt2-tiny", 2, 8, {})
    assert Variant("recompute:selective").plan_options(model, 100.0) == {"recompute": "selective"}
    Variant("recompute:full").validate("here")
    bad_labels = ("recompute:sometimes", "full", "pipeline:tp/zb/m2", "pipeline:tp/1f1b", "microbatches:0", "micro")
    for bad in bad_labels:
        with pytest.raises(ValueError, match="recompute:<none | selective | full>"):
            Variant(bad).validate("here")
    piped = Variant("pipeline:dp/interleaved/m4")
    piped.validate("here")
    assert piped.plan_options(model, 100.0) == {"pipeline": "dp", "schedule": "interleaved", "microbatches": 4}
    accumulated = Variant("microbatches:4")
    accumulated.validate("here")
    assert accumulated.plan_options(model, 100.0) == {"pipeline": "none", "microbatches": 4}
    free = Variant("pipeline:auto")  # the search's plan with pipeline="auto", reported against the fastest
    free.validate("here")
    assert free.pipeline is None and free.plan_options(model, 100.0) == {"pipeline": "auto"}


def test_fidelity_runs_a_benchmark_and_writes_its_figures(tmp_path, capsys):
    """``autopar fidelity`` end to end on 2 ranks: a tiny benchmark, every figure present and consistent."""
    from autopar.cli import main

    bench = tmp_path / "bench.toml"
    bench.write_text(
        "meshes = [[2]]\n"
        'variants = ["auto", "family:tensor parallel", "cap:0.0", "poor hint", "pipeline:tp/1f1b/m2", '
        '"pipeline:auto"]\n'
        "warmup_steps = 1\nrounds = 2\nsteps_per_round = 1\nmemory_steps = 2\n"
        "contest_rounds = 2\ncontest_margin = 1000.0\n"  # every plan is near: the contest times them all again
        '[[models]]\nname = "gpt2-tiny"\nbatch = 4\nseq = 16\n'
        'poor_hint = { "model.transformer.h.*.mlp.c_fc.weight" = { tp = "S(0)" } }\n'
    )
    out_json = tmp_path / "f.json"
    assert main(["fidelity", "--benchmark", str(bench), "--ranks", "2", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "predicted vs measured" in text and "spearman over all plans" in text
    figures = json.loads(out_json.read_text())
    for key in ("spearman", "median_abs_error", "memory_max_error", "cases"):
        assert key in figures, key
    assert figures["complete"] is True and figures["cases_planned"] == 1
    case = figures["cases"]["gpt2-tiny 2"]
    labels = [v for p in case["plans"] for v in p["variants"]]
    # the least-memory cap fits; the pipeline runs its two stages over 2 micro-batches
    want = ["auto", "cap:0.0", "family:tensor parallel", "pipeline:auto", "pipeline:tp/1f1b/m2", "poor hint"]
    assert sorted(labels) == want and not case["infeasible"], case["infeasible"]
    piped = next(p for p in case["plans"] if "pipeline:tp/1f1b/m2" in p["variants"])
    assert 0 < piped["predicted_bubble"] < 1 and 0 < piped["measured_bubble"] < 1, piped
    assert all(p["predicted_bubble"] is None for p in case["plans"] if p is not piped)
    least = next(p for p in case["plans"] if "cap:0.0" in p["variants"])
    auto = next(p for p in case["plans"] if "auto" in p["variants"])
    assert least["predicted_bytes"] <= auto["predicted_bytes"]
    fastest = min(p["measured_s"] for p in case["plans"])
    assert case["auto_over_fastest"] == pytest.approx(auto["measured_s"] / fastest)
    free = next(p for p in case["plans"] if "pipeline:auto" in p["variants"])  # planned with pipeline="auto"
    assert case["pipeline_auto_over_fastest"] == pytest.approx(free["measured_s"] / fastest)
    # the machine probe ran before planning and at the start of each of the 4 rounds: its ratio is reported
    assert case["machine_slowdown"] > 0 and figures["median_machine_slowdown"] == case["machine_slowdown"]
    assert "machine probe (3 matmuls on every rank) while timing / before planning" in text
    for p in case["plans"]:
        assert len(p["round_s"]) == 2 + 2, p  # the rounds and the contest's
        assert p["measured_s"] == pytest.approx(stats.median(p["round_s"]))
        assert p["measured_s"] > 0 and p["peak_bytes"] >= p["held_bytes"] > 0
        assert len(p["peak_steps"]) == 2 and min(p["peak_steps"]) <= p["peak_bytes"] <= max(p["peak_steps"])
        assert p["time_error"] == pytest.approx(p["predicted_s"] / p["measured_s"] - 1)


def test_calibrate_refuses_to_write_a_noisy_profile_unless_forced(tmp_path, capsys, monkeypatch):
    """Repeats spread over --max-spread (a busy machine): the profile is not written, exit 1, the message says
    why and how to fix it; ``--force`` writes it; a quiet one is written."""
    import autopar.measure.calibrate as calibrate_module
    import autopar.measure.calibration_report as report
    from autopar.cli import main

    noisy = SimpleNamespace(spreads=[0.3] * 9, spread=0.3, busy=True)
    quiet = SimpleNamespace(spreads=[0.02] * 9, spread=0.02, busy=False)
    monkeypatch.setattr(report, "render_calibration", lambda cal: "")
    monkeypatch.setattr(report, "write_profile", lambda cal, path, name=None: Path(path).write_text("written"))
    out = tmp_path / "p.toml"
    for cal, flags, code in (
        (noisy, [], 1),
        (noisy, ["--force"], 0),
        (quiet, [], 0),
        (noisy, ["--max-spread", "0.5"], 0),
    ):
        monkeypatch.setattr(calibrate_module, "calibrate", lambda cal=cal, **_: cal)
        out.unlink(missing_ok=True)
        assert main(["calibrate", "-o", str(out), *flags]) == code, (cal.spread, flags)
        assert out.exists() == (code == 0)
    monkeypatch.setattr(calibrate_module, "calibrate", lambda **_: noisy)
    assert main(["calibrate", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "spread 30.0% in the median (more than 10%)" in err and "machine was busy" in err and "--force" in err


def test_fidelity_refuses_bad_settings_before_any_rank_starts(tmp_path, capsys):
    from autopar.cli import main

    assert main(["fidelity", "--ranks", "3"]) == 2
    assert "no mesh of the benchmark" in capsys.readouterr().err
    assert main(["fidelity", "--models", "nope"]) == 2
    assert "--models ['nope']: not in the benchmark" in capsys.readouterr().err
    bad = tmp_path / "b.toml"
    bad.write_text('meshes = [[2]]\nvariants = ["auto", "cap:2"]\n[[models]]\nname = "gpt2-tiny"\nbatch = 2\nseq = 8\n')
    assert main(["fidelity", "--benchmark", str(bad), "--ranks", "2"]) == 2
    assert "variant 'cap:2' is not one of" in capsys.readouterr().err
    bad.write_text(
        'meshes = [[2]]\nvariants = ["auto"]\ncontest_rounds = -1\n[[models]]\nname = "gpt2-tiny"\nbatch = 2\nseq = 8\n'
    )
    assert main(["fidelity", "--benchmark", str(bad), "--ranks", "2"]) == 2
    assert "contest_rounds and contest_margin >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fidelity", "--contest-rounds", "-1"])
    assert "argument --contest-rounds: '-1': expected a whole number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fidelity", "--calibrate-passes", "0"])
    assert "argument --calibrate-passes: '0'" in capsys.readouterr().err
    assert main(["calibrate", "--base", "no-such-profile"]) == 2
    assert "unknown device profile 'no-such-profile'" in capsys.readouterr().err


def test_a_fidelity_run_that_stops_early_keeps_the_cases_it_finished(tmp_path, capsys):
    """The second case fails on rank 0 (its model cannot be built: 5 heads do not divide a width of 64): the
    first case is still printed and written, the JSON says the run is incomplete, the exit code is 1 and the
    error names the failure and how many cases finished."""
    from autopar.cli import main

    bench = tmp_path / "bench.toml"
    bench.write_text(
        'meshes = [[2]]\nvariants = ["auto"]\n'
        "warmup_steps = 1\nrounds = 1\nsteps_per_round = 1\nmemory_steps = 1\ncontest_rounds = 0\n"
        '[[models]]\nname = "gpt2-tiny"\nbatch = 2\nseq = 8\n'
        '[[models]]\nname = "gpt2-tiny"\nbatch = 2\nseq = 8\noverrides = { n_head = 5 }\n'
    )
    out_json = tmp_path / "f.json"
    assert main(["fidelity", "--benchmark", str(bench), "--ranks", "2", "--json", str(out_json)]) == 1
    captured = capsys.readouterr()
    assert "1 cases on 2 ranks" in captured.out and "INCOMPLETE: the run stopped early; 2 cases" in captured.out
    assert "the run stopped early" in captured.err and "(finished 1 of 2 cases)" in captured.err
    assert "embed_dim` must be divisible by num_heads" in captured.err
    figures = json.loads(out_json.read_text())
    assert figures["complete"] is False and figures["cases_planned"] == 2 and list(figures["cases"]) == ["gpt2-tiny 2"]
    (plan,) = figures["cases"]["gpt2-tiny 2"]["plans"]
    assert plan["variants"] == ["auto"] and plan["measured_s"] > 0
