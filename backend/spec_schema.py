"""JSON Schemas of what experiment and run creation accept, built from the sources that validate them: the run
spec's sections (training.config: keys, types, bounds, choices), the recipe catalog (names, typed options), the
evaluation tasks lm-eval can find and the directories user paths must lie in. The OpenAPI document carries them
(backend/openapi.py), so a request valid by the document is one the API accepts, but for the run spec's
arithmetic rules JSON Schema cannot state (listed in SPEC_RULES, and in the document's descriptions)."""
from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path

from backend.schemas import NON_BLANK
from training import config as tc
from training.precision import catalog

NO_NUL = "^[^\\u0000]*$"
# The run spec's rules over several fields (training.config), which JSON Schema has no arithmetic for.
SPEC_RULES = ("training.batch_size must be divisible by grad_accum x gpus x nodes",
              "training.warmup_steps must not exceed the run's steps",
              "bf16_first_layers + bf16_last_layers must not exceed the model's layers",
              "each keep_bf16 pattern must match a linear layer of the model's blocks (glob patterns over names such "
              "as layers.0.mlp.down_proj, those of the model the worker builds)",
              "where the API's host holds the data directory, a model.config / model.init_from model is read as the "
              "worker reads it: its config.json must be one transformers reads, data.seq_len at most its "
              "max_position_embeddings, bf16_first_layers + bf16_last_layers at most its blocks",
              "a custom model's hidden_size must be divisible by num_attention_heads (unless head_dim is given), "
              "num_attention_heads by num_key_value_heads, and its head dim must be even",
              "a custom model's vocab_size must not be smaller than data.vocab_size (with a trained tokenizer)",
              "an experiment makes at most 256 runs (its distinct recipes, each once per seed)",
              "where the API's host holds the data directory, data.corpus, data.val_corpus, data.tokenizer and "
              "model.config / model.init_from must name what exists: corpus files, a tokenizer, a config.json, a "
              "checkpoint folder with safetensors weights")


def _int(section: str, name: str, minimum: int | None, nullable: bool = False) -> dict:
    out: dict = {"type": ["integer", "null"] if nullable else "integer",
                 "maximum": tc.LIMITS.get(f"{section}.{name}", tc.DEFAULT_INT_LIMIT)}
    if minimum is not None:
        out["minimum"] = minimum
    return out


def _num(minimum: float | None = None, maximum: float | None = None, exclusive_min: bool = False) -> dict:
    out: dict = {"type": "number"}
    if minimum is not None:
        out["exclusiveMinimum" if exclusive_min else "minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _default(cls, name):
    f = {f.name: f for f in fields(cls)}[name]
    return None if f.default is MISSING else f.default


_SEGMENT = r"(?:[^/.\u0000][^/\u0000]*|\.|\.[^/.\u0000][^/\u0000]*|\.\.[^/\u0000]+)"  # any path segment but ".."


def path_schema(roots: list[Path], description: str) -> dict:
    """A user path as confine() accepts it: relative (under the data directory) without a `..` segment, or absolute
    under one of `roots` (checked again after symlinks are followed)."""
    patterns = [f"^{_SEGMENT}(?:/+{_SEGMENT})*/*$"]
    for root in roots:
        literal = "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in str(root))  # valid in every dialect
        patterns.append(f"^{literal.replace('/', '/+')}(?:/+{_SEGMENT})*/*$")
    return {"type": "string", "minLength": 1, "maxLength": 4096, "anyOf": [{"pattern": p} for p in patterns],
            "description": description}


def model_schema(roots: list[Path]) -> dict:
    dims = {k: _int("model", k, 1, nullable=k in ("num_key_value_heads", "head_dim", "vocab_size"))
            for k in tc.CUSTOM_MODEL_KEYS}
    dims["vocab_size"]["minimum"] = 2
    dims["head_dim"]["multipleOf"] = 2
    custom = {"type": "object", "title": "CustomModel", "properties": dims, "additionalProperties": False,
              "required": ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"],
              "description": "custom Llama dimensions (vocab_size null: data.vocab_size)"}
    by_file = [{"type": "object", "title": f"Model{key.title().replace('_', '')}", "required": [key],
                "additionalProperties": False,
                "properties": {key: {**path_schema(roots, what), "pattern": NON_BLANK}}}
               for key, what in (("config", "a config.json (or a folder holding one): random initialisation"),
                                 ("init_from", "a Hugging Face checkpoint folder: its weights"))]
    return {"title": "ModelSpec", "description": "a preset name, custom Llama dimensions, {\"config\": PATH} or "
            "{\"init_from\": PATH}; paths inside the data directory or PLAB_ALLOWED_PATHS",
            "anyOf": [{"type": "string", "enum": list(tc.MODEL_PRESET_NAMES)}, custom, *by_file]}


def data_schema(roots: list[Path]) -> dict:
    d = tc.DataSpec
    corpus = path_schema(roots, "a name under the data directory, a path or a glob; \"random\": random tokens")
    tokenizer = path_schema(roots, "\"train\" (a BPE trained on the corpus), \"checkpoint\" (model.init_from's) "
                                   "or a tokenizer folder / tokenizer.json")
    val_corpus = path_schema(roots, "the validation documents (null: val_fraction of the corpus)")
    val_corpus["not"] = {"const": tc.RANDOM_CORPUS}
    val_corpus["type"] = ["string", "null"]
    props = {
        "corpus": corpus,
        "vocab_size": {**_int("data", "vocab_size", 2), "default": _default(d, "vocab_size")},
        "seq_len": {**_int("data", "seq_len", 8), "default": _default(d, "seq_len")},
        "val_fraction": {**_num(0.0, 0.5, exclusive_min=True), "default": _default(d, "val_fraction")},
        "tokenizer": tokenizer,
        "text_field": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": NO_NUL,
                       "default": _default(d, "text_field")},
        "val_corpus": val_corpus,
        "num_proc": _int("data", "num_proc", 1, nullable=True),
        "max_bad_fraction": {**_num(0.0, 1.0), "default": _default(d, "max_bad_fraction")},
        "val_windows": {"type": "string", "enum": list(tc.VAL_WINDOW_RULES), "default": _default(d, "val_windows"),
                        "description": "where the validation windows lie in the validation split: \"spread\" evenly "
                                       "over it, or the \"first\" ones in a row (specs stored before this option)"},
        "eos_at_split": {**_bool(_default(d, "eos_at_split")),
                         "description": "a text file whose last val_fraction is held out: its training part ends "
                                        "with EOS (true), or runs on into the next file's first token (false: "
                                        "specs stored before this option)"},
    }
    return {"type": "object", "title": "DataSpec", "properties": props, "additionalProperties": False}


