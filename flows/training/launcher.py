"""Launch one training segment as `world_size` worker processes and supervise it.

Each worker is a fresh `python -m flows.training.worker` process (never a fork
of the flow process, which runs Prefect's threads). A "GPU" is a CUDA device id
passed through CUDA_VISIBLE_DEVICES; on a CPU-only machine it is a worker slot.
If any worker dies, the others are killed and the segment reports `crashed`:
the flow then relaunches from the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from flows.training.segment import SegmentResult, SegmentSpec, SegmentTimings

log = logging.getLogger("elasticflow.launcher")

ProgressCallback = Callable[[int, float, float], None]  # (iteration, loss, wall time)

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now, for the rendezvous store."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Segment:
    """A running segment: its processes, its folder, and how to stop it."""

    def __init__(self, spec: SegmentSpec, gpus: list[int], workdir: Path | None = None) -> None:
        if not gpus:
            raise ValueError("a segment needs at least one GPU / worker slot")
        self.spec, self.gpus = spec, list(gpus)
        self.dir = Path(tempfile.mkdtemp(prefix=f"segment-{spec.run_key[:12]}-", dir=workdir))
        (self.dir / "spec.json").write_text(spec.model_dump_json())
        self.procs: list[subprocess.Popen[bytes]] = []
        self.launch_t = 0.0
        self._progress_offset = 0

    def start(self) -> None:
        port = free_port()
        self.launch_t = time.time()
        world = len(self.gpus)
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                ELASTICFLOW_LAUNCH_T=repr(self.launch_t),
                ELASTICFLOW_GPUS=",".join(map(str, self.gpus)),
                # One device per worker: the worker always uses cuda:0 of what it sees.
                CUDA_VISIBLE_DEVICES=str(self.gpus[rank]) if self.spec.device == "cuda" else "",
                PYTHONPATH=os.pathsep.join(filter(None, [_REPO_ROOT, env.get("PYTHONPATH")])),
            )
            stderr = open(self.dir / f"rank{rank}.log", "wb")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "flows.training.worker", str(self.dir)],
                    env=env,
                    stdout=stderr,
                    stderr=subprocess.STDOUT,
                )
            )
            stderr.close()
        log.info("segment started run_key=%s gpus=%s port=%d dir=%s", self.spec.run_key, self.gpus, port, self.dir)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def request_stop(self) -> None:
        """Ask every worker to stop at the next iteration boundary (SIGTERM)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def kill(self, grace_s: float = 5.0) -> None:
        self.request_stop()
        deadline = time.time() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def poll_progress(self) -> list[dict[str, float]]:
        """New lines rank 0 wrote to progress.jsonl since the last poll."""
        path = self.dir / "progress.jsonl"
        if not path.exists():
            return []
        with open(path, "rb") as fh:
            fh.seek(self._progress_offset)
            data = fh.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._progress_offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def _log_tail(self, rank: int, chars: int = 2000) -> str:
        path = self.dir / f"rank{rank}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def wait(self, on_progress: ProgressCallback | None = None, poll_s: float = 0.05) -> SegmentResult:
        """Block until every worker exits; crash handling kills the survivors."""
        while True:
            codes = [p.poll() for p in self.procs]
            for line in self.poll_progress():
                if on_progress:
                    on_progress(int(line["iteration"]), float(line["loss"]), float(line["t"]))
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Survivors are stuck in a collective with a dead peer: no point
                # in a graceful stop, the last checkpoint is what we resume from.
                self.kill(grace_s=0.0)
                rank, code = failed[0]
                error = f"worker rank {rank} exited with {code}: {self._log_tail(rank)}"
                log.warning("segment crashed run_key=%s rank=%d code=%s", self.spec.run_key, rank, code)
                return SegmentResult(
                    gpus=self.gpus,
                    start_iteration=-1,
                    end_iteration=-1,
                    reason="crashed",
                    timings=SegmentTimings(launch_t=self.launch_t, end_t=time.time()),
                    error=error,
                )
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
        for line in self.poll_progress():
            if on_progress:
                on_progress(int(line["iteration"]), float(line["loss"]), float(line["t"]))
        result = SegmentResult.model_validate_json((self.dir / "result.json").read_text())
        result.gpus = self.gpus
        return result


def run_segment(
    spec: SegmentSpec, gpus: list[int], on_progress: ProgressCallback | None = None, workdir: Path | None = None
) -> SegmentResult:
    """Launch, supervise and collect one segment."""
    segment = Segment(spec, gpus, workdir)
    segment.start()
    try:
        return segment.wait(on_progress)
    except BaseException:
        segment.kill(grace_s=2.0)
        raise
