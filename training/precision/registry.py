"""The recipe registry, the conversion report and `apply_recipe`.

Each recipe module defines one `Recipe` subclass and registers it; `apply_recipe` only talks to that
interface (the torchtitan model-converter pattern), so the train loop never knows which formats exist.
What a recipe is (summary, options and their defaults, the capability its real kernels need) comes from
the catalog (catalog.py); the module named by a catalog entry is imported the first time the recipe is
asked for.
"""
from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from training.precision import catalog
from training.precision.emulation import GemmQuantizer
from training.precision.numerics import NumericsProbe

BACKENDS = ("auto", "real", "emulated")
REGISTRY: dict[str, "Recipe"] = {}


def register(recipe_cls):
    recipe = recipe_cls()
    if recipe.name not in catalog.recipe_names():
        raise ValueError(f"{recipe_cls.__name__} registers recipe {recipe.name!r}, which the catalog does not "
                         "list; add its RecipeEntry to training/precision/catalog.py (or through add_recipe) first")
    REGISTRY[recipe.name] = recipe
    return recipe_cls


def get_recipe(name: str) -> "Recipe":
    """The registered recipe `name`, importing its module on first use (RecipeError if the catalog lacks it)."""
    entry = catalog.get(name)
    if name not in REGISTRY:
        importlib.import_module(entry.implementation)
        if name not in REGISTRY:
            raise ImportError(f"{entry.implementation} did not register a Recipe named {name!r} "
                              "(decorate its Recipe subclass with @register)")
    return REGISTRY[name]


def load_recipes() -> None:
    """Import every catalog recipe; REGISTRY then lists them in catalog order (error messages use it)."""
    names = catalog.recipe_names()
    for name in names:
        get_recipe(name)
    ordered = {name: REGISTRY[name] for name in names}
    REGISTRY.clear()
    REGISTRY.update(ordered)


def cuda_capability(device: torch.device) -> Optional[tuple[int, int]]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def capability_reason(device: torch.device, minimum: tuple[int, int], what: str) -> Optional[str]:
    """None when `device` has the tensor cores for `what`, else a sentence saying why not."""
    cap = cuda_capability(device)
    if cap is None:
        return f"{what} need a CUDA GPU with compute capability sm_{minimum[0]}{minimum[1]}+, model is on {device.type}"
    if cap < minimum:
        return (f"{what} need compute capability sm_{minimum[0]}{minimum[1]}+, "
                f"this GPU is sm_{cap[0]}{cap[1]}")
    return None


class Recipe:
    """One precision recipe: `name` (its catalog entry) and the conversion. Subclasses implement the methods."""

    name: str = ""

    @property
    def entry(self) -> catalog.RecipeEntry:
        return catalog.get(self.name)

    @property
    def summary(self) -> str:
        return self.entry.summary

    @property
    def options(self) -> dict[str, Any]:
        """Option name -> default."""
        return self.entry.defaults()

    @property
    def min_capability(self) -> Optional[tuple[int, int]]:
        """The compute capability the real kernels need (None: no low-precision kernels)."""
        return self.entry.real_min_capability

    def resolve_options(self, given: dict) -> dict:
        """The options with every default filled in (catalog.RecipeError, a ValueError, if one is bad)."""
        return self.entry.resolve_options(given)

    def real_unavailable(self, device: torch.device, options: dict) -> Optional[str]:
        """None if real kernels can run on `device` with these options, else the reason."""
        raise NotImplementedError

    def skip_reason(self, linear: nn.Linear, real: bool) -> Optional[str]:
        """Why this layer cannot be converted (shape constraints), or None."""
        return None

    def convert(self, linear: nn.Linear, name: str, options: dict, real: bool) -> tuple[nn.Module, GemmQuantizer, str]:
        """Return (new module, quantizer describing its formats for telemetry, one-line description)."""
        raise NotImplementedError

    # What share_inputs set up, for the report's note ("N block(s): ...").
    shared_note = "linears reading the same input quantize it once where the fused kernels run (MLP gate and up)"

    def share_inputs(self, block: nn.Module, options: dict, real: bool) -> int:
        """After a block's linears are converted: let linears that read the same input quantize it once, or run
        together in one fused function (the same values). Returns how many groups were set up; none by default."""
        return 0

    def make_hooks(self, converted: list[tuple[str, nn.Module]], options: dict) -> list:
        return []

    def compile_mode(self, options: dict, real: bool) -> Optional[str]:
        """The torch.compile mode this recipe's layers run best under when the run does not name one
        (training.perf.compile_mode unset), or None for inductor's default."""
        return None

    def inductor_settings(self, model: nn.Module, on_cuda: bool) -> dict:
        """Inductor settings (`torch._inductor.config` names and values) a compiled step with this recipe's converted
        layers runs under; training.train applies them around its loop (forward, backward and recompiles) and
        restores inductor's own after it. {} (inductor's defaults) unless a recipe says otherwise."""
        return {}

    # The GEMM benchmark's relative-error bound ‖C − C_bf16‖ / ‖C_bf16‖ for a GEMM of Gaussian operands in this
    # recipe's format: about twice the expected error (two quantized operands, errors adding in quadrature), so
    # shape effects pass and a broken quantizer (error ≈ 1) fails. Recipes that own a GEMM format set it.
    gemm_error_bound: Optional[float] = None

    def gemm_ops(self, device: torch.device):
        """The recipe's GEMMs for the GEMM benchmark, a `training.precision.gemm_ops.GemmOps` (implemented by the
        recipes that own a GEMM format: catalog gemm_format == name; the others are timed as that format)."""
        raise NotImplementedError(f"recipe {self.name!r} has no GEMM operands of its own; the GEMM benchmark times "
                                  f"it as {self.entry.gemm_format!r}")


