"""The errors a trial raises that the driver reads back by name (``orchestrator.failures``).

Ray rebuilds an exception on the driver from its ``args``, so each takes one message.
"""

from __future__ import annotations

from orchestrator.contract import OomEvent
from orchestrator.units import human


class OomRetriesExhausted(RuntimeError):
    """The trial ran out of memory more often than ``memory.max_oom_retries`` allows.

    Its message lists every OOM event. It takes only that message so Ray can pickle it across
    processes (exceptions are rebuilt from their ``args``). Its first line is whole on its own,
    the last event's where and plan included: the table's status column, ``report`` and MLflow's
    ``error`` tag show that line alone.
    """

    @classmethod
    def from_events(cls, events: list[OomEvent], reason: str) -> "OomRetriesExhausted":
        if not events:
            return cls(reason)
        last = events[-1]
        rank = "" if last.rank is None else f" on rank {last.rank}"
        lines = [f"{reason}; {len(events)} OOM event(s), the last in epoch {last.epoch} {last.phase} step {last.step}"
                 f"{rank} at micro-batch {last.micro_batch}"]
        lines += [_event_line(e) for e in events]
        return cls("\n".join(lines))


def _event_line(e: OomEvent) -> str:
    """'epoch 1 train step 1: micro-batch 256, eval batch 512, asked 4.0 MiB with 196.6 KiB
    allocated (predicted peak 403.6 KiB) -> micro-batch 256->128 (accumulation 1->2)'."""
    rank = "" if e.rank is None else f" on rank {e.rank}"
    asked = "?" if e.bytes_requested is None else human(e.bytes_requested)
    predicted = f" (predicted peak {human(e.predicted_peak_bytes)})" if e.predicted_peak_bytes else ""
    return (f"  epoch {e.epoch} {e.phase} step {e.step}{rank}: micro-batch {e.micro_batch}, eval batch {e.eval_batch}, "
            f"asked {asked} with {human(e.bytes_allocated)} allocated{predicted} -> {e.action}")


class NotRetriedError(RuntimeError):
    """A trial's restart that fails at once: its earlier error is one a retry would not fix."""


class DataError(RuntimeError):
    """The trial could not load a sample of its data (``trainables.data.SampleError``): a bug in
    the workload's data, which a retry would meet again. Its message is the sample's line, where
    the trial was, and the file that holds the full traceback."""


class HostMemoryExhausted(RuntimeError):
    """Loading the data ran out of host memory in the trial's own process, with no DataLoader
    worker left to give up (``orchestrator.trial.host_memory``). One line."""
