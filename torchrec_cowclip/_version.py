"""The package version, one place for it (the root package and run folders read it)."""

__version__ = "0.1.0"
