"""The package version, in a module of its own so that stages can read it without importing
the package (whose __init__ loads the public API)."""
__version__ = "0.1.0"
