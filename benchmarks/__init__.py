"""The scripts that measure the figures the README quotes, each run from the repository root as
``python -m benchmarks.NAME`` and writing its results file under ``benchmarks/results/``."""
