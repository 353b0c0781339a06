"""``orchestrator run CONFIG --address URL``: the sweep as a Ray Job on a running cluster.

The job runs ``python -m orchestrator run CONFIG ...`` (without ``--address``) on the head
node; inside it Ray sets ``RAY_ADDRESS``, so the runner joins that cluster instead of
starting its own Ray. What the job needs from the submitting machine travels with it:

- the current directory is uploaded as the job's ``working_dir`` (as ``ray job submit
  --working-dir .`` does), so the config, the files it names and the user's own workload
  modules are there, whether the cluster is this machine or a remote one seen from a laptop.
  The config must therefore sit inside the current directory. Ray leaves out ``.git``,
  ``.venv``, ``venv``, ``__pycache__`` and what ``.gitignore``/``.rayignore`` list; we also
  leave out :data:`EXCLUDED` and earlier results under the storage path.
- the Python environment is the cluster's: the ``python`` on the PATH of ``ray start``. Start
  the cluster from an environment that has this project's dependencies.

Nothing is uploaded before the sweep passes the pre-flight ``run`` makes here
(``launch.base.preflight``): a sweep ``run`` refuses in one line is refused in the same line.
Results follow the runner's rules, but relative paths now resolve in the job's working
directory on the cluster, a temporary copy: we say so before submitting, so a user who wants
to keep them passes ``--storage-path`` and ``--tracking-uri`` that the cluster can reach.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shlex
import string
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from orchestrator import follow_up
from orchestrator.allocator_conf import import_time_environment
from orchestrator.config import SweepSpec
from orchestrator.errors import UserError
from orchestrator.failures import exception_line
from orchestrator.invocation import command_prefix, tool
from orchestrator.launch.base import EMBEDDED_RAY_FLAGS, Launcher, refuse_flags
from orchestrator.run_request import RunRequest
from orchestrator.tracking.runs import is_relative_sqlite

# Local tracking data is never worth uploading, even when a project has no .gitignore saying so.
EXCLUDED = ("mlruns", "mlflow.db", ".pytest_cache")

#: How the job starts ``run`` on the cluster: the Python on the PATH of its ``ray start``.
PROGRAM = ("python", "-m", "orchestrator")


@dataclass(frozen=True)
class JobRequest:
    """What is sent to the cluster's job API."""

    entrypoint: str
    runtime_env: dict
    metadata: dict[str, str]


def build_job_request(request: RunRequest, spec: SweepSpec, cwd: Path, address: str | None = None) -> JobRequest:
    """The job that runs ``request`` on the cluster, with ``cwd`` as its working_dir. The commands
    its driver prints (resume, report) start as the user started this one, and a ``run`` goes back
    to the cluster at ``address`` (``follow_up``)."""
    config = Path(request.config).resolve()
    cwd = cwd.resolve()
    if not config.is_relative_to(cwd):
        raise UserError(
            f"{request.config}: a job gets the current directory ({cwd}) as its working_dir, and this "
            "config is outside it; run from the project folder that contains the config"
        )
    entrypoint = request.replace(config=config.relative_to(cwd).as_posix()).command(PROGRAM)

    excludes = list(EXCLUDED)
    storage = (cwd / (request.storage_path or spec.storage_path)).resolve()
    if storage.is_relative_to(cwd) and storage != cwd:
        excludes.append("/" + storage.relative_to(cwd).as_posix())  # earlier sweeps' results
    return JobRequest(
        entrypoint=entrypoint,
        runtime_env={"working_dir": str(cwd), "excludes": excludes, "env_vars": {
            follow_up.PREFIX: shlex.join(command_prefix()),
            follow_up.RUN_FLAGS: shlex.join(["--address", address] if address else []),
            **import_time_environment(spec.memory.allocator_conf),
        }},
        # `job_name` is what the dashboard's job list shows in its Name column.
        metadata={"job_name": f"orchestrator {spec.experiment}", "experiment": spec.experiment,
                  "config": config.relative_to(cwd).as_posix()},
    )


def results_notes(request: RunRequest, spec: SweepSpec) -> list[str]:
    """Warnings for results that would land in the job's temporary working directory."""
    notes = []
    storage = request.storage_path or spec.storage_path
    if not os.path.isabs(storage):  # a URI is refused before this (config.StoragePath)
        notes.append(f"Tune results go to {storage!r} inside the job's temporary working directory on the "
                     "cluster; pass --storage-path with a path the cluster keeps (shared storage) to keep them.")
    tracking = request.tracking_uri or spec.tracking_uri
    if tracking is None or is_relative_sqlite(tracking):
        notes.append(f"MLflow records go to {tracking or 'sqlite:///mlflow.db'} inside that working directory; "
                     "pass --tracking-uri with an MLflow server (or an absolute sqlite path) the cluster can reach.")
    return notes


