"""The package version, in a module of its own: any module can read it without importing the package,
and pyproject.toml reads it from here."""

__version__ = "0.1.0"
