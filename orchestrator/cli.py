"""``orchestrator run | plan | submit | report``: the four things a user does.

Each command's work lives in the module named for it; this file parses flags, so the whole
command-line surface can be read in one place, and sets up the process every command shares
(its output into a pipe, Ray's loopback flag, the working directory on Python's path).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import stat
import sys

from orchestrator.errors import ToldInterrupt, UserError
from orchestrator.estimator_registry import names as estimator_names
from orchestrator.garbage import collect_less, skip_last_collection


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="sweep YAML file, e.g. configs/demo_cpu.yaml")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
        help="override a config key (YAML value), e.g. --set stop.epochs=2; repeatable",
    )


#: The installed distributions whose versions decide what a sweep does: the first line of a bug report.
VERSIONED = (("orchestrator", "memory-aware-orchestrator"), ("ray", "ray"), ("torch", "torch"), ("mlflow", "mlflow"))


def installed_versions() -> str:
    """``orchestrator 0.1.0 (ray 2.60.0, torch 2.13.0+cpu, mlflow 3.17.2, Python 3.11.7)``, read from
    the installed packages' metadata (importing Ray and torch would take seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(distribution: str) -> str:
        try:
            return version(distribution)
        except PackageNotFoundError:
            return "not installed"

    (_, ours), *others = VERSIONED
    parts = [f"{name} {installed(distribution)}" for name, distribution in others]
    return f"orchestrator {installed(ours)} ({', '.join(parts)}, Python {sys.version.split()[0]})"


