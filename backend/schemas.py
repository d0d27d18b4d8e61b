"""Pydantic schemas at the edge of the API: what comes in is validated here, what goes out is shaped here."""
from __future__ import annotations

import functools
import json
import math
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Tag as UnionTag
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, TypeAdapter,
                      WithJsonSchema, computed_field, field_validator, model_validator)

from training.evaluation.limits import MAX_EVAL_DOCS, document_limit
from training.precision import catalog


def _utc(value: datetime) -> datetime:
    """Stored times are UTC; SQLite hands them back without a zone, which an ISO date-time must carry."""
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


UtcDatetime = Annotated[datetime, AfterValidator(_utc)]

MAX_POINTS_PER_BATCH = 10_000
METRIC_KEY_PATTERN = r"^[A-Za-z0-9_./:\-\[\]]+$"
Status = Literal["queued", "running", "succeeded", "failed", "cancelled", "diverged"]


MAX_JSON_BYTES = 1 << 20  # a stored free-form JSON field (summary, report, progress, result): 1 MiB serialized
INT32_MAX = 2**31 - 1  # the database's Integer columns
BIGINT_MAX = 2**63 - 1
# The bound stated for counts in BIGINT columns and stored JSON (a progress step, a GEMM dimension): 2^53, every
# integer up to it exact as a double (2^63 - 1 is not: as a JSON Schema bound it reads as 2^63, past the column, and
# clients that hold numbers as doubles, JavaScript's included, cannot tell integers near it apart).
BIG = 2**53


NO_NUL_PATTERN = "^[^\\u0000]*$"  # what the OpenAPI document states of every string a request body types


def _refuse_nul(value, where: str = "body", free: frozenset[str] = frozenset()) -> None:
    """PostgreSQL text cannot hold NUL: a NUL in any string of a request is refused (422) before it reaches a column.
    `free` names the top-level fields of free-form JSON (stored in `json` columns, which keep `\\u0000` escapes as
    written and hand them back): a NUL inside those is stored like any other character."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where} contains a NUL character (\\u0000), which cannot be stored; remove it")
    elif isinstance(value, dict):
        for k, v in value.items():
            _refuse_nul(k, where)
            if k not in free:
                _refuse_nul(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_nul(v, f"{where}[{i}]")


def _integral(value):
    """JSON Schema's "integer" admits a number without a fractional part (`3.0`): taken as the integer."""
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


# A seed inside a list (a model's own integer fields get the same treatment from Strict below).
Seed = Annotated[int, Field(ge=0, le=2**31 - 1), BeforeValidator(_integral)]


def capped_json(value: dict | None, field: str) -> dict | None:
    """Free-form JSON the API stores is capped at MAX_JSON_BYTES serialized."""
    if value is None:
        return value
    size = len(json.dumps(value))  # NaN stays allowed here: the services store it as null
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{field} is {size:,} bytes of JSON, over the {MAX_JSON_BYTES:,}-byte limit; store less "
                         "(large results belong in files, with their path in an artifact)")
    return value


class Strict(BaseModel):
    """Every request body: unknown fields refused, no type coercion (`"1.5"` or `true` is not a number, an integer
    is still a valid float, and a float without a fractional part such as `3.0` a valid integer, as JSON Schema's
    "integer" says), no NUL characters in strings (free-form JSON fields, named in `free_json`, may hold them)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    free_json: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data):
        _refuse_nul(data, free=cls.free_json)
        if isinstance(data, dict):
            for name in _integer_fields(cls):
                value = data.get(name)
                if type(value) is float and math.isfinite(value) and value.is_integer():
                    data = {**data, name: int(value)}
        return data


@functools.cache
def _integer_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model` typed int or int | None (their JSON names); once per model (it runs for every point
    of a metric batch)."""
    import typing

    out = []
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        if int in args and float not in args and bool not in args:
            out.append(field.alias or name)
    return tuple(out)


def _recipe_field_doc() -> str:
    return "one of " + ", ".join(catalog.recipe_names()) + " (GET /api/v1/recipes describes each)"


OPTIONS_DOC = "the recipe's options (GET /api/v1/recipes lists each with its type, default and allowed values)"


def check_recipe(name: str, options: dict[str, Any]) -> None:
    """ValueError (a 422 at the API) unless the catalog knows the recipe and accepts its options; the stored
    options stay as given."""
    catalog.get(name).resolve_options(options)


# Not blank (Python's str.strip() would leave something) and no NUL: spelled out, for every regex dialect agrees on it.
_BLANK = "\\t-\\r \\u001c-\\u001f\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
NON_BLANK = f"^[^\\u0000]*[^\\u0000{_BLANK}][^\\u0000]*$"


# Seed replicates: at most this many seeds per recipe, and this many runs per experiment in all.
MAX_SEEDS = 16
# A recipe's label, leaving room in the runs' 200-character label for " #2" (a repeated label) and " seed=N".
MAX_RECIPE_LABEL = 160


# One line of text a person reads (an experiment's name, a run's label): not blank and no control character (line
# breaks and tabs, C0, DEL, C1, U+2028/U+2029; NUL is Strict's). The pattern states it in the OpenAPI document; the
# check before it says in words which rule a refused value broke (a pattern's own message only repeats the pattern).
_CONTROL = "\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029"
ONE_LINE = f"^[^{_CONTROL}]*[^{_CONTROL}{_BLANK}][^{_CONTROL}]*$"
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _one_line(value):
    if isinstance(value, str):
        bad = next((c for c in value if c < " " or "\x7f" <= c <= "\x9f" or c in "\u2028\u2029"), None)
        if bad is not None and bad != "\x00":
            what = "a line break" if bad in _LINE_BREAKS else "a tab" if bad == "\t" else "a control character"
            raise ValueError(f"contains a control character (U+{ord(bad):04X}, {what}): it is one line of text; "
                             "remove it")
        if value and not value.strip():
            raise ValueError("must not be blank (it holds only white space); give it some visible text")
    return value


