"""What ``orchestrator run`` prints while a sweep runs: one line per trial event, and on a
terminal a progress line that updates in place.

Tune's own reporter prints a box of every reported field for every result, and the libraries
under it log their start-up, snapshots and checkpoints; a person watching a sweep needs what
happened to each trial: started, its plan, an OOM and the plan it resumed with, a move to
another node, finished or failed and why. So Tune's reporter is silenced (``RunConfig(verbose=0)``
on its legacy output engine),
Ray's and MLflow's loggers are held to warnings (:func:`quiet_libraries`), and :class:`LiveView`,
a ``tune.Callback``, prints the events from what trials report. ``run --verbose`` keeps all of
Ray's output as it was.

Written on standard output as it happens; escape codes (the progress line's ``\\r`` and line
clearing, Ray's coloured worker prefixes) only where standard output is a terminal, so a
sweep piped to a file reads as plain lines.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray import tune

from orchestrator.contract import (
    GAVE_UP,
    MEMORY_LABELS,
    NOT_RETRIED_KEY,
    OOM_GAVE_UP_KEY,
    OOM_SHRINKS_KEY,
    HostMemoryEvent,
    Move,
    OomEvent,
    PlanCheck,
)
from orchestrator.failures import exception_line, gave_up_message, last_failure
from orchestrator.outcome import ENDED_IN_TUNE
from orchestrator.ray_internals import TOKEN_NOTICE_LOGGER
from orchestrator.table import split_text, trained_text, value_text
from orchestrator.trial.errors import DataError
from orchestrator.trial_report import STOPPED_EARLY, TrialReport
from orchestrator.units import human

#: Tune's ``verbose`` for the sweep: its own reporter off unless ``--verbose``, then its default
#: (``RunConfig``'s ``None``: a result box per finished trial and a status table now and then).
TUNE_VERBOSE, TUNE_QUIET = None, 0
#: How often the progress line is redrawn, at most (seconds).
PROGRESS_EVERY_S = 0.5


# -- what happened to a trial ------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    trial: str
    config: str  # "workload=mlp, lr=0.003"
    restarted: bool = False  # Tune started it again (after a failure, or on --resume)


@dataclass(frozen=True)
class Resumed:
    """A trial of a sweep that ``--resume`` continues, which had reported before: where it had got
    to and the plan it ran (its events up to there were told by the run that started it)."""

    trial: str
    config: str
    epoch: int
    step: int
    plan: str
    checkpointed: bool = True  # False: the sweep's saved state (Tune's) has no checkpoint of it: it trains again from the start


@dataclass(frozen=True)
class Planned:
    """The plan a trial's first report carries (the worker makes it, for its own device)."""

    trial: str
    plan: str  # "64 x 1"
    estimate: str  # "estimated peak 36.0 KiB (trace)", or why there is none
    settings: str = ""  # "bf16, activation checkpointing": what the plan runs other than fp32 without


@dataclass(frozen=True)
class OomSurvived:
    trial: str
    event: OomEvent  # its action says the change: "micro-batch 128->64 (accumulation 1->2)"
    plan: str = ""  # the plan it resumed with, on the last of the OOMs one report brought


@dataclass(frozen=True)
class PlanCorrected:
    """A verification on the device changed the plan (``orchestrator.trial.verify``)."""

    trial: str
    check: PlanCheck


@dataclass(frozen=True)
class Moved:
    trial: str
    move: Move


@dataclass(frozen=True)
class Finished:
    trial: str
    trained: str  # "3/3 epochs"
    metric: str  # "eval_loss 0.4609"
    peak: str  # "peak 36.0 KiB (tensor bytes)"
    stopped_early: bool = False  # by its scheduler (``TrialReport.stopped_early``)


@dataclass(frozen=True)
class Refused:
    trial: str
    reason: str


@dataclass(frozen=True)
class Diverged:
    trial: str
    reason: str  # "loss not finite at step 37 (epoch 2); last finite loss 0.4123; not retried (on_nan: stop)"