@dataclass
class RecipeReport:
    recipe: str
    gemm_backend: str = "bf16"
    layers: list = field(default_factory=list)
    hooks: list = field(default_factory=list)
    options: dict = field(default_factory=dict)
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    keep_bf16: list = field(default_factory=list)
    backend_requested: str = "auto"
    device: str = "cpu"
    notes: list = field(default_factory=list)
    compile_mode: Optional[str] = None  # Recipe.compile_mode: the mode the recipe asks for when the run names none
    probe: NumericsProbe = field(default_factory=NumericsProbe, repr=False)

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "gemm_backend": self.gemm_backend,
            "backend_requested": self.backend_requested,
            "device": self.device,
            "options": dict(self.options),
            "bf16_first_layers": self.bf16_first_layers,
            "bf16_last_layers": self.bf16_last_layers,
            "keep_bf16": list(self.keep_bf16),
            "converted_layers": sum(1 for layer in self.layers if layer["converted"]),
            "total_layers": len(self.layers),
            "layers": [dict(layer) for layer in self.layers],
            "notes": list(self.notes),
            "compile_mode": self.compile_mode,
        }

    def set_numerics_sampling(self, on: bool) -> None:
        self.probe.set_sampling(on)

    def collect_numerics(self) -> dict[str, float]:
        return self.probe.collect()


