"""The run specification: one JSON-able dict that fully describes a training run.

`RunSpec.from_dict(d)` validates strictly (unknown keys are errors, not silently ignored: a typo such as
`"learning_rate"` must not train with the default) and raises `SpecError` with a message that says what
to change. `RunSpec.to_dict()` gives back the canonical dict with every default filled in, so a stored
spec reproduces the run even if defaults change later.

Format (docs/INTERFACES.md)::

    {"model": "tiny" | {custom dims} | {"config": PATH} | {"init_from": PATH},
     "data": {"corpus", "vocab_size", "seq_len", "val_fraction", "tokenizer", "text_field", "val_corpus",
              "num_proc", "max_bad_fraction", "val_windows", "eos_at_split"},
     "training": {"steps" | "tokens", "batch_size", "grad_accum", "lr", ..., "perf": {...}},
     "seed", "recipe", "recipe_options", "bf16_first_layers", "bf16_last_layers"}

`training.perf` (an extension of INTERFACES.md, all optional) holds the throughput switches, so
each optimisation can be A/B-tested without code changes; see `PerfOptions`.
`data.corpus = "random"` gives uniformly random tokens (no tokenizer): for throughput benchmarks only.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from training.precision import catalog

RANDOM_CORPUS = "random"
# Model presets (re-exported as training.model.PRESETS). Defined here so that validating a spec does not
# import transformers. `1b` is 1.14B parameters with data.vocab_size 32000, the vocabulary of the reference
# stack bench/train_bench.py times it against (a preset takes its vocabulary from data.vocab_size); `tiny`
# (CPU tests) has 4 blocks so bf16_last_layers=1 leaves 3 converted, and every linear dim a multiple of 32
# so the FP8/MX/NVFP4 blocks tile it.
MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "125m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4),
    "350m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=8),
    # Llama-3.2-3B's and Llama-3-8B's transformer shapes (their vocabularies are 128256; a preset takes
    # data.vocab_size): for throughput on larger models, and FSDP.
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
}
MODEL_PRESET_NAMES = tuple(MODEL_PRESETS)
CUSTOM_MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size")
MODEL_PATH_KEYS = ("config", "init_from")  # model given by a file: {"config": PATH} or {"init_from": PATH}


class SpecError(ValueError):
    """A run spec is invalid; the message says which field and how to fix it."""


def default_data_dir() -> Path:
    """The data directory when PLAB_DATA_DIR is unset: `shared/data` beside the checkout (a development
    checkout), else `data/` in it. The API, the workers and the CLI all use this one default."""
    repo = Path(__file__).resolve().parent.parent
    for candidate in (repo.parent / "shared" / "data", repo / "data"):
        if candidate.is_dir():
            return candidate
    return repo / "data"


def data_root() -> Path:
    return Path(os.environ["PLAB_DATA_DIR"]) if os.environ.get("PLAB_DATA_DIR") else default_data_dir()


CONFINE_ENV = "PLAB_CONFINE_PATHS"  # "1" in jobs a worker runs: user paths must lie inside the allowed roots


def allowed_roots() -> list[Path]:
    """Where paths that arrive through the API may point: the data directory and PLAB_ALLOWED_PATHS
    (os.pathsep-separated), resolved."""
    extra = [Path(p) for p in os.environ.get("PLAB_ALLOWED_PATHS", "").split(os.pathsep) if p.strip()]
    return [root.resolve() for root in [data_root(), *extra]]


def confine(value: str, field: str, roots: list[Path]) -> Path:
    """`value` (a name under the data directory, or a path) resolved – `..` and symlinks followed – and required
    to lie inside one of `roots`. The error says the same whatever exists outside them."""
    path = Path(value)
    resolved = (path if path.is_absolute() else roots[0] / path).resolve()
    for root in roots:
        if resolved == root or root in resolved.parents:
            return resolved
    raise SpecError(f"{field} must be a name or path inside the data directory or PLAB_ALLOWED_PATHS; got {value!r}")


def confine_spec_paths(spec: dict, roots: list[Path]) -> None:
    """Every file path a run spec names, confined to `roots` (the API calls this before storing a spec that
    arrived over the network; a worker's job does it again before reading)."""
    data = spec.get("data") or {}
    for key in ("corpus", "val_corpus", "tokenizer"):
        value = data.get(key)
        if isinstance(value, str) and value and value not in (RANDOM_CORPUS, *TOKENIZER_SOURCES):
            confine(value, f"data.{key}", roots)
    model = spec.get("model")
    if isinstance(model, dict):
        for key in MODEL_PATH_KEYS:
            if isinstance(model.get(key), str) and model[key]:
                confine(model[key], f"model.{key}", roots)


def keep_bf16_patterns(value) -> list[str]:
    """`keep_bf16`: a list of glob patterns (fnmatch) naming block linears a recipe keeps in BF16."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise SpecError(f"keep_bf16 must be a list of glob patterns over layer names, e.g. [\"*.mlp.gate\", "
                        f"\"layers.0.*\"], got {value!r}")
    if len(value) > 256 or any(len(v) > 200 for v in value):
        raise SpecError("keep_bf16 takes at most 256 patterns of at most 200 characters each")
    return list(value)


def plab_home() -> Path:
    return Path(os.environ.get("PLAB_HOME", "./plab-data"))


def _check_keys(section: str, given: dict, allowed) -> None:
    if not isinstance(given, dict):
        raise SpecError(f"{section} must be an object (dict), got {type(given).__name__}")
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        import difflib

        close = [(k, m[0]) for k in unknown if isinstance(k, str)
                 for m in [difflib.get_close_matches(k, sorted(map(str, allowed)), n=1, cutoff=0.75)] if m]
        if len(unknown) == 1 and close:
            hint = f"; did you mean {close[0][1]!r}?"
        else:
            hint = f"; did you mean {', '.join(f'{m!r} (for {k!r})' for k, m in close)}?" if close else ""
        if section == "run spec" and {"recipes", "seeds", "replicates", "eval_tasks"} & set(unknown):
            # an experiment (several recipes) given where one run is expected
            hint = ("; this looks like an experiment (several recipes): submit it with `plab submit FILE`, or "
                    "train one run of it with `recipe: NAME` instead of `recipes:`")
        raise SpecError(f"unknown key(s) {unknown} in {section}; allowed keys are {sorted(allowed)}{hint}")


# Upper bounds of every integer in a run spec: far above any model or run the lab can train (a 1T-parameter
# Llama has hidden 25,600 and 128 layers), low enough that a typo (steps: 1e15, gpus: 100000) is refused when
# the spec is submitted instead of failing on a worker, and every value fits the database's 32-bit columns.
LIMITS = {
    "model.hidden_size": 65_536, "model.intermediate_size": 262_144, "model.num_hidden_layers": 1_024,
    "model.num_attention_heads": 1_024, "model.num_key_value_heads": 1_024, "model.head_dim": 2_048,
    "model.max_position_embeddings": 1_048_576, "model.vocab_size": 1_048_576,
    "data.vocab_size": 1_048_576, "data.seq_len": 1_048_576,
    "training.steps": 10_000_000, "training.tokens": 10**14, "training.batch_size": 65_536,
    "training.grad_accum": 65_536, "training.warmup_steps": 10_000_000, "training.val_every": 10_000_000,
    "training.val_batches": 100_000, "training.checkpoint_every": 10_000_000, "training.numerics_every": 10_000_000,
    "training.gpus": 1_024, "training.nodes": 4_096, "spec.seed": 2**31 - 1, "spec.bf16_first_layers": 1_024, "spec.bf16_last_layers": 1_024,
}
DEFAULT_INT_LIMIT = 2**31 - 1  # any other integer: a 32-bit column's range


def _int(section: str, name: str, value, *, minimum: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SpecError(f"{section}.{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(f"{section}.{name} must be >= {minimum}, got {value}")
    maximum = LIMITS.get(f"{section}.{name}", DEFAULT_INT_LIMIT)
    if value > maximum:
        raise SpecError(f"{section}.{name} must be <= {maximum:,} (training.config.LIMITS), got {value:,}")
    return value


def _float(section: str, name: str, value, *, minimum: float | None = None, maximum: float | None = None,
           strict_min: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{section}.{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SpecError(f"{section}.{name} must be finite, got {value}")
    if minimum is not None and (value <= minimum if strict_min else value < minimum):
        raise SpecError(f"{section}.{name} must be {'>' if strict_min else '>='} {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{section}.{name} must be <= {maximum}, got {value}")
    return value


def _queue(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 64 or not all(
            c.isalnum() or c in "_.-" for c in value):
        raise SpecError(f"training.queue must be a queue name (letters, digits, '_', '.', '-'; at most 64), "
                        f"e.g. h100 or cpu, got {value!r}")
    return value


def _bool(section: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{section}.{name} must be true or false, got {value!r}")
    return value


def _optional_bool(section: str, name: str, value, auto: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise SpecError(f"{section}.{name} must be true, false or null ({auto}), got {value!r}")
    return value


def _tokenizer_source(value, init_from) -> str:
    if value is None:
        return "checkpoint" if init_from is not None else "train"
    if not isinstance(value, str) or not value:
        raise SpecError(f"data.tokenizer must be 'train', 'checkpoint' or a tokenizer folder / tokenizer.json path, "
                        f"got {value!r}")
    if value == "checkpoint" and init_from is None:
        raise SpecError("data.tokenizer 'checkpoint' takes the tokenizer of model.init_from, which is not set; set "
                        "model.init_from, or use 'train' or a tokenizer path")
    return value


def _text_field(value) -> str:
    if not isinstance(value, str) or not value or len(value) > 200:
        raise SpecError(f"data.text_field must be the name of the JSON field / column holding the text (e.g. "
                        f"'text'), got {value!r}")
    return value


def _optional_path(section: str, name: str, value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or value == RANDOM_CORPUS:
        raise SpecError(f"{section}.{name} must be a name under PLAB_DATA_DIR, a path or a glob, got {value!r}")
    return value


def _close_names(value: str) -> str:
    """'; did you mean ...?' for a corpus name that is a typo of one in the data directory, else ''."""
    import difflib

    try:
        if any(c in value for c in "/*?[") or not data_root().is_dir():
            return ""
        names = sorted(p.name for p in data_root().iterdir() if not p.name.startswith("."))
    except OSError:
        return ""
    close = difflib.get_close_matches(value, names, n=3)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _check_data_paths(data: DataSpec) -> None:
    """The corpus, validation corpus and tokenizer exist and are readable as what they claim to be."""
    from training.corpus import CorpusError

    for which in ("corpus", "val_corpus"):
        if getattr(data, which) is None:
            continue
        try:
            data.open_corpus(which)
        except CorpusError as exc:
            raise SpecError(f"{exc} (data directory: {data_root()}){_close_names(getattr(data, which))}") from None
    path = data.tokenizer_path()
    try:
        usable = path is None or (path.is_file() and path.suffix == ".json") or (
            (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file())
    except OSError as e:
        raise SpecError(f"data.tokenizer {str(path)[:300]!r} cannot be read: {e.strerror or e}") from None
    if not usable:
        raise SpecError(f"data.tokenizer {str(path)!r} is not a tokenizer folder (with tokenizer.json) or a "
                        f"tokenizer.json file; give one, or 'train' to train a BPE on the corpus")


def check_new_run_data(data: "DataSpec") -> None:
    """What a *new* run's data may not be, beyond what any spec is checked for (stored runs are not refused for
    it: their tokenizing reports it instead): a data.val_corpus that names a file of data.corpus."""
    if data.val_corpus is None or data.corpus == RANDOM_CORPUS:
        return
    from training.corpus import CorpusError, check_disjoint
    try:
        check_disjoint(data.open_corpus(), data.open_corpus("val_corpus"))
    except CorpusError as exc:
        raise SpecError(str(exc)) from None


@dataclass
class ModelSpec:
    """The model: a preset name, custom Llama dims (vocab_size None ⇒ taken from data.vocab_size), a local
    `config.json` of any transformers causal-LM architecture (`config`: randomly initialised from the run's
    seed) or a local Hugging Face checkpoint folder (`init_from`: its weights, for continued pre-training)."""
    preset: str | None = "tiny"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    config: str | None = None
    init_from: str | None = None

    @property
    def source(self) -> str:
        """Where the model comes from: "preset" (a preset or custom dims), "config" or "checkpoint"."""
        if self.init_from is not None:
            return "checkpoint"
        return "config" if self.config is not None else "preset"

    @classmethod
    def from_value(cls, value, *, check_paths: bool = False) -> "ModelSpec":
        if isinstance(value, str):
            if value not in MODEL_PRESET_NAMES:
                raise SpecError(f"unknown model preset {value!r}; use one of {list(MODEL_PRESET_NAMES)}, "
                                f"a dict with custom dims {list(CUSTOM_MODEL_KEYS)}, {{\"config\": PATH}} or "
                                f"{{\"init_from\": PATH}}")
            return cls(preset=value)
        if not isinstance(value, dict):
            raise SpecError(f"model must be a preset name or a dict of dims, got {value!r}")
        if any(k in value for k in MODEL_PATH_KEYS):
            return cls._from_path(value, check_paths=check_paths)
        _check_keys("model", value, CUSTOM_MODEL_KEYS)
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if value.get(k) is None]
        if missing:
            raise SpecError(f"custom model is missing {missing}; give all of {list(required)}")
        dims = {k: _int("model", k, value.get(k), minimum=1, allow_none=True) for k in CUSTOM_MODEL_KEYS}
        heads = dims["num_attention_heads"]
        kv = dims["num_key_value_heads"] or heads
        if dims["head_dim"] is None and dims["hidden_size"] % heads:
            raise SpecError(f"model.hidden_size ({dims['hidden_size']}) must be divisible by "
                            f"model.num_attention_heads ({heads}), or set model.head_dim explicitly")
        if heads % kv:
            raise SpecError(f"model.num_attention_heads ({heads}) must be a multiple of "
                            f"model.num_key_value_heads ({kv})")
        head_dim = dims["head_dim"] or dims["hidden_size"] // heads
        if head_dim % 2:
            raise SpecError(f"head dim {head_dim} must be even for rotary embeddings; change hidden_size, "
                            f"num_attention_heads or head_dim")
        dims["num_key_value_heads"] = kv
        if dims["vocab_size"] is not None and dims["vocab_size"] < 2:
            raise SpecError("model.vocab_size must be >= 2")
        return cls(preset=None, **dims)

    @classmethod
    def _from_path(cls, value: dict, *, check_paths: bool) -> "ModelSpec":
        """`{"config": PATH}` or `{"init_from": PATH}` (exactly one key): the model's dims come from the file."""
        given = [k for k in MODEL_PATH_KEYS if k in value]
        if len(value) != 1 or len(given) != 1:
            raise SpecError(f"model as a file takes exactly one key, 'config' (a config.json or a folder holding "
                            f"one: random initialisation) or 'init_from' (a checkpoint folder: its weights), and "
                            f"nothing else (the dims come from the file); got keys {sorted(value)}")
        key = given[0]
        path = value[key]
        if not isinstance(path, str) or not path.strip():
            raise SpecError(f"model.{key} must be a path (a string), got {path!r}")
        spec = cls(preset=None, **{key: path})
        if check_paths:
            try:
                spec.config_file() if key == "config" else spec.checkpoint_dir()
            except OSError as e:  # a name too long, no permission: the system's reason, not a traceback
                raise SpecError(f"model.{key} {path[:300]!r} cannot be read: {e.strerror or e}") from None
        return spec

    def _resolved(self, key: str) -> Path:
        """model.<key> as a path: confined to the allowed roots in a worker's job, else relative to the data
        directory unless absolute (like data.corpus)."""
        value = getattr(self, key)
        if os.environ.get(CONFINE_ENV) == "1":
            return confine(value, f"model.{key}", allowed_roots())
        p = Path(value)
        return p if p.is_absolute() else data_root() / p

    def config_file(self) -> Path:
        """The config.json that model.config names (the file itself, or the one in the folder it names)."""
        path = self._resolved("config")
        found = path / "config.json" if path.is_dir() else path
        if not found.is_file():
            raise SpecError(f"model.config {self.config!r}: {str(found)!r} does not exist; give a config.json "
                            f"(or a folder holding one) under PLAB_DATA_DIR ({data_root()}) or an absolute path")
        return found

    def checkpoint_dir(self) -> Path:
        """The Hugging Face checkpoint folder that model.init_from names, checked to hold a config and weights."""
        path = self._resolved("init_from")
        if not (path / "config.json").is_file():
            raise SpecError(f"model.init_from {self.init_from!r}: {str(path)!r} is not a Hugging Face checkpoint "
                            f"folder (no config.json in it); give the folder that from_pretrained would load")
        weights = [p for p in ("model.safetensors", "model.safetensors.index.json") if (path / p).is_file()]
        if not weights:
            raise SpecError(f"model.init_from {self.init_from!r}: no model.safetensors or "
                            f"model.safetensors.index.json in {str(path)!r}; the lab loads safetensors weights "
                            f"only (convert a pytorch_model.bin with save_pretrained(safe_serialization=True))")
        return path

    def to_value(self):
        if self.preset is not None:
            return self.preset
        for key in MODEL_PATH_KEYS:
            if getattr(self, key) is not None:
                return {key: getattr(self, key)}
        return {k: getattr(self, k) for k in CUSTOM_MODEL_KEYS}


