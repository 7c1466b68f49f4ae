"""Packaging: a wheel carries the data files, and an installed autopar works from any directory.

The module's fixture builds the wheel the way a user's ``pip wheel .`` does, from a
copy of the checkout (so the build leaves no build/ or *.egg-info in the repository),
makes a fresh virtual environment that sees the host's site-packages, those of a
virtual environment the tests run in included (torch, ortools and transformers come
from there: ``--no-index`` downloads nothing, so a dependency the host lacks fails
the install), installs the wheel there with pip,
dependencies resolved, and runs the installed ``autopar`` from an empty directory.
The venv also sees the host's editable install of autopar, so every check first
makes sure that ``autopar`` resolves to the venv's own site-packages.

The in-process tests check the lookup itself: ``autopar.models.config_dir()`` is the
package ``autopar.configs`` found by ``importlib.resources`` (the checkout's
top-level ``configs/`` in the editable install), and ``$AUTOPAR_CONFIG_DIR``
overrides it for profiles and models alike.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import costmodel as cm
from autopar.models import builtin_models, config_dir

REPO = Path(__file__).resolve().parent.parent
#: what a checkout may hold besides its sources; none of it belongs in a wheel build
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".pytest_cache", ".ruff_cache", ".benchmarks", "out"
)
_PACKAGES = ("autopar", "costmodel")


@dataclass(frozen=True, slots=True)
class Installed:
    """A wheel of the checkout, installed into a fresh venv; ``cwd`` is an empty directory outside the repo."""

    wheel: Path
    python: Path
    autopar: Path
    cwd: Path
    env: dict[str, str]

    def run(self, *argv: str | Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(a) for a in argv], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=120
        )


def _check(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{what}: exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    src, dist, venv, cwd = root / "src", root / "dist", root / "venv", root / "elsewhere"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCES)
    cwd.mkdir()
    # no PYTHONPATH (it could put the checkout on the path) and no config override
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AUTOPAR_CONFIG_DIR", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run = lambda *argv: subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    # --no-build-isolation: the host's setuptools builds (the [test] extra installs it), nothing is downloaded
    _check(run(sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-w", dist), "pip wheel")
    (wheel,) = dist.glob("autopar-*.whl")
    # --without-pip: the venv runs the host's pip, which it sees through --system-site-packages
    _check(run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv), "python -m venv")
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    _see_the_hosts_packages(python, run)
    _check(run(python, "-m", "pip", "install", "--no-index", wheel), "pip install <wheel> into the venv")
    autopar = python.with_name("autopar.exe" if os.name == "nt" else "autopar")
    assert autopar.is_file(), f"the wheel's console script was not installed: expected {autopar}"
    return Installed(wheel=wheel, python=python, autopar=autopar, cwd=cwd, env=env)


def _see_the_hosts_packages(python: Path, run) -> None:
    """Make the new venv see the packages of the interpreter running the tests, where they are installed.

    ``--system-site-packages`` shows the *base* interpreter's site-packages: when the tests run in a virtual
    environment (the way most people install), torch, ortools and transformers live in that environment's
    site-packages instead, which a venv made from it does not see.  A ``.pth`` file in the new venv lists the
    running interpreter's site-packages after the venv's own (directories only: the host's editable install of
    autopar, a ``.pth`` finder there, is not run), so dependencies resolve and autopar is the venv's."""
    purelib = _check(
        run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"), "venv site-packages"
    ).stdout.strip()
    host = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "zz_host_site_packages.pth").write_text("".join(f"{p}\n" for p in host))


# ---------------------------------------------------------------- the wheel's contents