def _transformer_blocks(model: nn.Module) -> nn.ModuleList:
    from training.model import decoder_blocks
    return decoder_blocks(model)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def apply_recipe(model: nn.Module, name: str, *, bf16_first_layers: int = 0, bf16_last_layers: int = 0,
                 keep_bf16=(), backend: str = "auto", fsdp: bool = False, **options) -> RecipeReport:
    """Convert the nn.Linear layers inside the model's decoder blocks to recipe `name`, in place.

    Blocks found by structure (training.model.decoder_blocks), linears by module type: any transformers
    decoder converts. Embeddings, norms and the LM head stay high precision; so do blocks `i < bf16_first_layers`
    and `i >= n - bf16_last_layers` and linears whose name ("layers.<i>.<path>") matches a `keep_bf16` glob.
    The report lists every linear with its reason, the head, embeddings and non-nn.Linear block weights (an
    MoE's batched experts, its router) included. `backend`: "auto" (real kernels where the GPU has them, exact
    emulation elsewhere), "real" (error if unavailable) or "emulated". Returns a RecipeReport.
    Call it before building the optimizer and before torch.compile. `fsdp`: the model will be sharded with
    FSDP2 (recipes with a sharding-aware form use it: torchao's FP8 all-gather); not a recipe option."""
    recipe = get_recipe(name)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    first = _check_count("bf16_first_layers", bf16_first_layers)
    last = _check_count("bf16_last_layers", bf16_last_layers)
    keep = _check_patterns(keep_bf16)
    resolved = recipe.resolve_options(options)
    blocks = _transformer_blocks(model)
    n = len(blocks)
    for module_name, module in model.named_modules():
        if getattr(module, "_plab_converted", False):
            raise ValueError(f"model is already converted ({module_name}); build a fresh model to apply another recipe")
    # the layer counts and keep_bf16 rules, as a run's are checked when it is submitted, before anything converts
    check_layer_choices(model, bf16_first_layers=first, bf16_last_layers=last, keep_bf16=keep)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    report = RecipeReport(recipe=name, options=resolved, bf16_first_layers=first, bf16_last_layers=last,
                          backend_requested=backend, device=str(device), keep_bf16=list(keep))
    real = _real_kernels(recipe, name, backend, device, resolved, report)
    converted: list[tuple[str, nn.Module]] = []
    unfit: list[dict] = []  # linears the recipe cannot convert (shapes its blocks do not tile, ...)
    shared = 0
    backends_used = set()
    for i, block in enumerate(blocks):
        linears = [(child, mod) for child, mod in block.named_modules() if type(mod) is nn.Linear]
        for child, linear in linears:
            full = f"layers.{i}.{child}"
            entry = {"name": full, "block": i, "in_features": linear.in_features,
                     "out_features": linear.out_features, "converted": False, "backend": "bf16"}
            rule = next((p for p in keep if fnmatch.fnmatchcase(full, p)), None)
            kept = _kept_reason(name, i, n, first, last, rule)
            skip = kept or recipe.skip_reason(linear, real)
            if skip:
                entry["reason"] = skip
                if not kept:
                    unfit.append(entry)
            else:
                new, quantizer, how = recipe.convert(linear, full, {**resolved, "fsdp": fsdp}, real)
                new._plab_converted = True
                parent_path, _, attr = child.rpartition(".")
                parent = block.get_submodule(parent_path) if parent_path else block
                setattr(parent, attr, new)
                layer_backend = "real" if real else "emulated"
                entry.update(converted=True, backend=layer_backend, reason=how)
                backends_used.add(layer_backend)
                converted.append((full, new))
                report.probe.add_layer(full, new, quantizer)
            report.layers.append(entry)
        report.layers += (others := _unconverted_block_weights(block, i, keep))
        if name != catalog.BASELINE and first <= i < n - last:  # a block left to the recipe
            unfit += _not_kept(others, keep)
        shared += recipe.share_inputs(block, resolved, real) if name != catalog.BASELINE else 0
    _refuse_if_nothing_converts(name, unfit, converted)
    report.layers += _outside_blocks(model, blocks)
    if shared:
        report.notes.append(f"{shared} block(s): {recipe.shared_note}")
    if backends_used:
        report.gemm_backend = "emulated" if "emulated" in backends_used else "real"
    report.hooks = recipe.make_hooks(converted, {**resolved, "fsdp": fsdp})
    report.compile_mode = recipe.compile_mode({**resolved, "fsdp": fsdp}, real) if converted else None
    return report


def check_layer_choices(model: nn.Module, *, bf16_first_layers: int = 0, bf16_last_layers: int = 0,
                        keep_bf16=()) -> None:
    """What `apply_recipe` refuses about a run's layer choices, on a model of the run's architecture that need hold
    no weights (built on the meta device): more BF16 first and last blocks than the model has, a keep_bf16 pattern
    that names no matmul of its blocks. For checking a spec when it is submitted, before a worker builds the model
    (a typo in a pattern failed the run only when it started: hours later behind a queue). ValueError as
    `apply_recipe`'s."""
    first = _check_count("bf16_first_layers", bf16_first_layers)
    last = _check_count("bf16_last_layers", bf16_last_layers)
    keep = _check_patterns(keep_bf16)
    blocks = _transformer_blocks(model)
    if first + last > len(blocks):
        raise ValueError(f"bf16_first_layers ({first}) + bf16_last_layers ({last}) exceeds the model's {len(blocks)} "
                         f"blocks")
    if not keep:
        return
    matched: set = set()
    block0: list[str] = []  # the names the message shows: block 0's, as the conversion report lists them
    for i, block in enumerate(blocks):
        linears = [f"layers.{i}.{child}" for child, module in block.named_modules() if type(module) is nn.Linear]
        matched.update(p for p in keep if any(fnmatch.fnmatchcase(full, p) for full in linears))
        others = _unconverted_block_weights(block, i, keep, matched)  # a rule naming their module matches
        block0 = block0 or linears + [e["name"] for e in others]
    unmatched = [p for p in keep if p not in matched]
    if unmatched:
        more = f" and {len(unmatched) - 8} more" if len(unmatched) > 8 else ""
        raise ValueError(f"keep_bf16 pattern(s) {unmatched[:8]}{more} match no linear layer of the model's blocks; "
                         f"names look like {block0[:4]}")


def _not_kept(entries: list[dict], keep: list[str]) -> list[dict]:
    """The report entries no keep_bf16 rule names (by the weight's module or the weight itself)."""
    return [e for e in entries if not any(fnmatch.fnmatchcase(e["name"].rpartition(".")[0], p)
                                          or fnmatch.fnmatchcase(e["name"], p) for p in keep)]


