"""``python -m kernreg``: the same command line as the ``kernreg`` script."""

from kernreg.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
