"""Nothing the stack starts talks to a Prefect server other than the stack's:
with its environment and no API URL, a client fails loudly instead of
starting a temporary server of its own (Prefect's default profile does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scheduler_service.stack.local import stack_env

CLIENT = """
import asyncio
from prefect.client.orchestration import get_client
async def main():
    async with get_client() as client:
        await client.read_work_pools()
asyncio.run(main())
"""


def test_a_client_with_the_stacks_environment_and_no_api_url_fails_loudly(tmp_path: Path) -> None:
    env = {k: v for k, v in {**os.environ, **stack_env(tmp_path / "home", 1)}.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "No Prefect API URL provided" in done.stderr, done.stderr[-2000:]
    assert "temporary server" not in done.stdout + done.stderr
