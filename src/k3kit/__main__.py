"""`python -m k3kit`: the same command line as the installed `k3kit` script."""

from __future__ import annotations

import sys

from k3kit.cli import main

if __name__ == "__main__":
    sys.exit(main())
