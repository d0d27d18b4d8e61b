"""GEMM benchmark per layer shape: derive a model's training-step GEMMs, time them per format (the recipe
catalog's GEMM formats, each recipe's own GEMM operand code) and mode, check them against BF16, and predict the
end-to-end speedup."""
from .benchmark import run_gemm_benchmark
from .cli import main
from .formats import ERROR_BOUNDS, FORMATS, MODES
from .predict import predict_speedup
from .shapes import LAYERS, PASSES, GemmShape, gemm_shapes, parse_shapes

__all__ = ["gemm_shapes", "parse_shapes", "GemmShape", "LAYERS", "PASSES", "FORMATS", "MODES",
           "ERROR_BOUNDS", "run_gemm_benchmark", "predict_speedup", "main"]
