"""A run's ranks as Ray actors on a real 2-node cluster (loopback): where they
land, what they compute, resizes, a lost node and a killed coordinator.

The reference is the same job on one local worker slot, never resized: every
run here must reproduce its loss at every iteration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from flows.training.control import FileControlChannel
from flows.training.params import TrainParameters
from flows.training.coordinator.progress import ProgressTracker
from flows.training.coordinator.runtime import run_training
from tests.cluster.conftest import assert_same_losses
from tests.ray_cluster import alive_nodes

ROOT = Path(__file__).resolve().parents[2]


def nodes_by_name() -> dict[str, str]:
    return {n["NodeName"]: n["NodeID"] for n in alive_nodes()}


def capture_segments() -> tuple[list[Any], Callable[[Any], None]]:
    seen: list[Any] = []
    return seen, seen.append


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_two_slot_run_lands_on_one_node_on_exactly_the_named_slots(
        ray_address: str, make_params: Callable[..., TrainParameters], reference: list[float]) -> None:
    segments, hook = capture_segments()
    result = run_training(make_params(gpu_plan=[[2, 3]], iterations=20), "two-slots", segment_hook=hook)
    assert result.status == "completed"
    (segment,) = segments
    node_1 = nodes_by_name()["ray-node-1"]
    assert [(s.node, s.index) for s in segment.slots] == [(node_1, 0), (node_1, 1)]
    assert {r.where["node"] for r in segment.ranks} == {node_1}  # where each actor says it runs
    assert all(gone(pid) for pid in segment.pids)  # a segment's processes end with it
    assert_same_losses(result.losses, reference[:20])


def test_a_four_slot_run_spans_both_nodes_and_reduces_correctly(
        ray_address: str, make_params: Callable[..., TrainParameters], reference: list[float]) -> None:
    segments, hook = capture_segments()
    result = run_training(make_params(gpu_plan=[[0, 1, 2, 3]]), "four-slots", segment_hook=hook)
    (segment,) = segments
    assert {r.where["node"] for r in segment.ranks} == set(nodes_by_name().values())
    assert len(set(segment.pids)) == 4
    # What each rank was told: local ranks counted per node, the rendezvous on
    # rank 0's node, collectives on the interface of the node's address.
    assert [(o.rank, o.local_rank, o.master_addr, o.interface) for o in segment.orders] == [
        (0, 0, "127.0.0.1", "lo"), (1, 1, "127.0.0.1", "lo"), (2, 0, "127.0.0.1", "lo"), (3, 1, "127.0.0.1", "lo")]
    # 30 samples over 4 ranks (8, 8, 7, 7): the gradient all-reduce over both
    # nodes must give the one-slot run's loss at every iteration.
    assert_same_losses(result.losses, reference[:60])


def test_resized_4_2_4_gives_the_losses_of_never_resizing(
        ray_address: str, make_params: Callable[..., TrainParameters], reference: list[float]) -> None:
    params = make_params(gpu_plan=[[0, 1, 2, 3], [0, 1], [0, 1, 2, 3]], switch_at=[20, 40])
    result = run_training(params, "resized")
    assert [(s.gpus, s.start_iteration, s.end_iteration) for s in result.segments] == [
        ([0, 1, 2, 3], 0, 20), ([0, 1], 20, 40), ([0, 1, 2, 3], 40, 60)]
    assert all(r.seconds is not None and r.seconds > 0 for r in result.rescales)
    assert_same_losses(result.losses, reference[:60])


def test_a_node_lost_mid_run_continues_from_its_checkpoint_on_the_gpus_left(
        ray_cluster: Any, ray_address: str, make_params: Callable[..., TrainParameters],
        reference: list[float], tmp_path: Path) -> None:
    from flows.training.coordinator.ray_where import slots_for

    params = make_params(gpu_plan=[[0, 1, 2, 3]], iterations=300, checkpoint_interval=10)
    channel = FileControlChannel("node-lost", tmp_path / "control")
    out: dict[str, Any] = {}
    def every_iteration(total: int, ch: FileControlChannel) -> ProgressTracker:
        return ProgressTracker("node-lost", total, None, ch, min_interval_s=0.0)

    thread = threading.Thread(target=lambda: out.update(result=run_training(
        params, "node-lost", park_poll_s=0.1, tracker_factory=every_iteration,
        segment_hook=lambda segment: out.setdefault("segments", []).append(segment))))
    thread.start()
    give_up = time.time() + 120
    while (channel.status() is None or channel.status().iteration < 30) and time.time() < give_up:  # type: ignore[union-attr]
        time.sleep(0.05)
    survivors, everywhere = slots_for([0, 1]), slots_for([0, 1, 2, 3])  # named while node 1 is still there
    ray_cluster.kill_node(1)
    while not [n for n in alive_nodes() if n["NodeName"] == "ray-node-1"] == [] and time.time() < give_up:
        time.sleep(0.2)
    # A plan made a moment before the node died still names it: the segment
    # started there cannot start (its actors are unschedulable, not dead). A
    # crash to go on from, as on a cluster of real hosts (test_ray_netns.py),
    # where it once failed the run.
    channel.request("rescale", [0, 1, 2, 3], placement=everywhere)
    while len(out.get("segments", [])) < 2 and thread.is_alive() and time.time() < give_up:
        time.sleep(0.2)
    # The scheduler's part: re-plan on what is left and say where to go on.
    channel.request("rescale", [0, 1], placement=survivors)
    thread.join(timeout=180)
    result = out["result"]
    assert result.status == "completed" and result.iterations == 300
    assert result.restarts == 2
    crashed, unschedulable, resumed = result.segments[0], result.segments[1], result.segments[-1]
    assert crashed.reason == "crashed" and "ray-node-1" in (crashed.error or "")
    assert unschedulable.reason == "crashed" and "could not start" in (unschedulable.error or "")
    assert resumed.gpus == [0, 1] and resumed.start_iteration >= 30  # from a checkpoint, not from 0
    assert_same_losses(result.losses, reference)


COORDINATOR = """
import json, os, sys
from flows.training.params import TrainParameters
from flows.training.coordinator.runtime import run_training
params = TrainParameters.model_validate_json(sys.argv[1])
print(json.dumps({"pid": os.getpid()}), flush=True)
run_training(params, "killed", segment_hook=lambda s: print(json.dumps({"pids": s.pids}), flush=True))
"""


def test_a_killed_coordinator_leaves_no_rank_on_any_node(
        ray_address: str, make_params: Callable[..., TrainParameters]) -> None:
    import ray

    params = make_params(gpu_plan=[[0, 1, 2, 3]], iterations=100000, checkpoint_interval=1000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", COORDINATOR, params.model_dump_json()], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids: list[int] = []
    while not pids:
        line = proc.stdout.readline()
        assert line, "the coordinator exited before its segment started"
        pids = json.loads(line).get("pids", [])
    time.sleep(2)  # training
    proc.kill()  # as Prefect's hard kill of a cancelled run
    proc.wait()
    give_up = time.time() + 60
    while not all(gone(pid) for pid in pids) and time.time() < give_up:
        time.sleep(0.2)
    assert all(gone(pid) for pid in pids), "ranks outlived the process that owned them"
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if str(a.get("name", "")).startswith("killed/")]
    assert named == []