def test_wheel_ships_every_config_file_as_autopar_configs(installed):
    """Every file of the top-level configs/ (bar caches) sits under autopar/configs/ in the wheel, byte for byte."""
    sources = {
        p.relative_to(REPO / "configs").as_posix(): p.read_bytes()
        for p in (REPO / "configs").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    with zipfile.ZipFile(installed.wheel) as whl:
        shipped = {
            n.removeprefix("autopar/configs/"): whl.read(n) for n in whl.namelist() if n.startswith("autopar/configs/")
        }
    assert sorted(shipped) == sorted(sources)
    assert shipped == sources
    assert sum(n.startswith("devices/") for n in shipped) == 3 and "models/gpt2.toml" in shipped


def test_wheel_ships_every_discovered_subpackage(installed):
    """packages.find picks up each package folder of autopar and costmodel: none has to be listed by hand."""
    expected = {
        p.parent.relative_to(REPO).as_posix()
        for name in _PACKAGES
        for p in (REPO / name).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    with zipfile.ZipFile(installed.wheel) as whl:
        names = whl.namelist()
    shipped = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    assert expected <= shipped, f"subpackages missing from the wheel: {sorted(expected - shipped)}"
    assert {"autopar", "autopar/configs", "autopar/runtime", "autopar/strategies", "costmodel"} <= shipped
    strays = [n for n in names if n.startswith(("configs/", "tests/", "scripts/"))]
    assert not strays, f"top-level folders other than the packages in the wheel: {strays}"


# ---------------------------------------------------------------- the installed package


def test_installed_autopar_resolves_to_the_venv_not_the_checkout(installed):
    probe = (
        "import json, sysconfig, autopar, autopar.models, costmodel, autopar.configs;"
        "print(json.dumps({'purelib': sysconfig.get_paths()['purelib'], 'autopar': autopar.__file__,"
        " 'costmodel': costmodel.__file__, 'configs': str(autopar.models.config_dir()),"
        " 'profiles': costmodel.available_profiles(), 'h100': costmodel.load_profile('h100').name}))"
    )
    got = json.loads(_check(installed.run(installed.python, "-c", probe), "python -c <probe>").stdout)
    purelib = Path(got["purelib"]).resolve()
    assert purelib.is_relative_to(installed.python.parent.parent.resolve()), f"not the venv's site-packages: {purelib}"
    for key in ("autopar", "costmodel", "configs"):
        path = Path(got[key]).resolve()
        assert path.is_relative_to(purelib), f"{key} resolves to {path}, expected under the venv's {purelib}"
        assert not path.is_relative_to(REPO), f"{key} resolves to the checkout: {path}"
    assert Path(got["configs"]).resolve() == purelib / "autopar" / "configs"
    assert got["profiles"] == ["a100", "cpu", "h100"] and got["h100"] == "h100"


def test_installed_cli_lists_the_builtin_models(installed):
    out = _check(installed.run(installed.autopar, "models"), "autopar models").stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert {"gpt2", "gpt2-xl", "bert-base", "llama-7b-shaped", "gpt2-tiny", "llama-tiny", "bert-tiny"} <= names
    assert {"t5-tiny", "albert-tiny"} <= names  # from the tiny_hf.toml table
    assert len(names) == len(builtin_models())


def test_installed_cli_plans_gpt2_with_a_named_profile(installed):
    """From a directory outside the repo: the model table and a non-default device profile both resolve."""
    proc = installed.run(
        installed.autopar, "plan", "gpt2", "--mesh", "4", "--batch", "1", "--seq", "128", "--no-compare",
        "--profile", "a100",
    )  # fmt: skip
    out = _check(proc, "autopar plan gpt2").stdout
    assert out.startswith("autopar plan: GPT2LMHeadModel on mesh {'axis0': 4}, profile a100,"), out[:200]
    for table in ("parameters (per group)", "collectives", "totals per device", "step time"):
        assert table in out, f"plan output lacks {table!r}:\n{out}"
    assert "transformer.h.*.mlp.c_fc.weight" in out


# ---------------------------------------------------------------- the lookup, in process


def test_config_dir_is_the_autopar_configs_package(monkeypatch):
    monkeypatch.delenv("AUTOPAR_CONFIG_DIR", raising=False)
    package = importlib.resources.files("autopar.configs")
    assert isinstance(package, Path) and config_dir() == package
    on_disk = sorted(p.stem for p in (package / "devices").glob("*.toml"))
    assert cm.available_profiles() == on_disk == ["a100", "cpu", "h100"]
    assert (package / "models" / "gpt2.toml").is_file() and "gpt2" in builtin_models()


def test_config_dir_env_override_serves_profiles_and_models(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOPAR_CONFIG_DIR", raising=False)
    (tmp_path / "devices").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "devices" / "mine.toml").write_text((config_dir() / "devices" / "h100.toml").read_text())
    (tmp_path / "models" / "mymodel.toml").write_text((config_dir() / "models" / "gpt2-tiny.toml").read_text())
    monkeypatch.setenv("AUTOPAR_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path.resolve()
    assert cm.available_profiles() == ["mine"] and cm.load_profile("mine").name == "h100"
    assert builtin_models() == ["mymodel"]  # no tiny_hf.toml in the override: no <arch>-tiny names
    with pytest.raises(ValueError, match=r"unknown device profile 'h100'.*\['mine'\]"):
        cm.load_profile("h100")


def test_missing_config_package_names_it_and_the_fix(monkeypatch):
    monkeypatch.delenv("AUTOPAR_CONFIG_DIR", raising=False)
    monkeypatch.setattr("autopar.models.data_files._CONFIG_PACKAGE", "autopar.no_such_configs")
    monkeypatch.setattr("costmodel.profiles._CONFIG_PACKAGE", "autopar.no_such_configs")
    fix = r"'autopar.no_such_configs'.*not installed.*pip install -e \..*AUTOPAR_CONFIG_DIR"
    with pytest.raises(ImportError, match=fix):
        config_dir()  # the models and benchmarks
    with pytest.raises(ImportError, match=fix):
        cm.profiles_dir()  # the device profiles, found by the cost model itself
