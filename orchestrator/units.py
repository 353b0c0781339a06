"""Byte sizes as people write them ("24GiB", "512MB") and as tables show them."""

from __future__ import annotations

import math
import re

from orchestrator.errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

#: The largest size a byte count can be: torch, NVML and Ray count bytes in 64-bit integers.
MAX_BYTES = 2**63 - 1

GiB = 2**30
MiB = 2**20
KiB = 2**10
#: Largest first: a size is shown in the largest unit it reaches.
BINARY_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1))


def parse_bytes(value: int | float | str) -> int:
    """``"24GiB"`` -> 25769803776. Raises ValueError, in the words a user reads, on anything else.

    One rule for every size (a config key, a flag, a node's label): a number with a unit, rounded
    down to whole bytes, or a number without one (or in ``B``), which is bytes and so must be whole:
    ``1.5`` is refused rather than read as 1 byte, as whoever wrote it most likely meant a unit.
    A size must be positive and at most :data:`MAX_BYTES`: byte counts are 64-bit integers in
    torch, NVML and Ray, and anything larger (``1e400GiB`` is infinite) is a typo, not a memory.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 24GiB or 512MB, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"expected a size such as 24GiB or 512MB, got {value!r}")
        digits, unit = match.group(1), match.group(2).lower()
        number = int(digits) if digits.isdigit() else float(digits)  # exact where it can be
    size = number * _UNITS[unit]  # exact for an int; a float past its range is inf
    if isinstance(size, float) and math.isnan(size):
        raise ValueError(f"expected a size such as 24GiB or 512MB, got {value!r}")
    if size <= 0:
        raise ValueError(f"expected a positive size, got {value!r}")
    if size > MAX_BYTES:
        raise ValueError(f"expected a size of at most 2**63 - 1 bytes (8 EiB), got {value!r}")
    if _UNITS[unit] == 1 and size != int(size):
        raise ValueError(f"expected a whole number of bytes, or a larger unit such as {number:g}GiB, got {value!r}")
    if size < 1:  # rounds down to no byte (0.0001KiB)
        raise ValueError(f"expected a size of at least one byte, got {value!r}")
    return int(size)


def size_flag(flag: str, text: str | None) -> int | None:
    """A command line's size (``--host-memory 64GiB``), None when not given; a bad one is one line."""
    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None


def gib(n_bytes: float) -> str:
    """Bytes -> '21.9G' (GiB), the unit every table of this project uses."""
    return f"{n_bytes / GiB:.2f}G" if n_bytes < 10 * GiB else f"{n_bytes / GiB:.1f}G"


def binary_unit(n_bytes: float) -> tuple[str, int]:
    """The largest binary unit ``n_bytes`` reaches, ``("MiB", 2**20)`` for 1.5 MiB; bytes below 1 KiB."""
    for unit, size in BINARY_UNITS:
        if abs(n_bytes) >= size:
            return unit, size
    return BINARY_UNITS[-1]


def human(n_bytes: float) -> str:
    """Bytes -> the largest binary unit that keeps the number readable ('1.5 MiB')."""
    unit, size = binary_unit(n_bytes)
    return f"{int(n_bytes)} B" if size == 1 else f"{n_bytes / size:.1f} {unit}"


def apart(a: int, b: int, text=human) -> tuple[str, str]:
    """Two sizes as a line compares them, each written by ``text``: where ``text`` writes them
    alike ('needs 1.8MiB, budget 1.8MiB'), with as many more digits as tell them apart (1.77MiB
    and 1.76MiB), in ``text``'s own unit; in bytes where six digits do not."""
    if text(a) != text(b) or a == b:
        return text(a), text(b)
    _, size = binary_unit(max(abs(a), abs(b)))
    if size == 1:
        return text(a), text(b)
    unit = re.sub(r"^[\d.]+", "", text(size))  # ' MiB', 'MiB', 'G': as ``text`` writes the unit
    for digits in range(2, 7):
        first, second = f"{a / size:.{digits}f}{unit}", f"{b / size:.{digits}f}{unit}"
        if first != second:
            return first, second
    return f"{a} B", f"{b} B"