TOKENIZER_SOURCES = ("train", "checkpoint")  # or a local tokenizer folder / tokenizer.json
# Where the validation windows lie in the validation split (training.data.TokenDataset.val_slots): "spread" evenly
# over it, or the "first" ones in a row - what every spec stored before data.val_windows existed ran with
# (training.checkpoint.numerics_identity, migration 0009 of the API's database).
VAL_WINDOW_RULES = ("spread", "first")
LEGACY_VAL_WINDOWS = "first"
# Data keys whose default changed when they were added: the value every spec stored before the key existed ran
# with (training.checkpoint.numerics_identity; migrations 0009 and 0010 of the API's database write them in).
LEGACY_DATA = {"val_windows": LEGACY_VAL_WINDOWS, "eos_at_split": False}


@dataclass
class DataSpec:
    corpus: str = "tinyshakespeare"
    vocab_size: int = 2048             # the vocabulary of a trained BPE (tokenizer "train") and of a preset model
    seq_len: int = 128
    val_fraction: float = 0.02
    # "train" (a byte-level BPE trained on the corpus), "checkpoint" (model.init_from's tokenizer; the default
    # when model.init_from is set) or a local tokenizer folder / tokenizer.json.
    tokenizer: str = "train"
    text_field: str = "text"           # the JSON field / table column holding a document's text
    val_corpus: str | None = None      # the validation documents; None: val_fraction of the corpus held out
    num_proc: int | None = None        # tokenizer processes; None: every core (the tokens do not depend on it)
    max_bad_fraction: float = 0.001    # unreadable lines (bad JSON, not UTF-8) skipped up to this fraction
    val_windows: str = "spread"        # VAL_WINDOW_RULES: where validation's windows lie in the validation split
    # A text file whose last val_fraction is held out: its training part ends with EOS (true), or runs on into the
    # next file's first token (false: how every spec stored before this key was tokenized; training.shards).
    eos_at_split: bool = True

    def corpus_dir(self) -> Path | None:
        """The corpus path (a folder, a file or a glob), or None for the synthetic "random" corpus."""
        if self.corpus == RANDOM_CORPUS:
            return None
        return _user_path(self.corpus, "data.corpus")

    def open_corpus(self, which: str = "corpus"):
        """The training.corpus.Corpus of `data.corpus` (or of `data.val_corpus`: which="val_corpus"): a name
        under the data directory, a path or a glob; in a worker's job every file confined to the allowed roots."""
        from training.corpus import Corpus, is_glob, list_corpus_files
        value, field_name = getattr(self, which), f"data.{which}"
        if is_glob(value):
            pattern = value if Path(value).is_absolute() else str(data_root() / value)
            files = list_corpus_files(Path(pattern), field=field_name)
            if os.environ.get(CONFINE_ENV) == "1":
                files = [confine(str(p), field_name, allowed_roots()) for p in files]
            return Corpus(files, self.text_field)
        path = _user_path(value, field_name)
        return Corpus(list_corpus_files(path, field=field_name), self.text_field,
                      folder=path if path.is_dir() else None)

    def tokenizer_path(self) -> Path | None:
        """The tokenizer folder or file `data.tokenizer` names, or None for "train" / "checkpoint"."""
        return None if self.tokenizer in TOKENIZER_SOURCES else _user_path(self.tokenizer, "data.tokenizer")