def _one_line_text(description: str, max_length: int = 200):
    # The check before the pattern (it wraps what is left of it): its words, not the pattern's, answer a bad value.
    return Annotated[str, Field(min_length=1, max_length=max_length, pattern=ONE_LINE,
                                description=description + ": one line of text, not blank, no control characters"),
                     BeforeValidator(_one_line)]


ExperimentName = _one_line_text("the experiment's name")
RunLabel = _one_line_text("the run's label")
RecipeLabel = _one_line_text("the runs' label (default: made from the settings); a seed replicate's label adds "
                             "' seed=N'", MAX_RECIPE_LABEL)
ExternalRunLabel = _one_line_text("the run's label (default: the recipe, '(external)')")

MAX_RUNS_PER_EXPERIMENT = 256


class RecipeRequest(Strict):
    name: str = Field(description=_recipe_field_doc())
    options: dict[str, Any] = Field(default_factory=dict, description=OPTIONS_DOC)
    bf16_first_layers: Annotated[int, Field(ge=0, le=1000)] = 0
    bf16_last_layers: Annotated[int, Field(ge=0, le=1000)] = 0
    keep_bf16: list[Annotated[str, Field(min_length=1, max_length=200, pattern=NON_BLANK)]] = Field(
        default_factory=list, max_length=256,
        description='glob patterns of block linears kept in BF16, e.g. ["*.mlp.gate"] (names as in the '
                    'conversion report: layers.<block>.<path>)')
    label: RecipeLabel | None = None
    seeds: list[Seed] | None = Field(
        default=None, min_length=1, max_length=MAX_SEEDS,
        description="train this recipe once per seed (seed replicates); the experiment's `seed` is always one of "
                    "them (added first when missing: the run every comparison pairs with the other recipes); "
                    "default: the experiment's `seeds` for the baseline (and for every recipe with replicate='all'), "
                    "else the experiment's `seed` alone")

    @model_validator(mode="after")
    def known_recipe_and_options(self) -> "RecipeRequest":
        self.options = {k: _integral(v) for k, v in self.options.items()}
        check_recipe(self.name, self.options)
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds of {self.name} repeat ({self.seeds}): give each seed once")
        return self


class ExperimentCreate(Strict):
    name: ExperimentName
    description: str = Field(default="", max_length=10_000)
    model: str | dict[str, Any] = Field(default="tiny", description='preset name, custom Llama dimensions, '
                                        '{"config": PATH} (a config.json of any transformers causal LM, random '
                                        'init) or {"init_from": PATH} (a checkpoint folder); paths inside the '
                                        'data directory or PLAB_ALLOWED_PATHS')
    data: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict)
    seed: Annotated[int, Field(ge=0, le=2**31 - 1, description="the seed every recipe trains with (default: the "
                                                                "first of `seeds`, else 0)")] = 0
    recipes: list[str | RecipeRequest] = Field(default_factory=lambda: [RecipeRequest(name=catalog.BASELINE)],
                                               min_length=1, max_length=64,
                                               description="recipe names or objects with options")
    eval_tasks: list[str] = Field(default_factory=list, max_length=200)
    enqueue: bool = True
    # -- the verdict (backend/services/verdict.py) ------------------------------------------------------------------
    seeds: list[Seed] | None = Field(
        default=None, min_length=2, max_length=MAX_SEEDS,
        description="seed replicates, e.g. [0, 1, 2]: the baseline (or every recipe, with replicate='all') is "
                    "trained once per seed, and BF16's seed-to-seed spread becomes the band the verdict uses; "
                    "`seed` (which the other recipes train with) is always one of them: when it is given and not in "
                    "the list it is added first")
    replicates: int | None = Field(default=None, ge=2, le=MAX_SEEDS,
                                   description="shorthand for seeds = [seed, seed + 1, ..., seed + replicates - 1] "
                                               "(past 2^31 - 1 the count goes on from 0)")
    replicate: Literal["baseline", "all"] = Field(
        default="baseline", description="which recipes `seeds`/`replicates` apply to")
    verdict_tolerance_pct: float = Field(
        default=1.0, gt=0, le=100,
        description="the difference that matters, in percent of BF16's final validation loss: with one BF16 seed, a "
                    "recipe matches BF16 when within it; with seed replicates BF16's own seed band decides, and a "
                    "'matches' inside a band wider than this tolerance is not conclusive (resolved: false)")

    @field_validator("recipes", mode="before")
    @classmethod
    def names_to_objects(cls, v):
        if isinstance(v, list):
            return [{"name": r} if isinstance(r, str) else r for r in v]
        return v

    @model_validator(mode="after")
    def seed_replicates(self) -> "ExperimentCreate":
        if self.seeds is not None and self.replicates is not None:
            raise ValueError("give either seeds (a list) or replicates (a count), not both")
        if self.replicates is not None:
            self.seeds, self.replicates = [(self.seed + i) % (INT32_MAX + 1) for i in range(self.replicates)], None
        if self.seeds is not None:
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"seeds repeat ({self.seeds}): give each seed once")
            if "seed" not in self.model_fields_set:
                self.seed = self.seeds[0]
            # The reference run (the experiment's seed) first, added when missing: the comparisons pair it with
            # the other recipes, which share its initial weights and batch order.
            self.seeds = [self.seed] + [s for s in self.seeds if s != self.seed]
        for i, r in enumerate(self.recipes):
            if isinstance(r, RecipeRequest) and r.seeds is not None:
                self.recipes[i] = r.model_copy(update={"seeds": [self.seed] + [s for s in r.seeds if s != self.seed]})
        return self


