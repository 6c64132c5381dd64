"""Checkpoint storage on any fsspec URL, without importing Prefect.

Worker processes import this module directly: Prefect adds seconds to every
worker start, and a worker only needs bytes in and bytes out. The Prefect block
in `elasticflow_block.block` is a thin configuration wrapper around it. Torch is
imported only when a checkpoint is saved or loaded: the package is imported by
the store, the worker and pipelines, which never touch a payload.

Layout under the root URL, one folder per training run (the flow run id)::

    ROOT/RUN_KEY/ckpt-0000000120.pt       torch.save payload
    ROOT/RUN_KEY/ckpt-0000000120.sha256   hex digest of the payload, written last

A checkpoint exists only once both files are in place: the payload is written to
a temporary name and renamed, then the digest is written the same way, so a
crash mid-write leaves at most an orphan temp file that is never read.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

log = logging.getLogger("elasticflow.checkpoint")

_NAME = re.compile(r"ckpt-(\d{10})\.pt$")


class CheckpointCorrupt(RuntimeError):
    """The payload does not match its recorded digest or cannot be unpickled."""


@dataclass(frozen=True)
class CheckpointInfo:
    """Where one checkpoint lives and how long its save or load took."""

    run_key: str
    iteration: int
    path: str
    size_bytes: int
    seconds: float


def default_root() -> str:
    """`$ELASTICFLOW_HOME/checkpoints` (default `~/.elasticflow/checkpoints`)."""
    from elasticflow_block.home import elasticflow_home

    return str(elasticflow_home() / "checkpoints")


def resolve_checkpoint_url(value: str | None) -> str:
    """A URL/path as is; otherwise the name of a saved `CheckpointStore` block.

    Here rather than in the training runtime because the pipeline task finds a
    finished run's checkpoint the same way, and must not import the runtime.
    """
    if not value:
        return default_root()
    if "://" in value or value.startswith(("/", ".", "~")) or os.sep in value:
        return os.path.expanduser(value)
    from elasticflow_block.block import CheckpointStore

    return CheckpointStore.load(value).url  # type: ignore[union-attr]


class _HashingWriter:
    """Hashes bytes on their way to the file: one pass, no in-memory copy of the payload."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        self.fh.write(data)
        return len(data)

    def flush(self) -> None:
        self.fh.flush()


class CheckpointStorage:
    """Save, verify, list and prune checkpoints of training runs under one URL."""

    def __init__(self, url: str | None = None, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1: pruning the only checkpoint loses the run")
        self.url = url or default_root()
        self.keep = keep
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def _dir(self, run_key: str) -> str:
        if not run_key or "/" in run_key or run_key.startswith("."):
            raise ValueError(f"invalid run key {run_key!r}")
        return f"{self.root.rstrip('/')}/{run_key}"

    def folder(self, run_key: str) -> str:
        """Where a run's checkpoints go, as a person would look for them."""
        path = self._dir(run_key)
        return path if self._local() else self.fs.unstrip_protocol(path)

    def local_folder(self, run_key: str) -> Path | None:
        """The run's folder on this machine's file system; None for a remote store."""
        return Path(self._dir(run_key)) if self._local() else None

    def _local(self) -> bool:
        protocol = self.fs.protocol
        return "file" in ((protocol,) if isinstance(protocol, str) else protocol)

    def iterations(self, run_key: str) -> list[int]:
        """Complete checkpoints of a run (payload and digest present), oldest first."""
        folder = self._dir(run_key)
        if not self.fs.exists(folder):
            return []
        names = {Path(p).name for p in self.fs.ls(folder, detail=False)}
        found = []
        for name in names:
            match = _NAME.match(name)
            if match and name.replace(".pt", ".sha256") in names:
                found.append(int(match.group(1)))
        return sorted(found)

    def _paths(self, run_key: str, iteration: int) -> tuple[str, str]:
        base = f"{self._dir(run_key)}/ckpt-{iteration:010d}"
        return f"{base}.pt", f"{base}.sha256"

    def _tmp(self, path: str) -> str:
        return f"{path}.tmp-{uuid.uuid4().hex[:8]}"

    def _private(self, path: str, mode: int) -> None:
        """A model's weights are the user's: on a local disk only they may read
        them, whatever the umask of the process that saved them (a notebook, a
        pipeline task). Remote stores have their own access control."""
        if self._local():
            try:
                os.chmod(path, mode)
            except OSError:
                pass

    def save(self, run_key: str, iteration: int, state: dict[str, Any]) -> CheckpointInfo:
        """Write `state` as the checkpoint at `iteration`, then prune old ones."""
        start = time.perf_counter()
        data_path, sum_path = self._paths(run_key, iteration)
        self.fs.makedirs(self._dir(run_key), exist_ok=True)
        self._private(self._dir(run_key), 0o700)
        tmp = self._tmp(data_path)
        import torch

        with self.fs.open(tmp, "wb") as fh:
            writer = _HashingWriter(fh)
            torch.save(state, writer)
        self.fs.mv(tmp, data_path)
        tmp = self._tmp(sum_path)
        with self.fs.open(tmp, "wb") as fh:
            fh.write(writer.sha.hexdigest().encode())
        self.fs.mv(tmp, sum_path)
        for path in (data_path, sum_path):
            self._private(path, 0o600)
        self.prune(run_key)
        return CheckpointInfo(run_key, iteration, data_path, writer.size, time.perf_counter() - start)

    def load(self, run_key: str, iteration: int) -> tuple[dict[str, Any], CheckpointInfo]:
        """Load and verify one checkpoint; raise `CheckpointCorrupt` if it fails."""
        start = time.perf_counter()
        data_path, sum_path = self._paths(run_key, iteration)
        with self.fs.open(data_path, "rb") as fh:
            payload = fh.read()
        with self.fs.open(sum_path, "rb") as fh:
            expected = fh.read().decode().strip()
        if hashlib.sha256(payload).hexdigest() != expected:
            raise CheckpointCorrupt(f"{data_path}: checksum mismatch")
        import torch

        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
        except Exception as exc:  # a matching digest over a bad pickle: still corrupt
            raise CheckpointCorrupt(f"{data_path}: {exc}") from exc
        return state, CheckpointInfo(run_key, iteration, data_path, len(payload), time.perf_counter() - start)

    def load_latest(self, run_key: str) -> tuple[dict[str, Any], CheckpointInfo] | None:
        """The newest checkpoint that verifies, falling back to older ones.

        A corrupt newest checkpoint costs at most the iterations since the
        previous one, which is better than failing the run; the warning says so.
        """
        for iteration in reversed(self.iterations(run_key)):
            try:
                return self.load(run_key, iteration)
            except (CheckpointCorrupt, OSError) as exc:
                log.warning(
                    "checkpoint unusable, falling back to the previous one run_key=%s iteration=%d error=%s",
                    run_key,
                    iteration,
                    exc,
                )
        return None

    def prune(self, run_key: str) -> list[int]:
        """Delete all but the newest `keep` checkpoints; return the deleted iterations."""
        doomed = self.iterations(run_key)[: -self.keep]
        for iteration in doomed:
            for path in self._paths(run_key, iteration):
                if self.fs.exists(path):
                    self.fs.rm(path)
        return doomed

    def delete_run(self, run_key: str) -> None:
        """Remove every checkpoint of a run (after it completed, if wanted)."""
        folder = self._dir(run_key)
        if self.fs.exists(folder):
            self.fs.rm(folder, recursive=True)
