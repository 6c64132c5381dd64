"""Service benchmark (issue 5 targets) on a local stack started here.

(a) Time to first iteration: from `prefect deployment run train/mlp --param
    iterations=.. --param deadline=+10m` to the first training iteration
    (rank 0's first line in the run's `progress.jsonl`), measured both from the
    CLI command's start and from the flow run's creation on the server; median
    and max over --reps repetitions. Target <= 10 s. Reference, measured in the
    same run on the same server: the same path for a no-op flow (`bench/noop_flow.py`)
    on a plain Prefect `process` work pool polling at the same interval, to the
    first line of its body: the floor Prefect itself imposes. Also printed: where
    the time goes (run created -> Pending -> Running -> workers launched ->
    ready -> first iteration).
(b) Admission decision time with 100 admitted runs: the service's own code
    path, the control loop's step (which times the `ElasticFlowPolicy.schedule`
    call the worker records as `decision_ms`), driven in-process with 100
    admitted, running jobs on a 128-GPU cluster (n16g8), an epoch-seconds
    clock; one arrival per slot. Target <= 50 ms.
    The decision times the service itself recorded for the runs of (a) are
    printed too.
(c) CPU seconds (user + system) each process on the path to the first
    iteration spends starting (imports), least of 3 runs: figures that do not
    depend on what else runs on the machine, unlike the wall times of (a).
(d) `elasticflow status` with 100 runs in every phase in a temporary store
    (tests/cli/runs.py), as a subprocess: median wall time of 5, and its ratio
    to `elasticflow --help` measured the same way; and both CPU times as in (c).
    Target < 1 s. Alone, without a stack: --status-only.

The stack: a Prefect server on 127.0.0.1 (temporary PREFECT_HOME, SQLite), the
`gpus` elasticflow pool with deployment train/mlp, the worker started with
`prefect worker start --pool gpus`, `infra/local-cpu2.csv`, a seeded mlp curve
(no profiling). Targets are reported, not asserted: exit status is nonzero only
on errors. Timings depend on load: `uptime` is printed before and after.

Run: .venv/bin/python bench/service.py [--reps 5] [--interval 5] [--poll 1] [--status-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# Prefect is imported only once the stack's environment is set: its settings are
# read at import.

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.service_costs import measure_admission, measure_start_cpu, measure_status, print_status  # noqa: E402
from scheduler_service.stack.local import free_port, stop_process  # noqa: E402
PY = sys.executable
MLP_CURVE = {1: 20.0, 2: 36.0}  # as tests/service: admission plans with these, no profiling
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def uptime() -> str:
    return "load average " + ", ".join(Path("/proc/loadavg").read_text().split()[:3])


def spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PY, "-m", "prefect", *args], env=env, cwd=ROOT, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate: Any, timeout_s: float, what: str, logs: list[Path], every_s: float = 0.1) -> Any:
    """Poll `predicate`; API polls should be sparse: the benchmark's own requests
    take CPU from the server and the flow process it measures."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    tails = "\n".join(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
                      for p in logs if p.exists())
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def flow_run_times(run_id: str) -> dict[str, float]:
    """Creation time and the first Pending / Running state times of a run (server clock = ours)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)  # type: ignore[arg-type]
        states = client.read_flow_run_states(run_id)  # type: ignore[arg-type]
    times = {"created": run.created.timestamp(), "final": run.state.is_final() if run.state else False,
             "state": f"{run.state.type.value}/{run.state.name}" if run.state else "?"}
    for state in sorted(states, key=lambda s: s.timestamp):
        key = state.type.value.lower()
        times.setdefault(key, state.timestamp.timestamp())
    return times


def deployment_run(name: str, params: dict[str, Any], env: dict[str, str]) -> tuple[str, float, float]:
    """`prefect deployment run` as a user types it; (flow run id, command start, command end)."""
    args = [PY, "-m", "prefect", "deployment", "run", name]
    for key, value in params.items():
        args += ["--param", f"{key}={value}"]
    start = time.time()
    out = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    end = time.time()
    if out.returncode != 0:
        raise RuntimeError(f"prefect deployment run failed ({out.returncode}): {out.stdout}{out.stderr}")
    found = UUID_RE.search(out.stdout)
    if not found:
        raise RuntimeError(f"no flow run id in the output of prefect deployment run: {out.stdout}")
    return found.group(0), start, end


def first_iteration(home: Path, run_id: str) -> tuple[float, dict[str, float]] | None:
    """Time of the first iteration (rank 0's first progress line) and the first segment's timings."""
    segments = home / "control" / run_id / "segments"
    if not segments.exists():
        return None
    best: tuple[float, dict[str, float]] | None = None
    for folder in segments.iterdir():
        progress = folder / "progress.jsonl"
        if not progress.exists():
            continue
        line = progress.read_text().split("\n", 1)[0]
        if not line.endswith("}"):
            continue
        t = float(json.loads(line)["t"])
        timings: dict[str, float] = {}
        result = folder / "result.json"
        if result.exists():
            timings = {k: v for k, v in json.loads(result.read_text())["timings"].items()
                       if isinstance(v, float)}
        if best is None or t < best[0]:
            best = (t, timings)
    return best


def stats(values: list[float]) -> str:
    return f"median {statistics.median(values):5.2f} s, max {max(values):5.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--interval", type=float, default=5.0, help="ELASTICFLOW_INTERVAL_S (slot) of the worker")
    parser.add_argument("--poll", type=float, default=1.0,
                        help="ELASTICFLOW_POLL_S of the worker, and the reference pool's poll")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--status-only", action="store_true", help="only (d), elasticflow status; no stack")
    args = parser.parse_args()
    if args.status_only:
        with tempfile.TemporaryDirectory(prefix="elasticflow-bench-status-") as tmp_name:
            print(f"load before: {uptime()} (1/5/15 min), {os.cpu_count()} CPUs", flush=True)
            print_status(measure_status(Path(tmp_name)))
        return 0
    print(f"load before: {uptime()} (1/5/15 min), {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="elasticflow-bench-service-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        env = {
            **os.environ,
            "PREFECT_HOME": str(tmp / "prefect"),
            "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "ELASTICFLOW_HOME": str(tmp / "home"),
            "ELASTICFLOW_CLUSTER": str(ROOT / "infra" / "local-cpu2.csv"),
            "ELASTICFLOW_INTERVAL_S": repr(args.interval),
            "ELASTICFLOW_POLL_S": repr(args.poll),
            # the reference worker polls as often as ours looks for new runs
            "PREFECT_WORKER_QUERY_SECONDS": repr(args.poll),
        }
        env.pop("ELASTICFLOW_DATABASE_URL", None)
        os.environ.update(env)
        for key in ("ELASTICFLOW_DATABASE_URL",):
            os.environ.pop(key, None)
        logs = {name: tmp / f"{name}.log" for name in ("server", "worker", "process-worker")}
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs.append(spawn(["server", "start", "--host", "127.0.0.1", "--port", str(port)], logs["server"], env))
            wait_for(lambda: healthy(env["PREFECT_API_URL"]), 90, "the Prefect server", [logs["server"]])
            from prefect import flow as prefect_flow
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import WorkPoolCreate

            from scheduler_service.stack.deployments import deploy, ensure_pool
            from scheduler_service.store import save_curve

            save_curve("mlp", 32, MLP_CURVE)
            asyncio.run(ensure_pool("gpus"))

            async def plain_pool() -> None:
                async with get_client() as client:
                    await client.create_work_pool(WorkPoolCreate(name="plain", type="process"))

            asyncio.run(plain_pool())
            procs.append(spawn(["worker", "start", "--pool", "gpus"], logs["worker"], env))
            procs.append(spawn(["worker", "start", "--pool", "plain", "--type", "process"],
                               logs["process-worker"], env))
            deploy("gpus", ["mlp"], parameters={"hyperparameters": {"global_batch_size": 32}, "device": "cpu"})
            prefect_flow.from_source(source=str(ROOT), entrypoint="bench/noop_flow.py:noop").deploy(  # type: ignore[union-attr]
                name="reference", work_pool_name="plain", print_next_steps=False, ignore_warnings=True)
            for name in ("worker", "process-worker"):
                wait_for(lambda n=name: "started!" in logs[n].read_text(errors="replace"), 90,
                         f"the {name} to start", [logs[name]])
            forkserver_log = tmp / "home" / "logs" / "forkserver.log"
            if os.environ.get("ELASTICFLOW_WARM_START", "1") != "0":  # =0: the cold start, for comparison
                wait_for(lambda: forkserver_log.exists() and "ready" in forkserver_log.read_text(), 120,
                         "the warm-start fork server", [forkserver_log])
            print(f"stack up: server 127.0.0.1:{port}, pools gpus (elasticflow, slot {args.interval:g} s, "
                  f"poll {args.poll:g} s) and plain (process, polling every {args.poll:g} s)", flush=True)

            rows: list[dict[str, float]] = []
            refs: list[dict[str, float]] = []
            for rep in range(args.reps):
                out = tmp / f"noop-{rep}.txt"
                run_id, cli_start, cli_end = deployment_run("noop/reference", {"out": str(out)}, env)
                body = float(wait_for(lambda out=out: out.exists() and out.read_text(), 120, "the no-op flow body",
                                      [logs["process-worker"]]))
                times = wait_for(lambda r=run_id: (t := flow_run_times(r))["final"] and t, 60,
                                 "the no-op run to finish", [logs["process-worker"]], every_s=1.0)
                refs.append({"from_cli": body - cli_start, "from_created": body - times["created"],
                             "cli": cli_end - cli_start})

                run_id, cli_start, cli_end = deployment_run(
                    "train/mlp", {"iterations": args.iterations, "deadline": "+10m"}, env)
                # the progress file first (cheap), then the run's end over the API, sparsely
                found = wait_for(lambda r=run_id: first_iteration(tmp / "home", r), 180,
                                 "the first training iteration", [logs["worker"]], every_s=0.05)
                times = wait_for(lambda r=run_id: (t := flow_run_times(r))["final"] and t, 180,
                                 "the training run to finish", [logs["worker"]], every_s=1.0)
                if times["state"] != "COMPLETED/Completed":
                    raise RuntimeError(f"training run {run_id} ended {times['state']}")
                found = first_iteration(tmp / "home", run_id) or found  # now with the segment's timings
                first, seg = found
                row = {"from_cli": first - cli_start, "from_created": first - times["created"],
                       "cli": cli_end - cli_start, "created": times["created"] - cli_start,
                       "to_pending": times.get("pending", float("nan")) - times["created"],
                       "to_running": times.get("running", float("nan")) - times.get("pending", float("nan")),
                       "to_launch": seg.get("launch_t", float("nan")) - times.get("running", float("nan")),
                       "to_ready": seg.get("ready_t", float("nan")) - seg.get("launch_t", float("nan")),
                       "to_first": first - seg.get("ready_t", float("nan"))}
                rows.append(row)
                print(f"rep {rep}: train/mlp first iteration {row['from_cli']:5.2f} s after the CLI started, "
                      f"{row['from_created']:5.2f} s after the run was created "
                      f"[created +{row['created']:.2f}, Pending +{row['to_pending']:.2f}, "
                      f"Running +{row['to_running']:.2f}, workers launched +{row['to_launch']:.2f}, "
                      f"ready +{row['to_ready']:.2f}, first iteration +{row['to_first']:.2f}]; "
                      f"no-op body {refs[-1]['from_cli']:5.2f} / {refs[-1]['from_created']:5.2f} s; "
                      f"load {uptime()}", flush=True)

            from scheduler_service.worker.store import ServiceStore

            decisions = [r.decision_ms for r in ServiceStore().decisions() if r.decision_ms is not None]
            warm_starts = (forkserver_log.read_text(errors="replace").count("forked flow process")
                           if forkserver_log.exists() else 0)
            admission = measure_admission(tmp, args.interval)
            start_cpu = measure_start_cpu()
        finally:
            for process in reversed(procs):
                stop_process(process)
            from scheduler_service.stack.local import stop_processes_of

            stop_processes_of(tmp / "home", grace_s=0.0)

    def med(values: list[dict[str, float]], key: str) -> float:
        return statistics.median(v[key] for v in values)

    print()
    print(f"(a) deployment run -> first training iteration, {args.reps} reps, slot {args.interval:g} s, "
          f"poll {args.poll:g} s, {warm_starts} of {args.reps} flow processes started warm (forked):")
    for key, what in (("from_cli", "from the CLI's start"), ("from_created", "from the run's creation")):
        ours, ref = [r[key] for r in rows], [r[key] for r in refs]
        target = "met" if statistics.median(ours) <= 10 else "MISSED"
        print(f"    {what:24s}: train/mlp {stats(ours)}  (target <= 10 s: {target}); "
              f"no-op flow on a process pool {stats(ref)}; ratio of medians "
              f"{statistics.median(ours) / statistics.median(ref):.2f}x")
    print(f"    medians: CLI command {med(rows, 'cli'):.2f} s (run created at +{med(rows, 'created'):.2f}); "
          f"created -> Pending {med(rows, 'to_pending'):.2f}; Pending -> Running {med(rows, 'to_running'):.2f}; "
          f"Running -> workers launched {med(rows, 'to_launch'):.2f}; launched -> ready "
          f"{med(rows, 'to_ready'):.2f}; ready -> first iteration {med(rows, 'to_first'):.2f}")
    print(f"(b) admission decision with {admission['admitted_runs']} admitted running runs on "
          f"{admission['gpus']} GPUs, {admission['slots']} slots: policy call median "
          f"{admission['decision_ms_median']:.2f} ms, max {admission['decision_ms_max']:.2f} ms "
          f"(target <= 50 ms: {'met' if admission['decision_ms_max'] <= 50 else 'MISSED'}); "
          f"Scheduler.plan + actuate median {admission['plan_actuate_ms_median']:.2f} ms, "
          f"max {admission['plan_actuate_ms_max']:.2f} ms")
    if decisions:
        print(f"    the service's own decision_ms for the runs of (a): median {statistics.median(decisions):.2f} ms, "
              f"max {max(decisions):.2f} ms")
    print(f"(c) CPU seconds (user+system, least of 3; independent of load) on the path: flow process imports "
          f"{start_cpu['flow_process_s']:.2f} (Prefect {start_cpu['of_which_prefect_s']:.2f}, flows/train.py and "
          f"torch the rest); each DDP worker {start_cpu['standby_worker_s']:.2f}; Prefect's default supervisor "
          f"interpreter, which the elasticflow worker skips, {start_cpu['prefect_supervisor_s']:.2f}; "
          f"the prefect CLI's start {start_cpu['prefect_cli_s']:.2f}")
    print(f"load after: {uptime()}")
    print(json.dumps({
        "reps": args.reps, "interval_s": args.interval, "poll_s": args.poll, "warm_starts": warm_starts,
        "first_iteration_from_cli_s": {"median": round(med(rows, "from_cli"), 3),
                                       "max": round(max(r["from_cli"] for r in rows), 3)},
        "first_iteration_from_created_s": {"median": round(med(rows, "from_created"), 3),
                                           "max": round(max(r["from_created"] for r in rows), 3)},
        "reference_noop_from_cli_s": round(med(refs, "from_cli"), 3),
        "reference_noop_from_created_s": round(med(refs, "from_created"), 3),
        "ratio_from_created": round(med(rows, "from_created") / med(refs, "from_created"), 2),
        "admission": {k: round(v, 3) if isinstance(v, float) else v for k, v in admission.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
