"""Fixtures for the training runtime tests: every test gets its own
ELASTICFLOW_HOME, checkpoint folder and control folder, so runs never share state."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from flows.training.params import TrainParameters
from flows.training.supervision import PROGRESS_FILE, RunningSegment
from tests.stack import wait_fork_server


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread() -> None:
    """In-process torch work in tests is tiny; two OpenMP threads per xdist worker
    on two busy cores spin against each other and run ~50x slower."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fork server for this test process, as the worker runs one: the ranks
    of in-process runs are forked from it (`standby.served`) rather than
    started cold, each of which spent ~3 s of CPU importing torch. Tests of
    the cold start unset `ELASTICFLOW_FORKSERVER`."""
    from flows.training.launch.forkserver import launch
    from flows.training.launch.standby import FORKSERVER_ENV, POOL

    home = tmp_path_factory.mktemp("forkserver")
    process, path = launch(home)
    wait_fork_server(home / "logs" / "forkserver.log", process)
    os.environ[FORKSERVER_ENV] = str(path)
    yield path
    os.environ.pop(FORKSERVER_ENV, None)
    POOL.close()  # the server waits for every standby it forked to end (a failed test's too: then killed)
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(autouse=True)
def elasticflow_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("ELASTICFLOW_HOME", str(home))
    monkeypatch.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
    return home


def small_mlp(folder: Path, **overrides: Any) -> TrainParameters:
    """A small MLP run: uneven shards (30 over 4) and gradient accumulation
    (micro-batch 4), checkpoints and control channel under `folder`."""
    values: dict[str, Any] = dict(
        model="mlp",
        hyperparameters={"global_batch_size": 30, "max_micro_batch": 4, "learning_rate": 0.01},
        iterations=24,
        checkpoint_interval=4,
        checkpoint_store=str(folder / "checkpoints"),
        control_dir=str(folder / "control"),
        device="cpu",
    )
    values.update(overrides)
    return TrainParameters(**values)


@pytest.fixture
def make_params(tmp_path: Path) -> Callable[..., TrainParameters]:
    return lambda **overrides: small_mlp(tmp_path, **overrides)


def when_iteration_reaches(
    segment: RunningSegment, iteration: int, action: Callable[[], None], timeout_s: float = 60
) -> threading.Thread:
    """Run `action` from a thread once rank 0 of a local segment has logged
    `iteration` (polled every 2 ms)."""
    return when_progress(segment, lambda line: line["iteration"] >= iteration, action, timeout_s)


def when_progress(
    segment: RunningSegment, reached: Callable[[dict[str, Any]], bool], action: Callable[[], None],
    timeout_s: float = 60
) -> threading.Thread:
    """Run `action` from a thread once rank 0's last progress line (a
    `ProgressLine` as a dict) satisfies `reached` (polled every 2 ms)."""
    folder: Path = segment.transport.dir  # type: ignore[attr-defined]  # a local segment's folder

    def watch() -> None:
        import json

        path = folder / PROGRESS_FILE
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if path.exists():
                lines = path.read_text().splitlines()
                if lines and '"iteration": ' in lines[-1]:
                    try:
                        if reached(json.loads(lines[-1])):
                            action()
                            return
                    except ValueError:
                        pass
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def progress_iterations(segment_dir: Path) -> list[int]:
    import json

    path = segment_dir / PROGRESS_FILE
    return (
        [json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.strip()]
        if path.exists()
        else []
    )


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (an exited child not yet reaped is not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


REL_TOL = 1e-4
N = 240  # iterations of every run here; the reference is computed once per test process


def assert_same_trajectory(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert worst <= REL_TOL, f"largest relative loss difference {worst:.2e}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], list[float]]:
    """Losses of the never-resized job on one worker slot (computed once per test process)."""
    from flows.training.coordinator.runtime import run_training

    cache: dict[int, list[float]] = {}

    def get(iterations: int = N) -> list[float]:
        if iterations not in cache:
            root = tmp_path_factory.mktemp(f"reference{iterations}")
            params = TrainParameters(
                model="mlp",
                hyperparameters={"global_batch_size": 30, "max_micro_batch": 4, "learning_rate": 0.01},
                iterations=iterations,
                checkpoint_interval=1000,
                checkpoint_store=str(root / "ck"),
                control_dir=str(root / "ctl"),
                device="cpu",
            )
            cache[iterations] = run_training(params, "reference").losses
        return cache[iterations]

    return get
