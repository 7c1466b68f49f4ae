"""autopar's data files, installed as the package ``autopar.configs``.

This folder is the one copy of the data: ``devices/<name>.toml`` are the device
profiles (``costmodel.load_profile``) and ``models/<name>.toml`` the built-in
models (``autopar.models``).  pyproject.toml maps it to ``autopar.configs``
(``[tool.setuptools.package-dir]``, with its ``*.toml`` as package data), so an
editable install reads this folder and a wheel carries a copy; code finds it with
``autopar.models.config_dir()`` and ``costmodel.profiles_dir()`` (``importlib.resources``,
or ``$AUTOPAR_CONFIG_DIR``),
never by a path relative to the checkout.  No code lives here.
"""
