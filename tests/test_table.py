"""``orchestrator.table``: the terminal's tables and the values in them."""

from __future__ import annotations

from orchestrator.table import format_table, value_text


def test_columns_are_as_wide_as_their_widest_cell_and_a_rule_follows_the_header():
    assert format_table(["trial", "loss"], [("00000", 0.5), ("00001", None)]).splitlines() == [
        "trial  loss", "-----  ----", "00000  0.5", "00001"]


def test_floats_read_to_four_significant_digits_and_the_rest_as_they_are():
    assert [value_text(v) for v in (0.0018789852661499496, 0.03, 2.0, 1e-05, 64, "mlp", True, None)] == [
        "0.001879", "0.03", "2", "1e-05", "64", "mlp", "True", "None"]
