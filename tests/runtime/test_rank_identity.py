"""Ranks run users' code as an unprivileged account (`ELASTICFLOW_RANK_USER`,
issue 24): they reach their own run's checkpoint and control folders and
nothing else of the scheduler's (its store, its logs, other runs' folders),
and a run still trains, resizes and resumes from its checkpoints.

Needs root (only root switches users) and a checkout the account can read;
skips saying which is missing. Where the interpreter's own library is out of
the account's reach (a Python under /root, as on this project's machines),
the ranks get a readable copy of it on their PYTHONPATH: what an operator
does by installing Python where the rank user can read it (the worker refuses
the setting otherwise).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.training.launch.identity import RANK_USER_ENV, check_user, claim_group, gid_range, unreachable
from flows.training.launch.standby import FORKSERVER_ENV
from flows.training.coordinator.runtime import run_training
from tests.runtime.conftest import small_mlp

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
USER = "nobody"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root: only root starts processes as another user"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no user {USER!r} on this machine"
    for needed in (ROOT, Path(sys.prefix)):
        blocker = unreachable(needed / "x")
        if blocker is not None:
            return f"{USER} cannot reach {needed} ({blocker} lets no one else through)"
    return None


def _readable_stdlib(into: Path) -> list[str]:
    """PYTHONPATH entries with the standard library, if the account cannot
    read the interpreter's: a copy under `into` (about 75 MB, a second)."""
    stdlib = Path(os.__file__).parent
    if unreachable(stdlib / "x") is None:
        return []
    skip = shutil.ignore_patterns("site-packages", "test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip")
    shutil.copytree(stdlib, into / "stdlib", ignore=skip)
    return [str(into / "stdlib"), str(into / "stdlib" / "lib-dynload")]


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A home where the stack keeps what it keeps (store, logs), on a path
    others may pass through (pytest's own tmp folder is 0700)."""
    why = _why_not()
    if why:
        pytest.skip(why)
    folder = Path(tempfile.mkdtemp(prefix="ef-identity-"))
    folder.chmod(0o711)
    home = folder / "home"
    home.mkdir(mode=0o700)
    (home / "elasticflow.db").write_bytes(b"SQLite format 3\0")
    (home / "elasticflow.db").chmod(0o600)
    (home / "logs").mkdir(mode=0o700)
    (home / "logs" / "worker.log").write_text("worker\n")
    monkeypatch.setenv("ELASTICFLOW_HOME", str(home))
    monkeypatch.setenv(RANK_USER_ENV, USER)
    extra = _readable_stdlib(folder)
    if extra:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [*extra, os.environ.get("PYTHONPATH")])))
        # Ranks started cold, then: one forked from the fork server goes on importing the standard
        # library from where that server's interpreter found it (a package's submodules follow it).
        monkeypatch.delenv(FORKSERVER_ENV, raising=False)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_bad_settings_are_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=f"{RANK_USER_ENV}='no-such-user-here': no such user"):
        check_user("no-such-user-here")
    with pytest.raises(ValueError, match=f"{RANK_USER_ENV}='root' is root"):
        check_user("root")
    with pytest.raises(ValueError, match="FIRST-LAST"):
        gid_range("12-3")


def test_each_run_gets_a_group_of_its_own_and_keeps_it(tmp_path: Path) -> None:
    gids = (5000, 5002)
    first, second = claim_group("run-a", tmp_path, gids), claim_group("run-b", tmp_path, gids)
    assert first != second and claim_group("run-a", tmp_path, gids) == first
    claim_group("run-c", tmp_path, gids)
    with pytest.raises(RuntimeError, match="every gid"):
        claim_group("run-d", tmp_path, gids)


def test_a_rank_reaches_its_own_folders_and_nothing_else_of_the_scheduler(base: Path) -> None:
    home = base / "home"
    victim = small_mlp(base / "victim", iterations=8, checkpoint_interval=4,
                       checkpoint_store=str(home / "checkpoints"), control_dir=str(home / "control"))
    assert run_training(victim, "victim").status == "completed"
    victim_ck, victim_ctl = home / "checkpoints" / "victim", home / "control" / "victim"
    checkpoint = next(victim_ck.glob("*.pt"))
    attempts = {
        "read the store": ["read", str(home / "elasticflow.db")],
        "rewrite the store": ["append", str(home / "elasticflow.db")],
        "list the logs": ["list", str(home / "logs")],
        "read a log": ["read", str(home / "logs" / "worker.log")],
        "list the home": ["list", str(home)],
        "list the runs' checkpoints": ["list", str(home / "checkpoints")],
        "read another run's checkpoint": ["read", str(checkpoint)],
        "write in another run's checkpoints": ["write", str(victim_ck)],
        "write in another run's control folder": ["write", str(victim_ctl)],
        "read the group claims": ["list", str(home / "rank-groups")],
        "write in its own checkpoints": ["write", str(home / "checkpoints" / "snoop")],
        "write in its own control folder": ["write", str(home / "control" / "snoop")],
    }
    snoop = small_mlp(base / "snoop", model="tests.runtime.user_models:snooper",
                      model_kwargs={"attempts": attempts}, dataset="synthetic-vectors", iterations=4,
                      checkpoint_store=str(home / "checkpoints"), control_dir=str(home / "control"))
    assert run_training(snoop, "snoop").status == "completed"
    (report,) = (home / "control" / "snoop" / "segments").glob("*/attempts.json")
    seen = json.loads(report.read_text())
    assert seen["uid"] == pwd.getpwnam(USER).pw_uid and seen["groups"] != [0]
    own = {"write in its own checkpoints", "write in its own control folder"}
    assert {k: seen[k] for k in own} == {k: "ok" for k in own}
    assert {k: seen[k] for k in attempts if k not in own} == {k: "PermissionError" for k in attempts if k not in own}
    assert not list(victim_ck.glob("planted-by-*")) and not list(victim_ctl.glob("planted-by-*"))


def test_a_run_as_the_rank_user_trains_resizes_and_resumes(base: Path) -> None:
    home = base / "home"
    params = small_mlp(base, gpu_plan=[[0, 1], [0], [0, 1]], switch_at=[8, 16], iterations=24,
                       checkpoint_store=str(home / "checkpoints"), control_dir=str(home / "control"))
    result = run_training(params, "elastic")
    assert result.status == "completed" and result.iterations == 24
    assert [s.gpus for s in result.segments] == [[0, 1], [0], [0, 1]]
    assert [s.start_iteration for s in result.segments] == [0, 8, 16]  # each resumed from the last checkpoint
    owners = {p.stat().st_uid for p in (home / "checkpoints" / "elastic").glob("*.pt")}
    assert owners == {pwd.getpwnam(USER).pw_uid}
    folder = (home / "checkpoints" / "elastic").stat()
    assert folder.st_mode & 0o7777 == 0o2770 and folder.st_gid != 0  # the run's own group