@dataclass(frozen=True)
class HostMemory:
    trial: str
    event: HostMemoryEvent  # a DataLoader worker lost, and the fewer workers the trial went on with


@dataclass(frozen=True)
class StorageFault:
    trial: str
    reason: str  # the storage's refusal, naming the path, and how long it was tried


@dataclass(frozen=True)
class Failed:
    trial: str
    reason: str  # the exception line, in full
    log: str = ""  # where its traceback is
    retrying: str = ""  # how Tune restarts it: "retrying from its last checkpoint"


Event = (Started | Planned | OomSurvived | PlanCorrected | HostMemory | Moved | Finished | Refused | Diverged | StorageFault
         | Failed)


def format_event(event: Event) -> str:
    """One line per event, led by the trial's name as the final table shows it."""
    name = event.trial
    if isinstance(event, Started):
        return f"{name} {'restarted' if event.restarted else 'started'}: {event.config or 'the base config'}"
    if isinstance(event, Resumed):
        return (f"{name} resumed: {event.config or 'the base config'} (reported up to epoch {event.epoch}, "
                f"step {event.step}; plan {event.plan}), "
                + ("from its last checkpoint" if event.checkpointed else "from the start: the sweep's saved state has no checkpoint of it"))
    if isinstance(event, Planned):
        settings = f", {event.settings}" if event.settings else ""
        return f"{name} plan: micro-batch x accumulation {event.plan}{settings}, {event.estimate}"
    if isinstance(event, OomSurvived):
        e = event.event
        if e.phase == "eval":
            batch = "" if e.eval_batch_number is None else f" batch {e.eval_batch_number} of"
            where = f"eval after step {e.step} (epoch {e.epoch}),{batch} {e.eval_batch} samples"
        else:
            where = f"train step {e.step} (epoch {e.epoch}) at micro-batch {e.micro_batch}"
        where += "" if e.rank is None else f" on rank {e.rank}"
        if e.action == GAVE_UP:
            return f"{name} OOM in {where}: gave up"
        return f"{name} OOM in {where}: resumed with {e.action}" + (f", plan {event.plan}" if event.plan else "")
    if isinstance(event, PlanCorrected):
        return f"{name} plan verified on the device: {event.check.describe()}"
    if isinstance(event, Moved):
        return f"{name} {event.move.describe()}"
    if isinstance(event, Finished):
        ended = STOPPED_EARLY if event.stopped_early else "finished"
        return f"{name} {ended}: {', '.join(p for p in (event.trained, event.metric, event.peak) if p)}"
    if isinstance(event, Refused):
        return f"{name} refused: {event.reason}"
    if isinstance(event, Diverged):
        return f"{name} diverged: {event.reason}"
    if isinstance(event, HostMemory):
        return f"{name} {event.event.describe()}"
    if isinstance(event, StorageFault):
        return (f"{name} checkpoint not stored: {event.reason}; stopping the sweep, every trial at its last "
                "checkpoint (continue it with the command below once the storage is back)")
    first, *more = event.reason.splitlines() or [""]  # more: a trial that gave up lists its OOM events
    text = f"{name} failed{f', {event.retrying}' if event.retrying else ''}: {first}"
    return "\n".join([text + (f" (traceback: {event.log})" if event.log else ""), *more])


def cluster_text(nodes: Sequence[Mapping[str, float]]) -> str:
    """What the sweep's Ray holds, in the one line Ray's start-up gets here (Tune's resource line,
    which used to say it, is off unless ``--verbose``): where a SLURM job's gres or a cluster's
    GPUs did not reach Ray, this is where a user sees it."""
    cpus = sum(node.get("CPU", 0) for node in nodes)
    gpus = sum(node.get("GPU", 0) for node in nodes)
    return f"Ray: {len(nodes)} node(s), {value_text(cpus)} CPUs, {value_text(gpus)} GPUs"


