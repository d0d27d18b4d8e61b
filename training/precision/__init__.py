"""Precision recipes: the seam where number formats plug into training.

Minimal seam (bf16 only); the precision issue fills in the other recipes behind the same names.
"""
from __future__ import annotations

from dataclasses import dataclass, field

RECIPES = ("bf16", "fp8_delayed", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")


@dataclass
class RecipeReport:
    recipe: str
    gemm_backend: str = "bf16"
    layers: list = field(default_factory=list)
    hooks: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"recipe": self.recipe, "gemm_backend": self.gemm_backend, "layers": list(self.layers)}


def apply_recipe(model, name: str, *, bf16_first_layers: int = 0, bf16_last_layers: int = 0,
                 backend: str = "auto", **options) -> RecipeReport:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    if name != "bf16":
        raise NotImplementedError(f"recipe {name!r} is not implemented yet")
    return RecipeReport(recipe="bf16")