def _bool(default=None) -> dict:
    return {"type": "boolean", **({"default": default} if default is not None else {})}


def training_schema() -> dict:
    t, p = tc.TrainingSpec, tc.PerfOptions
    perf = {
        "fused_loss": _bool(), "loss_chunk_tokens": _int("training.perf", "loss_chunk_tokens", 1),
        "sdpa_backend": {"enum": list(p.SDPA_BACKENDS)},
        "compile_mode": {"enum": [None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]},
        "metrics_lag": _int("training.perf", "metrics_lag", 0), "prefetch": _bool(), "allow_tf32": _bool(),
        "fused_clip": _bool(), "overlap_optimizer": {"type": ["boolean", "null"]}, "fsdp_prefetch": _bool(),
        "fsdp_fused_cast": _bool(), "fsdp_one_rank_direct": _bool(),
        "compile_scope": {"enum": list(p.COMPILE_SCOPES)},
        "optimizer_update": {"enum": list(p.OPTIMIZER_UPDATES)},
        "shard_update": {"enum": list(p.SHARD_UPDATES)}, "fuse_qkv": {"type": ["boolean", "null"]},
        "fsdp_reshard_after_forward": {"enum": list(p.FSDP_RESHARD)},
        "fuse_gate_up": _bool(), "bf16_residual": _bool(), "ddp_bucket_mb": _int("training.perf", "ddp_bucket_mb", 1),
        "ddp_static_graph": _bool(), "gc_interval": _int("training.perf", "gc_interval", 0),
        "sync_free_mask": _bool(), "reuse_quantized_weights": _bool(),
        "cublaslt_workspace": {"enum": list(p.CUBLASLT_WORKSPACES)},
        "loss_weight_grad": {"enum": list(p.LOSS_WEIGHT_GRADS)},
        "rope_backward": {"enum": list(p.ROPE_BACKWARDS)},
    }
    assert set(perf) == {f.name for f in fields(p)}, "training.perf keys changed: update backend/spec_schema.py"
    s = "training"
    props = {
        "steps": {**_int(s, "steps", 1, nullable=True), "description": "the run's length in steps (default "
                  f"{_default(t, 'steps')} when tokens is not given)"},
        "tokens": {**_int(s, "tokens", 1, nullable=True), "description": "the run's length in tokens (instead of "
                   "steps)"},
        "batch_size": _int(s, "batch_size", 1), "grad_accum": _int(s, "grad_accum", 1),
        "lr": _num(0.0, exclusive_min=True), "warmup_steps": _int(s, "warmup_steps", 0),
        "min_lr_ratio": _num(0.0, 1.0), "weight_decay": _num(0.0),
        "beta1": _num(0.0, 0.999999), "beta2": _num(0.0, 0.999999), "grad_clip": _num(0.0),
        "val_every": _int(s, "val_every", 0), "val_batches": _int(s, "val_batches", 0),
        "checkpoint_every": _int(s, "checkpoint_every", 0), "compile": _bool(),
        "activation_checkpointing": {"anyOf": [{"enum": list(tc.AC_MODES)}, {"type": "boolean"}]},
        "activation_checkpointing_every": _int(s, "activation_checkpointing_every", 1),
        "parallel": {"enum": list(tc.PARALLEL_MODES)}, "init_device": {"enum": ["cpu", "device"]},
        "param_dtype": {"enum": list(tc.PARAM_DTYPES)}, "numerics_every": _int(s, "numerics_every", 0),
        "device": {"type": "string", "pattern": "^(auto|cpu|cuda|cuda:[^\\u0000]*)$", "maxLength": 64},
        "gpus": _int(s, "gpus", 1), "nodes": _int(s, "nodes", 1),
        "queue": {"type": ["string", "null"], "minLength": 1, "maxLength": 64, "pattern": r"^[A-Za-z0-9_.\-]+$",
                  "description": "the worker queue (e.g. h100, cpu); null: default"},
        "perf": {"type": ["object", "null"], "properties": perf, "additionalProperties": False},
    }
    assert set(props) == {f.name for f in fields(t)}, "training keys changed: update backend/spec_schema.py"
    both = {"properties": {"steps": {"type": "integer"}, "tokens": {"type": "integer"}},
            "required": ["steps", "tokens"]}
    return {"type": "object", "title": "TrainingSpec", "properties": props, "additionalProperties": False,
            "not": both, "description": "at most one of steps and tokens. Rules JSON Schema cannot state (422 when "
            "broken): " + "; ".join(SPEC_RULES)}


