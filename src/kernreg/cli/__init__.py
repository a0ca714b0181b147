"""The ``kernreg`` command line: ``list``, ``explain``, ``check`` and ``platform``.

It needs the ``cli`` extra (click and rich); the core never imports this package.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["MISSING_EXTRAS", "main"]

MISSING_EXTRAS = "kernreg's command line needs its extras: pip install 'kernreg[cli]'"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kernreg`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    try:
        import click  # noqa: F401
        import rich  # noqa: F401
    except ImportError:
        print(MISSING_EXTRAS, file=sys.stderr)
        return 2
    from kernreg.cli._app import run

    for stream in (sys.stdout, sys.stderr):
        # A legacy locale or PYTHONIOENCODING=ascii: an origin, target or reason the
        # encoding cannot hold is written escaped (\u03bb), not a UnicodeEncodeError.
        if callable(reconfigure := getattr(stream, "reconfigure", None)):
            reconfigure(errors="backslashreplace")
    return run(sys.argv[1:] if argv is None else argv)
