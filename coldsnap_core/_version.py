"""coldsnap's release version: the one place it is written (``pyproject.toml`` reads it from here when the
distribution is built, so the installed distribution's metadata says the same)."""

__version__ = "0.1.0"
