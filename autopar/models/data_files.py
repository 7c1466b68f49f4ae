"""Where autopar's data files live and how they are read: the ``configs/`` folder, TOML.

``config_dir()`` is ``$AUTOPAR_CONFIG_DIR`` if set, else the installed package
``autopar.configs``: the repository's top-level ``configs/`` folder, which
pyproject.toml installs under that name (``[tool.setuptools.package-dir]``).  An
editable install (``pip install -e .``) resolves to the checkout's folder, a wheel or
``pip install .`` to the copy in site-packages.  It is found with
``importlib.resources``, never by a path relative to this file, so the answer does not
depend on the working directory or on where the checkout lies.  It holds
``models/<name>.toml`` (the model zoo), ``benchmarks/<name>.toml`` (``autopar
fidelity``) and ``devices/<name>.toml`` (read by ``costmodel`` itself).

``tomllib`` is the standard library's parser (``tomli`` on Python 3.10).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError as e:
        raise ImportError("autopar reads TOML: on Python 3.10 run `pip install tomli`") from e

__all__ = ["CONFIG_ENV", "config_dir", "tomllib"]

#: The environment variable that points autopar at another configs folder.
CONFIG_ENV = "AUTOPAR_CONFIG_DIR"
#: The package the top-level configs/ folder installs as (pyproject.toml, [tool.setuptools.package-dir]).
_CONFIG_PACKAGE = "autopar.configs"


def config_dir() -> Path:
    """The configs directory: ``$AUTOPAR_CONFIG_DIR`` if set, else the installed package ``autopar.configs``.

    Raises ``ImportError`` when the package is missing (an install made before
    configs/ became a package, or autopar run from a checkout it was never installed
    from) and when it is not a folder on disk (a zip import).
    """
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env).expanduser().resolve()
    try:
        root = importlib.resources.files(_CONFIG_PACKAGE)
    except ModuleNotFoundError as e:
        raise ImportError(
            f"autopar's data package {_CONFIG_PACKAGE!r} (device profiles and built-in models) is not installed: "
            f"expected it next to the autopar package, got {e}. Reinstall autopar (`pip install -e .` in the "
            f"checkout, or `pip install .`), or set ${CONFIG_ENV} to a folder with devices/ and models/"
        ) from e
    if not isinstance(root, Path):
        raise ImportError(
            f"autopar's data package {_CONFIG_PACKAGE!r}: expected a folder on disk, got {root!r} (a zip import?); "
            f"install autopar with pip (wheels unpack to disk), or set ${CONFIG_ENV} to a folder with models/"
        )
    return root
