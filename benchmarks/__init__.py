"""Benchmarks: ``python -m benchmarks --help``. Side-by-side cases against plain Dramatiq/Celery (issue 6)."""
