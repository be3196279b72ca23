"""Unit tests, one file per module of src/ddp_sigterm/ (``core/`` for ``_core/``), named after it: one process,
no process group; what needs a fresh interpreter starts one. The multi-process scenarios are tests/test_*.py."""
