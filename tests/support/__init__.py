"""Helpers the tests share (the tests import nothing from benchmarks/ except the benchmarks' own tests)."""