class RunCreate(Strict):
    experiment_id: Annotated[int, Field(ge=1, le=2**31 - 1, description="id of an existing experiment")]
    recipe: str = Field(default=catalog.BASELINE, description=_recipe_field_doc())
    recipe_options: dict[str, Any] = Field(default_factory=dict, description=OPTIONS_DOC)
    label: ExternalRunLabel | None = None
    external: Literal[True] = True

    @model_validator(mode="after")
    def known_recipe_and_options(self) -> "RunCreate":
        self.recipe_options = {k: _integral(v) for k, v in self.recipe_options.items()}
        check_recipe(self.recipe, self.recipe_options)
        return self


class RecipeOptionOut(BaseModel):
    name: str
    type: Literal["boolean", "integer", "string"]
    default: Any
    choices: list[str] | None = Field(description="the allowed values of a string option")
    minimum: int | None
    maximum: int | None
    help: str


class RecipeOut(BaseModel):
    name: str
    summary: str
    elements: str
    scaling: str
    gemm_format: str = Field(description="the GEMM benchmark format its GEMMs are timed as")
    options: list[RecipeOptionOut]
    real_min_capability: tuple[int, int] | None = Field(
        description="minimum CUDA compute capability (major, minor) of its real low-precision kernels; null for "
                    "the baseline, which has none")
    real_kernels: str = Field(description="what runs where the GPU has the capability")
    emulated_elsewhere: bool = Field(description="runs as exact emulation (quantize, dequantize, BF16 GEMM) on "
                                                 "other GPUs and CPUs; its throughput is then not the format's")


class RecipeCatalogOut(BaseModel):
    baseline: str
    recipes: list[RecipeOut] = Field(description="in the documented recipe order")
    gemm_formats: list[str] = Field(description="the formats the GEMM benchmark offers, in order")


class Progress(Strict):
    """A run's progress as a worker reports it: steps done of the total (and what it is doing, e.g. preparing
    data). Anything else is refused, so the metric ingest that updates it never meets a bad value."""
    step: int = Field(ge=-1, le=BIG)
    total: int | None = Field(default=None, ge=0, le=BIG)
    phase: str | None = Field(default=None, max_length=64)


class StatusUpdate(Strict):
    status: Status
    worker_host: str | None = Field(default=None, max_length=200)
    device_name: str | None = Field(default=None, max_length=200)
    error_message: str | None = Field(default=None, max_length=100_000)
    diverged_step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    summary: dict[str, Any] | None = None
    progress: Progress | None = None
    gemm_backend: Literal["real", "emulated", "bf16", "fp32"] | None = None
    conversion_report: dict[str, Any] | None = None
    free_json: ClassVar[frozenset[str]] = frozenset({"summary", "conversion_report"})

    @field_validator("summary", "conversion_report")
    @classmethod
    def _capped(cls, v, info):
        return capped_json(v, info.field_name)


class HeartbeatOut(BaseModel):
    status: str
    cancel_requested: bool
    worker_host: str | None = Field(default=None, description="the job that holds the run (its claim's worker_host)")


def _distinct_tags(tags: list[str] | None) -> list[str] | None:
    """Tags as given, trailing blanks dropped, each once (first spelling wins, compared case-insensitively)."""
    if tags is None:
        return None
    seen, out = set(), []
    for tag in (t.rstrip() for t in tags):
        if tag.lower() not in seen:
            seen.add(tag.lower())
            out.append(tag)
    return out


Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=f"^[^,\\u0000-\\u0020{_BLANK}][^,\\u0000-\\u001f]*$",
                           description="free text up to 64 characters: no comma, no control character, not "
                                       "starting with a blank")]
MAX_NOTES = 20_000


class Housekeeping(Strict):
    """The user's own words about an experiment or a run (PATCH; a field left out is left as it is)."""
    tags: list[Tag] | None = Field(default=None, max_length=32, description="replaces the tags (at most 32)")
    notes: str | None = Field(default=None, max_length=MAX_NOTES, description="Markdown (a safe subset is rendered)")
    archived: bool | None = Field(default=None, description="true archives (hidden from lists unless asked for), "
                                                            "false restores")

    @field_validator("tags")
    @classmethod
    def _tags(cls, v):
        return _distinct_tags(v)


class ExperimentUpdate(Housekeeping):
    name: ExperimentName | None = None
    description: str | None = Field(default=None, max_length=10_000, description="Markdown (a safe subset is rendered)")


class RunInfoUpdate(Housekeeping):
    """A worker's informational fields (device, GEMM backend, summary, conversion report) and the user's (label,
    tags, notes, archived); none changes the run's status."""
    label: RunLabel | None = None
    device_name: str | None = Field(default=None, max_length=200)
    summary: dict[str, Any] | None = None
    gemm_backend: Literal["real", "emulated", "bf16", "fp32"] | None = None
    conversion_report: dict[str, Any] | None = None
    free_json: ClassVar[frozenset[str]] = frozenset({"summary", "conversion_report"})

    @field_validator("summary", "conversion_report")
    @classmethod
    def _capped(cls, v, info):
        return capped_json(v, info.field_name)


