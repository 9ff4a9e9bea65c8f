"""Code generation: per-rank Python modules from a materialized program."""

from lightning_nnscaler.codegen.emit import CodegenError, emit_rank
from lightning_nnscaler.codegen.load import StaleCodeError, load_rank_module, module_from_source, save_sources

__all__ = ["CodegenError", "StaleCodeError", "emit_rank", "load_rank_module", "module_from_source", "save_sources"]
