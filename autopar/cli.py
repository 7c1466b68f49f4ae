"""The ``autopar`` command line: a thin shell over the Python API.

    autopar plan MODEL --mesh 2x4 --axis-names dp,tp --mem-cap 40GiB --profile h100 \\
        --batch 8 --seq 1024 --dtype bf16 --format table|json [-o FILE] [--solver dp|ilp] [--timings] \\
        [--devices-per-node N] [--hint 'PATTERN=R,S(1)' ...] [--hints FILE.json|FILE.toml] [--strict-hints]
    autopar models          # the built-in model names
    autopar run MODEL --mesh 2x2 [--axis-names dp,tp] --steps 3 --check [--batch 4 --seq 32] \\
        [--family auto|data-parallel|sharded-parameters|tensor-parallel] [--lr 1e-3] \\
        [--save DIR [--save-every N]] [--resume PATH] [--pipeline AXIS --microbatches N --schedule 1f1b]
    autopar export CHECKPOINT_DIR -o OUT_DIR [--max-shard-size 5GiB] [--dtype fp32|bf16|fp16] [--include-tied]

``run`` trains on local CPU ranks it spawns (or, under torchrun, as this rank) and,
with ``--check``, compares with one device (autopar/launch/); exit code 1 on FAIL.
``export`` writes the model of a checkpoint ``autopar.save`` wrote as Hugging Face
safetensors for serving (``model.safetensors``, or shards and
``model.safetensors.index.json``), one tensor in memory at a time, into a new or
empty OUT_DIR (autopar/checkpoint/hf_export.py), and prints the files, tensors and bytes.

``--hint`` (repeatable) gives one semi-auto hint (``autopar.planner.hints``): placements
split on top-level commas (``'*.mlp.c_fc.weight=R,S(1)'``), ``replicate`` for a
module region, ``recompute`` for layers recomputed in backward, or a MindSpore tuple
(``'encoder.layer.0.intermediate.dense=((2,1),(1,4))'``).
``--hints`` reads a JSON or TOML table of ``pattern = value`` (lists of placements,
``"replicate"``, or ``[[2, 1], [1, 4]]``); ``--hint`` entries override it.

``--batch`` is the global batch; ``--seq`` defaults to 1024, or to the model's
position count when it has fewer.  ``--timings`` prints, as the last line on
stderr, one JSON object {"capture_s", "strategies_s", "search_s", "total_s",
"peak_rss_bytes"}.

Bad input exits with code 2 and one ``autopar: error:`` line that names the flag
and ends with the fix; what can be checked without the model (the profile, the
output path, the hints file, the sequence length against the model's positions)
is checked before the model is built, so nothing is planned only to be lost.
Errors from the API are given in the CLI's words (``--strict-hints``, not
``strict=False``), and warnings print as ``autopar: warning:`` lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import sys
import time
import warnings

from autopar import __version__

from .cli_types import (
    FLAG_FAMILY,
    bucket_arg,
    bytes_arg,
    family_arg,
    mesh_shape,
    microbatches_arg,
    positive_float,
    positive_int,
    virtual_stages_arg,
)
from .mesh import Mesh

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse, its errors as one ``autopar: error:`` line and a hint (not the usage block first)."""

    def error(self, message: str):
        print(f"autopar: error: {message}", file=sys.stderr)
        print(f"autopar: hint: `{self.prog} --help` lists the options", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autopar", description="Auto-partition PyTorch models over a device mesh.")
    p.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{plan,run,models,export,calibrate,fidelity}")
    _add_plan_parser(sub)
    _add_run_parser(sub)
    sub.add_parser("models", help="list the built-in models")
    from autopar.checkpoint import add_export_parser

    add_export_parser(sub, bytes_arg=bytes_arg)
    from autopar.measure import add_parsers

    add_parsers(sub, positive_int=positive_int, mesh_shape=mesh_shape)
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true", help="print the traceback of a failure")
    return p


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="plan a model and print the chosen strategies")
    pl.add_argument(
        "model", help="built-in name (see `autopar models`), path/to/file.py:factory or package.module:factory"
    )
    where = pl.add_mutually_exclusive_group()
    where.add_argument("--mesh", type=mesh_shape, default=(2,), help="mesh shape, e.g. 8 or 2x4 (default 2, as run)")
    where.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        help="plan for this many devices instead of a mesh: autopar chooses the mesh (--devices-per-node places it)",
    )
    pl.add_argument(
        "--axis-names", default=None, help="comma-separated axis names, e.g. dp,tp (default axis0,axis1,... as Mesh)"
    )
    pl.add_argument("--batch", type=positive_int, default=8, help="global batch (default 8)")
    pl.add_argument(
        "--seq",
        type=positive_int,
        default=None,
        help="sequence length (default 1024, or the model's position count when smaller)",
    )
    _add_planning_flags(pl)
    pl.add_argument(
        "--format",
        default="table",
        choices=("table", "json"),
        help="what to print: the plan table (default) or the plan JSON",
    )
    pl.add_argument(
        "-o", "--output", default=None, metavar="FILE", help="also write the plan JSON to FILE (checked first)"
    )
    pl.add_argument("--no-compare", action="store_true", help="skip the per-family comparison solves")
    pl.add_argument("--timings", action="store_true", help="print timings as JSON, last line on stderr")
    pl.add_argument(
        "--explain",
        action="store_true",
        help="after the table, which cost terms decided the plan against each family's best",
    )
    pl.add_argument(
        "--hint",
        action="append",
        default=[],
        type=_hint_arg,
        metavar="PATTERN=VALUE",
        help="fix placements: 'PATTERN=R,S(1)' (parameters), 'PATTERN=replicate' (modules), "
        "'PATTERN=recompute' (layers recomputed in backward), "
        "'MODULE=((2,1),(1,4))' (a matmul, MindSpore form); repeatable",
    )