class _VersionAction(argparse.Action):
    """``--version``: the versions are read only when asked for, not each time the parser is built."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(installed_versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of the orchestrator, Ray, PyTorch, MLflow and Python, and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run a sweep (embedded local Ray, a Ray cluster, or as a Ray Job)")
    _add_config_arguments(run)
    run.add_argument("--tracking-uri", help="MLflow tracking URI (default: the config's, else sqlite:///mlflow.db)")
    run.add_argument("--storage-path", help="where Tune keeps trial checkpoints and results (default: the config's)")
    run.add_argument(
        "--ray-address", metavar="HOST:PORT",
        help="run the driver here against an existing Ray cluster's GCS (as inside a SLURM job); never 'auto'",
    )
    run.add_argument(
        "--address", metavar="URL",
        help="submit the sweep as a Ray Job to a cluster's dashboard, e.g. http://127.0.0.1:8265, and follow its logs; "
             "uploads the current directory and sends Ray's auth token (see docs/dashboard.md)",
    )
    run.add_argument(
        "--name", help="the sweep's folder under the storage path (default: EXPERIMENT_<timestamp>); "
        "with --resume, the sweep to resume",
    )
    run.add_argument(
        "--resume", action="store_true",
        help="resume an interrupted sweep from its storage path (and send the MLflow records it could not)",
    )
    run.add_argument(
        "--allow-config-change", action="store_true",
        help="with --resume: resume even where the config differs from the one the sweep was started with "
             "(refused otherwise, naming the keys); the unfinished trials continue with the new config, "
             "the search space, scheduler and finished trials stay as stored",
    )
    run.add_argument(
        "--offline-tracking", action="store_true",
        help="start even if MLflow cannot be reached: its records wait in the sweep's folder, "
             "and `run --resume` sends them (the run exits 1 while any are unsent)",
    )
    run.add_argument("--num-cpus", type=int, help="CPUs of the embedded local Ray (default: the ones this process may use, "
                     "its affinity and CPU quota)")
    run.add_argument("--num-gpus", type=float, help="GPUs of the embedded local Ray (default: detected)")
    run.add_argument(
        "--host-memory", metavar="SIZE",
        help="the memory each node has available for the trials, e.g. 64GiB (default: this machine's for the "
             "embedded local Ray, else the memory Ray gave each node); data.prefetch_factor, then data.num_workers "
             "are cut until the trials a node runs at once fit it (see `orchestrator plan`)",
    )
    run.add_argument("--dashboard", action="store_true", help="start the Ray dashboard with the embedded local Ray")
    run.add_argument("--dashboard-host", default="127.0.0.1", help="address the dashboard binds to (default 127.0.0.1)")
    run.add_argument(
        "-v", "--verbose", action="store_true",
        help="print Ray's and Tune's own output (a result box per report, snapshot and checkpoint lines) "
             "instead of one line per trial event",
    )

    plan = commands.add_parser("plan", help="estimate every trial's memory and show its plan, before anything runs")
    _add_config_arguments(plan)
    plan.add_argument("--device-memory", metavar="SIZE", help="plan for a card of this size, e.g. 24GiB")
    plan.add_argument("--host-memory", metavar="SIZE",
                      help="plan the trials' host memory for a node with this much available (default: this machine's)")
    plan.add_argument("--estimator", choices=estimator_names(), help="override memory.estimator")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")

    submit = commands.add_parser("submit", help="submit the sweep to SLURM: a Ray cluster inside the allocation")
    _add_config_arguments(submit)
    submit.add_argument("--nodes", type=int, default=1, help="nodes of the allocation, one Ray node each (default 1)")
    submit.add_argument("--gpus-per-node", type=int, default=0,
                        help="GPUs per node, asked for as --gres=gpu:N (default 0; needed when trials use GPUs)")
    submit.add_argument("--cpus-per-node", type=int,
                        help="CPUs per node for the trials (needed for a CPU-only job; default for a GPU job: "
                             "one trial's resources.cpu per GPU)")
    submit.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    submit.add_argument("--time", default="01:00:00", help="SLURM time limit, HH:MM:SS or D-HH:MM:SS")
    submit.add_argument("--account", help="SLURM account to charge (default: yours)")
    submit.add_argument("--mem", help="memory per node, SLURM syntax (e.g. 64G)")
    submit.add_argument("--tracking-uri", help="MLflow server URI reachable from the nodes (default: start one on the head)")
    submit.add_argument("--storage-path", help="shared storage for Tune results (default: the config's)")
    submit.add_argument("--log-dir", default="slurm_logs", help="where SLURM writes the job's logs")
    submit.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it")
    submit.add_argument("--template", help="sbatch template (default: slurm/sweep.sbatch.tmpl; see slurm/README.md)")

    report = commands.add_parser("report", help="summarise a finished sweep from MLflow: table, plot, Parquet")
    report.add_argument("experiment", nargs="?", help="MLflow experiment name (its newest sweep), or a sweep's name "
                        "(its results folder's, as `run` prints it) or its MLflow run id for one sweep (default: the "
                        "most recent sweep)")
    report.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///mlflow.db)")
    report.add_argument("--out", default="report", help="folder for report.png and results.parquet (default: report)")
    return parser


def import_from_working_directory() -> None:
    """Put the working directory first on ``sys.path``, where ``python -m orchestrator`` has it.

    A user's own workload (``my_models.wide:WideNet``) lives in the folder they run from. The
    installed ``orchestrator`` script starts with its own bin folder on the path instead, so
    without this the config check cannot import the workload. Ray then gives the workers the
    driver's working directory, and a Ray Job's uploaded working_dir is its working directory.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


#: Ray reads it when ``ray`` is imported: off, a machine is not part of a cluster and Ray's node
#: address is the loopback one, so its GCS, raylet, agents, metrics export and workers listen
#: on 127.0.0.1 only (on Linux it is on by default and they listen on every interface).
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_local_ray_on_loopback(args: argparse.Namespace) -> None:
    """An embedded local Ray (``run`` without ``--address``/``--ray-address``, outside a Ray Job)
    serves nothing beyond this machine: keep all of its ports on 127.0.0.1. Must run before Ray
    is imported; ``ray.init(_node_ip_address="127.0.0.1")`` would not do (Ray swaps a loopback
    address for the machine's). The dashboard's address stays ``--dashboard-host``'s."""
    if args.command == "run" and not (args.address or args.ray_address or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault(RAY_CLUSTER_ENV, "0")


def join_clusters_with_the_token(args: argparse.Namespace) -> None:
    """``run --ray-address`` (or inside a Ray Job) sends Ray's token to the cluster wherever there
    is one (``orchestrator.ray_token``). Must run before Ray is imported."""
    if args.command == "run" and (args.ray_address or os.environ.get("RAY_ADDRESS")):
        from orchestrator.ray_token import send_token_to_clusters

        send_token_to_clusters()


class _UntilTheReaderLeaves(io.TextIOWrapper):
    """A standard stream on a pipe that, once the pipe's reader has left, writes to /dev/null.

    The pipe itself is written by C (a ``FileIO`` under the buffer), not by a method of ours: a
    Ctrl-C lands between Python's steps, and one landing after a Python write had written but
    before it returned would leave that text in the buffer, to be written a second time at exit.
    """

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except BrokenPipeError:
            self._write_to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            super().flush()
        except BrokenPipeError:
            self._write_to_devnull()
            super().flush()  # what the reader left unread goes to /dev/null, not again at exit

    def _write_to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.fileno())
        os.close(devnull)


