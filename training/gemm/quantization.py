"""The quantization work of one training step, per tensor - what "with quantization" mode adds to the GEMMs.

Training does not quantize each GEMM's operands afresh. Per linear layer and step a recipe quantizes three
tensors, each in the two layouts its two GEMMs read (formats.PASS_OPERANDS):

    X  (T×in,  input)        row for fprop,  transposed for wgrad
    W  (out×in, weight)      row for fprop,  transposed for dgrad
    dY (T×out, grad_output)  row for dgrad,  transposed for wgrad

with the recipe's training quantizer (`GemmOps.quantizer`: e.g. one amax reduction per tensor for FP8
tensorwise scaling, both layouts sharing the scale; NVFP4's fused kernel writing both layouts of X and dY in one
pass). So this module lists the distinct tensors of the step (`step_tensors`), the benchmark times each tensor's
quantizer once per distinct (format, quantizer, shape, layouts) - compiled as training compiles it - and counts
it with its multiplicity (layers × occurrences per step).

Custom GEMMs (`--shapes`) are not part of a layer: each quantizes its own A and B, in the one layout it
needs.

Per-GEMM figures in quant mode attribute each tensor's quantization time equally to the GEMMs that read
it (X: half to fprop, half to wgrad; ...). That split is a convention; per-layer and whole-step totals
are exact sums of the per-tensor times.
"""
from __future__ import annotations

from dataclasses import dataclass

from .formats import LAYOUTS, PASS_OPERANDS, GemmOps, storage_dims
from .shapes import CUSTOM_LAYER

TENSOR_NAMES = {"input": "X", "weight": "W", "grad_output": "dY"}


@dataclass(frozen=True)
class StepTensor:
    """One tensor a training step quantizes: `count` times per step, in `layouts`."""

    group: str  # the layer ("qkv", ...) or "custom#i" for the i-th custom GEMM
    role: str
    rows: int
    cols: int
    count: int
    layouts: tuple

    @property
    def name(self) -> str:
        return f"{self.group}.{TENSOR_NAMES[self.role]}"

    @property
    def elements(self) -> int:
        return self.rows * self.cols

    def to_dict(self) -> dict:
        return {"tensor": self.name, "group": self.group, "role": self.role, "rows": self.rows,
                "cols": self.cols, "count": self.count, "layouts": list(self.layouts)}


def _group(shape, index: int) -> str:
    return f"{CUSTOM_LAYER}#{index}" if shape.layer == CUSTOM_LAYER else shape.layer


def step_tensors(shapes, supported=None):
    """The quantized tensors of a step and, per shape, ((tensor index, layout) of A, of B).

    `supported(shape) -> bool` leaves out the GEMMs a format cannot run (training keeps them in BF16): a
    tensor is quantized only in the layouts its supported GEMMs read. A shape not supported maps to None.
    Two shapes of one layer must agree on the layer's tensors (same dims, same count).
    """
    found: dict = {}  # (group, role) -> {"dims", "count", "layouts": set, "first": shape label}
    uses: list = []
    for i, shape in enumerate(shapes):
        if supported is not None and not supported(shape):
            uses.append(None)
            continue
        group = _group(shape, i)
        pair = []
        for (role, layout), dims in zip(PASS_OPERANDS[shape.gemm], storage_dims(shape.gemm, shape.m, shape.k, shape.n)):
            key = (group, role)
            entry = found.setdefault(key, {"dims": dims, "count": shape.count, "layouts": set(), "first": shape.label})
            if entry["dims"] != dims or entry["count"] != shape.count:
                raise ValueError(f"{shape.label} (x{shape.count}) disagrees with {entry['first']} about the "
                                 f"{TENSOR_NAMES[role]} of layer {group}: {dims} x{shape.count} vs "
                                 f"{entry['dims']} x{entry['count']}")
            entry["layouts"].add(layout)
            pair.append((key, layout))
        uses.append(pair)
    keys = list(found)
    tensors = [StepTensor(group, role, *found[(group, role)]["dims"], found[(group, role)]["count"],
                          tuple(lay for lay in LAYOUTS if lay in found[(group, role)]["layouts"]))
               for group, role in keys]
    index = {key: i for i, key in enumerate(keys)}
    return tensors, [None if pair is None else tuple((index[key], layout) for key, layout in pair)
                     for pair in uses]


def readers(uses) -> dict:
    """How many GEMMs (shapes) read each tensor: the divisor of the per-GEMM attribution."""
    out: dict = {}
    for pair in uses:
        for t_index, _ in pair or ():
            out[t_index] = out.get(t_index, 0) + 1
    return out


def attributed_quant_s(pair, tensor_times: dict, n_readers: dict) -> float | None:
    """Quantization seconds attributed to one GEMM: Σ over its two tensors of time / readers.

    None when a tensor's quantization could not be timed."""
    total = 0.0
    for t_index, _ in pair:
        t = tensor_times.get(t_index)
        if t is None:
            return None
        total += t / n_readers[t_index]
    return total


def timing_key(ops: GemmOps, tensor: StepTensor) -> tuple:
    """Tensors sharing this key share one timing: same quantizer (the format's `timing_group` of the role), same
    shape, same layouts."""
    return ops.fmt, ops.timing_group(tensor.role), tensor.rows, tensor.cols, tensor.layouts