def refusal_line(message: str) -> str:
    """Ray's job client's error in one line: ``Request failed with status code 500: <reason>``,
    where the dashboard may send its whole server-side traceback as the reason (its last line)."""
    status, _, reason = message.partition(": ")
    return f"{status}: {exception_line(reason)}" if reason else message


def connect(address: str):
    """A job client for the dashboard at ``address``, sending Ray's auth token when we have one."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    from orchestrator.dashboard import auth_headers
    from orchestrator.ray_token import token_refused

    headers = auth_headers()
    try:
        return JobSubmissionClient(address, headers=headers)
    except AuthenticationError as exc:
        raise UserError(f"--address {address}: {token_refused(bool(headers), str(exc).splitlines()[0])}") from None
    except ConnectionError:
        raise UserError(
            f"--address {address}: no Ray dashboard answers there; start one with "
            "`ray start --head --dashboard-host 127.0.0.1` (from this project's Python environment) "
            "or fix the URL"
        ) from None


#: Ray's job client's loggers, held to warnings unless ``--verbose``.
JOB_CLIENT_LOGGERS = ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging",
                      "ray.dashboard.modules.job.sdk")


@dataclass(frozen=True)
class RayJobLauncher(Launcher):
    """Submits the sweep to the cluster whose dashboard is at ``address``, then follows its logs."""

    name: ClassVar[str] = "ray-job"

    address: str

    @classmethod
    def from_args(cls, args) -> RayJobLauncher:
        refuse_flags(args, (("ray_address", "--ray-address"), *EMBEDDED_RAY_FLAGS),
                     "only for a sweep run here; with --address the job runs on the cluster's Ray")
        if not args.address.startswith(("http://", "https://")):  # before the sweep is checked and estimated
            raise UserError(
                f"--address {args.address}: expected the dashboard's URL, e.g. http://127.0.0.1:8265 "
                "(to run the driver here against a cluster's HOST:PORT, use --ray-address)"
            )
        return cls(address=args.address)

    def check(self, request: RunRequest, spec: SweepSpec) -> None:
        build_job_request(request, spec, Path.cwd(), self.address)  # the config must travel with the working_dir

    def submit(self, request: RunRequest, spec: SweepSpec) -> int:
        """Submit, say where to watch and how to stop it, follow the logs; exit 0 iff the job succeeded."""
        from ray.job_submission import JobStatus

        from orchestrator.dashboard import how_to_open, job_page, token_required

        job = build_job_request(request, spec, Path.cwd(), self.address)
        if not request.verbose:  # their upload and WebSocket notices say again what our lines say
            for logger in JOB_CLIENT_LOGGERS:
                logging.getLogger(logger).setLevel(logging.WARNING)
        # The dashboard answers and takes our token, or its one line before anything else is said.
        # (After the pre-flight, as every launcher's: a sweep any launcher refuses is refused alike.)
        client = connect(self.address)
        for note in results_notes(request, spec):
            print(f"note: {note}")
        commands = JobCommands(self.address, new_submission_id(), token_required(self.address))
        try:
            print(f"Uploading {job.runtime_env['working_dir']} and submitting job {commands.submission_id}...",
                  flush=True)
            client.submit_job(entrypoint=job.entrypoint, runtime_env=job.runtime_env, metadata=job.metadata,
                              submission_id=commands.submission_id)
        except KeyboardInterrupt:
            print(interrupted_submission(client, commands), flush=True)
            return 130
        except RuntimeError as exc:  # Ray's job client, for a request the dashboard refused (an agent that is down)
            raise UserError(f"--address {self.address}: the cluster did not take the job: {refusal_line(str(exc))}") from None
        try:
            print(f"Submitted job {commands.submission_id}: {job.entrypoint}")
            print(how_to_open(job_page(self.address, commands.submission_id), commands.needs_token))
            print(f"Following its logs; Ctrl-C stops following, not the job. Stop the job with: {commands.stop}",
                  flush=True)
            followed = follow(client.tail_job_logs(commands.submission_id))
        except KeyboardInterrupt:
            followed = False
        if not followed:
            print(f"\nStopped following. {commands.still_running()}")
            return 130
        info = client.get_job_info(commands.submission_id)
        print(outcome_line(commands.submission_id, info.status.value, info.message or ""))
        if info.status != JobStatus.SUCCEEDED and (hint := not_installed_hint(info.message or "")):
            print(hint)
        return 0 if info.status == JobStatus.SUCCEEDED else 1


def outcome_line(submission_id: str, status: str, message: str) -> str:
    """``Job raysubmit_... FAILED: Job entrypoint command failed with exit code 1``: the first line
    of Ray's message, without the log tail it repeats (which the followed logs showed)."""
    first = message.splitlines()[0].split(", last available logs")[0] if message.strip() else ""
    return f"Job {submission_id} {status}: {first}".rstrip(": ")


