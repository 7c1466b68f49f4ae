"""``tomllib`` on every supported Python: the standard library's from 3.11, the same parser (tomli) on 3.10.

Import ``tomllib`` from here wherever autopar reads TOML (device profiles, model
tables, hint files, the fidelity benchmark); pyproject.toml installs tomli on 3.10.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
    try:
        import tomli as tomllib
    except ModuleNotFoundError as e:
        raise ImportError("autopar reads TOML: on Python 3.10 run `pip install tomli`") from e

__all__ = ["tomllib"]
