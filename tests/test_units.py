"""Byte sizes: parsed as people write them, shown in the unit they reach."""

import pytest

from orchestrator.units import GiB, KiB, MiB, binary_unit, human, parse_bytes


def test_sizes_parse_in_decimal_and_binary_units():
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("512MB") == 512 * 10**6 and parse_bytes(2048) == 2048
    with pytest.raises(ValueError, match="expected a size such as 24GiB"):
        parse_bytes("24 parsecs")


@pytest.mark.parametrize(("n_bytes", "unit"), [
    (0, "B"), (1023, "B"), (KiB, "KiB"), (1800 * KiB, "MiB"), (1.75 * MiB, "MiB"), (GiB - 1, "MiB"), (80 * GiB, "GiB"),
])
def test_a_size_is_shown_in_the_largest_unit_it_reaches(n_bytes, unit):
    assert binary_unit(n_bytes)[0] == unit


def test_human_sizes():
    assert [human(n) for n in (512, 1536, 1.75 * MiB, 80 * GiB)] == ["512 B", "1.5 KiB", "1.8 MiB", "80.0 GiB"]
