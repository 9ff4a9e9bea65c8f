"""The ``recipe/`` config group follows the catalog (``lightning_nnscaler/recipes/*.yaml``, the one source of truth).

``conf/recipe/<name>.yaml`` files document a recipe's parameters for Hydra users; a catalog recipe
without such a file (a recipe just added to the catalog) is still selectable as ``recipe=<name>``:
``register_catalog_recipes`` stores an entry for it in Hydra's ConfigStore, built from the plan
recipe's config dataclass (defaults; required parameters as ``???``, which Hydra asks for).
``register_user_recipes`` does the same for the recipes registered with ``register_recipe`` in the
process (``lightning-nnscaler --import my_recipes train recipe=<name>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from lightning_nnscaler.plans.catalog import RecipeSpec, list_recipes


def recipe_entry(spec: RecipeSpec) -> dict[str, Any]:
    """The ``recipe`` group node of a catalog recipe: its name and every field of its config with its default
    (a tuple as a list, as Hydra writes one)."""
    params = {
        name: "???" if parameter.required else list(parameter.default) if isinstance(parameter.default, tuple) else parameter.default
        for name, parameter in spec.parameters.items()
    }
    return {"name": spec.name, "params": params}


def register_catalog_recipes(conf_dir: Path) -> list[str]:
    """Store a ``recipe`` group entry for every catalog recipe that has no ``conf_dir/recipe/<name>.yaml``;
    returns their names."""
    written = {path.stem for path in (conf_dir / "recipe").glob("*.yaml")}
    missing = [spec for spec in list_recipes() if spec.origin != "register_recipe" and spec.name not in written]
    store = ConfigStore.instance()
    for spec in missing:
        store.store(group="recipe", name=spec.name, node=recipe_entry(spec))
    return [spec.name for spec in missing]


def register_user_recipes() -> list[str]:
    """Store a ``recipe`` group entry for every recipe registered with ``register_recipe`` so far
    (``recipe=<name>`` then selects it with its parameters' defaults); returns their names."""
    registered = [spec for spec in list_recipes() if spec.origin == "register_recipe"]
    store = ConfigStore.instance()
    for spec in registered:
        store.store(group="recipe", name=spec.name, node=recipe_entry(spec))
    return [spec.name for spec in registered]
