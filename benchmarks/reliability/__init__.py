"""Reliability runs: faults, fuzzing, overload, a soak (``python -m benchmarks.reliability.NAME``)."""
