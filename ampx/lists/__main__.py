"""`python -m ampx.lists [--opt-levels]`: print docs/cast-lists.md (or docs/opt-levels.md)."""

from __future__ import annotations

import sys

from ampx import lists, opt_levels

if __name__ == "__main__":
    if "--opt-levels" in sys.argv[1:]:
        sys.stdout.write(opt_levels.markdown())
    else:
        sys.stdout.write(lists.markdown())
