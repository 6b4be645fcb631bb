"""`python -m ampx.o1.lists [--opt-levels]`: print docs/cast-lists.md (or docs/opt-levels.md).

One job: regenerate the two generated doc pages from the code (`ampx lists` is the
interactive view of the same tables).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the requested markdown page; `--help` prints usage."""
    parser = argparse.ArgumentParser(
        prog="python -m ampx.o1.lists",
        description="Print the markdown of docs/cast-lists.md (O1's cast lists), or with "
                    "--opt-levels that of docs/opt-levels.md, generated from the code.",
        epilog="example:\n  python -m ampx.o1.lists > docs/cast-lists.md\n"
               "  python -m ampx.o1.lists --opt-levels > docs/opt-levels.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--opt-levels", action="store_true",
                        help="print the opt-level table page instead")
    args = parser.parse_args(argv)
    from ampx import _docs
    from ampx.o1 import lists

    sys.stdout.write(_docs.opt_levels_markdown() if args.opt_levels else lists.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
