"""Reclaim latency in the service: how long a team waits for a slot it lent.

A local stack (2 CPU slots, 2 s slots, seeded mlp curve) with two teams of one
slot each (work queues vision and speech). Each repetition: a speech run with
a loose deadline starts and borrows vision's idle slot (it trains on both);
then a vision run due soon is submitted. Measured from the vision run's
creation: when speech acknowledges giving the slot back (its ranks have
stopped), and when the vision run's first iteration is done. Reference,
measured in the same run on the same stack: the same vision run submitted on
an idle cluster, creation to first iteration. Printed: medians and maxima, and
the ratio of the reclaim path to the idle one.

Run: .venv/bin/python bench/reclaim.py [--reps 3]        (about 2 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.service import first_iteration, wait_for  # noqa: E402

MLP_CURVE = {1: 20.0, 2: 36.0}
TEAMS = "teams:\n  - name: vision\n    share: 1\n  - name: speech\n    share: 1\n"


def submit(queue: str, in_s: float, iterations: int) -> tuple[str, float]:
    from prefect.deployments import run_deployment

    deadline = (datetime.now(timezone.utc) + timedelta(seconds=in_s)).isoformat()
    run = run_deployment("train/mlp", timeout=0, work_queue_name=queue, parameters={
        "iterations": iterations, "deadline": deadline, "checkpoint_interval": 500,
        "hyperparameters": {"global_batch_size": 32}, "device": "cpu"})
    return str(run.id), run.created.timestamp()  # type: ignore[union-attr]


def acked(home: Path, run_id: str) -> list[int] | None:
    path = home / "control" / run_id / "ack.json"
    try:
        return json.loads(path.read_text())["gpus"]
    except (OSError, ValueError, KeyError):
        return None


def final(run_id: str) -> bool:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state  # type: ignore[arg-type]
    return state is not None and state.is_final()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from scheduler_service.stack.local import free_port, local_stack
    from scheduler_service.store import save_curve

    base = Path(tempfile.mkdtemp(prefix="reclaim-"))
    home = base / "home"
    (base / "teams.yaml").write_text(TEAMS)
    os.environ["ELASTICFLOW_HOME"] = str(home)
    settings = {"ELASTICFLOW_CLUSTER": str(ROOT / "infra" / "local-cpu2.csv"), "ELASTICFLOW_INTERVAL_S": "2",
                "ELASTICFLOW_RESTART_S": "0.5", "ELASTICFLOW_LAUNCH_S": "0",
                "ELASTICFLOW_TEAMS": str(base / "teams.yaml")}
    idle, given_back, reclaimed = [], [], []
    with local_stack(home, free_port(), env=settings, models=("mlp",), schedules=False) as stack, \
            temporary_settings(updates={PREFECT_API_URL: stack.api_url, PREFECT_HOME: home / "prefect"}):
        log = stack.logs / "worker.log"
        logs = [log]
        wait_for(lambda: "started!" in log.read_text(errors="replace"), 240, "the worker", logs, 0.5)
        save_curve("mlp", 32, MLP_CURVE)
        with get_client(sync_client=True) as client:
            for queue in ("vision", "speech"):
                client.create_work_queue(name=queue, work_pool_name="gpus")
        for rep in range(args.reps):
            run_id, created = submit("vision", 70, 20 * 40)
            first = wait_for(lambda: first_iteration(home, run_id), 120, "the idle-cluster run's first iteration", logs)
            idle.append(first[0] - created)
            wait_for(lambda: final(run_id), 180, "the idle-cluster run to end", logs, 0.5)
            loose, _ = submit("speech", 600, 5000)
            wait_for(lambda: acked(home, loose) == [0, 1], 150, "speech's run on both slots", logs)
            run_id, created = submit("vision", 70, 20 * 40)
            back = wait_for(lambda: (gpus := acked(home, loose)) is not None and len(gpus) == 1 and time.time(), 120,
                            "speech to give the slot back", logs, 0.05)
            given_back.append(back - created)
            first = wait_for(lambda: first_iteration(home, run_id), 120, "the vision run's first iteration", logs)
            reclaimed.append(first[0] - created)
            for waited in (run_id, loose):
                wait_for(lambda: final(waited), 420, "the runs to end", logs, 0.5)
            print(f"rep {rep + 1}: idle {idle[-1]:.2f} s; reclaim: slot back {given_back[-1]:.2f} s, "
                  f"first iteration {reclaimed[-1]:.2f} s", file=sys.stderr)
    print(f"vision run, creation to first iteration, on an idle cluster: median {statistics.median(idle):.2f} s, "
          f"max {max(idle):.2f} s")
    print(f"with its slot lent to speech: slot given back median {statistics.median(given_back):.2f} s "
          f"(max {max(given_back):.2f}); first iteration median {statistics.median(reclaimed):.2f} s "
          f"(max {max(reclaimed):.2f})")
    print(f"reclaim / idle (first iteration, medians): {statistics.median(reclaimed) / statistics.median(idle):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