# A metric value (or wall time) beyond +-MAX_METRIC_MAGNITUDE is stored as NULL, like NaN and +-Infinity: no loss,
# norm or rate is that large, and sums of such values (a rollup bucket's, a comparison's mean) overflow to
# infinity, which JSON cannot carry. A rollup bucket holds at most 2**24 points, so its sum stays finite.
MAX_METRIC_MAGNITUDE = 1e300
NULL_VALUE_DOC = ("a non-finite value (NaN, +-Infinity) or one beyond +-1e300 is stored as null (no finite value at "
                  "this step)")


class MetricPointIn(Strict):
    key: str = Field(min_length=1, max_length=200, pattern=METRIC_KEY_PATTERN)
    step: int = Field(ge=0, le=2**62)
    value: float | None = Field(description=NULL_VALUE_DOC)
    tokens: int | None = Field(default=None, ge=0, le=2**62)
    wall_time: float | None = Field(default=None, description=NULL_VALUE_DOC)

    @field_validator("value", "wall_time")
    @classmethod
    def finite_or_null(cls, v: float | None) -> float | None:
        # Non-finite values, and finite ones past MAX_METRIC_MAGNITUDE, are stored as NULL.
        return v if v is None or -MAX_METRIC_MAGNITUDE <= v <= MAX_METRIC_MAGNITUDE else None


class MetricBatch(Strict):
    """The row form: one object per point (readable; what scripts written by hand tend to send)."""
    points: list[MetricPointIn] = Field(max_length=MAX_POINTS_PER_BATCH)


# A step or a token count: an integer, or a float without a fractional part (JSON Schema's "integer" admits 3.0).
_Count = Annotated[Annotated[int, Field(strict=True, ge=0, le=2**62)] | Annotated[float, Field(strict=True, ge=0,
                   le=2**62)], WithJsonSchema({"type": "integer", "minimum": 0, "maximum": 2**62})]
# [step, value, tokens, wall_time]; a non-finite value or wall time, or one beyond +-1e300, is stored as NULL.
MetricTuple = tuple[_Count, float | None, _Count | None, float | None]


# Not a `Strict` model: its NUL walk is not needed (the key's pattern and the numbers cannot hold a NUL) and walking
# 10,000 points in Python cost more than the rest of the request.
class MetricSeriesIn(BaseModel):
    """One key's points, each an array [step, value, tokens, wall_time] (value, tokens, wall_time may be null; a
    non-finite value or wall time, or one beyond +-1e300, is stored as null)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    key: str = Field(min_length=1, max_length=200, pattern=METRIC_KEY_PATTERN)
    points: list[MetricTuple] = Field(min_length=1, max_length=MAX_POINTS_PER_BATCH)

    @field_validator("points")
    @classmethod
    def _normalise(cls, points: list) -> list:
        lo, hi = -MAX_METRIC_MAGNITUDE, MAX_METRIC_MAGNITUDE  # NaN fails both comparisons
        out = []
        for p in points:
            step, value, tokens, wall = p
            if type(step) is float or type(tokens) is float:  # never from our client: it sends integers
                for what, v in (("step", step), ("tokens", tokens)):
                    if type(v) is float and not v.is_integer():
                        raise ValueError(f"{what} must be an integer, got {v!r}")
                step, tokens = int(step), None if tokens is None else int(tokens)
                p = (step, value, tokens, wall)
            if (value is not None and not lo <= value <= hi) or (wall is not None and not lo <= wall <= hi):
                p = (step, value if value is None or lo <= value <= hi else None, tokens,
                     wall if wall is None or lo <= wall <= hi else None)
            out.append(p)
        return out


class MetricSeriesBatch(BaseModel):
    """The compact form: points grouped by key, each point an array [step, value, tokens, wall_time]; the form
    the metric client sends."""
    model_config = ConfigDict(extra="forbid", strict=True)
    series: list[MetricSeriesIn] = Field(max_length=MAX_POINTS_PER_BATCH)


def _metric_form(value) -> str:
    return "series" if isinstance(value, dict) and "series" in value else "points"


MetricIngest = Annotated[Annotated[MetricBatch, UnionTag("points")] | Annotated[MetricSeriesBatch, UnionTag("series")],
                         Discriminator(_metric_form)]
METRIC_INGEST = TypeAdapter(MetricIngest)


def metric_series(batch: MetricBatch | MetricSeriesBatch) -> dict[str, list[tuple]]:
    """Either form as {key: [(step, value, tokens, wall_time), ...]} in arrival order (non-finite already None)."""
    out: dict[str, list[tuple]] = {}
    if isinstance(batch, MetricBatch):
        for p in batch.points:
            out.setdefault(p.key, []).append((p.step, p.value, p.tokens, p.wall_time))
    else:
        for s in batch.series:
            out.setdefault(s.key, []).extend(s.points)
    return out


class MetricBatchResult(BaseModel):
    inserted: int
    duplicates: int
    run_status: Status
    cancel_requested: bool


class ArtifactIn(Strict):
    kind: str = Field(min_length=1, max_length=32)
    path: str = Field(min_length=1, max_length=4096)
    step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    meta: dict[str, Any] = Field(default_factory=dict)
    free_json: ClassVar[frozenset[str]] = frozenset({"meta"})


class ArtifactOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    run_id: int
    kind: str
    path: str
    step: int | None
    meta: dict[str, Any]
    created_at: UtcDatetime

    @computed_field(description="whether the path is present where the API runs (workers and API share PLAB_HOME; "
                                "a run keeps only its newest checkpoints, so older ones go); null for a URL")
    @property
    def exists(self) -> bool | None:
        if "://" in self.path:
            return None
        from plab.settings import get_settings, home_path

        try:
            return home_path(self.path, get_settings().home).exists()
        except (OSError, ValueError):
            return False


class RunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    experiment_id: int
    recipe: str
    recipe_options: dict[str, Any]
    bf16_first_layers: int
    bf16_last_layers: int
    label: str
    seed: int | None = Field(description="the seed the run trains with (seed replicates differ only in it)")
    external: bool
    status: Status
    cancel_requested: bool
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    worker_host: str | None
    device_name: str | None
    gemm_backend: str | None
    error_message: str | None
    diverged_step: int | None
    progress: dict[str, Any]
    summary: dict[str, Any]
    attempts: int
    tags: list[str] = Field(default_factory=list)
    notes: str = ""
    archived_at: UtcDatetime | None = None


class RunDetail(RunOut):
    spec: dict[str, Any]
    conversion_report: dict[str, Any]
    dispatch_id: str | None = Field(default=None, description="the job message of the run's latest dispatch")
    dispatched_at: UtcDatetime | None = Field(
        default=None, description="when the run was last sent to the job queue; a worker skips an older message "
                                  "for the run (one the run has been re-sent since)")


class ExperimentOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    name: str
    description: str
    model: Any = Field(validation_alias="model_config_")
    data: dict[str, Any] = Field(validation_alias="data_config")
    training: dict[str, Any] = Field(validation_alias="training_spec")
    seed: int
    recipes: list[Any]
    baseline: str
    eval_tasks: list[str]
    verdict_tolerance_pct: float = Field(description="the stated tolerance of the one-seed verdict rule, percent")
    created_at: UtcDatetime
    tags: list[str] = Field(default_factory=list)
    notes: str = ""
    archived_at: UtcDatetime | None = None
    runs: list[RunOut] = Field(default_factory=list)


class Page(BaseModel):
    total: int
    items: list[Any]


class Series(BaseModel):
    key: str
    step: list[int]
    tokens: list[int | None]
    wall_time: list[float | None]
    value: list[float | None]
    total_points: int
    downsampled: bool


X_RANGE_DOC = ("the range of x to read, both ends included; x_min above x_max is an empty range (no points, like "
              "a zoom past the data), not an error")


class SeriesQuery(Strict):
    max_points: int = Field(default=2000, ge=4, le=100_000)
    x_min: float | None = None
    x_max: float | None = None
    x: Literal["step", "tokens", "wall_time"] = "step"

    @property
    def empty(self) -> bool:
        """x_min above x_max: a range that holds no point."""
        return self.x_min is not None and self.x_max is not None and self.x_min > self.x_max


# -- evaluations ------------------------------------------------------------------------------------------------------
def _document_limit(value: Any) -> int | float | None:
    """An evaluation's `limit` (training.evaluation.limits' rule, as lm-eval's --limit), echoed as JSON if refused."""
    return document_limit(value, shown=_echo(value))


