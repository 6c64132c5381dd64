"""Ranks run as an unprivileged account by default (issue 43, item 4): `up`,
run as root, creates `elasticflow-rank` if missing and gives it to the
worker; where that account cannot run the ranks it refuses, saying how, and
`--rank-user root` is the explicit opt-out. What the account's ranks can
reach: tests/runtime/test_rank_identity.py."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from scheduler_service.stack.rank_account import DEFAULT_ACCOUNT, RankAccountError, resolve
from scheduler_service.worker.settings import rank_user_problem

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="only root switches users or creates accounts")


@pytest.fixture
def passable_home(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home other users may pass through to (pytest's tmp folder is 0700)."""
    monkeypatch.delenv("ELASTICFLOW_RANK_USER", raising=False)
    folder = Path(tempfile.mkdtemp(prefix="ef-account-"))
    folder.chmod(0o711)
    return folder / "home"


@ROOT_ONLY
def test_up_creates_the_default_account_and_uses_it_or_refuses_saying_how(passable_home: Path) -> None:
    try:
        account = resolve(None, passable_home)
    except RankAccountError as exc:  # made, but this machine keeps it from Python (a Python under /root)
        assert pwd.getpwnam(DEFAULT_ACCOUNT).pw_uid != 0
        assert rank_user_problem(DEFAULT_ACCOUNT) is not None
        assert "install Python" in str(exc) and "--rank-user root" in str(exc)
        return
    entry = pwd.getpwnam(DEFAULT_ACCOUNT)
    assert account.user == DEFAULT_ACCOUNT and entry.pw_uid != 0 and entry.pw_shell.endswith("nologin")
    assert resolve(None, passable_home).user == DEFAULT_ACCOUNT  # made once, used ever after


@ROOT_ONLY
def test_root_is_an_explicit_opt_out_and_an_unknown_account_is_refused(passable_home: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    opted = resolve("root", passable_home)
    assert opted.user is None and "root" in opted.said
    with pytest.raises(RankAccountError, match="--rank-user no-such-user-here: no such user"):
        resolve("no-such-user-here", passable_home)
    monkeypatch.setenv("ELASTICFLOW_RANK_USER", "root")  # the variable opts out as the option does
    assert resolve(None, passable_home).user is None


@ROOT_ONLY
def test_up_refuses_before_starting_anything_where_the_ranks_account_cannot_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler_service.cli import _register, app

    _register()
    monkeypatch.delenv("ELASTICFLOW_RANK_USER", raising=False)
    home = tmp_path / "home"  # under pytest's 0700 folder: no other user reaches it
    result = CliRunner().invoke(app, ["up", "--home", str(home), "--port", "1"])
    assert result.exit_code == 2, result.output
    assert "--rank-user root" in result.output and DEFAULT_ACCOUNT in result.output
    assert not (home / "logs").exists()  # nothing started
