"""Shared pytest setup: importing the package first keeps torchvision importable (see _compat)."""

import lightning_nnscaler  # noqa: F401
