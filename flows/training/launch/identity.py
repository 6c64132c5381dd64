"""Who a run's ranks are: an unprivileged account, apart from the scheduler
and from every other run.

The ranks run users' model code. Run as the stack's own account (root, on a
machine set up as the README does), that code could read and rewrite the
scheduler's store, every run's control channel and every checkpoint. With
`ELASTICFLOW_RANK_USER` set, a rank drops to that user before it reads its
segment, and keeps one supplementary group of its run's own (a gid claimed
from `ELASTICFLOW_RANK_GIDS`, no /etc/group entry needed). The run's
checkpoint and control folders belong to that group (setgid, 2770): a rank
reaches its own run's folders through the group, and nothing else under the
home: the home and its `checkpoints` and `control` folders let others pass
through (0711) but not list, the store and the logs stay the stack's (0600,
0700), and other runs' folders belong to other groups.

Standard library and pydantic only: a standby imports this before torch.
"""

from __future__ import annotations

import os
import pwd
import stat
import zlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict

RANK_USER_ENV = "ELASTICFLOW_RANK_USER"
RANK_GIDS_ENV = "ELASTICFLOW_RANK_GIDS"
DEFAULT_GIDS = (3_000_000, 3_999_999)
SHARED_DIR = 0o2770  # setgid: what is created inside belongs to the run's group too
PASS_THROUGH = 0o111  # others may traverse the home's folders to their run's, never list them


class RankIdentity(BaseModel):
    """The account a run's ranks switch to; carried in their `StandbyOrder`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    user: str
    uid: int
    gid: int
    run_gid: int

    def assume(self, workdir: Path) -> None:
        """Become this account for good (groups first: after setuid they can no
        longer change), with `workdir` as the working directory and HOME."""
        os.setgroups([self.run_gid])
        os.setgid(self.gid)
        os.setuid(self.uid)
        os.chdir(workdir)
        os.environ.update(HOME=str(workdir), USER=self.user, LOGNAME=self.user)

    def share(self, folder: Path, contents: bool = True) -> None:
        """`folder` (made if missing), and with `contents` what is in it,
        reachable by the run's ranks and by nobody else but the stack: folders
        theirs to write in, the stack's files theirs to read (their own files
        are theirs already)."""
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in [folder, *(folder.rglob("*") if contents else ())]:
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                continue
            os.chown(path, -1, self.run_gid)
            os.chmod(path, SHARED_DIR if stat.S_ISDIR(mode) else stat.S_IMODE(mode) & 0o700 | 0o040)

    def share_file(self, path: Path) -> None:
        """One of the stack's files, readable by the run's ranks (a resize in place's word)."""
        os.chown(path, -1, self.run_gid)
        os.chmod(path, 0o640)

    def release(self, home: Path) -> None:
        """Give the run's group back (a profile's scratch is gone with it)."""
        (claims_dir(home) / str(self.run_gid)).unlink(missing_ok=True)


def claims_dir(home: Path) -> Path:
    return home / "rank-groups"


def configured_user(env: dict[str, str] | None = None) -> str | None:
    return ((os.environ if env is None else env).get(RANK_USER_ENV) or "").strip() or None


def gid_range(text: str | None) -> tuple[int, int]:
    """`FIRST-LAST`, the operator's range of gids free for runs' groups."""
    if not text or not text.strip():
        return DEFAULT_GIDS
    first, sep, last = text.strip().partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit() or int(first) > int(last):
        raise ValueError(f"{RANK_GIDS_ENV}={text!r}: expected FIRST-LAST, two whole numbers, FIRST <= LAST")
    return int(first), int(last)


def check_user(name: str) -> pwd.struct_passwd:
    """The account named, if the stack may switch to it: it exists, is not
    root, and the stack runs as root (only root can switch users)."""
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"{RANK_USER_ENV}={name!r}: no such user on this machine") from None
    if account.pw_uid == 0:
        raise ValueError(f"{RANK_USER_ENV}={name!r} is root: name an unprivileged user")
    if os.geteuid() != 0:
        raise ValueError(f"{RANK_USER_ENV}={name!r}: the stack runs as uid {os.geteuid()}, and only root can "
                         "start processes as another user; unset it (ranks then run as the stack's user)")
    return account


def claim_group(run_key: str, home: Path, gids: tuple[int, int]) -> int:
    """A gid of `gids` that is this run's alone: a claim file per gid, created
    exclusively; a run asking again (a relaunched flow process) gets its own
    back. Claims outlive the run, as its checkpoints do."""
    folder = claims_dir(home)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    first, last = gids
    span = last - first + 1
    start = zlib.crc32(run_key.encode()) % span
    for step in range(span):
        gid = first + (start + step) % span
        path = folder / str(gid)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            if path.read_text() == run_key:
                return gid
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(run_key)
        return gid
    raise RuntimeError(f"every gid of {RANK_GIDS_ENV} ({first}-{last}) is claimed by a run; widen the range")


def identity_for(run_key: str, home: Path, env: dict[str, str] | None = None) -> RankIdentity | None:
    """The account this run's ranks take (None: unset, they stay the stack's
    user), its group claimed, and the home opened for passing through."""
    name = configured_user(env)
    if name is None:
        return None
    account = check_user(name)
    gid = claim_group(run_key, home, gid_range((os.environ if env is None else env).get(RANK_GIDS_ENV)))
    return RankIdentity(user=name, uid=account.pw_uid, gid=account.pw_gid, run_gid=gid)


def for_run(run_key: str, folders: list[Path], home: Path, env: dict[str, str] | None = None) -> RankIdentity | None:
    """The account of this run's ranks (None: not configured), with the run's
    `folders` (its control folder, its checkpoint folder on this machine)
    theirs to use and the folders of the home on the way to them passable."""
    identity = identity_for(run_key, home, env)
    if identity is None:
        return None
    home = home.resolve()
    for folder in folders:
        folder = folder.resolve()
        for parent in reversed(folder.parents):
            if parent == home or home in parent.parents:
                open_for_passing(parent)
        blocker = unreachable(folder.parent)
        if blocker is not None:
            raise PermissionError(
                f"{RANK_USER_ENV}={identity.user}: this run's ranks could not reach {folder}: {blocker} lets no "
                f"other user through; allow it (chmod o+x {blocker}) or keep ELASTICFLOW_HOME and the run's "
                "checkpoint store under folders that do")
        identity.share(folder)
    return identity


def open_for_passing(folder: Path) -> None:
    """Let others traverse `folder` (not list it): a stack-made folder on the
    way from `/` to a run's own."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & PASS_THROUGH != PASS_THROUGH:
        os.chmod(folder, mode | PASS_THROUGH)


def unreachable(folder: Path) -> Path | None:
    """The first folder on the way to `folder` that others cannot traverse."""
    for parent in reversed(folder.resolve().parents):
        if not parent.stat().st_mode & stat.S_IXOTH:
            return parent
    return None
