"""The costs `bench/service.py` measures without its stack: (b) one admission
decision in the control loop with 100 admitted running runs, (c) the CPU the
processes on the path to a first iteration spend starting, (d) `elasticflow
status` on a store of 100 runs. Apart from the stack because none of them
needs it (`bench/service.py --status-only` runs (d) alone)."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
PY = sys.executable


def cpu_seconds(args: list[str], reps: int = 3) -> float:
    """CPU time (user + system) of a command, the least of `reps` runs: what it
    costs whatever the load, where wall time depends on who else runs."""
    best = float("inf")
    for _ in range(reps):
        proc = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"{args} exited with {proc.returncode}")
        best = min(best, usage.ru_utime + usage.ru_stime)
    return best


def measure_start_cpu() -> dict[str, float]:
    """(c) The CPU the processes on the path to the first iteration spend importing."""
    return {
        # the engine of a flow process, up to the flow body (Prefect, then flows/train.py)
        "flow_process_s": cpu_seconds([PY, "-c", "import prefect.engine, prefect.flow_engine, flows.train"]),
        "of_which_prefect_s": cpu_seconds([PY, "-c", "import prefect.engine, prefect.flow_engine"]),
        # Prefect's default launcher before the engine: a workspace supervisor interpreter
        "prefect_supervisor_s": cpu_seconds([PY, "-c", "import prefect.runner._workspace_supervisor"]),
        # one DDP worker: torch, torch._dynamo (the first optimizer step needs it), the runtime
        "standby_worker_s": cpu_seconds([PY, "-m", "flows.training.rank.rank_main", "--standby"]),
        # the user's command
        "prefect_cli_s": cpu_seconds([PY, "-m", "prefect", "--help"]),
    }


def wall_median(args: list[str], env: dict[str, str], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        subprocess.run(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_status(tmp: Path, runs: int = 100) -> dict[str, float]:
    """(d) `elasticflow status` on a store of `runs` runs, against `elasticflow --help`."""
    from tests.cli.runs import CLUSTER, fill

    home = tmp / "status-home"
    home.mkdir(parents=True, exist_ok=True)
    fill(home, runs)
    env = {**os.environ, "ELASTICFLOW_HOME": str(home), "ELASTICFLOW_CLUSTER": str(CLUSTER)}
    env.pop("ELASTICFLOW_DATABASE_URL", None)
    cli = str(Path(PY).parent / "elasticflow")
    status_s, help_s = wall_median([cli, "status"], env), wall_median([cli, "--help"], env)
    os.environ.update(env)  # cpu_seconds runs in this environment
    return {"runs": runs, "status_s": status_s, "help_s": help_s, "ratio": status_s / help_s,
            "status_cpu_s": cpu_seconds([cli, "status"]), "help_cpu_s": cpu_seconds([cli, "--help"])}


def print_status(result: dict[str, float]) -> None:
    print(f"(d) elasticflow status, {result['runs']} runs: median {result['status_s']:.2f} s of 5 "
          f"(target < 1 s); elasticflow --help {result['help_s']:.2f} s; ratio {result['ratio']:.2f}; "
          f"CPU (least of 3, whatever the load) {result['status_cpu_s']:.2f} s vs {result['help_cpu_s']:.2f} s",
          flush=True)


def measure_admission(tmp: Path, interval: float, admitted: int = 100, samples: int = 30) -> dict[str, Any]:
    """(b): the worker's control loop, planning and actuating with `admitted` running admitted jobs."""
    from scheduler_service.loop import ControlLoop, LoopSettings
    from scheduler_service.loop.actions import Admitted, Command, Rejected
    from scheduler_service.loop.events import Acknowledged, Arrived, Progress
    from scheduler_service.policy import Job
    from scheduler_service.policy.overhead import RestartOverhead
    from scheduler_service.simulator.experiment import data_dir
    from scheduler_service.simulator.inputs import load_throughputs
    from scheduler_service.worker import cluster as cluster_mod

    cluster = cluster_mod.load(data_dir() / "clusters" / "n16g8.csv")
    # As the worker builds it (WorkerSettings.loop), with the default restart cost.
    loop = ControlLoop(cluster.topology, LoopSettings(
        policy="elasticflow", interval_s=interval, overhead=RestartOverhead(stop_s=0.5, restart_s=2.0, per_level_s=0.0),
        safety_margin=0.05))
    rng = random.Random(11)
    curves = list(load_throughputs(data_dir() / "throughputs" / "A100").values())
    now = time.time()
    count = 0

    def arrive(now: float) -> None:
        nonlocal count
        curve = rng.choice(curves)
        window = rng.uniform(3600, 7 * 86400)
        iterations = curve.points[1] * window * rng.uniform(0.05, 0.3)
        run_id = f"bench-{count:04d}"
        count += 1
        loop.handle(Arrived(run_id, Job(run_id, now, iterations, now + window, curve, model="bench", batch_size=256),
                            now), now)

    def step(now: float) -> float:
        """One poll's decisions; the policy call's seconds, if it decided anyone."""
        decided = 0.0
        for action in loop.step(now):
            if isinstance(action, (Admitted, Rejected)):
                decided = action.decision_s
            elif isinstance(action, Command):  # the flow acknowledges and reports, as a running run would
                loop.handle(Acknowledged(action.run_id, action.seq, action.gpus), now)
                loop.handle(Progress(action.run_id, 0, action.gpus), now)
        return decided

    while len(loop.runs) < admitted:  # build the state: a few arrivals per slot, untimed
        for _ in range(min(10, admitted - len(loop.runs))):
            arrive(now)
        step(now)
        now += interval
    active = len(loop.runs)
    policy_ms, plan_ms = [], []
    for _ in range(samples):
        arrive(now)
        start = time.perf_counter()
        seconds = step(now)
        plan_ms.append((time.perf_counter() - start) * 1e3)
        policy_ms.append(seconds * 1e3)
        now += interval
    return {"admitted_runs": active, "gpus": cluster.topology.num_gpus, "slots": samples,
            "decision_ms_median": statistics.median(policy_ms), "decision_ms_max": max(policy_ms),
            "plan_actuate_ms_median": statistics.median(plan_ms), "plan_actuate_ms_max": max(plan_ms)}
