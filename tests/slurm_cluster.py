"""A throw-away, single-node SLURM cluster for tests: munged, slurmctld and slurmd on localhost.

Everything lives in one temporary folder: ``slurm.conf``, ``gres.conf``, the munge key and
socket, state, spool, logs, pid files and (when ``mknod`` is allowed) two fake GPU device
files, so that ``--gres=gpu:N`` sets ``CUDA_VISIBLE_DEVICES`` as on a real GPU node. Nothing
under ``/etc`` is touched and no systemd is needed; the recipe is the one in FACTS.md.

Only the daemons this class starts are stopped, by PID. ``LocalSlurm.unavailable()`` returns
the exact reason a test must skip (not installed, not root, left out by ORCHESTRATOR_NO_SYSTEM_PACKAGES=1)
instead of failing.

Usage::

    cluster = LocalSlurm(tmp_dir, cpus=2)
    cluster.start()            # raises SlurmStartError with the daemons' logs if it can't
    env = cluster.env()        # SLURM_CONF for sbatch/squeue/sacct subprocesses
    ...
    cluster.stop()
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ports import free_ports
from system_packages import left_out

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "srun", "scancel")


class SlurmStartError(RuntimeError):
    """The daemons did not come up; the message carries the tail of their logs."""


def _which(tool: str) -> str | None:
    return shutil.which(tool) or (f"/usr/sbin/{tool}" if os.access(f"/usr/sbin/{tool}", os.X_OK) else None)


@dataclass
class LocalSlurm:
    """A one-node SLURM cluster named ``localhost`` with ``cpus`` CPUs and (maybe) 2 fake GPUs."""

    root: Path
    cpus: int = 2
    memory_mb: int = 8000
    gpus: int = 2
    nodes: int = 1  # more than one: slurmd instances node1..nodeN on this host, each on its own port
    pids: dict[str, int] = field(default_factory=dict)
    has_gpus: bool = False
    gpu_note: str = ""

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine can't run the cluster, or None when it can."""
        opted_out = left_out("slurm-wlm and munge")
        if opted_out:
            return opted_out
        missing = [tool for tool in DAEMONS + CLIENTS if _which(tool) is None]
        if missing:
            return (
                f"SLURM/munge not installed (missing {', '.join(missing)}); "
                "scripts/install_slurm.sh installs slurm-wlm and munge as root"
            )
        if os.geteuid() != 0:
            return "slurmd must run as root to start job steps as the submitting user; tests are not root"
        try:
            pwd.getpwnam("munge")
        except KeyError:
            return "no 'munge' user (the munge package creates it)"
        return None

    # -- start / stop --------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        self.root = Path(self.root)
        for sub in ("state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if self.nodes > 1:
            for name in self.node_names:
                (self.root / "spool" / name).mkdir(exist_ok=True)
        self._start_munged()
        self._make_fake_gpus()
        self._write_config()
        env = self.env()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], env)
        for name in self.node_names:
            self._spawn(self._daemon(name), [_which("slurmd"), "-D", "-N", name, "-f", str(self.conf)], env)
        self._wait_until_idle(timeout)

    @property
    def node_names(self) -> list[str]:
        return ["localhost"] if self.nodes == 1 else [f"node{i}" for i in range(1, self.nodes + 1)]

    def _daemon(self, node: str) -> str:
        return "slurmd" if self.nodes == 1 else f"slurmd-{node}"

    def stop(self) -> None:
        """Cancel the jobs still in the queue, then SIGTERM the daemons we started (slurmd first)
        and SIGKILL what is left."""
        self._cancel_jobs()
        for name in [self._daemon(n) for n in self.node_names] + ["slurmctld", "munged"]:
            pid = self.pids.get(name)
            if pid is None:
                continue
            if name == "munged":  # signal munged itself; its parent, runuser, then exits and reaps it
                _signal(self._munged_pid() or pid, signal.SIGTERM)
            else:
                _signal(pid, signal.SIGTERM)
            if not _wait_gone(pid, 15):
                _signal(pid, signal.SIGKILL)
                _wait_gone(pid, 5)
            self.pids.pop(name, None)
        if getattr(self, "munge_dir", None):
            shutil.rmtree(self.munge_dir, ignore_errors=True)

    def _cancel_jobs(self, timeout: float = 90) -> None:
        """A job a failed test left running gets SLURM's own cancel (its script's TERM trap tears
        its Ray cluster down); stopping slurmd under it would orphan those processes instead."""
        if "slurmctld" not in self.pids:
            return
        env = self.env()
        queue = lambda: subprocess.run(["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True).stdout.split()  # noqa: E731
        jobs = queue()
        if not jobs:
            return
        subprocess.run(["scancel", *jobs], env=env, capture_output=True)
        deadline = time.monotonic() + timeout
        while queue() and time.monotonic() < deadline:
            time.sleep(1)

    def _munged_pid(self) -> int | None:
        try:
            return int((self.munge_dir / "munged.pid").read_text().strip())
        except (AttributeError, OSError, ValueError):
            return None

    def env(self, base: dict | None = None) -> dict:
        """The environment for SLURM client commands (and so for the jobs they submit)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    # -- pieces --------------------------------------------------------------------------

    def _start_munged(self) -> None:
        """A private munged (own key, socket and pid file) so a system one is neither needed nor disturbed.

        munged runs as the ``munge`` user and checks the permissions of every folder up to its
        socket, so its folder is a fresh 0700 one in /tmp owned by munge (pytest's tmp folders are
        root-only); it is 0711, since munged requires clients to be able to
        reach the socket. The path stays short: a unix socket path is limited to ~107 characters.
        """
        munge = pwd.getpwnam("munge")
        self.munge_dir = Path(tempfile.mkdtemp(prefix="orch-munge-", dir="/tmp"))
        key, self.munge_socket = self.munge_dir / "munge.key", self.munge_dir / "munge.sock"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        for path in (self.munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        os.chmod(key, 0o600)
        os.chmod(self.munge_dir, 0o711)  # clients need to reach the socket; munged insists
        log = self.munge_dir / "munged.log"
        command = [
            "runuser", "-u", "munge", "--", _which("munged"), "--foreground",
            f"--socket={self.munge_socket}", f"--key-file={key}", f"--log-file={log}",
            f"--pid-file={self.munge_dir / 'munged.pid'}", f"--seed-file={self.munge_dir / 'munged.seed'}",
        ]
        self._spawn("munged", command, dict(os.environ))
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self._exited("munged"):
                raise SlurmStartError(f"munged did not start:\n{_tail(log)}")
            time.sleep(0.1)

    def _make_fake_gpus(self) -> None:
        """Character devices for GRES ``File=`` (slurmd drains a node whose GPUs have no File=)."""
        devices = self.root / "dev"
        devices.mkdir(exist_ok=True)
        try:
            for i in range(self.gpus):
                path = devices / f"nvidia{i}"
                if not path.exists():
                    os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))  # like /dev/null
            self.has_gpus = True
        except OSError as exc:
            self.has_gpus = False
            self.gpu_note = f"mknod of fake GPU devices failed ({exc}); cluster runs without GRES"

    def _write_config(self) -> None:
        r = self.root
        gres = f" Gres=gpu:{self.gpus}" if self.has_gpus and self.nodes == 1 else ""
        ctld_port, slurmd_port, *node_ports = free_ports(2 + len(self.node_names))
        if self.nodes == 1:
            nodes = [f"NodeName=localhost Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 "
                     f"RealMemory={self.memory_mb}{gres} State=UNKNOWN"]
        else:  # several slurmd on this host (a build with --enable-multiple-slurmd): own name and port each
            nodes = [f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} Sockets=1 "
                     f"CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory={self.memory_mb} State=UNKNOWN"
                     for name, port in zip(self.node_names, node_ports)]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=orchtest",
                    "SlurmctldHost=localhost",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    # Each node's config may claim this host's CPUs and memory: several slurmd share it.
                    *(["SlurmdParameters=config_overrides"] if self.nodes > 1 else []),
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    "CredType=cred/munge",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}" + ("/%n" if self.nodes > 1 else ""),
                    f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'run' / 'slurmd'}" + ("-%n" if self.nodes > 1 else "") + ".pid",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd'}" + ("-%n" if self.nodes > 1 else "") + ".log",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    "ProctrackType=proctrack/linuxproc",  # no systemd/cgroup delegation here
                    "TaskPlugin=task/none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core_Memory",
                    "DefMemPerCPU=2000",  # else one job takes all memory and jobs serialize
                    "MailProg=/bin/true",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    "KillWait=30",
                    "MinJobAge=600",  # keep finished jobs visible to scontrol for the test
                    "GresTypes=gpu",
                    *nodes,
                    f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        lines = [f"NodeName=localhost Name=gpu File={r / 'dev'}/nvidia[0-{self.gpus - 1}]"] if gres else []
        (r / "gres.conf").write_text("\n".join(lines) + "\n")
        (r / "cgroup.conf").write_text("")

    def _spawn(self, name: str, command: list[str], env: dict) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "ab")
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.pids[name] = process.pid
        self._processes = getattr(self, "_processes", {})
        self._processes[name] = process

    def _exited(self, name: str) -> bool:
        process = getattr(self, "_processes", {}).get(name)
        return process is not None and process.poll() is not None

    def _wait_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name in ["slurmctld"] + [self._daemon(n) for n in self.node_names]:
                if self._exited(name):
                    raise SlurmStartError(f"{name} exited:\n{self.logs()}")
            result = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True
            )
            state = result.stdout.strip()
            states = state.split()
            if len(states) == self.nodes and all(s in ("idle", "mixed") for s in states):
                return
            time.sleep(0.5)
        raise SlurmStartError(f"node not idle after {timeout:.0f} s (state {state!r}):\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        files = sorted((self.root / "log").glob("*"))
        if getattr(self, "munge_dir", None):
            files.append(self.munge_dir / "munged.log")
        return "\n".join(f"--- {p.name}\n{_tail(p, lines)}" for p in files if p.is_file())


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            finished, _ = os.waitpid(pid, os.WNOHANG)
            if finished:
                return True
        except ChildProcessError:  # not our child: poll for existence
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.2)
    return False
