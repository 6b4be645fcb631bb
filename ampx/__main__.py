"""`python -m ampx ...`: the command line (see `ampx.cli.main`)."""

from __future__ import annotations

from ampx.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
