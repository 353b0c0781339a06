"""``PYTORCH_CUDA_ALLOC_CONF``: what the trials' CUDA caching allocator is told, read as PyTorch reads it.

The config checks it before any worker starts (PyTorch would only complain when a worker first
touches CUDA, minutes into a sweep), the trials export it, and the allocator model
(``orchestrator.memory.allocator``) replays allocations under it. Pure Python: the driver reads
it without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MiB = 1 << 20
LARGE_SEGMENT = 20 * MiB
#: ``roundup_power2_divisions`` has one setting per power of two from 1 MiB to 64 GiB.
DIVISION_INTERVALS = 16
MAX_REGISTER_THREADS = 128

#: What the allocator-settings knob defaults to; fragmentation 1.39 -> 1.07 on GPT-2 (FACTS.md).
DEFAULT_ALLOC_CONF = "expandable_segments:True"

#: Where PyTorch reads its allocator settings, the first one set winning (the second is the older name).
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def effective_allocator_conf(alloc_conf: str | None) -> str | None:
    """The allocator settings a trial's process will run with: an exported one, else ``alloc_conf``."""
    return next((os.environ[v] for v in ALLOC_CONF_VARIABLES if v in os.environ), alloc_conf)


def import_time_environment(alloc_conf: str | None) -> dict[str, str]:
    """What the trials' workers must have in their environment when they start, not set later.

    PyTorch reads the allocator's ``backend`` when it is imported (pytorch#104801: a worker that
    sets ``backend:cudaMallocAsync`` after ``import torch`` fails at its first CUDA call), and a
    trial's worker has imported torch before the trial's code runs. Every other setting is read at
    CUDA's first use, which the trial sets itself (``orchestrator.device.configure_allocator``).
    """
    conf = effective_allocator_conf(alloc_conf)
    return {ALLOC_CONF_VARIABLES[1]: conf} if conf and parse_alloc_conf(conf).backend != "native" else {}


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of ``PYTORCH_CUDA_ALLOC_CONF`` that change what the allocator reserves."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: any block may be split
    max_non_split_rounding: int = LARGE_SEGMENT
    roundup_power2_divisions: tuple[int, ...] = (0,) * DIVISION_INTERVALS
    garbage_collection_threshold: float = 0.0
    large_segment_size: int = LARGE_SEGMENT
    backend: str = "native"
    source: str = ""  # the string it was parsed from

    @property
    def modelled(self) -> bool:
        """Whether :class:`CachingAllocator` models this allocator (cudaMallocAsync is CUDA's own)."""
        return self.backend == "native"

    def describe(self) -> str:
        return self.source or "default"


_BOOL_KEYS = (
    "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
)
KEYS = (
    "expandable_segments", "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
    "garbage_collection_threshold", "large_segment_size_mb", "backend", "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb", *_BOOL_KEYS,
)


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """``PYTORCH_CUDA_ALLOC_CONF`` (``key:value,key:[a:b,>:c]``) -> :class:`AllocatorConfig`.

    Accepts what PyTorch accepts and refuses what it refuses, so a mistake is found before any
    worker starts: :class:`ValueError` naming the key or value and what was expected.
    """
    if text is None or not text.strip():
        return AllocatorConfig(source="")
    tokens = _tokenize(text)
    settings: dict = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key in ",:[]":
            raise ValueError(f"expected a key, got {key!r} in {text!r}")
        if key not in KEYS:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(KEYS)})")
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise ValueError(f"{key}: expected '{key}:<value>'")
        if tokens[i + 2] == "[":
            end = tokens.index("]", i + 2) if "]" in tokens[i + 2:] else -1
            if end < 0:
                raise ValueError(f"{key}: expected a closing ']'")
            value: str | list[str] = tokens[i + 3:end]
            i = end + 1
        else:
            value = tokens[i + 2]
            if value in ",:]":
                raise ValueError(f"{key}: expected a value after ':'")
            i += 3
        settings.update(_setting(key, value))
        if i < len(tokens):
            if tokens[i] != ",":
                raise ValueError(f"{key}: expected ',' before {tokens[i]!r}")
            i += 1
    return AllocatorConfig(**settings, source=text.strip())


