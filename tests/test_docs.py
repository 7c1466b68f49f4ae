"""Every code block of the README and of the documentation site runs, as written.

A page is a session, its blocks run in order in one temporary directory (which holds links to the repository's
``configs``, ``docs``, ``scripts`` and ``tests``, so paths written from the repository root resolve):

* a ``python`` block runs in the page's Python process (one per run of consecutive Python blocks: later blocks
  see the names earlier ones made);
* a ``bash`` block runs with ``bash -euo pipefail``, with this interpreter's ``autopar`` and ``torchrun`` first
  on the ``PATH``;
* ``text`` blocks are output and ``mermaid`` blocks diagrams, not run.

An HTML comment right before a block changes what happens to it:

* ``<!-- docs-test: file NAME -->``: the block is written to ``NAME`` (a script a later ``bash`` block runs);
* ``<!-- docs-test: output -->`` (a ``text`` block): the previous block's output, compared line by line;
* ``<!-- docs-test: twice -->``: the ``bash`` block runs twice at once (a command run on each of two nodes);
* ``<!-- docs-test: loss-falls -->``: the ``bash`` block's ``step N: loss X`` lines fall from first to last;
* ``<!-- docs-test: ci -->``: the block is what ``.ci/run`` runs, line for line (it installs; CI runs it).

The site itself builds with ``mkdocs build --strict`` (the ``[test]`` extra installs MkDocs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!-- docs-test: (.+?) -->\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    directive: str  # '' when none

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, top level only (a block inside a list item is indented and also counts)."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        previous = lines[start - 1].strip() if start else ""
        d = _DIRECTIVE.match(previous)
        out.append(Block(page, start + 1, m.group(1) or "text", "\n".join(body) + "\n", d.group(1) if d else ""))
        i += 1
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["COLUMNS"] = "130"
    return env


def _workdir(tmp_path: Path) -> Path:
    for name in ("configs", "docs", "scripts", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def _run(argv: list[str], cwd: Path, what: str, timeout: float = 600) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{what} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


_SESSION = """
import sys
namespace = {"__name__": "__main__"}
for path in sys.argv[1:]:
    exec(compile(open(path).read(), path, "exec"), namespace)
"""


def _run_python(run: list[Block], cwd: Path) -> str:
    paths = []
    for n, b in enumerate(run):
        path = cwd / f"_block{b.line}_{n}.py"
        path.write_text(b.code)
        paths.append(str(path))
    return _run([sys.executable, "-c", _SESSION, *paths], cwd, f"python blocks {', '.join(b.where() for b in run)}")


def _run_bash(b: Block, cwd: Path) -> str:
    argv = ["bash", "-euo", "pipefail", "-c", b.code]
    if b.directive != "twice":
        return _run(argv, cwd, f"bash block {b.where()}")
    procs = [
        subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"bash block {b.where()} (twice) exited {p.returncode}\n{out}\n{err}"
    return outs[0][0]


def _check_output(b: Block, got: str) -> None:
    want = [line.rstrip() for line in b.code.splitlines() if line.strip()]
    have = [line.rstrip() for line in got.splitlines() if line.strip()]
    assert have[: len(want)] == want, f"{b.where()}: the block above prints\n" + "\n".join(have[: len(want) + 2])


def _check_loss_falls(b: Block, got: str) -> None:
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)$", got, re.M)]
    assert len(losses) >= 5 and losses[-1] < losses[0], f"{b.where()}: losses {losses}"


def run_page(page: Path, cwd: Path) -> None:
    pending: list[Block] = []
    output = ""
    for b in blocks(page):
        if b.directive.startswith("file "):
            (cwd / b.directive.removeprefix("file ").strip()).write_text(b.code)
            continue
        if b.lang == "python" and not b.directive:
            pending.append(b)
            continue
        if pending:
            output = _run_python(pending, cwd)
            pending = []
        if b.directive == "ci":
            continue  # tests/test_docs.py::test_the_readme_commands_are_what_ci_runs
        if b.lang == "bash":
            output = _run_bash(b, cwd)
            if b.directive == "loss-falls":
                _check_loss_falls(b, output)
        elif b.directive == "output":
            _check_output(b, output)
    if pending:
        _run_python(pending, cwd)


def _runnable(page: Path) -> bool:
    return any(b.lang in ("python", "bash") and b.directive != "ci" for b in blocks(page))


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_every_code_block_of_the_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    run_page(page, _workdir(tmp_path))


def test_every_block_is_a_kind_this_test_knows() -> None:
    unknown = [b.where() for page in PAGES for b in blocks(page) if b.lang not in ("python", "bash", "text", "mermaid")]
    assert not unknown, f"code blocks in a language tests/test_docs.py does not run: {unknown}"
    assert sum(_runnable(p) for p in PAGES) >= 8  # the README and the guide pages


def test_the_readme_commands_are_what_ci_runs() -> None:
    (ci,) = [b for b in blocks(REPO / "README.md") if b.directive == "ci"]
    commands = [line for line in ci.code.splitlines() if line.strip()]
    script = (REPO / ".ci" / "run").read_text().splitlines()
    assert all(c in script for c in commands), f".ci/run does not run the README's commands as written: {commands}"


def test_the_readme_is_a_front_door() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert text.index("## Two commands") < 1500  # near the top


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """MkDocs (the [test] extra installs it) builds the site with every warning an error: a broken link, a page
    the nav names that does not exist, a docstring the API reference cannot read."""
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")]
    _run(argv, REPO, "mkdocs build --strict", timeout=300)
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("plan_from_context") >= 1
