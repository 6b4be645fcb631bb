"""`python -m ampx ...`: the command line (see `ampx.cli`)."""

from __future__ import annotations

from ampx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
