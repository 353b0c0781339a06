"""``orchestrator submit``: run a sweep on a SLURM allocation, inside a Ray cluster the job starts.

The work is split so each part can be read (and tested) alone:

- :func:`plan_job` turns the validated sweep spec and the command-line flags into a
  :class:`SlurmJob`: every decision (CPUs, GPUs, where results, logs and MLflow go) is made
  here, in Python, where a mistake becomes a one-line ``error: ...`` before anything is queued.
- :func:`render` fills the bash template ``slurm/sweep.sbatch.tmpl`` with that job. The template
  holds what has to happen on the nodes at run time (which nodes, which IP, which ports are
  free) and is meant to be read and adapted by cluster admins (``slurm/README.md``).
- :class:`SlurmLauncher` (the ``slurm`` launcher) writes the job folder (a copy of the config,
  the script) and calls ``sbatch``, or with ``--dry-run`` prints the script. Before either, the
  sweep passes the pre-flight ``run`` makes (``launch.base.preflight``), and the storage path,
  which the submitting machine shares with the nodes, must take files as ``run`` asks.

The driver's command line is the one every launcher renders (``run_request.RunRequest``), with
the values the script learns on the nodes (the head's address, the MLflow server it started)
left to the shell.

Why the script starts the Ray head and workers itself (``srun ... ray start --block``) instead
of Ray's newer ``ray symmetric-run``: Ray's SLURM guide says symmetric-run does not currently
work in multi-tenant environments, and GPU nodes are often shared between jobs and users. The
explicit pattern lets every job pin its own ports and temp dir, which is what makes two jobs
on one node safe.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from orchestrator.atomic_file import atomic_write
from orchestrator.config import SweepSpec
from orchestrator.errors import UserError
from orchestrator.launch.base import Launcher
from orchestrator.preflight import check_storage
from orchestrator.ray_internals import LOCAL_RAY_SYSTEM_CONFIG
from orchestrator.run_request import Expanded, RunRequest
from orchestrator.writable import taken_back_if_refused

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "slurm"
DEFAULT_TEMPLATE = TEMPLATE_DIR / "sweep.sbatch.tmpl"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")

# Tracking stores that live in a local file: nodes can't share them safely (SQLite on a
# network filesystem breaks under concurrent writers), so the job runs a server instead.
LOCAL_TRACKING_SCHEMES = ("", "file", "sqlite")

# How long before the time limit SLURM signals the job to stop and requeue (at most; short
# jobs get a quarter of their limit). Tune needs seconds to save its state; trials keep
# their own checkpoints, so a few minutes is plenty.
MAX_STOP_GRACE_S = 300


@dataclass(frozen=True)
class SlurmJob:
    """Everything the sbatch template needs, decided at submit time. Paths are absolute."""

    job_name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    time: str  # SLURM syntax, as given
    time_limit_s: int
    partition: str | None
    account: str | None
    mem: str | None
    workdir: str  # the job runs here (relative paths in the config resolve against it)
    log_file: str  # SLURM's output file pattern, with %j for the job id
    job_dir: str  # per submission: config.yaml, job.sbatch, mlflow.db, logs/
    storage_path: str  # Tune's storage: must be on a filesystem every node sees
    tracking_uri: str | None  # an MLflow server everyone can reach; None = start one on the head
    overrides: tuple[str, ...]
    python: str
    ray: str
    mlflow: str

    @property
    def stop_grace_s(self) -> int:
        return max(10, min(MAX_STOP_GRACE_S, self.time_limit_s // 4))

    def sbatch_directives(self) -> list[str]:
        """The ``#SBATCH`` lines: one task per node, and that task holds the node's CPUs and GPUs."""
        lines = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={self.cpus_per_node}",
        ]
        if self.gpus_per_node:
            lines.append(f"--gres=gpu:{self.gpus_per_node}")
        lines.append(f"--time={self.time}")
        for flag, value in (("partition", self.partition), ("account", self.account), ("mem", self.mem)):
            if value:
                lines.append(f"--{flag}={value}")
        lines += [
            f"--chdir={self.workdir}",
            f"--output={self.log_file}",
            "--open-mode=append",  # a requeued job appends to the same log
            "--requeue",  # preempted jobs go back to the queue and resume
            f"--signal=B:USR1@{self.stop_grace_s}",  # tell the batch shell before the time limit
        ]
        return ["#SBATCH " + line for line in lines]

    def log_path(self, job_id: str) -> str:
        return self.log_file.replace("%j", job_id).replace("%x", self.job_name)

    def driver_request(self) -> RunRequest:
        """The sweep's ``run`` on the head node: the job folder's copy of the config, the
        cluster and MLflow server the script started (shell variables it sets), and the job
        folder's name as the sweep's, so a requeued attempt resumes exactly this sweep."""
        return RunRequest(
            config=Expanded('"$CONFIG"'), overrides=self.overrides, storage_path=Expanded('"$STORAGE"'),
            tracking_uri=Expanded('"$TRACKING_URI"'), ray_address=Expanded('"$RAY_ADDRESS_HEAD"'),
            name=os.path.basename(self.job_dir),
        )


