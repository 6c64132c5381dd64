"""The stack's API secret (issue 43, item 5): generated once into the home,
0600, the same at every later `up`; `client.env` holds what a user's shell
loads. That the server asks for it: tests/runtime/test_supervision.py."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from scheduler_service.stack.secret import api_auth_string, client_env_file, load_client_env, load_hint


def test_the_secret_is_made_once_private_and_reused(tmp_path: Path) -> None:
    first = api_auth_string(tmp_path)
    assert first.startswith("elasticflow:") and len(first) > 40
    assert stat.S_IMODE((tmp_path / "api-auth").stat().st_mode) == 0o600
    assert api_auth_string(tmp_path) == first  # a restart keeps the server, the worker and users' clients agreeing
    (tmp_path / "other").mkdir()
    assert api_auth_string(tmp_path / "other") != first  # each stack its own


def test_client_env_is_private_and_a_shell_loads_it(tmp_path: Path, monkeypatch) -> None:
    path = client_env_file(tmp_path, "http://127.0.0.1:4200/api", "elasticflow:s3cr3t")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    shown = subprocess.run(["sh", "-c", f"{load_hint(tmp_path)}; env"], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"]}).stdout.splitlines()
    assert "PREFECT_API_URL=http://127.0.0.1:4200/api" in shown
    assert "PREFECT_API_AUTH_STRING=elasticflow:s3cr3t" in shown
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert load_client_env(tmp_path)
    assert os.environ["PREFECT_API_AUTH_STRING"] == "elasticflow:s3cr3t"