def recipe_options_schema(entry) -> dict:
    props = {}
    for o in entry.options:
        if o.type == "boolean":
            props[o.name] = {"type": "boolean"}
        elif o.type == "string":
            props[o.name] = {"type": "string", "enum": list(o.choices)}
        else:
            props[o.name] = {"type": "integer", **({"minimum": o.minimum} if o.minimum is not None else {}),
                             **({"maximum": o.maximum} if o.maximum is not None else {})}
        props[o.name]["description"] = o.help
    return {"type": "object", "title": f"RecipeOptions_{entry.name}", "properties": props,
            "additionalProperties": False}


def recipe_names() -> list[str]:
    return list(catalog.recipe_names())


def recipe_option_rules(name_key: str, options_key: str, *, name_required: bool) -> list[dict]:
    """`allOf` entries: the options object each recipe accepts, chosen by the recipe name."""
    rules = []
    for name in recipe_names():
        cond = {"properties": {name_key: {"const": name}}, "required": [name_key]}
        rules.append({"if": cond, "then": {"properties": {options_key: recipe_options_schema(catalog.get(name))}}})
    if not name_required:  # left out: the baseline
        rules.append({"if": {"not": {"required": [name_key]}}, "then": {"properties": {
            options_key: recipe_options_schema(catalog.get(catalog.BASELINE))}}})
    return rules


# -- GEMM benchmarks (backend/services/gemm.py validates with the training library's own checks) ---------------------
def _dim_pattern(maximum: int) -> str:
    """Decimal integers 1..maximum (leading zeros allowed, as int() reads them)."""
    digits = str(maximum)
    alts = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        head, rest = digits[:i], len(digits) - i - 1
        low = 1 if i == 0 else 0
        if int(d) > low:
            alts.append(f"{head}[{low}-{int(d) - 1}][0-9]{{{rest}}}")
    alts.append(digits)
    return "0*(?:" + "|".join(alts) + ")"


