"""The version of kernreg."""

__version__ = "0.1.0"