def _echo(value: Any, width: int = 60) -> str:
    """What a request gave, as JSON, cut to `width` characters for an error message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


DocumentLimit = Annotated[Any, AfterValidator(_document_limit), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": 1, "maximum": MAX_EVAL_DOCS},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "null"}]})]


class EvaluationCreate(Strict):
    tasks: list[Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:\-]+$")]] = Field(
        min_length=1, max_length=200, description="task or group names, e.g. plab_blimp, plab_lambada_openai "
                                                  "(letters, digits, '_', '-', '.', ':')")
    limit: DocumentLimit = Field(default=None, description="documents per task (a whole number), or a fraction of each "
                                                           "task's documents in (0, 1), as lm-eval's --limit; for "
                                                           "quick checks (none: every document)")

    @field_validator("tasks")
    @classmethod
    def task_names(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))  # each task once


class EvaluationStatusUpdate(Strict):
    status: Literal["running", "succeeded", "failed"]
    worker_host: str | None = Field(default=None, max_length=200, description=(
        "with `running`: the job that starts it (host, message and attempt). The claim is refused (409) while "
        "another job holds it (a heartbeat younger than PLAB_STALE_S)"))
    error_message: str | None = Field(default=None, max_length=100_000)
    lm_eval_version: str | None = Field(default=None, max_length=32)


_SAMPLE_VALUE = {"type": ["number", "null", "array"], "items": {"type": "number"},
                 "description": "a document's score, null, or a [loglikelihood, weight] pair (perplexity, bits per "
                                "byte)"}
EVAL_RESULT_SCHEMA = {
    "type": "object", "additionalProperties": True,
    "description": "free-form JSON, but for the fields stored in columns of their own and those the paired comparison "
                   "reads (samples, subtasks, aggregation, higher_is_better, weight_by_size, metrics). Rules across "
                   "fields: every list in `samples` has one entry per `doc_id`; a task's `samples` holds every metric "
                   "its `aggregation` names; a group's `subtasks` never lead back to the group itself",
    "properties": {"task_hash": {"type": ["string", "null"], "maxLength": 128, "pattern": NO_NUL_PATTERN},
                   "time_s": {"type": ["number", "null"]},
                   "metrics": {"type": ["object", "null"], "additionalProperties": True},
                   "aggregation": {"type": ["object", "null"], "additionalProperties": {
                       "type": ["string", "null"], "pattern": NO_NUL_PATTERN}},
                   "higher_is_better": {"type": ["object", "null"],
                                        "additionalProperties": {"type": ["boolean", "null"]}},
                   "weight_by_size": {"type": ["object", "null"],
                                      "additionalProperties": {"type": ["boolean", "null"]}},
                   "subtasks": {"type": ["array", "null"], "uniqueItems": True, "items": {
                       "type": "string", "minLength": 1, "maxLength": 200, "pattern": NO_NUL_PATTERN}},
                   "samples": {"type": ["object", "null"],
                               "description": "per-document values: {\"doc_id\": [...], metric: [one per doc_id]}",
                               "anyOf": [{"maxProperties": 0}, {"required": ["doc_id"]}],
                               "properties": {"doc_id": {"type": "array", "uniqueItems": True,
                                                         "items": {"type": "integer"}}},
                               "additionalProperties": {"type": "array", "items": _SAMPLE_VALUE}}}}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_samples(samples: dict) -> dict:
    """`samples` as the paired comparison reads it (training.evaluation.stats): {"doc_id": [distinct integers],
    metric: [a number, null or [loglikelihood, weight] per document]}; doc_ids given as integral floats become
    integers. The lists' lengths are compared with the other fields (`check_eval_result`)."""
    if not samples:
        return samples
    doc_id = samples.get("doc_id")
    if doc_id is None:
        raise ValueError("result.samples has per-document values but no \"doc_id\" list: give the documents' ids "
                         "(training.evaluation.evaluate_checkpoint's records carry them)")
    if not isinstance(doc_id, list) or not all(type(d) is int or (type(d) is float and d.is_integer())
                                               for d in doc_id):
        raise ValueError("result.samples.doc_id must be a list of integers (the documents' ids)")
    doc_id = [int(d) for d in doc_id]
    seen: set[int] = set()
    for d in doc_id:
        if d in seen:
            raise ValueError(f"result.samples.doc_id lists document {d} twice: each document is scored once")
        seen.add(d)
    for metric, values in samples.items():
        if metric == "doc_id":
            continue
        if not isinstance(values, list):
            raise ValueError(f"result.samples.{metric} must be a list (one value per document), got "
                             f"{type(values).__name__}")
        for i, v in enumerate(values):
            if not (v is None or _is_number(v) or (isinstance(v, list) and all(_is_number(x) for x in v))):
                raise ValueError(f"result.samples.{metric}[{i}] must be a number, null or a list of numbers "
                                 f"([loglikelihood, weight]), got {v!r:.60}")
    return {**samples, "doc_id": doc_id}