# -- deciding -----------------------------------------------------------------------------


def plan_job(args, spec: SweepSpec, *, cwd: str | None = None, now: datetime | None = None) -> SlurmJob:
    """Check the flags against the sweep and decide the job; raises UserError on anything wrong."""
    cwd = os.path.abspath(cwd or os.getcwd())
    now = now or datetime.now()
    if args.nodes < 1:
        raise UserError(f"--nodes: expected at least 1, got {args.nodes}")
    if args.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node: expected 0 or more, got {args.gpus_per_node}")
    cpus = _cpus_per_node(args, spec)
    time_limit_s = parse_time_limit(args.time)
    for flag in ("partition", "account", "mem"):
        value = getattr(args, flag)
        if value is not None and not re.fullmatch(r"[\w.,:+-]+", value):
            raise UserError(f"--{flag}: unexpected characters in {value!r}")
    if args.mem is not None and not re.fullmatch(r"[0-9]+[KMGT]?", args.mem, re.IGNORECASE):
        # sbatch would refuse it only once the job is submitted, after the checks and the script
        raise UserError(f"--mem: expected SLURM's memory per node, a whole number with K, M (the default), G or T, "
                        f"such as 64G, got {args.mem!r}")

    storage = _absolute(args.storage_path or spec.storage_path, cwd)
    log_dir = _absolute(args.log_dir, cwd)
    safe_name = re.sub(r"[^\w.-]", "_", spec.experiment)
    job_name = f"orch-{safe_name}"
    job_dir = os.path.join(storage, "slurm", f"{safe_name}-{now:%Y%m%d-%H%M%S}")
    for what, path in (("working directory", cwd), ("--log-dir", log_dir), ("storage path", storage)):
        if odd := re.search(r"[\s'\"\\%]", path):  # sbatch splits at spaces, strips quotes, reads % as a pattern
            kind = "whitespace" if odd.group().isspace() else repr(odd.group())
            raise UserError(f"{what}: {path!r} contains {kind}, which #SBATCH lines can't carry as written")

    return SlurmJob(
        job_name=job_name,
        nodes=args.nodes,
        cpus_per_node=cpus,
        gpus_per_node=args.gpus_per_node,
        time=args.time,
        time_limit_s=time_limit_s,
        partition=args.partition,
        account=args.account,
        mem=args.mem,
        workdir=cwd,
        log_file=os.path.join(log_dir, f"{job_name}-%j.out"),
        job_dir=job_dir,
        storage_path=storage,
        tracking_uri=shared_tracking_uri(args.tracking_uri or spec.tracking_uri),
        overrides=tuple(args.overrides),
        python=sys.executable,
        ray=_executable("ray"),
        mlflow=_executable("mlflow"),
    )