def _add_planning_flags(pl) -> None:
    """The flags of ``autopar.planner.PLAN_KEYWORDS``: each lands in ``args.<keyword>``, its default the table's."""
    from autopar.planner import PLAN_KEYWORDS, RECOMPUTE_OPTIONS, SOLVERS
    from costmodel import OPTIMIZERS

    flag = _keyword_flag(pl)
    flag("mem_cap", type=bytes_arg, help="per-device memory cap: bytes or 40GiB, 512MiB (default none)")
    flag(
        "profile",
        metavar="PROFILE",
        help="device profile: a name from `configs/devices` (a100, cpu, h100, ...) or a .toml path (default: the "
        "model's GPU; h100 for a model on meta, as the built-in models are, or on the CPU)",
    )
    flag(
        "devices_per_node",
        type=positive_int,
        metavar="N",
        help="ranks per node of the job (default: the profile's); mesh axes spanning nodes use the inter-node link",
    )
    flag(
        "dtype",
        choices=("fp32", "bf16", "bf16-pure"),
        help="training precision: fp32 (the default), bf16 (mixed, float32 master weights) or bf16-pure (no "
        "float32 copy); left out, a model with bfloat16 parameters trains bf16-pure",
    )
    flag("optimizer", choices=sorted(OPTIMIZERS), help="optimizer state to count (default adamw)")
    flag(
        "grad_bucket_bytes",
        type=bucket_arg,
        metavar="BYTES",
        help="the runtime's data-parallel gradient bucket: bytes or 25MiB, 0 for none (default 25MiB)",
    )
    flag("solver", choices=SOLVERS, help="exact DP (default) or the CP-SAT model")
    flag(
        "recompute",
        choices=RECOMPUTE_OPTIONS,
        help="recompute in backward: auto (where the fastest plan under the cap needs it; the default), none, "
        "selective (each layer's attention core and activations), full (whole layers)",
    )
    flag(
        "family",
        type=family_arg,
        metavar="{auto," + ",".join(FLAG_FAMILY) + "}",
        help="force a plan family (default auto: any)",
    )
    flag(
        "allow_state_sharding",
        action="store_false",
        help="keep each gradient and optimizer state with its parameter (no ZeRO-1/2 state sharding)",
    )
    budget = PLAN_KEYWORDS["search_budget_s"].default
    flag(
        "search_budget_s",
        type=positive_float,
        metavar="SECONDS",
        help=f"stop the search after this long with the best plan met and its proven gap (default {budget:g})",
    )
    _pipeline_flags(flag)
    flag("hints", metavar="FILE", help="JSON or TOML file of pattern = value hints")
    flag("strict", action="store_true", help="a hint pattern that matches nothing is an error")


def _keyword_flag(parser):
    """``flag(name, **spec)``: the ``PLAN_KEYWORDS`` flag of ``name`` on ``parser``, its default the table's."""
    from autopar.planner import PLAN_KEYWORDS

    def flag(name: str, **spec) -> None:
        parser.add_argument(PLAN_KEYWORDS[name].flag, dest=name, default=PLAN_KEYWORDS[name].default, **spec)

    return flag


