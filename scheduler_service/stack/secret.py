"""The stack's API secret: Prefect's own basic authentication, on.

Without it any local user could call the API: one `PATCH /api/deployments/<id>`
setting a job variable made every later run execute the caller's code as the
stack's user (issue 43). Prefect 3.9.1's server, given
`PREFECT_SERVER_API_AUTH_STRING`, answers 401 to every API request but
`GET /api/health` and `/api/ready` whose `Authorization: Basic <base64>`
header does not decode to exactly that string (`prefect/server/api/server.py`,
`token_validation`); a client sends it from `PREFECT_API_AUTH_STRING`
(`prefect/client/orchestration`). The string is opaque to the server; the
UI, which then asks for it at login, wants it whole.

The secret is generated once into `$ELASTICFLOW_HOME/api-auth` (0600) and
reused by every `up` after, so a restarted server and the worker, the flow
processes and users' clients keep agreeing. `client.env` (0600) holds what a
user's shell needs: `set -a; . $ELASTICFLOW_HOME/client.env; set +a`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"
SECRET_FILE = "api-auth"
CLIENT_ENV_FILE = "client.env"


def _write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by its owner alone from the first byte on."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(partial, path)


def api_auth_string(home: Path) -> str:
    """The stack's secret, made at the first `up` and the same ever after."""
    path = home / SECRET_FILE
    if path.exists():
        path.chmod(0o600)
        found = path.read_text().strip()
        if found:
            return found
    made = f"elasticflow:{secrets.token_urlsafe(32)}"
    _write_private(path, made + "\n")
    return made


def client_env_file(home: Path, api_url: str, auth_string: str) -> Path:
    """`$home/client.env`: the settings a user's Prefect client needs, `KEY=value` lines."""
    path = home / CLIENT_ENV_FILE
    _write_private(path, f"PREFECT_API_URL={api_url}\n{CLIENT_AUTH_ENV}={auth_string}\n")
    return path


def load_client_env(home: Path) -> bool:
    """A CLI run by the stack's user (`elasticflow audit`): take the stack's
    client settings from its home where the environment has none. Whether it did."""
    path = home / CLIENT_ENV_FILE
    if os.environ.get(CLIENT_AUTH_ENV) or not path.is_file():
        return False
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key in ("PREFECT_API_URL", CLIENT_AUTH_ENV):
            os.environ.setdefault(key, value)
    return True


def load_hint(home: Path) -> str:
    return f"set -a; . {home / CLIENT_ENV_FILE}; set +a"
