"""The recipe catalog (training.precision.catalog), read-only: what each recipe is, its options, the GEMM formats."""
from __future__ import annotations

from fastapi import APIRouter

from backend.schemas import RecipeCatalogOut
from training.precision import catalog

router = APIRouter(tags=["recipes"])


@router.get("/recipes", response_model=RecipeCatalogOut)
def list_recipes():
    """Every recipe in the documented order (name, summary, elements, scaling, typed options with defaults and
    allowed values, GEMM format, real-kernel capability), the baseline and the GEMM benchmark's formats."""
    return catalog.catalog_dict()
