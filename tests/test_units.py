"""Byte sizes: parsed as people write them, shown in the unit they reach."""

import pytest

from orchestrator.errors import UserError
from orchestrator.units import MAX_BYTES, GiB, KiB, MiB, apart, binary_unit, human, parse_bytes, size_flag


def test_sizes_parse_in_decimal_and_binary_units():
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("512MB") == 512 * 10**6 and parse_bytes(2048) == 2048
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES  # digits are read exactly, not through a float
    with pytest.raises(ValueError, match="expected a size such as 24GiB"):
        parse_bytes("24 parsecs")


@pytest.mark.parametrize(("value", "message"), [
    ("1e400GiB", "expected a size of at most 2**63 - 1 bytes (8 EiB), got '1e400GiB'"),
    (float("inf"), "expected a size of at most 2**63 - 1 bytes (8 EiB), got inf"),
    (10**400, "expected a size of at most 2**63 - 1 bytes (8 EiB), got 1000"),
    (MAX_BYTES + 1, "expected a size of at most 2**63 - 1 bytes (8 EiB), got 9223372036854775808"),
    (float("nan"), "expected a size such as 24GiB or 512MB, got nan"),
    (1.5, "expected a whole number of bytes, or a larger unit such as 1.5GiB, got 1.5"),
    ("2.5B", "expected a whole number of bytes, or a larger unit such as 2.5GiB, got '2.5B'"),
    ("0.4", "expected a whole number of bytes, or a larger unit such as 0.4GiB, got '0.4'"),
    (0, "expected a positive size, got 0"),
    ("0KiB", "expected a positive size, got '0KiB'"),
    ("0.0001KiB", "expected a size of at least one byte, got '0.0001KiB'"),  # rounds down to none
    (True, "expected a size such as 24GiB or 512MB, got True"),
])
def test_a_size_is_positive_finite_and_whole_in_bytes(value, message):
    """A bare number is bytes, so it must be whole (``1.5`` is not read as 1 byte); a size past
    what 64-bit byte counts hold (``1e400GiB`` is infinite) is refused, not an OverflowError."""
    with pytest.raises(ValueError) as err:
        parse_bytes(value)
    assert str(err.value).startswith(message)


def test_units_round_down_to_whole_bytes_up_to_the_largest_size():
    assert parse_bytes("1.5KB") == 1500 and parse_bytes("1.001KiB") == 1025 and parse_bytes(2048.0) == 2048
    assert parse_bytes(MAX_BYTES) == MAX_BYTES and parse_bytes("8388607TiB") == 8388607 * 2**40


def test_a_flag_s_size_error_names_the_flag():
    assert size_flag("--host-memory", None) is None and size_flag("--host-memory", "64GiB") == 64 * GiB
    with pytest.raises(UserError) as err:
        size_flag("--device-memory", "1e400GiB")
    assert str(err.value) == "--device-memory: expected a size of at most 2**63 - 1 bytes (8 EiB), got '1e400GiB'"


@pytest.mark.parametrize(("n_bytes", "unit"), [
    (0, "B"), (1023, "B"), (KiB, "KiB"), (1800 * KiB, "MiB"), (1.75 * MiB, "MiB"), (GiB - 1, "MiB"), (80 * GiB, "GiB"),
])
def test_a_size_is_shown_in_the_largest_unit_it_reaches(n_bytes, unit):
    assert binary_unit(n_bytes)[0] == unit


def test_human_sizes():
    assert [human(n) for n in (512, 1536, 1.75 * MiB, 80 * GiB)] == ["512 B", "1.5 KiB", "1.8 MiB", "80.0 GiB"]


def test_sizes_a_line_compares_get_the_digits_that_tell_them_apart():
    """'measured 1.8 MiB above predicted 1.8 MiB' read as a contradiction: as many digits as tell
    them apart, in the unit the writer uses."""
    assert apart(1_856_596, 1_849_688) == ("1.77 MiB", "1.76 MiB")
    assert apart(1_856_596, 1_855_000) == ("1.771 MiB", "1.769 MiB")
    assert apart(2 * MiB, MiB) == ("2.0 MiB", "1.0 MiB")  # apart at one decimal: as written
    assert apart(1_873_526, 1_873_500) == ("1.78673 MiB", "1.78671 MiB")
    assert apart(1_873_501, 1_873_500) == ("1.786710 MiB", "1.786709 MiB") and apart(MiB, MiB) == ("1.0 MiB", "1.0 MiB")
    compact = lambda n: f"{n / GiB:.2f}G" if n >= GiB else human(n).replace(" ", "")  # noqa: E731 - as tables write sizes
    assert apart(1_856_596, 1_849_688, compact) == ("1.77MiB", "1.76MiB")
    assert apart(3 * GiB, 3 * GiB + MiB, compact) == ("3.000G", "3.001G")
    assert apart(3 * GiB, 3 * GiB + 1, compact) == ("3221225472 B", "3221225473 B")