def not_installed_hint(job_message: str) -> str | None:
    """What to do when the job's ``python`` lacks the orchestrator: the job ran the ``python`` on
    the PATH its cluster's ``ray start`` had (a head started outside the venv, the usual slip),
    and Ray's log says only ``No module named orchestrator``."""
    missing = re.search(r"^(\S*python[\w.]*): No module named orchestrator$", job_message, re.M)
    if missing is None:
        return None
    return (f"hint: the cluster runs jobs with {missing.group(1)}, the `python` on the PATH of its `ray start`, "
            "and the orchestrator is not installed there: install it into that Python, or start the cluster from "
            "the environment that has it (`source .venv/bin/activate && ray start --head ...`)")


def new_submission_id() -> str:
    """An id of Ray's own form (``raysubmit_`` and 16 letters and digits), chosen here rather than
    by the cluster, so that a submission cut short by Ctrl-C can still be looked up by it."""
    return "raysubmit_" + "".join(secrets.choice(SUBMISSION_ID_CHARACTERS) for _ in range(16))


#: Letters and digits, less those easily confused (Ray leaves out the same five).
SUBMISSION_ID_CHARACTERS = "".join(sorted(set(string.ascii_letters + string.digits) - set("IlOo0")))


@dataclass(frozen=True)
class JobCommands:
    """Ray's CLI lines for one submitted job, with the token mode its dashboard needs."""

    address: str
    submission_id: str
    needs_token: bool

    def _ray(self, verb: str) -> str:
        ray = shlex.quote(tool("ray"))
        ray_cli = f"RAY_AUTH_MODE=token {ray}" if self.needs_token else ray  # Ray's CLI sends the token only when told to
        return f"{ray_cli} job {verb} {self.submission_id} --address {self.address}"

    @property
    def stop(self) -> str:
        return self._ray("stop")

    @property
    def follow(self) -> str:
        return self._ray("logs --follow")

    @property
    def status(self) -> str:
        return self._ray("status")

    def still_running(self) -> str:
        return (f"Job {self.submission_id} keeps running on the cluster.\n"
                f"  follow it again: {self.follow}\n"
                f"  stop it:         {self.stop}")


def interrupted_submission(client, commands: JobCommands) -> str:
    """What a Ctrl-C during ``submit_job`` left behind, asked of the cluster: nothing (it came
    while the working directory was packed or uploaded, or before the cluster took the job), or
    a job that now runs without anyone following it (the reply was what the Ctrl-C cut short)."""
    try:
        taken = any(job.submission_id == commands.submission_id for job in client.list_jobs())
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:  # RuntimeError: Ray's client, for a failed request
        asked = "a second Ctrl-C" if isinstance(exc, KeyboardInterrupt) else f"the cluster did not answer: {exc}"
        return (f"Interrupted while submitting; whether job {commands.submission_id} reached the cluster is not known "
                f"({asked}). Ask with: {commands.status}")
    if not taken:
        return (f"Interrupted before the cluster took the job: nothing was submitted "
                f"({commands.submission_id} is not in its job list).")
    return f"Interrupted, but the cluster had taken the job. {commands.still_running()}"


def follow(chunks: AsyncIterator[str]) -> bool:
    """Print log chunks until they end (True) or Ctrl-C stops following (False).

    ``asyncio.run`` turns Ctrl-C into a cancelled task and then a ``KeyboardInterrupt``, but a
    Ctrl-C that lands while it installs its handler escapes as ``CancelledError`` (Python 3.11
    zeroes its interrupt count after installing the handler). Nothing else cancels this task, so
    both mean the user stopped following. One that lands before the loop starts the printing
    leaves it never awaited, which Python would warn about on the user's screen: it is closed.
    """
    printing = _print_all(chunks)
    try:
        asyncio.run(printing)
    except (KeyboardInterrupt, asyncio.CancelledError):
        printing.close()
        return False
    return True


async def _print_all(chunks: AsyncIterator[str]) -> None:
    async for chunk in chunks:
        print(chunk, end="", flush=True)
