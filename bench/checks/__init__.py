"""One-off GPU checks and table builders (each runs as ``python bench/checks/<name>.py`` from the repository root)."""
