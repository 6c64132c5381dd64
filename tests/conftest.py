from pathlib import Path

import pytest

from tests.stack import stack  # noqa: F401  (one real Prefect stack per test process, for every folder)

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def data_dir() -> Path:
    return DATA
