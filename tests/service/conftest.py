"""The service tests use the shared `stack` fixture (tests/stack.py)."""

from tests.stack import MLP_CURVE, POOL, ROOT, Stack, _kill_processes_of, _stop  # noqa: F401
