"""A Ray cluster whose nodes are separate network hosts on this machine.

The loopback cluster (`ray_local.LocalRayCluster`) puts every node on
127.0.0.1: a rank that reached its peers through loopback, or a coordinator
that waited for ever on a node it cannot reach, would pass there. Here each
worker node is `ray start` inside its own network namespace, joined to a
bridge by a veth pair, with its own address and its own loopback: nodes talk
only over the bridge, as machines over a switch. The head (no worker slots:
a control machine) stays in this namespace, so the stack's worker and flow
processes find a raylet at their own address, as they do on a real head.

A node dies by SIGKILL to every process in its namespace (its machine gone)
and is partitioned by taking its cable down (the bridge's end of its veth).
Needs root and `ip netns`; `unavailable()` says why not where it cannot.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flows.training.ray_nodes import SLOTS_RESOURCE, USAGE_STATS_ENV

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why this machine cannot make the cluster, or None when it can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"efprobe{os.getpid()}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name)
    return None


class NamespacedRayCluster:
    """A head at `<subnet>.1` in this namespace (0 slots) and `nodes` nodes
    of `slots` worker slots at `<subnet>.11`, `.12`... each in namespace
    `ef<pid>n<i>`, named `ns-node-<i>`."""

    def __init__(self, nodes: int, slots: int, port: int) -> None:
        """The head gives a silent node up after 4 missed health checks 2 s
        apart (Ray's defaults take up to a minute): about 10-20 s on a quiet
        machine, longer on a loaded one (CI once took over 30 s)."""
        tag = os.getpid() % 100_000
        self.subnet = f"10.{77 + tag // 250 % 100}.{tag % 250}"
        self.bridge, self.prefix, self.port, self.slots = f"efbr{tag}", f"ef{tag}n", port, slots
        # Ray's socket paths must stay under 107 characters: a short folder, not pytest's.
        self.temp = Path(tempfile.mkdtemp(prefix="efns"))
        self.env = {**os.environ, USAGE_STATS_ENV: "0", "PYTHONPATH": str(ROOT)}
        self.env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # not a loopback cluster
        self.head_env = {**self.env, "RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "2000",
                         "RAY_health_check_failure_threshold": "4"}
        self.head: subprocess.Popen[bytes] | None = None
        self.node_procs: dict[int, subprocess.Popen[bytes]] = {}
        self.count = nodes
        try:
            self._bridge()
            self._start_head()
            for i in range(1, nodes + 1):  # one after the other: two raylets starting at once lost a race once
                self._namespace(i)
                self.start_node(i)
                self.wait_nodes([self.node_name(i)])
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return f"{self.subnet}.1:{self.port}"

    def node_ip(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def node_name(self, i: int) -> str:
        return f"ns-node-{i}"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def _veth(self, i: int) -> str:
        return f"{self.bridge}v{i}"

    def _run(self, *args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def _bridge(self) -> None:
        self._run("link", "add", self.bridge, "type", "bridge")
        self._run("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        self._run("link", "set", self.bridge, "up")

    def _namespace(self, i: int) -> None:
        ns, veth = self.namespace(i), self._veth(i)
        self._run("netns", "add", ns)
        self._run("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._run("link", "set", veth, "master", self.bridge, "up")
        self._run("netns", "exec", ns, "ip", "addr", "add", f"{self.node_ip(i)}/24", "dev", "eth0")
        self._run("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
        self._run("netns", "exec", ns, "ip", "link", "set", "lo", "up")  # its own loopback, nobody else's

    def _start_head(self) -> None:
        self.head = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--node-ip-address={self.subnet}.1", f"--port={self.port}",
             "--num-cpus=0", "--num-gpus=0", "--node-name=ns-head", "--include-dashboard=false",
             "--disable-usage-stats", f"--temp-dir={self.temp}"],
            env=self.head_env, cwd=ROOT, stdout=open(self.temp / "head.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
        self._wait_port(f"{self.subnet}.1", self.port, self.head, "the head")

    def start_node(self, i: int) -> None:
        """`ray start` in node i's namespace: a fresh raylet, as a machine booted again."""
        self.node_procs[i] = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(i), RAY, "start", "--block", f"--address={self.address}",
             f"--node-ip-address={self.node_ip(i)}", f"--num-cpus={self.slots}", "--num-gpus=0",
             f'--resources={{"{SLOTS_RESOURCE}": {self.slots}}}', f"--node-name={self.node_name(i)}",
             "--disable-usage-stats", "--object-store-memory=100000000",
             # a folder of its own: machines share no files, and a raylet started beside another
             # on the head's folder once died on their shared socket names
             f"--temp-dir={self.temp / f'n{i}'}"],
            env=self.env, cwd=ROOT, stdout=open(self.temp / f"node-{i}.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def wait_nodes(self, names: list[str], timeout_s: float = 180.0) -> None:
        """Until the head counts each node named alive (asked by a driver of
        its own, in a process of its own: this one stays off the cluster)."""
        script = ("import sys, time, ray; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
                  "want = set(sys.argv[3:]); give_up = time.time() + float(sys.argv[2])\n"
                  "while not want <= {n['NodeName'] for n in ray.nodes() if n['Alive']}:\n"
                  "    assert time.time() < give_up, 'nodes not alive: ' + str(want)\n"
                  "    time.sleep(0.5)")
        done = subprocess.run([sys.executable, "-c", script, self.address, str(timeout_s), *names], env=self.env,
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout_s + 60)
        if done.returncode != 0:
            raise RuntimeError(f"Ray nodes {names} did not join: {done.stderr[-1500:]}")

    def _wait_port(self, host: str, port: int, proc: subprocess.Popen[bytes], what: str) -> None:
        import socket

        give_up = time.monotonic() + 120
        while time.monotonic() < give_up:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited: {(self.temp / 'head.log').read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection((host, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{what} did not listen on {host}:{port} in 120 s")

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.namespace(i)).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, i: int) -> None:
        """Every process of node i's machine killed at once."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc = self.node_procs.pop(i, None)
        if proc is not None:
            proc.wait(timeout=30)

    def cable(self, i: int, up: bool) -> None:
        """Node i's only link to the others, plugged in or pulled out."""
        self._run("link", "set", self._veth(i), "up" if up else "down")

    def shutdown(self) -> None:
        for i in range(1, self.count + 1):
            self.kill_node(i)
            _ip("netns", "del", self.namespace(i))  # and its veth pair with it
        if self.head is not None:
            try:
                os.killpg(self.head.pid, signal.SIGTERM)
                self.head.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            self._kill_left_by_head()
        _ip("link", "del", self.bridge)
        shutil.rmtree(self.temp, ignore_errors=True)

    def _kill_left_by_head(self) -> None:
        """The head's processes that outlived `ray start --block` (Ray starts
        some in sessions of their own): each names this cluster's folder."""
        marker = str(self.temp).encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if marker in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                continue