def quiet_when_the_reader_leaves() -> None:
    """``orchestrator plan ... | head``: the reader leaves early, and Python would end the command
    in a ``BrokenPipeError`` traceback at its next print. Where standard output or error is a pipe,
    what is written after the reader left is dropped instead, so every command finishes its work
    and exits with its own status (a sweep is not cut short because nobody reads its table)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or stream is not getattr(sys, f"__{name}__"):  # replaced, e.g. captured by a test
            continue
        try:
            fd = stream.fileno()
        except (OSError, ValueError):
            continue
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            continue
        stream.flush()
        setattr(sys, name, _UntilTheReaderLeaves(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding=stream.encoding, errors=stream.errors,
            line_buffering=stream.line_buffering, write_through=stream.write_through,
        ))


def lines_as_printed() -> None:
    """Standard output written a line at a time wherever it goes. Python writes a pipe or a file
    in 8 KiB blocks, and a sweep's output is read while it runs (``run ... | tee``, a SLURM
    job's log, ``ray job logs``): a line nothing flushes (how many nodes Ray has, the
    dashboard's address, what a resume continues) would wait there for the next trial event."""
    stream = sys.stdout
    if isinstance(stream, io.TextIOWrapper) and stream is sys.__stdout__:  # not one a test captures
        stream.reconfigure(line_buffering=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lines_as_printed()  # first: the pipe's stream that replaces standard output keeps it
    quiet_when_the_reader_leaves()
    keep_local_ray_on_loopback(args)
    join_clusters_with_the_token(args)
    import_from_working_directory()
    try:
        if args.command in ("run", "submit"):
            from orchestrator.launch import get_launcher, launch
            from orchestrator.run_request import RunRequest

            backend = "slurm" if args.command == "submit" else "ray-job" if args.address else "local"
            return launch(get_launcher(backend).from_args(args), RunRequest.from_args(args))
        if args.command == "plan":
            from orchestrator.plan_command import plan_command

            return plan_command(args)
        from orchestrator.report import report_command

        return report_command(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        if not isinstance(exc, ToldInterrupt):
            print("interrupted", file=sys.stderr)
        return 130


def entry() -> int:
    """The installed ``orchestrator`` command and ``python -m orchestrator``: :func:`main`, with
    fewer garbage collections, and none of the objects torch, Ray and MLflow made in the
    interpreter's last collection (``orchestrator.garbage``); the exit handlers (Ray's shutdown,
    MLflow's, removing temporary folders) still run. Not part of :func:`main`, which tests call
    in their own process."""
    collect_less()
    _warnings_said_plainly()
    code = main()
    skip_last_collection()
    return code


def _warnings_said_plainly() -> None:
    """The orchestrator's own warnings in the command's process (MLflow unavailable, writes kept
    for the resume) as its other lines are: the message alone on standard error, not in the log
    format ``ray.init``'s logging config gives the root logger (a timestamp, ``file:line --``, then
    Ray's job, worker and node ids after the message)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    ours = logging.getLogger("orchestrator")
    ours.setLevel(logging.WARNING)
    ours.addHandler(handler)
    ours.propagate = False
