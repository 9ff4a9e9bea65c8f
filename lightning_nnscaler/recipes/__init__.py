"""The recipe catalog's files: one YAML per built-in recipe (shipped inside the wheel; ``recipes/`` at
the repository root points here). ``lightning_nnscaler.plans.catalog`` reads them."""
