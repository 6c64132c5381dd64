"""A throwaway PostgreSQL server from the distribution's binaries, for the
burst benchmark and its test: `elasticflow up --database` on something real
without asking an operator for a database. Not for production: trust
authentication on 127.0.0.1, data in a temporary folder removed afterwards.

`make test` installs the binaries where it can (infra/ensure-postgres.sh);
`binaries()` is None where there are none, and callers skip with that reason.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

NO_POSTGRES = "no PostgreSQL server binaries (Debian: apt-get install postgresql; make test tries)"


def binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@contextmanager
def throwaway_postgres(max_connections: int = 200, settings: dict[str, str] | None = None) -> Iterator[str]:
    """Start a server on a free port of 127.0.0.1; yields `postgresql://` URL of
    its `postgres` database. PostgreSQL refuses to run as root: as root it runs
    as the `postgres` account, in a folder that account owns. `settings` are
    server settings (`-c name=value`), e.g. a time zone."""
    from scheduler_service.stack.local import free_port

    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError(NO_POSTGRES)
    data = Path(tempfile.mkdtemp(prefix="elasticflow-pg-"))
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(data, "postgres")
    data.chmod(0o700)
    port = free_port()

    def run(*args: str) -> None:
        done = subprocess.run([*as_user, *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{Path(args[0]).name} failed: {done.stdout}{done.stderr}")

    try:
        run(str(bin_dir / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "elasticflow")
        run(str(bin_dir / "pg_ctl"), "-D", str(data / "db"), "-l", str(data / "server.log"), "-w", "-o",
            f"-h 127.0.0.1 -p {port} -k {data} -c max_connections={max_connections}"
            + "".join(f" -c {name}={value}" for name, value in (settings or {}).items()), "start")
        yield f"postgresql://elasticflow@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(data, ignore_errors=True)
