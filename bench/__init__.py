"""The GPU benchmarks: suites at the top level (each runs as ``python bench/<suite>.py`` from the repository root),
shared helpers in ``bench.lib``, one-off checks and table builders in ``bench.checks``."""