class EvalTaskResultIn(Strict):
    task: str = Field(min_length=1, max_length=200)
    result: Annotated[dict[str, Any], WithJsonSchema(EVAL_RESULT_SCHEMA)] = Field(
        description="one task's entry of training.evaluation.evaluate_checkpoint()")
    free_json: ClassVar[frozenset[str]] = frozenset({"result"})

    @field_validator("result")
    @classmethod
    def _capped(cls, v):
        # The fields stored in columns of their own, and those the paired comparison reads, are typed; the rest is
        # free-form JSON. Rules across fields are `check_eval_result`'s (after the evaluation is found).
        task_hash, time_s, samples = v.get("task_hash"), v.get("time_s"), v.get("samples")
        if task_hash is not None and (not isinstance(task_hash, str) or len(task_hash) > 128 or "\x00" in task_hash):
            raise ValueError("result.task_hash must be a string of at most 128 characters (no NUL) or null")
        if time_s is not None and (isinstance(time_s, bool) or not isinstance(time_s, (int, float))):
            raise ValueError(f"result.time_s must be a number of seconds or null, got {time_s!r}")
        if samples is not None and not isinstance(samples, dict):
            raise ValueError("result.samples must be an object (metric -> per-document values) or null")
        for name in ("metrics", "aggregation", "higher_is_better", "weight_by_size"):
            if v.get(name) is not None and not isinstance(v[name], dict):
                raise ValueError(f"result.{name} must be an object (metric -> ...) or null, got "
                                 f"{type(v[name]).__name__}")
        for metric, agg in (v.get("aggregation") or {}).items():
            if agg is not None and not isinstance(agg, str):
                raise ValueError(f"result.aggregation.{metric} must be the aggregation's name (a string) or null")
        for name in ("higher_is_better", "weight_by_size"):
            for metric, flag in (v.get(name) or {}).items():
                if flag is not None and not isinstance(flag, bool):
                    raise ValueError(f"result.{name}.{metric} must be true, false or null, got {flag!r:.60}")
        subtasks = v.get("subtasks")
        if subtasks is not None:
            if not isinstance(subtasks, list) or not all(isinstance(t, str) and 0 < len(t) <= 200 and "\x00" not in t
                                                         for t in subtasks):
                raise ValueError("result.subtasks must be a list of task names (1 to 200 characters, no NUL)")
            if len(set(subtasks)) != len(subtasks):
                raise ValueError("result.subtasks lists a task twice: name each subtask once")
        if samples:
            v = {**v, "samples": _check_samples(samples)}
        return capped_json(v, "result")


