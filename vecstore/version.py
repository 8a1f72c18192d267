"""The package's version (its one source: ``pyproject.toml`` reads it from here)."""

__version__ = "0.1.0"
