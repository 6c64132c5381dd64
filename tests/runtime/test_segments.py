"""What the local and the Ray launchers share, written once: the rank orders
and the environment built from them, the rendezvous port, the progress tail,
and which failed rank a crash report blames."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flows.training.control import GpuSlot
from flows.training.datasets import DatasetSpec
from flows.training.launch.spec import LaunchSpec, standby_of
from flows.training.coordinator.launcher import WorkerPool, local_seats, local_segment
from flows.training.orders import Seat, StandbyOrder, free_port, rank_orders
from flows.training.params import Hyperparameters
from flows.training.segment import SegmentSpec
from flows.training.supervision import (
    Failure,
    ProgressLine,
    RankFailure,
    cause_of,
    crash_result,
    exit_failure,
    read_progress,
)

ABORT, KILL = -signal.SIGABRT, -signal.SIGKILL


def _blamed(codes: list[int | None], took: list[bool] | None = None) -> int:
    took = took or [True] * len(codes)
    return cause_of([exit_failure(r, c, t) for r, (c, t) in enumerate(zip(codes, took))]).rank


def test_a_rank_killed_by_a_signal_is_the_cause_and_aborted_or_failing_peers_are_casualties() -> None:
    assert _blamed([ABORT, KILL, 1]) == 1  # SIGKILL first, whatever the rank order
    assert _blamed([ABORT, 1]) == 1  # a rank's own error before gloo's abort once its socket closed
    assert _blamed([1, 1, ABORT]) == 0  # among alike failures, the lowest rank
    assert _blamed([1, None], took=[True, False]) == 1  # one that never took its part before one that failed
    assert _blamed([ABORT, -signal.SIGSEGV]) == 1  # any signal but SIGABRT is a death
    assert exit_failure(0, ABORT, True).how is Failure.ABORTED


def test_the_crash_report_names_the_cause_then_every_failed_rank_then_its_log() -> None:
    failures = [RankFailure(0, Failure.FAILED, "failed: DistBackendError", "node-a", "Connection closed by peer"),
                RankFailure(1, Failure.DIED, "died: ActorDiedError", "node-b", "the actor died unexpectedly")]
    result, cause = crash_result([0, 1], 5.0, failures, lambda f: f"log of {f.rank}")
    assert cause.rank == 1 and result.reason == "crashed" and result.timings.launch_t == 5.0
    assert result.error == ("worker rank 1 on node-b died: ActorDiedError: the actor died unexpectedly (failed: "
                            "rank 0 on node-a: failed: DistBackendError, rank 1 on node-b: died: ActorDiedError): "
                            "log of 1")


def test_rank_orders_count_local_ranks_per_node_and_give_each_rank_its_device() -> None:
    seats = [Seat("a", "eth0", 0), Seat("a", "eth0", 1), Seat("b", "eth1", 0)]
    orders = rank_orders(seats, "10.0.0.1", 29500, "cuda", 12.5, [4, 5, 6])
    assert [o.env() for o in orders] == [
        {"RANK": str(r), "LOCAL_RANK": lr, "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
         "GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname, "CUDA_VISIBLE_DEVICES": device}
        for r, (lr, ifname, device) in enumerate([("0", "eth0", "0"), ("1", "eth0", "1"), ("0", "eth1", "0")])]
    assert {(o.launch_t, tuple(o.gpus)) for o in orders} == {(12.5, (4, 5, 6))}  # for its timings and result
    on_cpu = rank_orders(seats, "10.0.0.1", 29500, "cpu", 12.5, [4, 5, 6])
    assert {o.env()["CUDA_VISIBLE_DEVICES"] for o in on_cpu} == {""}  # a worker slot sees no GPU


def test_both_launchers_build_the_same_rank_environment_for_one_machine() -> None:
    pytest.importorskip("ray")
    from flows.training.coordinator.ray_where import ray_seats

    placement = [GpuSlot(node="n0", name="ray-node-0", ip="127.0.0.1", index=i) for i in (0, 1)]
    where = [{"node": "n0", "ip": "127.0.0.1", "pid": 1, "host": "h", "interface": "lo"}] * 2
    local = rank_orders(local_seats([0, 1]), "127.0.0.1", 1234, "cuda", 1.0, [0, 1])
    ray = rank_orders(ray_seats(placement, where), "127.0.0.1", 1234, "cuda", 1.0, [0, 1])
    assert local == ray


def test_the_local_launcher_hands_each_standby_its_rank_order(tmp_path: Path) -> None:
    """Standbys that only write down what they are handed, and exit."""
    pool = WorkerPool()
    received = [tmp_path / f"order{r}" for r in (0, 1)]
    pool._standby += [subprocess.Popen([sys.executable, "-c", f"import sys; open({str(path)!r}, 'w').write("
                                        "sys.stdin.readline())"], stdin=subprocess.PIPE) for path in received]
    spec = SegmentSpec(run_key="orders", model="mlp", dataset=DatasetSpec(name="synthetic-vectors"),
                       hyperparameters=Hyperparameters(global_batch_size=8), total_iterations=1, stop_at=1,
                       checkpoint_interval=1, checkpoint_url=str(tmp_path / "ck"), device="cuda")
    segment = local_segment(spec, [2, 3], pool=pool)
    segment.start()
    for rank in segment.ranks:
        rank.proc.wait(timeout=60)
    handed = [StandbyOrder.model_validate_json(path.read_text()) for path in received]
    assert [h.order for h in handed] == segment.orders
    assert segment.orders == rank_orders(local_seats([2, 3]), "127.0.0.1", segment.orders[0].master_port, "cuda",
                                         segment.launch_t, [2, 3])
    assert [o.env()["CUDA_VISIBLE_DEVICES"] for o in segment.orders] == ["2", "3"]
    assert {Path(h.segment_dir) for h in handed} == {segment.transport.dir} and handed[1].log.endswith("rank1.log")


def test_the_progress_tail_leaves_a_line_being_written_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    path.write_text(ProgressLine(1, 0.5, 10.0).json() + "\n" + '{"iteration": 2, "lo')
    lines, offset = read_progress(tmp_path, 0)
    assert lines == [ProgressLine(1, 0.5, 10.0)]
    with open(path, "a") as fh:
        fh.write('ss": 0.25, "t": 11.0}\n')
    assert read_progress(tmp_path, offset) == ([ProgressLine(2, 0.25, 11.0)], path.stat().st_size)
    assert read_progress(tmp_path / "none", 7) == ([], 7)


def test_a_rendezvous_port_is_free_on_the_address_asked_for() -> None:
    port = free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # still free


def test_a_rendezvous_port_is_one_no_outgoing_connection_can_take_meanwhile() -> None:
    """Outgoing connections get their local port from the kernel's ephemeral
    range; one took a rank 0's rendezvous port between its choice and its
    bind once (`Address already in use`). Ports come from below that range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1, ports


def test_the_launch_carries_the_standby_count_and_a_bad_one_reads_as_none() -> None:
    spec = LaunchSpec(gpus=[0, 1], nodes=["localhost"], standby=2)
    assert LaunchSpec.from_env(spec.to_env()) == spec and standby_of(spec.to_env()) == 2
    assert standby_of({}) == 0 and standby_of({"ELASTICFLOW_LAUNCH": '{"standby": -1}'}) == 0
