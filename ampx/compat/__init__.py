"""Adapters for code written against other mixed-precision APIs (apex, fairseq)."""
