"""Build shim: lets ``packages.find`` and ``package-dir`` in pyproject.toml work together.

pyproject.toml holds all the metadata and the package configuration.  Two parts of
it do not combine on their own:

* ``[tool.setuptools.packages.find]`` discovers the packages, so a new subpackage
  of autopar or costmodel ships without a package list to update;
* ``[tool.setuptools.package-dir]`` installs a folder under another name: the
  repository's top-level ``configs/`` becomes the package ``autopar.configs``
  (read with ``importlib.resources`` by ``autopar.models.config_dir`` and ``costmodel.profiles_dir``).

Discovery only finds a package in the folder its name spells, and pyproject cannot
list one beside the found ones, so ``_MappedPackagesDistribution`` adds each
package-dir entry that discovery left out, with the folders under it as namespace
packages (what ``packages.find`` with its default ``namespaces = true`` does for the
rest).  Nothing else lives here; ``pip install -e .`` and ``pip wheel .`` both run it.
"""

from __future__ import annotations

import os

from setuptools import find_namespace_packages, setup
from setuptools.dist import Distribution

_ROOT = os.path.dirname(os.path.abspath(__file__))


class _MappedPackagesDistribution(Distribution):
    """A Distribution whose ``packages`` also hold the ``package_dir`` entries that discovery missed."""

    def parse_config_files(self, *args, **kwargs) -> None:
        super().parse_config_files(*args, **kwargs)  # applies pyproject.toml: runs packages.find
        packages = list(self.packages or [])
        for name, folder in (self.package_dir or {}).items():
            if not name or name in packages:
                continue  # "" is the root of the found packages; a found package is already listed
            path = os.path.join(_ROOT, folder)
            if not os.path.isfile(os.path.join(path, "__init__.py")):
                raise ValueError(
                    f"pyproject.toml [tool.setuptools.package-dir]: {name!r} maps to {folder!r}, "
                    f"expected a folder with an __init__.py, got none at {path}; add the file or fix the mapping"
                )
            packages += [name, *(f"{name}.{sub}" for sub in find_namespace_packages(where=path))]
        self.packages = packages


setup(distclass=_MappedPackagesDistribution)
