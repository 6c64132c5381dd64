"""Who `elasticflow up`'s ranks run as: an unprivileged account by default.

Ranks run users' model code. As root they read the scheduler's store, other
runs' checkpoints, Prefect's database and /etc/shadow (issue 43). So `up`,
run as root, gives the worker `ELASTICFLOW_RANK_USER`: the account named by
`--rank-user` (or that variable), else `elasticflow-rank`, created here with
`useradd` if missing. Where that account cannot run the ranks (no `useradd`,
Python, the project or the home out of its reach) `up` refuses and says how;
`--rank-user root` is the explicit opt-out. A stack that is not root cannot
switch users: its ranks run as its own, unprivileged, user.

What each run's ranks may then reach (their run's folders, through a group of
the run's own, and nothing else of the stack's) is flows/training/launch/identity.py's.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from flows.training.launch.identity import RANK_USER_ENV, unreachable

DEFAULT_ACCOUNT = "elasticflow-rank"
OPT_OUT = "root"


class RankAccountError(ValueError):
    """The ranks' account cannot be used here; the message says how to proceed."""


@dataclass(frozen=True)
class RankAccount:
    """The outcome: `user` for the worker's ELASTICFLOW_RANK_USER (None: not set,
    ranks run as the stack's user), and a line for the operator."""

    user: str | None
    said: str


def exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def create(name: str) -> None:
    """A system account with no home, no login shell and a group of its own."""
    useradd = shutil.which("useradd") or next((p for p in ("/usr/sbin/useradd", "/sbin/useradd")
                                               if os.access(p, os.X_OK)), None)
    if useradd is None:
        raise RankAccountError(
            f"ranks run users' code, and by default as the unprivileged account {name!r}, which does not exist and "
            f"cannot be created here (no useradd): create it (e.g. `adduser --system {name}`), or name another with "
            f"--rank-user NAME, or run the ranks as root with --rank-user {OPT_OUT}")
    done = subprocess.run([useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                           "--shell", "/usr/sbin/nologin", "--comment", "ElasticFlow training ranks", name],
                          capture_output=True, text=True)
    if done.returncode != 0 and not exists(name):  # a second `up` may have made it meanwhile
        raise RankAccountError(f"useradd {name} failed ({done.stderr.strip() or done.returncode}): create the "
                               f"account yourself, or run the ranks as root with --rank-user {OPT_OUT}")


def resolve(wanted: str | None, home: Path) -> RankAccount:
    """The ranks' account for a stack at `home`: `wanted` (`--rank-user`, else
    ELASTICFLOW_RANK_USER, else the default), made if it is the default and
    missing, and checked as the worker checks it, plus the home reachable."""
    from scheduler_service.worker.settings import rank_user_problem

    wanted = (wanted or os.environ.get(RANK_USER_ENV) or "").strip() or None
    if wanted == OPT_OUT:
        return RankAccount(None, "ranks run as root (--rank-user root): users' training code can read and change "
                                 "everything the stack can")
    if os.geteuid() != 0:
        if wanted is not None and wanted != pwd.getpwuid(os.geteuid()).pw_name:
            raise RankAccountError(f"--rank-user {wanted}: the stack runs as uid {os.geteuid()}, and only root can "
                                   "start processes as another user; run `up` as root, or leave --rank-user out")
        return RankAccount(None, "ranks run as this stack's own user (only root can switch them to another)")
    name = wanted or DEFAULT_ACCOUNT
    made = ""
    if not exists(name):
        if wanted is not None and wanted != DEFAULT_ACCOUNT:
            raise RankAccountError(f"--rank-user {name}: no such user on this machine; create it, or leave "
                                   f"--rank-user out to have `up` create {DEFAULT_ACCOUNT!r}")
        create(name)
        made = " (created)"
    how = f"; or run the ranks as root with --rank-user {OPT_OUT}"
    problem = rank_user_problem(name)
    if problem is not None:
        raise RankAccountError(f"ranks run users' code as {name!r}, an unprivileged account, by default; it cannot "
                               f"run them here: {problem}{how}")
    blocker = unreachable(home)  # the home itself the worker opens for passing
    if blocker is not None:
        raise RankAccountError(f"ranks run users' code as {name!r} by default, and reach their run's folders under "
                               f"the home {home}; {blocker} lets no other user through: choose a --home others may "
                               f"pass through (e.g. /var/lib/elasticflow){how}")
    return RankAccount(name, f"ranks run as the unprivileged account {name!r}{made}, each run with a group of its "
                             "own (--rank-user root opts out)")
