"""``orchestrator.table``: the terminal's tables and the values in them."""

from __future__ import annotations

from orchestrator.table import format_table, split_text, value_text


def test_columns_are_as_wide_as_their_widest_cell_and_a_rule_follows_the_header():
    assert format_table(["trial", "loss"], [("00000", 0.5), ("00001", None)]).splitlines() == [
        "trial  loss", "-----  ----", "00000  0.5", "00001"]


def test_floats_read_to_four_significant_digits_and_the_rest_as_they_are():
    assert [value_text(v) for v in (0.0018789852661499496, 0.03, 2.0, 1e-05, 64, "mlp", True, None)] == [
        "0.001879", "0.03", "2", "1e-05", "64", "mlp", "True", "None"]


def test_a_plan_whose_micro_batches_do_not_divide_the_step_says_its_last_one():
    """128 samples as 100 + 28 read ``100 x 2 (last 28)``: ``100 x 2`` alone reads as 200."""
    assert split_text(100, 2, 128) == "100 x 2 (last 28)"
    assert split_text(28, 5, 128) == "28 x 5 (last 16)"
    assert split_text(64, 2, 128) == "64 x 2" and split_text(64, 2) == "64 x 2"
    assert split_text(22, 2, 64, ranks=2) == "22 x 2 x 2 ranks (last 10)"  # a rank's 32 as 22 + 10