def gemm_request_schema() -> dict:
    from backend.services.gemm import MAX_DIM, MAX_TOKENS
    # the catalog's names, not training.gemm's (which imports torch: the API process must not)
    FORMATS, MODES = catalog.gemm_formats(), catalog.GEMM_MODES

    dim = _dim_pattern(MAX_DIM)
    from backend.schemas import _BLANK

    blank = f"[{_BLANK}]*"  # Python's whitespace (parse_shapes' \\s), spelled out: regex dialects disagree on \\s
    item = f"{blank}{dim}{blank}[xX×]{blank}{dim}{blank}[xX×]{blank}{dim}{blank}"
    shapes = {"type": "string", "pattern": f"^{item}(?:,{item}){{0,255}}$",
              "description": "GEMMs as 'MxKxN,...' (at most 256, each dimension 1 to 2^20)"}
    pos = {"type": "integer", "minimum": 1, "maximum": MAX_DIM}
    model = {"anyOf": [
        {"type": "string", "enum": list(tc.MODEL_PRESET_NAMES)},
        {"type": "object", "additionalProperties": False,
         "required": ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"],
         "properties": {**{k: pos for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "vocab_size")},
                        "num_key_value_heads": {**pos, "type": ["integer", "null"]},
                        "head_dim": {**pos, "type": ["integer", "null"]}},
         "description": "Llama dims: num_attention_heads a multiple of num_key_value_heads, hidden_size divisible by "
                        "num_attention_heads unless head_dim is given (422 otherwise)"}]}

    def names(allowed):
        return {"anyOf": [{"type": "array", "minItems": 1, "items": {"enum": list(allowed)}},
                          {"type": "null"}],
                "description": "a list of " + ", ".join(allowed) + " (null: all)"}

    props = {
        "model": model, "shapes": shapes,
        "micro_batch": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
        "seq_len": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
        "formats": names(FORMATS), "modes": names(MODES),
        "gated_mlp": {"type": "boolean"}, "no_gqa": {"type": "boolean"},
        "vocab_size": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_DIM},
        "repeats": {"type": ["integer", "null"], "minimum": 1, "maximum": 10_000},
        "warmup": {"type": ["integer", "null"], "minimum": 0, "maximum": 10_000},
        "device": {"type": "string", "pattern": "^(auto|cpu|cuda|cuda:[0-9]+)$"},
        "bf16_step_time_s": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "compile_quant": {"type": "boolean"},
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
    }
    null = {"type": "null"}
    return {"type": "object", "title": "GemmRequest", "properties": props, "additionalProperties": False,
            "description": f"keyword arguments of training.gemm.run_gemm_benchmark: exactly one of model and shapes "
                           f"(vocab_size and no_gqa describe a model); micro_batch x seq_len at most {MAX_TOKENS:,} "
                           "tokens (422 otherwise)",
            "anyOf": [{"required": ["model"], "properties": {"model": {"not": null}, "shapes": null}},
                      {"required": ["shapes"], "properties": {"shapes": {"not": null}, "model": null,
                                                               "vocab_size": null, "no_gqa": {"const": False}}}]}


def gemm_result_schema() -> dict:
    """A result as run_gemm_benchmark returns it: the fields the API and the dashboard read are typed, the rest is
    free-form JSON (a NUL character is kept there, in a json column; typed strings refuse it)."""
    from backend.schemas import BIG, NO_NUL_PATTERN
    from backend.services.gemm import RESULT_SCHEMA

    def text(n):
        return {"type": "string", "maxLength": n, "pattern": NO_NUL_PATTERN}

    count = {"type": "integer", "minimum": 1, "maximum": BIG}
    shape = {"type": "object", "required": ["layer", "gemm", "m", "k", "n", "count"],
             "properties": {"layer": text(200), "gemm": text(64), "m": count, "k": count, "n": count,
                            "count": {**count, "minimum": 0}}}
    record = {"type": "object", "required": ["layer", "gemm", "m", "k", "n", "format", "mode"],
              "properties": {"format": text(64), "mode": text(32), "layer": text(200), "gemm": text(64),
                             "m": count, "k": count, "n": count, "speedup_vs_bf16": {"type": ["number", "null"]},
                             "tflops": {"type": ["number", "null"]}}}
    return {"type": "object", "title": "GemmResult", "description": "the dict run_gemm_benchmark returned (at most "
            "1 MiB of JSON)",
            "required": ["schema", "request", "device", "results", "totals", "prediction", "failures", "shapes"],
            "properties": {"schema": {"const": RESULT_SCHEMA}, "request": {"$ref": "#/components/schemas/GemmRequest"},
                           "device": {"type": "object", "required": ["name"], "properties": {"name": text(100_000)}},
                           "results": {"type": "array", "items": record},
                           "totals": {"type": "object", "description": "mode -> format -> {speedup, ...}",
                                      "additionalProperties": {"type": "object", "additionalProperties": {
                                          "type": "object", "properties": {"speedup": {"type": ["number", "null"]}}}}},
                           "prediction": {"type": "object"}, "failures": {"type": "array"},
                           "shapes": {"type": "array", "items": shape}}}

