"""Overflow provenance: which parameters and modules a skipped step's inf/NaN came from
(`report`, `flags`, `forward`), one session's watch over them (`watch`) and what to do when
overflows persist (`policy`)."""