def _cpus_per_node(args, spec: SweepSpec) -> int:
    """``--cpus-per-node``, or for a GPU job one trial's CPUs per GPU; checked against a trial's needs."""
    gpu = spec.resources.gpu
    wants_gpu = gpu == "auto" or gpu > 0
    if wants_gpu and args.gpus_per_node == 0:
        raise UserError(
            f"--gpus-per-node: the sweep's trials need GPUs (resources.gpu: {gpu}); "
            "ask for some, e.g. --gpus-per-node 4"
        )
    if gpu != "auto" and gpu > args.gpus_per_node > 0:
        raise UserError(
            f"--gpus-per-node: {args.gpus_per_node} is fewer than one trial needs (resources.gpu: {gpu:g}); "
            "a trial runs on one node"
        )
    workers = spec.resources.workers
    if workers > 1:  # a data-parallel trial's workers may spread over the allocation's nodes
        by_gpus = args.gpus_per_node // int(gpu) if gpu else workers
        by_cpus = args.cpus_per_node // math.ceil(spec.resources.cpu) if args.cpus_per_node else workers
        per_node = min(by_gpus, by_cpus)
        if per_node * args.nodes < workers:
            fits = per_node * args.nodes
            raise UserError(
                f"--nodes/--gpus-per-node: a trial needs {workers} workers (resources.workers) of GPU {gpu:g}, "
                f"CPU {spec.resources.cpu:g}, and {args.nodes} node(s) hold {fits}; "
                f"ask for --nodes {math.ceil(workers / max(per_node, 1))} or set resources.workers: {fits}"
            )
    if args.cpus_per_node is None:
        if args.gpus_per_node == 0:
            raise UserError(
                "--cpus-per-node: needed for a CPU-only job, e.g. --cpus-per-node 8 "
                f"(runs {math.floor(8 / spec.resources.cpu)} trials of resources.cpu={spec.resources.cpu:g} at once per node)"
            )
        cpus = args.gpus_per_node * math.ceil(spec.resources.cpu)
    else:
        cpus = args.cpus_per_node
    if cpus < spec.resources.cpu:
        raise UserError(
            f"--cpus-per-node: {cpus} is fewer than one trial needs (resources.cpu: {spec.resources.cpu:g})"
        )
    return cpus


def parse_time_limit(text: str) -> int:
    """SLURM's --time syntax (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise UserError(f"--time: expected HH:MM:SS, D-HH:MM:SS or minutes, got {text!r}")
    days, a, b, c = (int(x) if x is not None else None for x in match.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # M:S
        seconds = a * 60 + b
    else:  # M
        seconds = a * 60
    if seconds <= 0:
        raise UserError(f"--time: expected a positive time limit, got {text!r}")
    return seconds


def shared_tracking_uri(uri: str | None) -> str | None:
    """A tracking URI every node can write to, or None when the job must start its own server."""
    if not uri:
        return None
    scheme = uri.split(":", 1)[0].lower() if re.match(r"^[A-Za-z][\w+.-]*://", uri) else ""
    return None if scheme in LOCAL_TRACKING_SCHEMES else uri


def _absolute(path: str, cwd: str) -> str:
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))


def _executable(name: str) -> str:
    """The tool installed next to this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise UserError(f"'{name}' not found next to {sys.executable} or on PATH; install ray[default] and mlflow")
    return found


# -- rendering ----------------------------------------------------------------------------

#: How the script starts the driver: the job's Python (``$PYTHON``, which a site may set), unbuffered
#: so the job log shows progress as it happens.
DRIVER_PROGRAM = (Expanded('"$PYTHON"'), "-u", "-m", "orchestrator")


def render(job: SlurmJob, template: str | None = None) -> str:
    """Fill the template's ``{{name}}`` placeholders; values are shell-quoted."""
    text = template if template is not None else DEFAULT_TEMPLATE.read_text()
    q = shlex.quote
    values = {
        "sbatch_directives": "\n".join(job.sbatch_directives()),
        "python": q(job.python),
        "ray": q(job.ray),
        # The job's Ray is one the sweep starts, as an embedded one is: set the same.
        "ray_system_config": q(json.dumps(LOCAL_RAY_SYSTEM_CONFIG)),
        "mlflow": q(job.mlflow),
        "job_dir": q(job.job_dir),
        "run_command": job.driver_request().command(DRIVER_PROGRAM),
        "resume_command": job.driver_request().replace(resume=True).command(DRIVER_PROGRAM),
        "storage_path": q(job.storage_path),
        "tracking_uri": q(job.tracking_uri or ""),
        "nodes": str(job.nodes),
        "cpus_per_node": str(job.cpus_per_node),
        "gpus_per_node": str(job.gpus_per_node),
    }

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise UserError(f"SLURM template: unknown placeholder {{{{{name}}}}}")
        return values[name]

    return PLACEHOLDER.sub(fill, text)