def check_eval_result(task: str, result: dict) -> None:
    """ValueError unless `result`'s fields agree with each other (what the document states in words): a group does
    not list itself among its subtasks, every list of `samples` has one entry per document, a task's samples hold
    every metric its `aggregation` names."""
    if task in (result.get("subtasks") or []):
        raise ValueError(f"result.subtasks of {task} lists {task} itself: a group holds other tasks")
    samples = result.get("samples") or {}
    n = len(samples.get("doc_id") or [])
    for metric, values in samples.items():
        if len(values) != n:
            raise ValueError(f"result.samples.{metric} has {len(values)} values for {n} documents (doc_id): give one "
                             "per document, in doc_id order")
    if result.get("kind") != "group" and not result.get("subtasks"):
        missing = [m for m in (result.get("aggregation") or {}) if m not in samples]
        if missing:
            raise ValueError(f"result.samples has no per-document values for {', '.join(map(repr, missing))}, which "
                             "result.aggregation names: the paired comparison needs them (or leave the metric out of "
                             "aggregation)")


class EvalResultOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    task: str
    metrics: dict[str, Any]
    task_hash: str | None
    duration_s: float | None


class EvaluationOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    run_id: int
    tasks: list[str]
    limit: int | float | None = Field(description="documents per task, or a fraction of each task's documents")
    status: str
    error_message: str | None
    lm_eval_version: str | None
    created_at: UtcDatetime
    finished_at: UtcDatetime | None
    results: list[EvalResultOut] = Field(default_factory=list)
    worker_host: str | None = Field(default=None, description="the job that claimed it (its `running` report)")
    attempts: int = Field(default=0, description="starts (`running` reports); the reconciler sends one whose worker "
                                                 "died again until PLAB_MAX_ATTEMPTS")
    dispatch_id: str | None = Field(default=None, description="the job message of the evaluation's latest dispatch")
    dispatched_at: UtcDatetime | None = Field(
        default=None, description="when the evaluation was last sent to the job queue; a worker skips an older "
                                  "message for it (one it has been re-sent since)")


# -- verdict (training.evaluation.verdict) ----------------------------------------------------------------------------
class VerdictAccuracyRow(BaseModel):
    task: str
    metric: str
    delta: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None = Field(description="uncorrected")
    p_holm: float | None = Field(description="Holm-adjusted over the run's tasks and metrics")
    significant: bool | None = Field(description="p_holm < 0.05")
    significant_uncorrected: bool | None
    improved: bool | None
    higher_is_better: bool | None
    n: int | None = Field(description="paired documents")
    method: str | None
    baseline_seed_spread: list[float] | None = Field(
        description="[min, max] of BF16's own seed replicates' deltas to the reference (0 included); null with one "
                    "seed")


class VerdictRecipe(BaseModel):
    variant: str = Field(description="the recipe with its options and kept layers (its seed replicates pooled)")
    recipe: str
    run_ids: list[int]
    seeds: list[int]
    statuses: list[str]
    emulated: bool
    final_val_loss: float | None = Field(description="mean over its finished seeds")
    min_val_loss: float | None = Field(description="its finished seeds' lowest validation loss, averaged")
    val_delta_pct: float | None
    min_val_delta_pct: float | None = Field(
        description="min_val_loss against the reference run's own lowest validation loss, in percent")
    band_pct: list[float] | None = Field(
        default=None, description="the seed band this recipe was judged by, for its number of finished seeds (its "
                                  "own seeds pooled into the spread with 2+); null under the tolerance rule")
    tokens_per_s: float | None
    speedup: float | None = Field(
        description="the mean of its seeds' speedups: each run's tokens/s over the mean of the BF16 replicates' on "
                    "the same device")
    speedup_note: str | None = Field(default=None, description="why there is no speedup, where there is none")
    speed_word: Literal["speedup", "slowdown"] | None
    outcome: Literal["matches", "better", "worse", "diverged"] | None = Field(
        description="null until it has finished with a validation loss")
    matches: bool | None = Field(description="outcome is matches or better")
    resolved: bool | None = Field(
        default=None, description="false for 'matches' inside a seed band wider than the experiment's tolerance: the "
                                  "runs cannot tell this recipe from BF16 at that precision")
    accuracy: list[VerdictAccuracyRow]


class VerdictRun(BaseModel):
    run_id: int
    variant: str
    recipe: str
    seed: int
    status: str
    is_baseline: bool
    emulated: bool
    final_val_loss: float | None
    min_val_loss: float | None
    val_delta_pct: float | None
    tokens_per_s: float | None
    speedup: float | None = Field(
        description="tokens/s over the mean of the BF16 replicates' that ran on the same device; null with a "
                    "speedup_note where none did (no speedup across two kinds of GPU)")
    speedup_note: str | None = None
    device: str | None = Field(default=None, description="the device it trained on, where known")
    accuracy: list[VerdictAccuracyRow]


class VerdictBaseline(BaseModel):
    run_ids: list[int]
    seeds: list[int]
    final_val_loss: float | None
    tokens_per_s: float | None


class VerdictBest(BaseModel):
    variant: str
    run_ids: list[int]


class VerdictOut(BaseModel):
    experiment_id: int
    baseline_recipe: str
    metric: str = Field(description="the metric judged: val/loss")
    reference_run_id: int | None = Field(description="the baseline run every difference is measured against")
    baseline: VerdictBaseline
    rule: Literal["seed_band", "tolerance"]
    rule_text: str
    band_pct: list[float] | None = Field(
        description="with 2+ BF16 seeds, the band a one-seed recipe's delta is judged by: BF16's mean delta ± the 95% "
                    "two-sample t interval's half-width (each recipe's entry has its own band)")
    tolerance_pct: float
    recipes: list[VerdictRecipe]
    runs: list[VerdictRun]
    best: VerdictBest | None
    summary: str = Field(description="the one-line verdict")
    accuracy_error: str | None = Field(description="why accuracy was not paired (different documents), if so")
    validation: dict[str, Any] | None = Field(
        default=None, description="what the reference run's val loss is the mean over (windows, tokens, rule, the "
                                  "split's windows and tokens), from its summary; null when it does not say")


