"""Fuzzing of every wire decoder with hypothesis (see ``_harness`` and ``make_corpus``)."""