# -- submitting ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmLauncher(Launcher):
    """Submits the sweep as one SLURM job that starts its own Ray cluster (``slurm/``)."""

    name: ClassVar[str] = "slurm"

    args: Any  # the ``submit`` flags (--nodes, --time, --dry-run, ...), as :func:`plan_job` reads them

    @classmethod
    def from_args(cls, args) -> SlurmLauncher:
        return cls(args)

    def check(self, request: RunRequest, spec: SweepSpec) -> None:
        plan_job(self.args, spec)  # the allocation holds a trial; the flags are SLURM's syntax

    def submit(self, request: RunRequest, spec: SweepSpec) -> int:
        args = self.args
        job = plan_job(args, spec)
        template_path = Path(getattr(args, "template", None) or os.environ.get("ORCHESTRATOR_SLURM_TEMPLATE") or DEFAULT_TEMPLATE)
        try:
            script = render(job, template_path.read_text())
        except OSError as exc:
            raise UserError(f"SLURM template {template_path}: {exc.strerror}") from None
        notes = _notes(args, spec, job)

        if args.dry_run:
            sys.stdout.write(script)
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            print(f"(dry run: nothing written or submitted; the job folder would be {job.job_dir})", file=sys.stderr)
            return 0

        sbatch = shutil.which("sbatch")
        if sbatch is None:
            raise UserError("sbatch not found: submit from a SLURM login node, or use --dry-run to see the script")
        check_storage(job.storage_path)
        script_path = _write_job_dir(job, spec, script)
        with taken_back_if_refused(os.path.dirname(job.log_file)):  # the job folder stays: the error names its script
            os.makedirs(os.path.dirname(job.log_file), exist_ok=True)  # SLURM doesn't create it
            try:
                result = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True, text=True, check=False)
            except KeyboardInterrupt:  # the terminal's Ctrl-C reached sbatch too: did the controller take the job?
                _interrupted_submission(job, spec, script_path, notes)
                return 130
            if result.returncode != 0:
                message = (result.stderr or result.stdout).strip().replace("\n", " ")
                raise UserError(f"sbatch refused the job: {message} (script: {script_path})")
        job_id = result.stdout.strip().split(";")[0]
        _print_submitted(job, spec, job_id, notes)
        return 0


#: The job script's port blocks (``slurm/sweep.sbatch.tmpl``'s PORT_MIN, PORT_BLOCKS and
#: PORT_BLOCK_SIZE): a job takes one block of its own, the first free one from its job id on.
PORT_MIN, PORT_BLOCKS, PORT_BLOCK_SIZE = 10000, 45, 500


def expected_dashboard_port(job_id: str) -> int:
    """The port the job's dashboard will most likely get: the template's first choice of port block.

    The job moves to the next block when that one is busy on the head node, so the job log
    has the final word.
    """
    port_min = int(os.environ.get("ORCHESTRATOR_PORT_MIN", PORT_MIN))
    blocks = int(os.environ.get("ORCHESTRATOR_PORT_BLOCKS", PORT_BLOCKS))
    return port_min + (int(job_id) % blocks) * PORT_BLOCK_SIZE + 4


