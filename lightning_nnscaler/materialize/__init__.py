"""Materialization: turning mismatched producer/consumer pieces into communication."""

from lightning_nnscaler.materialize.layouts import Layout
from lightning_nnscaler.materialize.search import (
    AlphaBeta,
    CostModel,
    Path,
    Step,
    Transfer,
    clear_search_cache,
    p2p_path,
    search,
)

__all__ = ["AlphaBeta", "CostModel", "Layout", "Path", "Step", "Transfer", "clear_search_cache", "p2p_path", "search"]