def _user_path(value: str, field_name: str) -> Path:
    """A name under the data directory or a path; confined to the allowed roots in a worker's job."""
    if os.environ.get(CONFINE_ENV) == "1":
        return confine(value, field_name, allowed_roots())
    p = Path(value)
    return p if p.is_absolute() else data_root() / p


@dataclass
class PerfOptions:
    """Throughput switches (each one A/B-testable by bench/train_bench.py). Defaults are the fast path."""
    # Cross-entropy over vocabulary chunks inside a custom autograd function: never materialises the
    # full (tokens x vocab) FP32 logits, which for 8192 tokens x 32000 is 1 GiB written and read back.
    fused_loss: bool = True
    loss_chunk_tokens: int = 2048
    # How the fused loss forms the LM head's weight gradient (training.model._ChunkedLinearCrossEntropy):
    # "one_gemm" one GEMM over every token after the last chunk (FP32 accumulation inside the GEMM, one rounding,
    # as the unfused backward; a tokens x vocab buffer in BF16 while the loss runs: 0.5 GiB at 8192 x 32000, 4 GiB
    # at 16384 x 128256); "per_chunk" a GEMM per chunk added to an FP32 accumulator (no such buffer; a pass over the
    # accumulator per chunk, ~1 ms a step at 32000 x 2048 and 4 chunks: bench/NOTES_floor.md 72).
    # "auto" (the default): per_chunk where the run checkpoints activations (it trades time for memory already),
    # else one_gemm.
    loss_weight_grad: str = "auto"
    # RoPE's backward on the fused QKV projection's output (fuse_qkv; training.rope_triton): "one_pass" one Triton
    # pass forms the projection's dY = [RoPE⁻¹(dQ) | RoPE⁻¹(dK) | dV] (the torch reference on a CPU), bit for bit
    # inductor's values; "compiled" leaves RoPE's backward and the concatenation to the compiler (one flat kernel,
    # 1.8x its bytes on an H100: bench/NOTES_floor.md 61, 75). "auto" (the default): one_pass on a GPU where that
    # keeps the compiled path's values (bf16, mxfp8: training.rope_triton.auto_one_pass), compiled where inductor
    # fuses RoPE's backward into an FP8 cast of dY (fp8_tensorwise, fp8_rowwise; fp8_delayed has fused_qkv_rope) or
    # the projection's epilogue into RoPE's forward (nvfp4's emulated per-tensor scale).
    rope_backward: str = "auto"
    # SDPA backend: "auto" lets PyTorch choose; "cudnn" / "flash" / "efficient" / "math" pin one.
    sdpa_backend: str = "auto"
    # torch.compile mode (None = default). "max-autotune-no-cudagraphs" spends more compile time.
    compile_mode: str | None = None
    # Steps between issuing an async metric copy and reading it on the host (GPU only).
    metrics_lag: int = 2
    # Background thread that pins and copies the next batch to the GPU (GPU only).
    prefetch: bool = True
    # Gradient clipping folded into the fused AdamW kernel (its `grad_scale` divides each gradient as it
    # is read) instead of clip_grad_norm_'s extra pass that multiplies every FP32 gradient in place:
    # saves a read and a write of all gradients (~9 GB per step at 1.14B params, ~3 ms on H100).
    fused_clip: bool = True
    # Carry the residual stream in BF16 on GPU (Megatron's default, fp32_residual_connection=False).
    # Under autocast HF Llama's residual adds promote to FP32 (FP32 embeddings + BF16 block outputs), so
    # every add/norm moves twice the bytes of a BF16 stack. Off by default: it changes the baseline's
    # numerics (weights stay FP32 masters either way).
    bf16_residual: bool = False
    # One GEMM for Q, K and V (training.model.fuse_qkv; recipes then scale the fused weight as one tensor,
    # like Transformer Engine's linear_qkv). None = on for GPU runs, off on CPU. HF checkpoints keep
    # separate q/k/v weights either way.
    fuse_qkv: bool | None = None
    # One GEMM for the MLP's gate and up projections (training.model.fuse_gate_up; Megatron's linear_fc1, the
    # `mlp_up` shape of the GEMM benchmark): the MLP input is quantized once, and recipes scale the fused
    # weight as one tensor. Off until measured end to end on a GPU. HF checkpoints keep gate/up separate.
    fuse_gate_up: bool = False
    # GPU runs with BF16 parameters: the optimizer step runs on a side CUDA stream, layer by layer in forward
    # order, while the next step's forward proceeds behind per-layer events (training.optim.
    # OverlappedOptimizerStep; under FSDP2 training.parallel.OverlappedShardedStep). None (auto): overlapped
    # under FSDP2 only, and not on one process where fsdp_one_rank_direct applies. Without FSDP2, on one H100 or
    # DDP on two, the overlapped step was never faster in any recipe measured (cuBLAS's persistent GEMMs hold
    # every SM, so the update's programs run between the products, not beside them; an overlapped FP8 DDP step
    # was host-bound, 0.90x) and reserved 2-3 GiB more on one GPU (setup.overlap_update, bench/NOTES_floor.md 32,
    # 36, 39).
    overlap_optimizer: bool | None = None
    # FSDP2 on one process with the overlapped update: each next unit unsharded ahead (cast + copy of its
    # shards) on a prefetch stream, beside the current unit's forward, instead of on the compute stream in
    # its own pre-forward (training.parallel.OverlappedShardedStep). No effect elsewhere.
    fsdp_prefetch: bool = True
    # FSDP2 on one process: each unshard casts the FP32 shard straight into the BF16 unsharded parameter (6 B per
    # parameter) instead of casting it into a new tensor and copying that (10 B; training.parallel.
    # one_rank_cast_into_output, same bits). No effect elsewhere.
    fsdp_fused_cast: bool = True
    # FSDP2 on one process, with the update after the backward: the one-rank group keeps its BF16 unsharded
    # parameters and gradients from step to step, as the unwrapped run keeps its BF16 parameters, instead of
    # packing the gradients into FP32 and casting every shard again before each forward (~12 B per parameter
    # per step that nothing needs at one rank). The update reads the BF16 gradients and writes the FP32 shard and
    # the BF16 parameter in one pass (training.parallel.OneRankDirectStep, same bits as FSDP2's path). Not with
    # torchao's FP8 all-gather or an overlapped update (those keep FSDP2's path). No effect on several processes.
    # Memory: both hold 16 B per parameter after the backward, but through the forward this path already holds the
    # BF16 weights (+2 B per parameter at the activations' peak); false where that peak is what does not fit.
    fsdp_one_rank_direct: bool = True
    # FSDP2: whether each block frees its gathered weights after its forward and gathers them again for its backward
    # (torch's default, "always"), or keeps them to the backward ("never": half the all-gathers, and with FP8
    # all-gather half the weight casts, for the memory of every block's gathered BF16 weights). "auto": keep them on
    # one process, and on a GPU where every block's BF16 weights take under a tenth of its memory (a 1.14B model on
    # 4 x H200 ran fp8_tensorwise host-bound at 0.80x BF16 with "always", bench/results/*_1b_x4_*); else "always".
    # The last block keeps its weights in every mode (the backward needs them at once).
    fsdp_reshard_after_forward: str = "auto"
    # How MasterAdamW updates a bucket (training.optim): "auto" (one Triton kernel launch per bucket on CUDA,
    # the eager update op for op; eager on CPU), "triton", "compiled" (torch.compile: one inductor kernel per
    # parameter, the update before the Triton kernel existed) or "eager".
    optimizer_update: str = "auto"
    # How FSDP2's overlapped update steps the FP32 shards (training.parallel.LocalFusedAdamW): "auto" (the Triton
    # kernel training.optim_kernels.adamw_shard_update on CUDA: torch's fused AdamW arithmetic without storing the
    # clipped gradients back, 28 B per parameter instead of 32; torch's fused AdamW on CPU) or "torch"
    # (`torch._fused_adamw_`, what `optimizer.step()` runs, everywhere).
    shard_update: str = "auto"
    # torch.compile granularity: "model" (one graph with the loss), "layers" (each decoder layer, plus the
    # loss's chunk math), "auto" = "layers" on a GPU (faster there with or without the overlapped step), else
    # "model".
    compile_scope: str = "auto"
    # TF32 for any FP32 matmul left (e.g. outside autocast); BF16 autocast GEMMs are unaffected.
    allow_tf32: bool = True
    # Multi-GPU (DDP) gradient buckets: size in MiB of each all-reduce and DDP's static_graph (the same
    # parameters get gradients in the same order every step). 100 MiB, not torch's 25: on 2 x H200 (1.14B,
    # BF16 gradients) 25 MiB buckets gave 1.54-1.76x one GPU, 100 MiB 1.85x (bench/results/*scaling*).
    ddp_bucket_mb: int = 100
    ddp_static_graph: bool = False
    # GPU runs: Python's cyclic GC frozen after the first step and run every N steps instead of whenever its
    # allocation counters say (0 = leave it automatic). See train.py.
    gc_interval: int = 100
    # transformers checks, on every forward without an attention mask, whether the position ids hold packed
    # sequences, with an `.all()` that waits for the GPU (the host cannot run ahead into the next step). The
    # lab's batches never carry position ids (the model makes 0..T-1), so the answer is known: give it without
    # the sync (training.model.CausalLMLoss). Same numbers either way.
    sync_free_mask: bool = True
    # With gradient accumulation: the emulated linears quantize each weight once per optimizer step instead of
    # once per micro-batch (training.precision.weight_reuse; same bits): MXFP8's fused GPU quantizer, and any
    # emulated recipe in an uncompiled run. Not under FSDP2. Holds a quantized copy of those weights.
    reuse_quantized_weights: bool = True
    # cuBLASLt's workspace in this process (torch's CUBLASLT_WORKSPACE_SIZE, set before the run's first GEMM by
    # training.setup.configure_cublaslt_workspace): "default" torch's; "none" no workspace, where cuBLASLt runs the
    # same FP8 kernels in variants that need no memset before each call (with one, ~190 memsets a step sat before
    # fp8_delayed's GEMMs, each followed by idle GPU): fp8_delayed 87.4 against 88.8 ms a step, fp8_tensorwise 96.7
    # against 97.3 on an H100. The variants' products differ in the last bits (another summation order), so an FP8
    # run's losses differ from the default's after a few steps, as two runs of the same code on a GPU do (cuDNN's
    # attention backward).
    # "auto" (the default): the recipe's catalog entry says (RecipeEntry.cublaslt_workspace) where its real kernels
    # run: "none" for fp8_delayed and fp8_tensorwise on an sm_89+ GPU, whose loss curves stay within the run-to-run
    # spread of their own repeats (bench/curve_ab.py, 4 runs against 2 on an H100, permutation p = 0.87 and 0.67;
    # bench/NOTES_floor.md 67, 69); "default" for every other recipe, and where a recipe runs emulated.
    # A CUBLASLT_WORKSPACE_SIZE in the environment wins.
    cublaslt_workspace: str = "auto"

    SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
    LOSS_WEIGHT_GRADS = ("auto", "one_gemm", "per_chunk")
    ROPE_BACKWARDS = ("auto", "one_pass", "compiled")
    CUBLASLT_WORKSPACES = ("auto", "default", "none")
    COMPILE_SCOPES = ("auto", "model", "layers")
    OPTIMIZER_UPDATES = ("auto", "triton", "compiled", "eager")
    SHARD_UPDATES = ("auto", "torch")
    FSDP_RESHARD = ("auto", "always", "never")