def _tokenize(text: str) -> list[str]:
    """PyTorch's tokens: ``, : [ ]`` on their own, whitespace dropped, everything else joined."""
    tokens, word = [], ""
    for ch in text:
        if ch in ",:[]":
            if word:
                tokens.append(word)
                word = ""
            tokens.append(ch)
        elif not ch.isspace():
            word += ch
    if word:
        tokens.append(word)
    return tokens


def _setting(key: str, value) -> dict:
    if isinstance(value, list) and key != "roundup_power2_divisions":
        raise ValueError(f"{key}: expected a single value, got a list")
    if key == "expandable_segments":
        return {"expandable_segments": _bool(key, value)}
    if key in _BOOL_KEYS:
        _bool(key, value)
        return {}
    if key == "max_split_size_mb":
        return {"max_split_size": _integer(key, value, LARGE_SEGMENT // MiB) * MiB}
    if key == "max_non_split_rounding_mb":
        return {"max_non_split_rounding": _integer(key, value, LARGE_SEGMENT // MiB) * MiB}
    if key == "large_segment_size_mb":
        return {"large_segment_size": _integer(key, value, 1) * MiB}
    if key == "pinned_reserve_segment_size_mb":
        _integer(key, value, 1)
        return {}
    if key == "pinned_num_register_threads":
        threads = _integer(key, value, 1)
        if not _power_of_two(threads) or threads > MAX_REGISTER_THREADS:
            raise ValueError(f"{key}: expected a power of two up to {MAX_REGISTER_THREADS}, got {value!r}")
        return {}
    if key == "garbage_collection_threshold":
        try:
            threshold = float(value)
        except ValueError:
            threshold = -1.0
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"{key}: expected a number between 0 and 1 (exclusive), got {value!r}")
        return {"garbage_collection_threshold": threshold}
    if key == "backend":
        if value not in ("native", "cudaMallocAsync"):
            raise ValueError(f"backend: expected native or cudaMallocAsync, got {value!r}")
        return {"backend": value}
    return {"roundup_power2_divisions": _divisions(value)}


def _bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):
        raise ValueError(f"{key}: expected True or False, got {value!r}")
    return value == "True"


def _integer(key: str, value: str, minimum: int) -> int:
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(f"{key}: expected a whole number of at least {minimum}, got {value!r}")
    return int(value)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _divisions(value) -> tuple[int, ...]:
    """``4`` (every interval) or ``[64:8,256:4,>:1]`` (MiB boundary: divisions) -> one per interval."""
    key = "roundup_power2_divisions"
    if isinstance(value, str):
        n = _integer(key, value, 1)
        if not _power_of_two(n):
            raise ValueError(f"{key}: expected a power of two, got {value!r}")
        return (n,) * DIVISION_INTERVALS
    divisions = [0] * DIVISION_INTERVALS
    items = [t for t in value if t != ","]
    if len(items) % 3 or any(items[j + 1] != ":" for j in range(0, len(items), 3)) or not items:
        raise ValueError(f"{key}: expected [<MiB>:<divisions>, ..., >:<divisions>], got [{''.join(value)}]")
    first, last = True, 0
    for j in range(0, len(items), 3):
        boundary, count = items[j], items[j + 2]
        if not count.isdigit() or (int(count) != 0 and not _power_of_two(int(count))):
            raise ValueError(f"{key}: divisions must be 0 or a power of two, got {count!r}")
        n = int(count)
        if boundary == ">":
            divisions[last + 1:] = [n] * (DIVISION_INTERVALS - last - 1)
            continue
        if not boundary.isdigit() or not _power_of_two(int(boundary)):
            raise ValueError(f"{key}: interval boundaries must be powers of two (MiB), got {boundary!r}")
        index = min(int(boundary).bit_length() - 1, DIVISION_INTERVALS - 1)
        if first:
            divisions[:index] = [n] * index
            first = False
        divisions[index] = n
        last = index
    return tuple(divisions)