def config_text(config: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The hyper-parameters that differ between trials, ``workload=mlp, lr=0.003``."""
    return ", ".join(f"{k}={value_text(v)}" for k, v in config.items() if k in keys)


def plan_text(report: TrialReport) -> str:
    """``64 x 1`` (micro-batch x accumulation), ``x 2 ranks`` for a data-parallel trial; ``-`` for
    a refused trial, whose report carries the micro-batch it tried (1), not a plan it trained with."""
    if report.micro_batch is None or report.refused:
        return "-"
    return split_text(report.micro_batch, report.accum_steps, report.effective_batch, report.ranks)


def settings_text(report: TrialReport) -> str:
    """``bf16, activation checkpointing``: what a plan runs with where not even micro-batch 1 fits
    in full precision without checkpointing (the planner turns them on, as the memory policy
    allows), or what the config asked for; fp32 without checkpointing goes unsaid."""
    parts = [report.precision] if report.precision and report.precision != "fp32" else []
    if report.activation_checkpointing:
        parts.append("activation checkpointing")
    return ", ".join(parts)


# -- events out of a trial's reports -----------------------------------------------------------


@dataclass
class Seen:
    """What the view already told of one trial."""

    planned: bool = False
    refused: bool = False
    oom_events: int = 0
    host_memory_events: int = 0
    moves: int = 0
    plan_checks: int = 0

    @classmethod
    def told_before(cls, report: TrialReport) -> "Seen":
        """All that ``report`` holds, told by the run before a resume."""
        return cls(planned=report.micro_batch is not None, refused=report.refused, oom_events=len(report.oom_events),
                   host_memory_events=len(report.host_memory_events), moves=len(report.moves),
                   plan_checks=len(report.plan_checks))

    def note_refusal(self) -> bool:
        """Notes the trial as refused; whether that is news (its last report and its end both carry it)."""
        told, self.refused, self.planned = self.refused, True, True
        return not told


def report_events(trial: str, report: TrialReport, seen: Seen) -> list[Event]:
    """The events a trial's report adds to what was already told (``seen``, updated)."""
    events: list[Event] = []
    if report.refused:
        return [Refused(trial, report.refusal or "nothing fits")] if seen.note_refusal() else []
    plan = plan_text(report)
    new_events = report.oom_events[seen.oom_events:]
    for i, event in enumerate(new_events, 1):
        events.append(OomSurvived(trial, event, plan if i == len(new_events) else ""))
    seen.oom_events = max(seen.oom_events, len(report.oom_events))
    events.extend(PlanCorrected(trial, c) for c in report.plan_checks[seen.plan_checks:] if c.changed)
    seen.plan_checks = max(seen.plan_checks, len(report.plan_checks))
    for host in report.host_memory_events[seen.host_memory_events:]:
        events.append(HostMemory(trial, host))
    seen.host_memory_events = max(seen.host_memory_events, len(report.host_memory_events))
    for move in report.moves[seen.moves:]:
        events.append(Moved(trial, move))
    seen.moves = max(seen.moves, len(report.moves))
    if not seen.planned and report.micro_batch is not None:
        seen.planned = True
        started_with, estimate = plan, _estimate(report, report.predicted_peak_bytes, report.predicted_phase)
        settings = settings_text(report)
        if new_events:  # the plan it ran out of memory with, and that plan's estimate
            started_with = _plan_before(new_events[0], report)
            estimate = _estimate(report, new_events[0].predicted_peak_bytes, None)
            settings = ""  # those of the plan it ran out of memory with: its OOM line says what changed
        elif any(c.changed for c in report.plan_checks):  # it ran its first steps before a check changed it
            first = report.plan_checks[0]
            micro, accumulation = (int(n) for n in first.plan.split(" (")[0].split(" x ")[:2])  # '91 x 2 (last 37, ...'
            started_with = split_text(micro, accumulation, report.effective_batch, report.ranks)
            estimate = _estimate(report, first.predicted_bytes, first.phase)  # that plan's, where it was checked
        events.insert(0, Planned(trial, started_with, estimate, settings))
    if report.storage_fault:
        events.append(StorageFault(trial, report.storage_fault))
    return events


def _plan_before(event: OomEvent, report: TrialReport) -> str:
    """The plan a trial ran before its first OOM: the event's micro-batch, at the same effective batch."""
    accumulation = max(math.ceil((report.effective_batch or 0) // report.ranks / event.micro_batch), 1)
    return split_text(event.micro_batch, accumulation, report.effective_batch, report.ranks)


def _estimate(report: TrialReport, peak: int | None, phase: str | None) -> str:
    """The estimate of a plan of the trial: its predicted ``peak``, in ``phase`` where known."""
    estimator = report.estimator or "none"
    if peak:
        phase = f" in {phase}" if phase else ""
        compiled = ", of the compiled model's eager modules" if (report.plan or {}).get("compiled") else ""
        return f"estimated peak {human(peak)}{phase} ({estimator}{compiled})"
    return "no estimate (memory.estimator: none)" if estimator == "none" else f"no estimate ({estimator})"


def finished_event(trial: str, report: TrialReport, metric: str, stop_epochs: int | None,
                   stop_steps: int | None = None) -> Event:
    if report.refused:
        return Refused(trial, report.refusal or "nothing fits")
    if report.diverged:
        return Diverged(trial, report.diverged)
    trained = trained_text(report.epoch or 0, report.step or 0, stop_epochs, stop_steps, unit="epochs")
    value = report.metric(metric)
    shown = f"{metric} {value:.4f}" if isinstance(value, (int, float)) and math.isfinite(value) else ""
    peak, source = report.measured_peak, report.memory_source or ""
    peak_text = f"peak {human(peak)} ({MEMORY_LABELS.get(source, source)})" if peak else ""
    return Finished(trial, trained, shown, peak_text, report.stopped_early)


# -- the progress line -------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    done: int
    running: int
    pending: int
    elapsed_s: float
    fraction: float  # of the sweep's training done, 0..1
    ooms: int  # OOMs survived so far


def format_progress(p: Progress, width: int | None = None) -> str:
    """The line, within ``width`` columns where given: the parts that fit, in order. A line as wide
    as the terminal or wider wraps, and ``\\r`` then goes back to the start of its last row only,
    so each redraw left a fragment above the next on a narrow terminal."""
    parts = [f"{p.done} done, {p.running} running, {p.pending} pending", f"{_duration(p.elapsed_s)} elapsed"]
    if 0 < p.fraction < 1:
        parts.append(f"~{_duration(p.elapsed_s * (1 - p.fraction) / p.fraction)} left")
    if p.ooms:
        parts.append(f"{p.ooms} OOM(s) survived")
    if width is None:
        return " | ".join(parts)
    room = width - 1  # the last column would wrap on some terminals
    line = parts[0][:room]
    for part in parts[1:]:
        if len(line) + 3 + len(part) > room:
            break
        line += " | " + part
    return line


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def trial_fraction(status: str, result: Mapping[str, Any], stop_epochs: int | None, stop_steps: int | None) -> float:
    """How much of its budget a trial has trained: its epochs or steps, whichever budget is nearer."""
    if status in ENDED_IN_TUNE:
        return 1.0
    shares = [(result.get("epoch") or 0) / stop_epochs if stop_epochs else 0.0,
              (result.get("step") or 0) / stop_steps if stop_steps else 0.0]
    return min(max(shares), 1.0)


# -- the callback ------------------------------------------------------------------------------


class LiveView(tune.Callback):
    """Prints trial events as Tune's controller sees them, and the progress line on a terminal.

    Tune pickles its callbacks with the experiment (``Tuner.restore`` runs the copies), so the
    view holds no stream: it writes to the ``sys.stdout`` of the moment.
    """

    def __init__(self, shown_keys: Sequence[str], metric: str, stop_epochs: int | None, stop_steps: int | None):
        self.shown_keys = list(shown_keys)
        self.metric = metric
        self.stop_epochs, self.stop_steps = stop_epochs, stop_steps
        self._seen: dict[str, Seen] = {}
        self._started: set[str] = set()
        self._ending: set[str] = set()  # restarted only to fail at once (orchestrator.retry): not told
        self._done_untold: dict[str, TrialReport] = {}  # reported its budget spent; its end not told yet
        self._shrinks: dict[str, int] = {}
        self._ooms = 0
        self._start = time.monotonic()
        self._drawn = 0.0
        self._progress_shown = False
        self._total = 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_seen": {}, "_started": set(), "_ending": set(), "_shrinks": {}, "_ooms": 0,
                "_progress_shown": False, "_done_untold": {}}

    def setup(self, stop=None, num_samples=None, total_num_samples=None, **info) -> None:
        self._start = time.monotonic()
        self._total = total_num_samples or 0

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        if trial.trial_id in self._ending:
            return
        restarted = trial.trial_id in self._started
        self._started.add(trial.trial_id)
        config = config_text(trial.config, self.shown_keys)
        earlier = None if restarted else TrialReport.from_result(trial.last_result or {})
        if earlier is None or earlier.step is None:
            self._say(Started(trial.trial_id, config, restarted))
            return
        # A trial of the sweep being resumed that had reported: the run before told its events.
        self._seen[trial.trial_id] = Seen.told_before(earlier)
        self._shrinks[trial.trial_id] = trial.config.get(OOM_SHRINKS_KEY, 0)
        self._ooms += earlier.oom_retries or 0
        self._say(Resumed(trial.trial_id, config, earlier.epoch or 0, earlier.step, plan_text(earlier),
                          checkpointed=trial.checkpoint is not None))

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        seen = self._seen.setdefault(trial.trial_id, Seen())
        report = TrialReport.from_result(result)
        for event in report_events(trial.trial_id, report, seen):
            self._ooms += isinstance(event, OomSurvived) and event.event.action != GAVE_UP
            self._say(event)
        if report.training_done:
            self._done_untold[trial.trial_id] = report

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._done_untold.pop(trial.trial_id, None)
        self._say_finished(trial.trial_id, TrialReport.from_result(trial.last_result))

    def _say_finished(self, trial: str, report: TrialReport) -> None:
        event = finished_event(trial, report, self.metric, self.stop_epochs, self.stop_steps)
        if isinstance(event, Refused) and not self._seen.setdefault(trial, Seen()).note_refusal():
            return  # its last report said it already
        self._say(event)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._done_untold.pop(trial.trial_id, None)  # it failed after its last report: told as failed
        self._say(self._failure(trial))

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        """Tune requeues a failed trial, after the retry scheduler set its config for the restart."""
        self._done_untold.pop(trial.trial_id, None)
        config = trial.config
        if config.get(NOT_RETRIED_KEY) or config.get(OOM_GAVE_UP_KEY):
            self._ending.add(trial.trial_id)  # its final failure says why
            return
        shrinks = config.get(OOM_SHRINKS_KEY, 0)
        if shrinks > self._shrinks.get(trial.trial_id, 0):
            self._shrinks[trial.trial_id] = shrinks
            self._ooms += 1
            self._say(self._failure(trial, "its worker died out of memory; restarting from its last checkpoint with a smaller plan"))
            return
        self._say(self._failure(trial, "retrying from its last checkpoint"))

    def on_step_end(self, iteration, trials, **info) -> None:
        if _on_terminal() and time.monotonic() - self._drawn >= PROGRESS_EVERY_S:
            self._draw(trials)

    def on_experiment_end(self, trials, **info) -> None:
        """A stop (Ctrl-C) ends the trials Tune runs without telling the callbacks of their end:
        one whose last report had spent its budget finished all the same, and is told so."""
        self._clear()
        for trial, report in self._done_untold.items():
            self._say_finished(trial, report)
        self._done_untold.clear()

    # -- output ----------------------------------------------------------------------------
    def _failure(self, trial, retrying: str = "") -> Failed:
        """The failure's exception line; for a trial that gave up on OOMs, every event too (those
        before its first report were never told)."""
        text = last_failure(trial.error_file)
        reason = f"OomRetriesExhausted: {gave_up_message(text)}" if "OomRetriesExhausted:" in text else exception_line(text)
        # Where the traceback is, unless the error names its own (a data error's trial log).
        log = os.path.join(str(trial.path), "error.txt") if trial.path and "traceback in " not in reason else ""
        return Failed(trial.trial_id, reason or "unknown error", log, retrying)

    def _say(self, event: Event) -> None:
        """The event's line in one write, its newline included: Ctrl-C's notice (:class:`StopNotice`)
        is written from a signal handler, which runs between two writes (``print`` makes two, each
        its own system call where standard output is unbuffered), and would end up after the text."""
        self._clear()
        sys.stdout.write(format_event(event) + "\n")
        sys.stdout.flush()

    def _draw(self, trials) -> None:
        statuses = [t.status for t in trials]
        done = sum(s in ENDED_IN_TUNE for s in statuses)
        running = sum(s == "RUNNING" for s in statuses)
        pending = max(self._total, len(trials)) - done - running
        fractions = [trial_fraction(t.status, t.last_result or {}, self.stop_epochs, self.stop_steps) for t in trials]
        fraction = sum(fractions) / max(self._total, len(trials), 1)
        progress = Progress(done, running, pending, time.monotonic() - self._start, fraction, self._ooms)
        line = format_progress(progress, shutil.get_terminal_size().columns)
        sys.stdout.write(f"\r\x1b[K{line}")
        sys.stdout.flush()
        self._drawn = time.monotonic()
        self._progress_shown = True

    def _clear(self) -> None:
        if self._progress_shown:
            sys.stdout.write("\r\x1b[K")
            sys.stdout.flush()
            self._progress_shown = False
            self._drawn = 0.0  # redraw at the next step


def _on_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


# -- the libraries' own output -----------------------------------------------------------------


class _Dropped(logging.Filter):
    """Drops the log records ``told_elsewhere`` picks."""

    def __init__(self, told_elsewhere: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.told_elsewhere = told_elsewhere

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.told_elsewhere(record)


class _OneLine(logging.Filter):
    """Keeps the records ``picks`` picks in one line: the message's first line and the error's
    (the record's exception, or the last line of a traceback written into the message)."""

    def __init__(self, picks: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.picks = picks

    def filter(self, record: logging.LogRecord) -> bool:
        if self.picks(record):
            lines = [line for line in record.getMessage().splitlines() if line.strip()] or [""]
            error = str(record.exc_info[1]) if record.exc_info else lines[-1] if len(lines) > 1 else ""
            error = " ".join(error.split())
            record.msg, record.args = lines[0].rstrip(": ") + (f": {error}" if error else ""), ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def _starts(*prefixes: str) -> Callable[[logging.LogRecord], bool]:
    return lambda record: record.getMessage().startswith(prefixes)


def _a_data_error(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return isinstance(error, DataError) or isinstance(getattr(error, "cause", None), DataError)


_CONTROLLER, _TUNE = "ray.tune.execution.tune_controller", "ray.tune.tune"

#: Tune's records that our own lines say better, even with ``--verbose``: its resume hint is
#: Python for a Tune user (ours is ``orchestrator run ... --resume``, printed with the summary),
#: a data error's traceback is in the trial's log file, which its one line names, and the
#: TensorBoard logger's warning of a NaN or infinite number is a refused or diverged trial's
#: metric (the worst value, on purpose), which its own line explains.
_TOLD_BY_US = (
    (_TUNE, lambda record: "Tuner.restore(" in record.getMessage()), (_CONTROLLER, _a_data_error),
    ("tensorboardX.x2num", _starts("NaN or Inf found")),
)
#: And those :class:`LiveView` and the final table say in a line each, unless ``--verbose``.
_TOLD_BY_THE_VIEW = (
    (_CONTROLLER, _starts("Trial task failed for trial")),  # + the whole traceback
    (_TUNE, _starts("Trials did not complete")),  # + every unfinished trial's repr
)


#: And those kept in one line, unless ``--verbose``: Tune failing to save the experiment's state
#: to a storage that refuses writes (a trial's refused checkpoint stops the sweep, in a line of
#: the view's; ``orchestrator.storage_fault``), each with a traceback of Tune's and pyarrow's frames.
_ONE_LINE = (
    ("ray.tune.execution.experiment_state", _starts("Saving experiment state to storage")),
    (_TUNE, _starts("Experiment state snapshotting failed")),
    ("ray.train._internal.syncer", _starts("Last sync command failed")),
)


@contextlib.contextmanager
def tune_lines_told_here(verbose: bool) -> Iterator[None]:
    """While the sweep runs, Tune's log records that this console tells in its own words are
    dropped or cut to one line (and put back after, for whatever the process runs next)."""
    held = [(logging.getLogger(name), _Dropped(picks))
            for name, picks in _TOLD_BY_US + (() if verbose else _TOLD_BY_THE_VIEW)]
    held += [(logging.getLogger(name), _OneLine(picks)) for name, picks in (() if verbose else _ONE_LINE)]
    for logger, dropped in held:
        logger.addFilter(dropped)
    try:
        yield
    finally:
        for logger, dropped in held:
            logger.removeFilter(dropped)


def quiet_libraries(verbose: bool) -> None:
    """Hold Ray, Tune and MLflow to what a person needs, unless ``--verbose``; before Ray starts.

    - Tune's new output engine prints an experiment box and a TensorBoard hint even at
      ``verbose=0``; its legacy engine (``RAY_AIR_NEW_OUTPUT=0``) prints nothing at 0;
    - Tune warns of frequent experiment snapshots, which a sweep of short epochs makes by design
      (its documented switch: a threshold of 0);
    - Tune logs each failed attempt's whole traceback: :class:`LiveView` says the failure in a
      line that names the trial's ``error.txt``, where the traceback is (:func:`tune_lines_told_here`);
    - MLflow logs creating its tables, Ray its start (:func:`ray_logging_config` does the workers);
    - Ray colours its worker prefixes even into a file: not where standard output is no terminal;
    - Ray tells every new local cluster that token authentication is on, which it always is there
      (``ray_internals.TOKEN_NOTICE_LOGGER``; the dashboard's docs say how the token is used);
    - Tune's notice that Ctrl-C (or SIGTERM) reached it carries Ray's ids and a timestamp: it is
      said in one line of ours (:class:`StopNotice`);
    - building the results of a sweep stopped early, Tune warns of every trial that never
      started, whose files it cannot find: the table shows those trials, not started.
    """
    if not _on_terminal():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if verbose:
        return
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is imported
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # where it already was
    logging.getLogger(TOKEN_NOTICE_LOGGER).setLevel(logging.ERROR)
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)
    tune_logger = logging.getLogger("ray.tune.tune")
    if not any(isinstance(f, StopNotice) for f in tune_logger.filters):
        tune_logger.addFilter(StopNotice())


class StopNotice(logging.Filter):
    """Tune's notice that a stop signal reached it, said as one plain line. Written straight to
    the file descriptor: it is said from within the signal handler, which may have interrupted a
    print on the same stream."""

    LINE = "Stopping the sweep: its trials stop, its state is saved one last time (Ctrl-C again skips that)\n"

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Stop signal received"):
            return True
        _clear_the_terminal_line()
        os.write(sys.stderr.fileno(), self.LINE.encode())
        return False


def _clear_the_terminal_line() -> None:
    """On a terminal, the line the cursor is on cleared, straight through the file descriptor (in a
    signal handler, the stream may be mid-write): :class:`LiveView`'s progress line stays open, with
    no newline, and a line written now would follow it. Elsewhere the console ends every line."""
    if not _on_terminal():
        return
    try:
        os.write(sys.stdout.fileno(), b"\r\x1b[K")
    except (OSError, ValueError):  # a stream with no descriptor of its own: no progress line was drawn there
        pass


def ray_logging_config(verbose: bool):
    """``ray.init``'s logging config: the driver's and every worker's Ray loggers at warnings
    (no "Started a local Ray instance", no "Checkpoint successfully created" per report), unless
    ``--verbose``, which keeps Ray's default."""
    import ray

    return None if verbose else ray.LoggingConfig(log_level="WARNING")