def _write_job_dir(job: SlurmJob, spec: SweepSpec, script: str) -> Path:
    """The job folder: the config as it is now (a queued job doesn't see later edits) and the script."""
    job_dir = Path(job.job_dir)
    try:
        job_dir.mkdir(parents=True, exist_ok=False)
    except FileExistsError:
        raise UserError(f"{job_dir} already exists (two submissions in one second?); submit again") from None
    except OSError as exc:
        raise UserError(f"cannot create the job folder {job_dir}: {exc.strerror}") from None
    script_path = job_dir / "job.sbatch"
    try:  # each attempt of a requeued job reads them again: whole files or none
        with open(spec.source, "rb") as source, atomic_write(job_dir / "config.yaml", "wb") as f:
            shutil.copyfileobj(source, f)
        with atomic_write(script_path) as f:
            f.write(script)
    except OSError as exc:
        raise UserError(f"cannot write the job folder {job_dir}: {exc.strerror or exc}") from None
    script_path.chmod(0o755)
    return script_path


def _notes(args, spec: SweepSpec, job: SlurmJob) -> list[str]:
    notes = []
    asked = args.tracking_uri or spec.tracking_uri
    if asked and job.tracking_uri is None:
        notes.append(
            f"tracking URI {asked} is a local store the nodes can't share; "
            f"the job starts an MLflow server on its head node instead (store: {job.job_dir}/mlflow.db)"
        )
    if job.gpus_per_node and spec.resources.gpu == 0:
        notes.append(f"the job asks for {job.gpus_per_node} GPU(s) per node but trials use none (resources.gpu: 0)")
    return notes


def _interrupted_submission(job: SlurmJob, spec: SweepSpec, script_path: Path, notes: list[str]) -> None:
    """What a Ctrl-C during ``sbatch`` left behind, asked of SLURM: a queued job that nobody was
    told of (the reply was what the Ctrl-C cut short: it gets the usual lines), or nothing, in
    which case the job folder goes too (it was written for this submission only)."""
    squeue = ["squeue", "--user", getpass.getuser(), "--noheader", "--format=%i %o"]  # %o: the job's script
    ask = f"{shlex.join(squeue)} | grep {shlex.quote(str(script_path))}"
    try:
        listed = subprocess.run(squeue, capture_output=True, text=True, timeout=60, check=False)
        unknown = None if listed.returncode == 0 else "squeue: " + (listed.stderr or listed.stdout).strip().replace("\n", " ")
    except (KeyboardInterrupt, OSError, subprocess.TimeoutExpired) as exc:
        unknown = "a second Ctrl-C" if isinstance(exc, KeyboardInterrupt) else f"squeue did not answer: {exc}"
    if unknown is not None:
        print(f"Interrupted while submitting; whether SLURM took the job is not known ({unknown}). Ask with: {ask}")
        return
    taken = [line.split()[0] for line in listed.stdout.splitlines() if line.split(maxsplit=1)[1:] == [str(script_path)]]
    if taken:
        print("Interrupted, but SLURM had taken the job:")
        _print_submitted(job, spec, taken[0], notes)
        return
    shutil.rmtree(job.job_dir, ignore_errors=True)
    print(f"Interrupted before SLURM took the job: nothing was submitted (no job of yours runs {script_path}); "
          f"its folder {job.job_dir} was removed.")


def _print_submitted(job: SlurmJob, spec: SweepSpec, job_id: str, notes: list[str]) -> None:
    log = job.log_path(job_id)
    where = "s" if job.nodes > 1 else ""
    mlflow = job.tracking_uri or f"a server on the head node; afterwards: sqlite:///{job.job_dir}/mlflow.db"
    print(f"Submitted SLURM job {job_id}: sweep {spec.experiment} on {job.nodes} node{where}")
    print(f"  logs:       {log}")
    print(f"  job folder: {job.job_dir}")
    print(f"  results:    {job.storage_path}/{os.path.basename(job.job_dir)}/")  # the sweep is named as its job folder
    print(f"  MLflow:     {mlflow}")
    tunnel = f"ssh -N -L 8265:<head node>:{expected_dashboard_port(job_id)} {getpass.getuser()}@{socket.gethostname()}"
    print(f"  dashboard:  {tunnel}   then open http://localhost:8265")
    print(f"              (once it runs; the log has the exact line: grep 'ssh -N' {log})")
    # The batch shell alone: it stops the driver, then the job's Ray and MLflow server, in that order.
    print(f"  status:     squeue -j {job_id}    stop: scancel --batch --signal=TERM {job_id}")
    for note in notes:
        print(f"note: {note}")
