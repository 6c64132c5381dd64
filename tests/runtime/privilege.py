"""What a process can see and expose, read from /proc: its initial
environment, the TCP sockets it listens on, the modes of files."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with (for a fork: its exec'd ancestor's)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def listening(pids: list[int]) -> list[str]:
    """`address:port` of every TCP socket (v4 and v6) these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.append(f"{_address(address, width)}:{int(port, 16)}")
    return found


def _address(hex_address: str, width: int) -> str:
    if width == 8:
        return ".".join(str(int(hex_address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return "[" + hex_address + "]"  # v6: any listener here is a failure; the raw form says which


def too_open(root: Path) -> list[str]:
    """Files and folders under `root` that others than the owner can read, write or enter."""
    found = []
    for path in [root, *root.rglob("*")]:
        try:
            mode = path.lstat().st_mode
        except OSError:  # gone meanwhile
            continue
        if stat.S_ISSOCK(mode) or stat.S_ISLNK(mode):
            continue
        if mode & 0o077:
            found.append(f"{path.relative_to(root)}: {stat.filemode(mode)}")
    return found
