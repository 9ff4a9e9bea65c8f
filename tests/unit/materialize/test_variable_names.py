"""``materialize.names``: per-rank variable names, suffixed when taken, as a search from ``name`` would give them."""

from __future__ import annotations

from lightning_nnscaler.materialize.names import VariableNames


def test_names_are_identifiers_suffixed_per_rank_in_order() -> None:
    names = VariableNames(2)
    assert [names.new(0, "linear.0.1") for _ in range(3)] == ["linear_0_1", "linear_0_1_1", "linear_0_1_2"]
    assert names.new(1, "linear.0.1") == "linear_0_1"
    assert names.new(0, "0x") == "t_0x"


def test_a_suffix_another_base_took_is_skipped() -> None:
    names = VariableNames(1)
    assert names.new(0, "view_1") == "view_1"
    assert [names.new(0, "view") for _ in range(3)] == ["view", "view_2", "view_3"]
    assert names.new(0, "view_4") == "view_4" and names.new(0, "view") == "view_5"
