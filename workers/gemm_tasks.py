"""Celery task for the GEMM benchmark (filled in by the GEMM wiring work)."""