PARAM_DTYPES = ("auto", "bf16", "fp32")
PARALLEL_MODES = ("auto", "ddp", "fsdp")          # training.parallel.PARALLEL_MODES
AC_MODES = ("none", "full", "blocks", "ops")      # training.parallel.AC_MODES


def _ac_mode(value) -> str:
    """training.activation_checkpointing: one of AC_MODES, or true/false (older specs) for "full"/"none"."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return _choice("training", "activation_checkpointing", value, AC_MODES)


def _choice(section: str, key: str, value, choices) -> str:
    if value not in choices:
        raise SpecError(f"{section}.{key} must be one of {list(choices)}, got {value!r}")
    return value


@dataclass
class TrainingSpec:
    steps: int | None = 200
    tokens: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    val_every: int = 50
    val_batches: int = 4
    checkpoint_every: int = 0
    compile: bool = False
    # "none" | "full" | "blocks" (every k-th block, k = activation_checkpointing_every) | "ops" (every block,
    # matmul and attention outputs kept); true/false are read as "full"/"none". training.parallel explains.
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 2
    # "ddp" | "fsdp" | "auto" (FSDP when the training state would not fit comfortably on one GPU); see
    # training.parallel.
    parallel: str = "auto"
    # Where the initial weights are drawn: "cpu" (default; the same weights on any machine, so every recipe
    # and hardware starts from one point) or "device" (on the GPU, from the same seed: the same weights for
    # every recipe on one kind of GPU, tens of times faster for multi-billion-parameter models).
    init_device: str = "cpu"
    # Parameter dtype. "bf16": BF16 parameters for compute, FP32 master weights and FP32 moments in the
    # optimizer (training.optim.MasterAdamW). "fp32": FP32 parameters, forward/backward under BF16 autocast
    # on GPU (plain FP32 on CPU). "auto": bf16 on GPU, fp32 on CPU.
    param_dtype: str = "auto"
    numerics_every: int = 0
    device: str = "auto"
    gpus: int = 1                      # processes (GPUs) per node
    nodes: int = 1                     # hosts; more than one needs a Slurm worker (workers/slurm.py)
    # The worker queue the job goes to (the hardware it asks for, e.g. "h100", "cpu"; None: "default"). Only
    # the dispatcher reads it; it does not change what is trained.
    queue: str | None = None
    perf: PerfOptions = field(default_factory=PerfOptions)


# An experiment's recipe entry ({name, options, bf16_first_layers, ...}) and where a run spec keeps each field.
_ENTRY_FIELDS_IN_A_RUN_SPEC = {"name": "recipe", "options": "recipe_options", "bf16_first_layers": "bf16_first_layers",
                               "bf16_last_layers": "bf16_last_layers", "keep_bf16": "keep_bf16"}


def recipe_entry_hint(entry: dict) -> str:
    """The error for a run spec whose `recipe` is a mapping (an experiment's recipe entry pasted in): what the run
    spec says instead, spelled from the entry's own fields."""
    import json

    names = ", ".join(catalog.recipe_names())
    moved, dropped = [], []
    entry = dict(entry)
    options = entry.get("options")
    if isinstance(options, dict):  # the layer choices are run-spec keys of their own, not recipe options
        layer_keys = [k for k in options if k in catalog.LAYER_CHOICES]
        entry["options"] = {k: v for k, v in options.items() if k not in layer_keys}
        entry.update({k: options[k] for k in layer_keys if k not in entry})
        if not entry["options"]:
            del entry["options"]
    for key, value in entry.items():
        target = _ENTRY_FIELDS_IN_A_RUN_SPEC.get(key)
        if target is None:
            dropped.append(str(key))
            continue
        try:
            shown = json.dumps(value)
        except (TypeError, ValueError):
            shown = repr(value)
        moved.append(f"{target}: {shown[:200]}")
    message = (f"recipe must be a recipe name (one of {names}), got a mapping; a run spec gives an experiment's "
               f"recipe entry as top-level keys: recipe (its name), recipe_options (its options), "
               f"bf16_first_layers, bf16_last_layers, keep_bf16")
    if moved:
        message += f" - here: {', '.join(moved)}"
    if dropped:
        shown = ", ".join(k[:50] for k in sorted(dropped)[:10]) + (" ..." if len(dropped) > 10 else "")
        message += (f"; {shown} belong(s) to an experiment's entry only (a run spec has one top-level seed and no "
                    f"label)")
    return message


@dataclass
class RunSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    seed: int = 0
    recipe: str = "bf16"
    recipe_options: dict = field(default_factory=dict)
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    # Glob patterns (fnmatch, over the conversion report's names such as "layers.3.mlp.gate") of block
    # linears the recipe leaves in BF16, e.g. ["*.mlp.gate"] for an MoE router.
    keep_bf16: list = field(default_factory=list)

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: a custom model's vocab_size when set, else data.vocab_size."""
        return self.model.vocab_size or self.data.vocab_size

    @property
    def tokens_per_step(self) -> int:
        return self.training.batch_size * self.data.seq_len

    @property
    def total_steps(self) -> int:
        if self.training.steps is not None:
            return self.training.steps
        return math.ceil(self.training.tokens / self.tokens_per_step)

    # ---- (de)serialisation --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, *, check_paths: bool = True) -> "RunSpec":
        """Parse and validate; `check_paths=False` skips the corpus-exists check (e.g. on an API host
        that does not hold the data)."""
        top_keys = [f.name for f in fields(cls)]
        _check_keys("run spec", d, top_keys)
        model = ModelSpec.from_value(d.get("model", "tiny"), check_paths=check_paths)
        data = cls._parse_data(d.get("data", {}), check_paths=check_paths,
                               init_from=getattr(model, "init_from", None))
        training = cls._parse_training(d.get("training", {}))
        seed = _int("spec", "seed", d.get("seed", 0), minimum=0)
        recipe = d.get("recipe", catalog.BASELINE)
        recipe_options = d.get("recipe_options", {}) or {}
        if not isinstance(recipe_options, dict):
            raise SpecError(f"recipe_options must be an object, got {recipe_options!r}")
        if isinstance(recipe, dict):
            raise SpecError(recipe_entry_hint(recipe))
        try:
            entry = catalog.get(recipe)
        except catalog.RecipeError as exc:
            raise SpecError(str(exc)) from None
        try:
            # Validated only: the spec keeps the options as given (the recipe fills in its defaults at run time).
            entry.resolve_options(recipe_options)
        except catalog.RecipeError as exc:
            raise SpecError(f"recipe_options: {exc}") from None
        first = _int("spec", "bf16_first_layers", d.get("bf16_first_layers", 0), minimum=0)
        last = _int("spec", "bf16_last_layers", d.get("bf16_last_layers", 0), minimum=0)
        spec = cls(model=model, data=data, training=training, seed=seed, recipe=recipe,
                   recipe_options=dict(recipe_options), bf16_first_layers=first, bf16_last_layers=last,
                   keep_bf16=keep_bf16_patterns(d.get("keep_bf16", [])))
        spec._cross_check()
        return spec

    @staticmethod
    def _parse_data(d: dict, *, check_paths: bool, init_from=None) -> DataSpec:
        _check_keys("data", d, [f.name for f in fields(DataSpec)])
        base = DataSpec()
        corpus = d.get("corpus", base.corpus)
        if not isinstance(corpus, str) or not corpus:
            raise SpecError(f"data.corpus must be a name under PLAB_DATA_DIR, a path or a glob, got {corpus!r}")
        out = DataSpec(
            corpus=corpus,
            vocab_size=_int("data", "vocab_size", d.get("vocab_size", base.vocab_size), minimum=2),
            seq_len=_int("data", "seq_len", d.get("seq_len", base.seq_len), minimum=8),
            val_fraction=_float("data", "val_fraction", d.get("val_fraction", base.val_fraction),
                                minimum=0.0, maximum=0.5, strict_min=True),
            tokenizer=_tokenizer_source(d.get("tokenizer"), init_from),
            text_field=_text_field(d.get("text_field", base.text_field)),
            val_corpus=_optional_path("data", "val_corpus", d.get("val_corpus")),
            num_proc=_int("data", "num_proc", d.get("num_proc"), minimum=1, allow_none=True),
            max_bad_fraction=_float("data", "max_bad_fraction", d.get("max_bad_fraction", base.max_bad_fraction),
                                    minimum=0.0, maximum=1.0),
            val_windows=_choice("data", "val_windows", d.get("val_windows", base.val_windows), VAL_WINDOW_RULES),
            eos_at_split=_bool("data", "eos_at_split", d.get("eos_at_split", base.eos_at_split)),
        )
        if corpus != RANDOM_CORPUS:
            if out.tokenizer == "train" and out.vocab_size < 300:
                raise SpecError(f"data.vocab_size must be >= 300 for a byte-level BPE (256 byte tokens + "
                                f"merges + special), got {out.vocab_size}")
            if check_paths:
                _check_data_paths(out)
        return out

    @staticmethod
    def _parse_perf(perf_d: dict) -> PerfOptions:
        _check_keys("training.perf", perf_d, [f.name for f in fields(PerfOptions)])
        pbase = PerfOptions()
        sdpa = perf_d.get("sdpa_backend", pbase.sdpa_backend)
        if sdpa not in PerfOptions.SDPA_BACKENDS:
            raise SpecError(f"training.perf.sdpa_backend must be one of {list(PerfOptions.SDPA_BACKENDS)}, "
                            f"got {sdpa!r}")
        mode = perf_d.get("compile_mode", pbase.compile_mode)
        if mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise SpecError(f"training.perf.compile_mode {mode!r} is not a torch.compile mode")
        if perf_d.get("rope_backward") == "one_pass" and perf_d.get("fuse_qkv") is False:
            raise SpecError("training.perf.rope_backward: one_pass runs RoPE's backward on the fused QKV projection's "
                            "output, and training.perf.fuse_qkv is false; set fuse_qkv to true (or leave it out: on "
                            "for GPU runs), or rope_backward to auto")
        return PerfOptions(
            fused_loss=_bool("training.perf", "fused_loss", perf_d.get("fused_loss", pbase.fused_loss)),
            loss_chunk_tokens=_int("training.perf", "loss_chunk_tokens",
                                   perf_d.get("loss_chunk_tokens", pbase.loss_chunk_tokens), minimum=1),
            sdpa_backend=sdpa, compile_mode=mode,
            metrics_lag=_int("training.perf", "metrics_lag", perf_d.get("metrics_lag", pbase.metrics_lag),
                             minimum=0),
            prefetch=_bool("training.perf", "prefetch", perf_d.get("prefetch", pbase.prefetch)),
            allow_tf32=_bool("training.perf", "allow_tf32", perf_d.get("allow_tf32", pbase.allow_tf32)),
            fused_clip=_bool("training.perf", "fused_clip", perf_d.get("fused_clip", pbase.fused_clip)),
            overlap_optimizer=_optional_bool("training.perf", "overlap_optimizer", perf_d.get("overlap_optimizer"),
                                             "auto: overlapped under FSDP2 only, not on its one-rank direct path"),
            fsdp_prefetch=_bool("training.perf", "fsdp_prefetch", perf_d.get("fsdp_prefetch", pbase.fsdp_prefetch)),
            fsdp_fused_cast=_bool("training.perf", "fsdp_fused_cast",
                                  perf_d.get("fsdp_fused_cast", pbase.fsdp_fused_cast)),
            fsdp_one_rank_direct=_bool("training.perf", "fsdp_one_rank_direct",
                                       perf_d.get("fsdp_one_rank_direct", pbase.fsdp_one_rank_direct)),
            fsdp_reshard_after_forward=_choice("training.perf", "fsdp_reshard_after_forward", perf_d.get(
                "fsdp_reshard_after_forward", pbase.fsdp_reshard_after_forward), PerfOptions.FSDP_RESHARD),
            compile_scope=_choice("training.perf", "compile_scope", perf_d.get("compile_scope", pbase.compile_scope),
                                  PerfOptions.COMPILE_SCOPES),
            optimizer_update=_choice("training.perf", "optimizer_update", perf_d.get(
                "optimizer_update", pbase.optimizer_update), PerfOptions.OPTIMIZER_UPDATES),
            shard_update=_choice("training.perf", "shard_update", perf_d.get("shard_update", pbase.shard_update),
                                 PerfOptions.SHARD_UPDATES),
            fuse_qkv=_optional_bool("training.perf", "fuse_qkv", perf_d.get("fuse_qkv"),
                                    "auto: on for GPU runs, off on CPU"),
            fuse_gate_up=_bool("training.perf", "fuse_gate_up", perf_d.get("fuse_gate_up", pbase.fuse_gate_up)),
            bf16_residual=_bool("training.perf", "bf16_residual",
                                perf_d.get("bf16_residual", pbase.bf16_residual)),
            ddp_bucket_mb=_int("training.perf", "ddp_bucket_mb", perf_d.get("ddp_bucket_mb", pbase.ddp_bucket_mb),
                               minimum=1),
            ddp_static_graph=_bool("training.perf", "ddp_static_graph",
                                   perf_d.get("ddp_static_graph", pbase.ddp_static_graph)),
            gc_interval=_int("training.perf", "gc_interval", perf_d.get("gc_interval", pbase.gc_interval),
                             minimum=0),
            sync_free_mask=_bool("training.perf", "sync_free_mask",
                                 perf_d.get("sync_free_mask", pbase.sync_free_mask)),
            reuse_quantized_weights=_bool("training.perf", "reuse_quantized_weights",
                                          perf_d.get("reuse_quantized_weights", pbase.reuse_quantized_weights)),
            cublaslt_workspace=_choice("training.perf", "cublaslt_workspace", perf_d.get(
                "cublaslt_workspace", pbase.cublaslt_workspace), PerfOptions.CUBLASLT_WORKSPACES),
            loss_weight_grad=_choice("training.perf", "loss_weight_grad", perf_d.get(
                "loss_weight_grad", pbase.loss_weight_grad), PerfOptions.LOSS_WEIGHT_GRADS),
            rope_backward=_choice("training.perf", "rope_backward", perf_d.get(
                "rope_backward", pbase.rope_backward), PerfOptions.ROPE_BACKWARDS),
        )

    @staticmethod
    def _parse_training(d: dict) -> TrainingSpec:
        _check_keys("training", d, [f.name for f in fields(TrainingSpec)])
        base = TrainingSpec()
        s = "training"
        steps_given = d.get("steps") is not None
        tokens_given = d.get("tokens") is not None
        if steps_given and tokens_given:
            raise SpecError("set exactly one of training.steps and training.tokens (the other must be null "
                            "or absent)")
        steps = _int(s, "steps", d["steps"], minimum=1) if steps_given else None
        tokens = _int(s, "tokens", d["tokens"], minimum=1) if tokens_given else None
        if steps is None and tokens is None:
            steps = base.steps
        device = d.get("device", base.device)
        if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
            raise SpecError(f"training.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        perf = RunSpec._parse_perf(d.get("perf", {}) or {})
        out = TrainingSpec(
            steps=steps, tokens=tokens,
            batch_size=_int(s, "batch_size", d.get("batch_size", base.batch_size), minimum=1),
            grad_accum=_int(s, "grad_accum", d.get("grad_accum", base.grad_accum), minimum=1),
            lr=_float(s, "lr", d.get("lr", base.lr), minimum=0.0, strict_min=True),
            warmup_steps=_int(s, "warmup_steps", d.get("warmup_steps", base.warmup_steps), minimum=0),
            min_lr_ratio=_float(s, "min_lr_ratio", d.get("min_lr_ratio", base.min_lr_ratio), minimum=0.0,
                                maximum=1.0),
            weight_decay=_float(s, "weight_decay", d.get("weight_decay", base.weight_decay), minimum=0.0),
            beta1=_float(s, "beta1", d.get("beta1", base.beta1), minimum=0.0, maximum=0.999999),
            beta2=_float(s, "beta2", d.get("beta2", base.beta2), minimum=0.0, maximum=0.999999),
            grad_clip=_float(s, "grad_clip", d.get("grad_clip", base.grad_clip), minimum=0.0),
            val_every=_int(s, "val_every", d.get("val_every", base.val_every), minimum=0),
            val_batches=_int(s, "val_batches", d.get("val_batches", base.val_batches), minimum=0),
            checkpoint_every=_int(s, "checkpoint_every", d.get("checkpoint_every", base.checkpoint_every),
                                  minimum=0),
            compile=_bool(s, "compile", d.get("compile", base.compile)),
            activation_checkpointing=_ac_mode(d.get("activation_checkpointing", base.activation_checkpointing)),
            activation_checkpointing_every=_int(s, "activation_checkpointing_every",
                                                d.get("activation_checkpointing_every",
                                                      base.activation_checkpointing_every), minimum=1),
            parallel=_choice(s, "parallel", d.get("parallel", base.parallel), PARALLEL_MODES),
            init_device=_choice(s, "init_device", d.get("init_device", base.init_device), ("cpu", "device")),
            param_dtype=_choice(s, "param_dtype", d.get("param_dtype", base.param_dtype), PARAM_DTYPES),
            numerics_every=_int(s, "numerics_every", d.get("numerics_every", base.numerics_every), minimum=0),
            device=device,
            gpus=_int(s, "gpus", d.get("gpus", base.gpus), minimum=1),
            nodes=_int(s, "nodes", d.get("nodes", base.nodes), minimum=1),
            queue=_queue(d.get("queue")),
            perf=perf,
        )
        return out

    def _cross_check(self) -> None:
        t = self.training
        per_step_split = t.grad_accum * t.gpus * t.nodes
        if t.batch_size % per_step_split:
            nodes = " x nodes" if t.nodes > 1 else ""
            raise SpecError(f"training.batch_size ({t.batch_size}) must be divisible by grad_accum x gpus{nodes} "
                            f"({per_step_split}): it is the global batch")
        if self.training.warmup_steps > self.total_steps:
            default = ", the default" if t.warmup_steps == TrainingSpec.warmup_steps else ""
            raise SpecError(f"training.warmup_steps ({t.warmup_steps}{default}) exceeds the run length "
                            f"({self.total_steps} steps); set training.warmup_steps to at most {self.total_steps} "
                            f"(e.g. {max(1, self.total_steps // 10)}, a tenth of the run)")
        if self.model.preset is None:
            layers = self.model.num_hidden_layers
        else:
            layers = MODEL_PRESETS[self.model.preset]["num_hidden_layers"]
        # A model given by a file is checked against its blocks when it is built (apply_recipe).
        if layers is not None and self.bf16_first_layers + self.bf16_last_layers > layers:
            raise SpecError(f"bf16_first_layers + bf16_last_layers ({self.bf16_first_layers} + "
                            f"{self.bf16_last_layers}) exceeds the model's {layers} layers")
        if self.model.vocab_size is not None and self.data.corpus != RANDOM_CORPUS \
                and self.data.tokenizer == "train" and self.model.vocab_size < self.data.vocab_size:
            raise SpecError(f"model.vocab_size ({self.model.vocab_size}) is smaller than data.vocab_size "
                            f"({self.data.vocab_size}); drop model.vocab_size or raise it")

    def to_dict(self) -> dict[str, Any]:
        training = asdict(self.training)
        return {
            "model": self.model.to_value(),
            "data": asdict(self.data),
            "training": training,
            "seed": self.seed,
            "recipe": self.recipe,
            "recipe_options": dict(self.recipe_options),
            "bf16_first_layers": self.bf16_first_layers,
            "bf16_last_layers": self.bf16_last_layers,
            # Only when set: specs stored (and checkpoints written) before the option existed stay equal.
            **({"keep_bf16": list(self.keep_bf16)} if self.keep_bf16 else {}),
        }
