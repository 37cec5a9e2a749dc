"""The version of accelkit: one place, importable from any layer without importing the package's
public names (``accelkit.__version__`` re-exports it)."""

__version__ = "0.1.0"
