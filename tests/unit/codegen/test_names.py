"""Generated variables never shadow a keyword, a builtin, a name of the generated module or a
parameter of its ``forward``, whatever the user's ops and modules are called."""

from __future__ import annotations

import builtins
import keyword

import pytest
import torch
from torch import nn

import lightning_nnscaler as lnn
from lightning_nnscaler.codegen.names import MODULE_NAMES, is_reserved, safe_names

EVERY_RESERVED = sorted({*keyword.kwlist, *keyword.softkwlist, *dir(builtins), *MODULE_NAMES, "recompute_0", "recompute_12"})


@pytest.mark.parametrize("name", EVERY_RESERVED)
def test_a_reserved_name_gets_a_distinct_valid_variable(name: str) -> None:
    taken = list(dict.fromkeys([name, f"{name.strip('_')}_", "x"]))  # the obvious rename is taken by another tensor
    names = safe_names(taken)
    assert len(set(names.values())) == len(taken)
    renamed = names[name]
    assert renamed.isidentifier() and not keyword.iskeyword(renamed) and not is_reserved(renamed)
    assert renamed not in (set(taken) - {name})
    assert names["x"] == "x"  # names that collide with nothing stay as they are


def test_renames_are_deterministic_and_readable() -> None:
    assert safe_names(["zeros", "zeros_1", "token", "add"]) == {"zeros": "zeros_", "zeros_1": "zeros_1", "token": "token_", "add": "add"}
    assert safe_names(["slice", "slice_"]) == {"slice": "slice_1", "slice_": "slice_"}


class Creates(nn.Module):
    """Creates tensors in forward: ``zeros`` once shadowed the runtime helper of that name."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 8)
        bias = torch.zeros(8) + torch.ones(8) * 0.5 + torch.full((8,), 0.25)
        position = torch.arange(x.shape[1], dtype=x.dtype)[None, :, None]  # (1, T, 1)
        h = self.down(torch.relu(self.up(self.norm(x + position + bias))))
        return (h * h).mean()


class Named(nn.Module):
    """Submodules named like the generated module's names and builtins; ops whose names are builtins."""

    def __init__(self) -> None:
        super().__init__()
        for name, (inputs, outputs) in {"token": (8, 16), "held": (16, 8), "communicator": (8, 16), "checkpoint": (16, 8),
                                        "assemble": (8, 16), "list": (16, 8)}.items():
            self.add_module(name, nn.Linear(inputs, outputs))
        self.add_module("class", nn.LayerNorm(8))
        self.add_module("print", nn.ReLU())
        self.add_module("sum", nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 8)
        h = getattr(self, "class")(x)
        h = self.held(self.print(self.token(h))) + h
        h = self.checkpoint(self.sum(self.communicator(h))) + h
        h = self.list(self.print(self.assemble(h)))
        # aten.slice, abs, pow, max, sum: variables named after builtins
        return h[:, : h.shape[1] // 2].abs().pow(2).sum() + h.max()


@pytest.mark.parametrize("model", [Creates, Named])
@pytest.mark.parametrize("recipe", ["dp", "tp", "sp", "coshard"])
def test_models_with_colliding_names_verify(model: type[nn.Module], recipe: str) -> None:
    torch.manual_seed(0)
    plan = lnn.parallelize(model(), (torch.randn(4, 8, 8),), recipe, 2, allow_partial=True)
    plan.verify()
    for source in plan.sources:
        forward = source[source.index("def stage0_microbatch0") : source.index("\nSEGMENTS = ")]
        assigned = {line.split("=")[0].strip() for line in forward.splitlines() if " = " in line}
        assigned = {name for target in assigned for name in target.replace(",", " ").split()}
        assert not {name for name in assigned if is_reserved(name) and name != "token"}, source
