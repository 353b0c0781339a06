"""A real local Ray head (``ray start --head``) for integration tests, with the dashboard on.

It is what a user starts by hand: token authentication on (the token made by
``ray get-auth-token --generate`` in the test HOME), dashboard on 127.0.0.1, its own
``--temp-dir`` and free ports, so it never meets another cluster on the machine. It is
stopped by the PIDs it started, never with ``ray stop`` (which kills every Ray of the user).

Tests use the session's ``ray_head`` fixture (``conftest.py``), or :func:`start_head` directly.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from ports import free_ports

START_TIMEOUT_S = 90
#: The dashboard agent's HTTP port, which the job API submits through: 0, the port the agent
#: binds, not one chosen here and free until ``ray start`` gets to it. A port another process took
#: in those seconds (the other test process's sweeps make connections all the while) left the
#: agent up without its HTTP service, and every job submission to the head answered "No available
#: agent to submit job" (a CI run lost the two modules that submit jobs that way).
AGENT_PORT = 0


@dataclass
class RayHead:
    """A running head node and the addresses a test needs."""

    process: subprocess.Popen
    temp_dir: Path
    dashboard_url: str
    gcs_address: str
    metrics_export_port: int
    token: str
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_export_port}/metrics"

    def scrape(self) -> str:
        """The node's Prometheus text (the metrics export port has no auth)."""
        return requests.get(self.metrics_url, timeout=10).text

    def session_metrics_port(self) -> int:
        """The port Ray wrote under ``session_latest``, where users find it for their own clusters."""
        [path] = glob.glob(str(self.temp_dir / "session_latest" / "metrics_export_port_*"))
        return int(Path(path).read_text().strip())

    def stop(self) -> None:
        """SIGTERM ``ray start --block`` (it stops its GCS, raylet, dashboard and workers), then
        SIGKILL whatever of its process tree is left after 20 s."""
        tree = descendants(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
            time.sleep(0.2)
        for pid in tree:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def descendants(root: int) -> list[int]:
    """PIDs of ``root``'s whole process tree, read from /proc (Ray's job drivers start their own
    sessions, so a process group would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(Path(stat).parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie awaiting its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_head(temp_dir: Path, num_cpus: int = 2, node_name: str | None = None,
               labels: dict[str, str] | None = None, path: str | None = None) -> RayHead:
    """Start a head node under ``temp_dir`` (short, as conftest's ``ray_temp_dir`` makes it: Ray's
    sockets live under it).
    ``path``: the PATH ``ray start`` has, where its jobs find their ``python`` (Ray's own
    processes run with the venv's Python whatever it is)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
           "MLFLOW_DISABLE_TELEMETRY": "true", **({"PATH": path} if path is not None else {})}
    ray = str(Path(sys.executable).parent / "ray")
    token = subprocess.run(
        [ray, "get-auth-token", "--generate"], env=env, check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()
    ports = dict(zip(("gcs", "dashboard", "metrics", "client"), free_ports(4)))
    temp_dir.mkdir(parents=True, exist_ok=True)
    log_path = temp_dir.parent / f"{temp_dir.name}-ray-start.log"
    command = [
        ray, "start", "--head", "--block", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--num-gpus=0",
        f"--port={ports['gcs']}", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
        f"--metrics-export-port={ports['metrics']}", f"--dashboard-agent-listen-port={AGENT_PORT}",
        f"--ray-client-server-port={ports['client']}",
    ] + _node_options(node_name, labels)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(
        process=process, temp_dir=temp_dir, dashboard_url=f"http://127.0.0.1:{ports['dashboard']}",
        gcs_address=f"127.0.0.1:{ports['gcs']}", metrics_export_port=ports["metrics"], token=token,
        log_path=log_path,
    )
    try:
        _wait_ready(head)
    except BaseException:
        head.stop()
        raise
    return head


def _node_options(name: str | None, labels: dict[str, str] | None) -> list[str]:
    """``--node-name`` (how results name the node) and ``--labels`` (what the node declares)."""
    options = [f"--node-name={name}"] if name else []
    if labels:
        options.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
    return options


def _wait_ready(head: RayHead) -> None:
    """Until the job API answers an authenticated request (it needs the GCS and the agent up)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if head.process.poll() is not None:
            raise RuntimeError(f"ray start exited {head.process.returncode}: {head.log_path.read_text()[-3000:]}")
        try:
            if requests.get(f"{head.dashboard_url}/api/jobs/", headers=head.headers, timeout=5).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError(f"Ray head not ready after {START_TIMEOUT_S} s: {head.log_path.read_text()[-3000:]}")


def listening_addresses(pids: list[int]) -> dict[str, int]:
    """``{"127.0.0.1:6379": pid}``: the TCP sockets those processes listen on, read from /proc."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host, port = fields[1].split(":")
            found[f"{_address(host, width)}:{int(port, 16)}"] = inodes[fields[9]]
    return found


def _address(hex_host: str, width: int) -> str:
    """/proc/net/tcp's little-endian hex address -> dotted IPv4 (IPv4-mapped IPv6 too), or the IPv6 hex."""
    import socket
    import struct

    if width == 8:
        return socket.inet_ntoa(struct.pack("<I", int(hex_host, 16)))
    words = struct.pack("<4I", *(int(hex_host[i:i + 8], 16) for i in range(0, 32, 8)))
    text = socket.inet_ntop(socket.AF_INET6, words)
    return text.removeprefix("::ffff:")


@dataclass
class RayWorker:
    """A worker node that joined a head: ``ray start --address HEAD --block`` with its own name,
    CPUs, labels and temp folder, as a user starts one on each further machine."""

    name: str
    process: subprocess.Popen
    log_path: Path

    def raylet_pid(self) -> int:
        """The node's raylet: killing it is what losing the machine looks like to the cluster."""
        for pid in descendants(self.process.pid):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    return pid
            except OSError:
                continue
        raise RuntimeError(f"node {self.name} has no raylet: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the raylet, as a node that disappears; ``ray start --block`` then ends the rest."""
        os.kill(self.raylet_pid(), signal.SIGKILL)

    def stop(self) -> None:
        RayHead.stop(self)  # same process-tree rule: SIGTERM, then SIGKILL what is left


def start_worker(head: RayHead, temp_dir: Path, name: str, num_cpus: int = 1,
                 labels: dict[str, str] | None = None) -> RayWorker:
    """Join ``head`` with a worker node named ``name`` and wait until the cluster lists it alive."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
    temp_dir.mkdir(parents=True, exist_ok=True)
    log_path = temp_dir.parent / f"{temp_dir.name}-ray-start.log"
    [metrics_port] = free_ports(1)
    command = [
        "ray", "start", f"--address={head.gcs_address}", "--block", "--disable-usage-stats",
        f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--num-gpus=0",
        f"--metrics-export-port={metrics_port}", f"--dashboard-agent-listen-port={AGENT_PORT}",
    ] + _node_options(name, labels)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    worker = RayWorker(name, process, log_path)
    try:
        _wait_joined(head, worker)
    except BaseException:
        worker.stop()
        raise
    return worker


def alive_node_names(head: RayHead) -> set[str]:
    """The names of the nodes the head's state API lists alive."""
    reply = requests.get(f"{head.dashboard_url}/api/v0/nodes", headers=head.headers, timeout=10)
    reply.raise_for_status()
    return {n["node_name"] for n in reply.json()["data"]["result"]["result"] if n["state"] == "ALIVE"}


def _wait_joined(head: RayHead, worker: RayWorker) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            raise RuntimeError(f"ray start exited {worker.process.returncode}: {worker.log_path.read_text()[-3000:]}")
        try:
            if worker.name in alive_node_names(head):
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError(f"node {worker.name} did not join after {START_TIMEOUT_S} s: {worker.log_path.read_text()[-3000:]}")