# -- GEMM benchmarks --------------------------------------------------------------------------------------------------
_Dim = Annotated[int, Field(ge=1, le=BIG), BeforeValidator(_integral)]


def _text(n: int):
    return Field(max_length=n, pattern=NO_NUL_PATTERN)


class GemmShape(BaseModel):
    """One GEMM of a stored benchmark result: the dashboard shows these numbers, so they must be numbers."""
    model_config = ConfigDict(extra="allow", strict=True)
    layer: str = _text(200)
    gemm: str = _text(64)
    m: _Dim
    k: _Dim
    n: _Dim
    count: Annotated[int, Field(ge=0, le=BIG), BeforeValidator(_integral)]


class GemmRecord(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    format: str = _text(64)
    mode: str = _text(32)
    layer: str = _text(200)
    gemm: str = _text(64)
    m: _Dim
    k: _Dim
    n: _Dim
    speedup_vs_bf16: float | None = None
    tflops: float | None = None


def gemm_result(value: dict | None, field: str) -> dict | None:
    """A stored GEMM benchmark result: its shapes and per-format records have the types the dashboard draws."""
    if value is None:
        return value
    capped_json(value, field)
    device = value.get("device")
    if isinstance(device, dict) and isinstance(device.get("name"), str) and "\x00" in device["name"]:
        raise ValueError(f"{field}.device.name contains a NUL character (\\u0000), which cannot be stored; remove it")
    totals = value.get("totals", {})  # {mode: {format: {"speedup": number | null, ...}}}: the list's summary
    for mode, per in (totals.items() if isinstance(totals, dict) else [(None, None)]):
        for fmt, t in (per.items() if isinstance(per, dict) else [(None, None)]):
            if not isinstance(t, dict) or isinstance(t.get("speedup"), bool) or not isinstance(
                    t.get("speedup"), (int, float, type(None))):
                raise ValueError(f"{field}.totals must map mode -> format -> an object whose speedup is a number or "
                                 f"null (got {mode!r} -> {fmt!r} -> {t!r})")
    for name, model in (("shapes", GemmShape), ("results", GemmRecord)):
        rows = value.get(name, [])
        if not isinstance(rows, list):
            raise ValueError(f"{field}.{name} must be a list")
        for i, row in enumerate(rows):
            try:
                model.model_validate(row)
            except ValueError as exc:
                first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"{field}.{name}[{i}].{where}: {first['msg']}") from None
    return value


class GemmBenchmarkCreate(Strict):
    """Exactly one of `request` (queued for a worker) or `result` (a finished benchmark, as the CLI posts it)."""

    request: dict[str, Any] | None = Field(
        None, description="keyword arguments of training.gemm.run_gemm_benchmark, e.g. "
                          '{"model": "1b", "micro_batch": 4, "seq_len": 2048, "formats": ["bf16", "fp8_tensorwise"]}')
    result: dict[str, Any] | None = Field(None, description="the dict run_gemm_benchmark returned")
    free_json: ClassVar[frozenset[str]] = frozenset({"result"})
    experiment_id: int | None = Field(None, ge=1, le=2**31 - 1)
    name: str = Field("", max_length=200)
    enqueue: bool = Field(True, description="with `request`: send it to a worker now")
    queue: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$",
                       description="the worker queue (e.g. h100, cpu) the job goes to")

    @field_validator("result")
    @classmethod
    def _result(cls, v):
        return gemm_result(v, "result")

    @field_validator("request")
    @classmethod
    def _request(cls, v):
        return capped_json(v, "request")


class GemmStatusUpdate(Strict):
    status: Literal["running", "succeeded", "failed"]
    worker_host: str | None = Field(default=None, max_length=200, description=(
        "with `running`: the job that starts it (host, message and attempt). The claim is refused (409) while "
        "another job holds it (a heartbeat younger than PLAB_STALE_S)"))
    device_name: str | None = Field(None, max_length=200)
    error_message: str | None = Field(None, max_length=100_000)
    result: dict[str, Any] | None = None
    free_json: ClassVar[frozenset[str]] = frozenset({"result"})

    @field_validator("result")
    @classmethod
    def _result(cls, v):
        return gemm_result(v, "result")


class GemmBenchmarkOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    experiment_id: int | None
    name: str
    request: dict[str, Any]
    status: str
    device_name: str | None
    error_message: str | None
    created_at: UtcDatetime | None
    summary: dict[str, Any] = {}
    queue: str | None = Field(default=None, description="the worker queue its job was sent to (null: never sent)")
    worker_host: str | None = Field(default=None, description="the job that claimed it (its `running` report)")
    attempts: int = Field(default=0, description="starts (`running` reports); the reconciler sends one whose worker "
                                                 "died again until PLAB_MAX_ATTEMPTS")
    dispatch_id: str | None = Field(default=None, description="the job message of the benchmark's latest dispatch")
    dispatched_at: UtcDatetime | None = Field(
        default=None, description="when the benchmark was last sent to the job queue; a worker skips an older "
                                  "message for it (one it has been re-sent since)")


class GemmBenchmarkDetail(GemmBenchmarkOut):
    result: dict[str, Any]
