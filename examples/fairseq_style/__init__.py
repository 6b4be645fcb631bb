"""A small trainer in fairseq's shape that uses ampx only through its object API.

See README.md. Run from the repository root::

    python -m examples.fairseq_style.train --arch mlp --optimizer adam --opt-level O2
"""