def _refuse_if_nothing_converts(name: str, unfit: list[dict], converted: list) -> None:
    """Not one matmul weight the run left to the recipe can take its format: training would be BF16 under the
    recipe's name, and the comparison would call it the recipe. `unfit`: the blocks' nn.Linear layers the format
    cannot tile and their other matmul weights (GPT-2's Conv1D, batched experts), which no recipe converts.
    (Keeping every block in BF16 on purpose, bf16_first_layers + bf16_last_layers = the blocks, stays possible:
    the report says so.)"""
    if unfit and not converted:
        reasons = sorted({e["reason"] for e in unfit})
        raise ValueError(f"{name} can convert none of the model's {len(unfit)} block matmul weight(s) left to it "
                         f"({'; '.join(reasons[:3])}): the run would train BF16 under {name}'s name; choose "
                         f"dimensions the format's blocks divide, a model whose blocks use nn.Linear, or another "
                         f"recipe")


def _real_kernels(recipe: Recipe, name: str, backend: str, device, resolved: dict, report: RecipeReport) -> bool:
    """Whether the recipe's real kernels run (else its exact emulation, noted in the report): `backend` "real"
    raises where they are unavailable on `device`."""
    if name == catalog.BASELINE:
        return False
    unavailable = recipe.real_unavailable(device, resolved)
    if backend == "real" and unavailable:
        raise ValueError(f"backend='real' is unavailable for {name}: {unavailable}; use backend='auto' or 'emulated'")
    real = backend != "emulated" and unavailable is None
    if not real:
        report.notes.append(f"emulated: {unavailable}" if backend == "auto" else "emulated: backend='emulated' requested")
    return real


def _kept_reason(name: str, i: int, n: int, first: int, last: int, rule) -> str | None:
    """Why block `i`'s linear stays BF16 by the run's choice (baseline, first/last blocks, a keep_bf16 rule)."""
    if name == catalog.BASELINE:
        return "bf16 baseline: high-precision GEMM"
    if i < first:
        return f"kept in BF16: block {i} < bf16_first_layers={first}"
    if i >= n - last:
        return f"kept in BF16: block {i} is among the last bf16_last_layers={last}"
    if rule is not None:
        return f"kept in BF16: matches keep_bf16 rule {rule!r}"
    return None


def _check_patterns(value) -> list[str]:
    if isinstance(value, str) or not all(isinstance(p, str) and p for p in value):
        raise ValueError(f"keep_bf16 must be a list of glob patterns such as ['*.mlp.gate'], got {value!r}")
    return list(value)


def _unconverted_block_weights(block: nn.Module, i: int, keep: list, matched: set | None = None) -> list[dict]:
    """Report entries for the matmul weights of block `i` that are not nn.Linear modules: an MoE's experts kept
    as one batched 3-D tensor, a router that calls F.linear on its own weight. Recipes swap nn.Linear modules
    for quantized ones; these GEMMs run in BF16 (a keep_bf16 rule naming the module, e.g. "*.mlp.gate" for a
    router, counts as matched: added to `matched` when given)."""
    out = []
    for path, module in block.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or getattr(module, "_plab_converted", False):
            continue
        if matched is not None:
            matched.update(p for p in keep if fnmatch.fnmatchcase(f"layers.{i}.{path}", p))
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() < 2:
                continue
            kind = "batched expert weights (one GEMM per expert)" if p.dim() == 3 else "a matmul weight"
            out.append({"name": f"layers.{i}.{path + '.' if path else ''}{pname}", "block": i,
                        "in_features": p.shape[-1], "out_features": p.shape[-2], "converted": False,
                        "backend": "bf16", "reason": f"kept in BF16: {kind} of {type(module).__name__}, not an "
                        f"nn.Linear; the recipes convert nn.Linear layers only"})
    return out


def _outside_blocks(model: nn.Module, blocks: nn.ModuleList) -> list[dict]:
    """Report entries for the LM head and the embeddings: high precision by convention (the NVFP4 and FP8
    recipes of the papers keep them so; the head's GEMM is a small share and its errors reach every token)."""
    out = []
    getters = (("LM head", "get_output_embeddings"), ("embeddings", "get_input_embeddings"))
    seen = set()
    for what, getter in getters:
        module = getattr(model, getter, lambda: None)()
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        name = next((n for n, m in model.named_modules() if m is module), what)
        weight = module.weight
        tied = what == "embeddings" and any(weight is getattr(m, "weight", None) for m in
                                            [getattr(model, "get_output_embeddings", lambda: None)()])
        out.append({"name": name, "block": None, "in_features": weight.shape[1], "out_features": weight.shape[0],
                    "converted": False, "backend": "bf16",
                    "reason": f"kept in BF16 by convention: {what}" + (" (tied to the LM head)" if tied else "")})
    return out