def _pipeline_flags(flag) -> None:
    """``--pipeline``, ``--microbatches``, ``--schedule``, ``--virtual-stages`` (``autopar plan`` and ``autopar
    run``)."""
    from autopar.cost import SCHEDULES

    flag("pipeline", metavar="AXIS", help="pipeline along this mesh axis, auto (the search's pick) or none (default)")
    flag(
        "microbatches",
        type=microbatches_arg,
        metavar="N",
        help="micro-batches per step, the batch split evenly: a number, or auto (the default: 1 without a "
        "pipeline (with --pipeline auto, more when one does not fit); with one, the search's pick of about 1, 2 "
        "and 4 per stage)",
    )
    flag("schedule", choices=(*SCHEDULES, "auto"), help="the pipeline schedule (default auto: the search's pick)")
    flag(
        "virtual_stages",
        type=virtual_stages_arg,
        metavar="V",
        help="stages per rank of the interleaved schedule: a number >= 2, or auto (the default: each of 2, 4, 8, "
        "... the layers fill)",
    )


def _hint_arg(text: str) -> tuple[str, object]:
    from autopar.planner import hint_from_text

    try:
        return hint_from_text(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--hint {e}") from None


def _load_hints(path: str | None, given: list[tuple[str, object]]) -> dict | None:
    """The hints of ``--hints FILE`` (JSON or TOML) updated by each ``--hint``; None when there are none."""
    from autopar.planner import hints_from_file

    hints: dict = {}
    if path is not None:
        try:
            hints = hints_from_file(path)
        except ValueError as e:
            raise ValueError(f"--hints {e}") from None
    hints.update(dict(given))
    return hints or None


_RUN_FAMILIES = {"auto": None, **FLAG_FAMILY}


def _add_run_parser(sub) -> None:
    from autopar.planner import RECOMPUTE_OPTIONS

    r = sub.add_parser("run", help="train a compiled model on local ranks; --check compares with one device")
    r.add_argument(
        "model", help="built-in name (see `autopar models`), path/to/file.py:factory or package.module:factory"
    )
    where = r.add_mutually_exclusive_group()
    where.add_argument(
        "--mesh", type=mesh_shape, default=(2,), help="mesh shape, e.g. 2 or 2x2 (default 2); one rank each"
    )
    where.add_argument(
        "--devices", type=positive_int, default=None, help="this many ranks, on the mesh autopar chooses for them"
    )
    r.add_argument(
        "--axis-names", default=None, help="comma-separated axis names, e.g. dp,tp (default axis0,axis1,... as Mesh)"
    )
    r.add_argument("--steps", type=positive_int, default=3, help="AdamW steps (default 3)")
    r.add_argument("--check", action="store_true", help="dropout off; compare with the same model on one device")
    r.add_argument("--batch", type=positive_int, default=4, help="global batch (default 4)")
    r.add_argument("--seq", type=positive_int, default=32, help="sequence length (default 32)")
    r.add_argument("--family", default="auto", choices=tuple(_RUN_FAMILIES), help="force a plan family (default auto)")
    r.add_argument(
        "--recompute",
        default="auto",
        choices=RECOMPUTE_OPTIONS,
        help="recompute in backward: auto (the default), none, selective (attention cores and activations), "
        "full (whole layers)",
    )
    _pipeline_flags(_keyword_flag(r))
    r.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    r.add_argument(
        "--timeout", type=positive_float, default=600.0, help="stop the ranks after this many seconds (default 600)"
    )
    r.add_argument("--save", metavar="DIR", default=None, help="write checkpoints DIR/step-<n> (after the last step)")
    r.add_argument(
        "--save-every", metavar="N", type=positive_int, default=None, help="with --save: also after every N-th step"
    )
    r.add_argument(
        "--resume",
        metavar="PATH",
        default=None,
        help="continue from a checkpoint, or the latest step-<n> in a --save directory, on this mesh and plan",
    )


def _mesh(shape: tuple[int, ...], axis_names: str | None, default: tuple[str, ...] | None) -> Mesh:
    """The mesh of ``--mesh`` and ``--axis-names``, with errors in the flags' words."""
    if axis_names is None:
        return Mesh(shape, axis_names=default)
    names = [n.strip() for n in axis_names.split(",")]
    mesh_text = "x".join(map(str, shape))
    example = ",".join(("dp", "tp", "pp", "ep")[: len(shape)]) if len(shape) <= 4 else "a,b,..."
    if len(names) != len(shape) or not all(names):
        count = f"{len(shape)} non-empty comma-separated names" if len(shape) > 1 else "one non-empty name"
        raise ValueError(
            f"--axis-names {axis_names}: expected {count} for --mesh {mesh_text}, e.g. --axis-names {example}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--axis-names {axis_names}: names must be distinct, e.g. --axis-names {example}")
    return Mesh(shape, axis_names=tuple(names))


def _check_seq(model: str, seq: int | None) -> int:
    """``--seq``, or the model's default, checked against a built-in model's positions before it is built."""
    from autopar.models import default_seq, max_positions

    if seq is None:
        return default_seq(model)
    limit = max_positions(model)
    if limit is not None and seq > limit:
        raise ValueError(f"--seq {seq}: model {model} has {limit} positions; pass --seq {limit} or less")
    return seq


def _save_every(args) -> int:
    if args.save_every is not None and not args.save:
        raise ValueError(f"--save-every {args.save_every}: checkpoints need a directory; add --save DIR")
    return args.save_every or 0


def _resume(given: str | None, config) -> str | None:
    """``--resume``'s checkpoint, checked before any rank starts: complete, fewer steps done than ``--steps``,
    and under ``--check`` trained as this command's one-device reference trains."""
    if given is None:
        return None
    from autopar.checkpoint import model_mismatch
    from autopar.launch import check_replayable, resolve_checkpoint, saved_step
    from autopar.models import load_model

    path = resolve_checkpoint(given)
    if config.check:
        check_replayable(config, path)
    done = saved_step(path)
    if done >= config.steps:
        raise ValueError(
            f"--resume {given}: {path} has done {done} steps, --steps is {config.steps}; pass --steps larger "
            f"than {done} (the total step count of the job)"
        )
    mismatch = model_mismatch(path, load_model(config.model, batch=1, seq=config.seq)[0])
    if mismatch:  # found here, before the ranks start, in the CLI's words (the API's fix says strict=False)
        raise ValueError(f"--resume {given}: {mismatch}; resume with the model that saved it, or drop --resume")
    return str(path)


def _cmd_run(args) -> int:
    from autopar.launch import LaunchError, RunConfig, render_report, run

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # config warnings, once per rank, bury the report
    try:
        shape = _mesh_or_devices(args)
        config = RunConfig(
            model=args.model,
            mesh_shape=shape,
            devices=args.devices,
            axis_names=_mesh(shape, args.axis_names, None).axis_names if args.axis_names else None,
            steps=args.steps,
            check=args.check,
            batch=args.batch,
            seq=_check_seq(args.model, args.seq),
            family=_RUN_FAMILIES[args.family],
            recompute=args.recompute,
            lr=args.lr,
            seed=args.seed,
            timeout_s=args.timeout,
            save_dir=args.save,
            save_every=_save_every(args),
            pipeline=args.pipeline,
            microbatches=args.microbatches,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
        )
        config = dataclasses.replace(config, resume_dir=_resume(args.resume, config))
        report = run(config)
    except (ValueError, TypeError) as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:  # a rank's traceback: its last line, the whole on --verbose
        if args.verbose:
            print(f"autopar: error: {e}", file=sys.stderr)
        else:
            print(f"autopar: error: {one_line(e)}", file=sys.stderr)
            print("autopar: hint: --verbose prints the failing rank's traceback", file=sys.stderr)
        return 1
    if report is None:  # a torchrun rank other than 0: rank 0 prints
        return 0
    sys.stdout.write(render_report(report))
    return 1 if report.passed is False else 0


def _cmd_plan(args) -> int:
    t0 = time.perf_counter()
    try:
        inputs = _plan_inputs(args)  # everything that can be checked without the model, before it is built
        result = _run_plan(args, *inputs)
    except (ValueError, TypeError) as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    return _write_plan(args, result, t0)


def _plan_inputs(args):
    """(mesh, PlanOptions, HintOptions, seq) of ``autopar plan``'s flags, each checked in the flags' words."""
    from autopar.planner import PLAN_KEYWORDS, HintOptions, OptionError, PlanOptions, check_writable
    from costmodel import check_devices_per_node

    mesh = _mesh(_mesh_or_devices(args), args.axis_names, None)
    try:
        options = PlanOptions.from_keywords(vars(args))
    except OptionError as e:
        raise ValueError(f"{PLAN_KEYWORDS[e.option].flag} {e.value}: {e.problem}") from None
    if args.output:
        check_writable(args.output, "-o")
    if options.devices_per_node is not None:
        try:
            check_devices_per_node(mesh.shape, options.devices_per_node)
        except ValueError as e:
            raise ValueError(f"--{e}".replace("devices_per_node", "devices-per-node", 1)) from None
    hint_options = HintOptions(hints=_load_hints(args.hints, args.hint), strict=args.strict)
    where = mesh if args.devices is None else args.devices  # a device count: the plan chooses the mesh
    return where, options, hint_options, _check_seq(args.model, args.seq)


def _mesh_or_devices(args) -> tuple[int, ...]:
    """The mesh shape of ``--mesh``, or ``(N,)`` for ``--devices N`` (the plan chooses the mesh then;
    ``--axis-names`` would name axes not yet chosen; argparse refuses ``--mesh`` with it)."""
    if args.devices is None:
        return args.mesh
    if args.axis_names:
        raise ValueError("--axis-names with --devices: the mesh and its axes are the plan's choice; drop --axis-names")
    return (args.devices,)


def _run_plan(args, mesh: Mesh | int, options, hint_options, seq: int):
    """The plan, its errors in the CLI's words (the API's fixes name keywords; here they are flags)."""
    from autopar.launch import TerminalProgress
    from autopar.models import load_model
    from autopar.planner import MemoryCapError, UnmatchedHintError, plan_on

    bar = TerminalProgress()  # stages and a bar on a terminal when planning takes over a second
    try:
        model, margs, mkwargs = load_model(args.model, batch=args.batch, seq=seq)
        bar("capture + strategies", 0, 1)
        compare = not args.no_compare
        return plan_on(model, mesh, margs, mkwargs, options, hint_options, compare_families=compare, progress=bar)[0]
    except UnmatchedHintError as e:
        raise ValueError(f"{e.problem}. Fix: correct the pattern, or drop --strict-hints to only warn.") from None
    except MemoryCapError as e:
        micro = "run the batch in micro-batches (--microbatches N, or --pipeline auto), " if e.whole_batch else ""
        raise ValueError(
            f"{e.problem}\n  Fix: {micro}raise --mem-cap to at least that, use more devices (--mesh), a smaller "
            "--batch or --seq, or bf16 (--dtype bf16)."
        ) from None
    finally:
        bar.close()


def _write_plan(args, result, t0: float) -> int:
    """Print the plan (table or JSON), write ``-o`` and the ``--timings`` line."""
    from autopar.planner import render_explanation, render_table

    if args.format == "json":
        sys.stdout.write(result.to_json())
    else:
        sys.stdout.write(render_table(result))
        if args.explain:
            sys.stdout.write(render_explanation(result))
    if args.output:
        try:
            result.to_json(args.output)
        except (OSError, ValueError) as e:
            print(f"autopar: error: -o {args.output}: could not write the plan JSON ({e})", file=sys.stderr)
            return 2
    if args.timings:
        t = dict(result.timings)
        t["total_s"] = time.perf_counter() - t0
        t["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        keys = ("capture_s", "strategies_s", "search_s", "total_s", "peak_rss_bytes")
        print(json.dumps({k: t.get(k) for k in keys}), file=sys.stderr)
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``autopar: warning:`` line, without the source line of the library that raised them."""
    print(f"autopar: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(_values_that_start_with_a_dash(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return _dispatch(args)
        except BrokenPipeError:  # `autopar models | head`: the reader left; nothing more to say
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):  # no real stdout (captured in tests)
                pass
            return 0
        except Exception as e:  # noqa: BLE001 - an unexpected failure: one line, the traceback on --verbose
            if getattr(args, "verbose", False):
                raise
            print(f"autopar: error: {one_line(e)}", file=sys.stderr)
            print("autopar: hint: --verbose prints the traceback", file=sys.stderr)
            return 1


def _dispatch(args) -> int:
    if args.command == "models":
        from autopar.models import builtin_models, model_config

        for name in builtin_models():
            print(f"{name:18s} {model_config(name).get('description', '')}")
        return 0
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "export":
        from autopar.checkpoint import cmd_export

        return cmd_export(args)
    if args.command in ("calibrate", "fidelity"):
        from autopar.measure import cmd_calibrate, cmd_fidelity

        return cmd_calibrate(args) if args.command == "calibrate" else cmd_fidelity(args)
    return _cmd_plan(args)


def one_line(error: BaseException) -> str:
    """An error in one line: its message's first line, or for a rank's failure (a traceback in the message) the
    rank and the exception it raised (the traceback's last line)."""
    text = str(error).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in text:
        return f"{lines[0].rstrip(':')}: {lines[-1].strip()}"
    return lines[0] if lines else type(error).__name__


def _values_that_start_with_a_dash(argv: list[str]) -> list[str]:
    """``--mem-cap -1GiB`` as ``--mem-cap=-1GiB``: argparse takes a value starting with ``-`` (and not a plain
    negative number) for an option and says "expected one argument"; joined, the value gets its own check."""
    out: list[str] = []
    for token in argv:
        if (
            out
            and out[-1].startswith("--")
            and "=" not in out[-1]
            and token[:2].startswith("-")
            and token[1:2].isdigit()
        ):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


if __name__ == "__main__":
    sys.exit(main())
