"""GEMM benchmarks: requests validated against `training.gemm.run_gemm_benchmark`, results stored as
the JSON that function returns, and the status machine a worker moves a queued benchmark through.

A benchmark row holds the `request` (the keyword arguments of `run_gemm_benchmark`, so a worker or a user can
re-run it with `run_gemm_benchmark(**request)`) and, once finished, the `result` dict the function returned.
"""
from __future__ import annotations

import math
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend.errors import Conflict, InvalidInput, NotFound
from backend.models import Experiment, GemmBenchmark
from backend.schemas import GemmBenchmarkDetail, GemmBenchmarkOut
from backend.services import leases

RESULT_SCHEMA = "plab.gemm_bench/1"
STATUSES = ("queued", "running", "succeeded", "failed")
FINAL = {"succeeded", "failed"}
# A worker retried after a crash re-announces `running`; a finished benchmark never changes again, except that
# re-sending the very same final status (a retried HTTP call) is accepted as a no-op.
TRANSITIONS = {"queued": {"running", "succeeded", "failed"}, "running": {"running", "succeeded", "failed"}}

# The keyword arguments of run_gemm_benchmark that a stored request may carry (`progress` is a callback, not
# data). tests/gemm/test_api_wiring.py checks this against the function's signature.
REQUEST_KEYS = ("model", "shapes", "micro_batch", "seq_len", "formats", "modes", "gated_mlp", "no_gqa",
                "vocab_size", "repeats", "warmup", "device", "bf16_step_time_s", "compile_quant", "seed")
# Bounds that keep a request runnable on one GPU: a typo such as seq_len=20480000 is refused here, not after
# a worker has tried to allocate it.
MAX_TOKENS = 1 << 22
MAX_DIM = 1 << 20


def _integral(value: Any) -> Any:
    return int(value) if type(value) is float and math.isfinite(value) and value.is_integer() else value


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"request.{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"request.{name} must be true or false, got {value!r}")
    return value


def _choices(name: str, value: Any, allowed: tuple) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise InvalidInput(f"request.{name} must be a non-empty list of names from {', '.join(allowed)}")
    bad = [v for v in value if v not in allowed]
    if bad:
        raise InvalidInput(f"request.{name}: unknown {bad}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(value))


def validate_request(request: Any) -> dict:
    """The request normalised to every keyword of `run_gemm_benchmark` (defaults filled in), or InvalidInput.

    The domain checks are the training library's own (`model_dims`, `parse_shapes`, the format and mode
    names), so the API refuses exactly what the benchmark would refuse, before a worker picks it up.
    """
    # Imported on use: training.gemm pulls in torch, which an API that never sees a benchmark need not load.
    from training.config import MODEL_PRESETS
    from training.gemm import FORMATS, MODES, parse_shapes
    from training.gemm.shapes import model_dims

    if not isinstance(request, dict):
        raise InvalidInput("request must be an object of run_gemm_benchmark keyword arguments")
    # JSON Schema's "integer" admits a number without a fractional part (4.0): read as the integer.
    request = {k: _integral(v) for k, v in request.items()}
    if isinstance(request.get("model"), dict):
        request["model"] = {k: _integral(v) for k, v in request["model"].items()}
    unknown = sorted(set(request) - set(REQUEST_KEYS))
    if unknown:
        raise InvalidInput(f"request has unknown keys {unknown}; run_gemm_benchmark accepts {', '.join(REQUEST_KEYS)}")
    r = {"model": None, "shapes": None, "micro_batch": 4, "seq_len": 2048, "formats": None, "modes": None,
         "gated_mlp": True, "no_gqa": False, "vocab_size": None, "repeats": None, "warmup": None,
         "device": "auto", "bf16_step_time_s": None, "compile_quant": True, "seed": 0, **request}
    model, shapes = r["model"], r["shapes"]
    if (model is None) == (shapes is None):
        raise InvalidInput("request needs exactly one of 'model' (a preset name or a dict of Llama dims) or "
                           "'shapes' ('MxKxN,...')")
    r["micro_batch"] = _int("micro_batch", r["micro_batch"], 1, MAX_TOKENS)
    r["seq_len"] = _int("seq_len", r["seq_len"], 1, MAX_TOKENS)
    if r["micro_batch"] * r["seq_len"] > MAX_TOKENS:
        raise InvalidInput(f"request.micro_batch × seq_len = {r['micro_batch'] * r['seq_len']} tokens exceeds "
                           f"{MAX_TOKENS}; lower one of them")
    if shapes is not None:
        try:
            parsed = parse_shapes(shapes)
        except ValueError as e:
            raise InvalidInput(f"request.shapes: {e}") from e
        if any(max(s.m, s.k, s.n) > MAX_DIM for s in parsed):
            raise InvalidInput(f"request.shapes: every dimension must be <= {MAX_DIM}")
        if len(parsed) > 256:
            raise InvalidInput("request.shapes: at most 256 GEMMs per benchmark")
        for name in ("vocab_size",):
            if r[name] is not None:
                raise InvalidInput(f"request.{name} describes a model; it does not apply to 'shapes'")
        if r["no_gqa"] is not False:
            raise InvalidInput("request.no_gqa describes a model; it does not apply to 'shapes'")
    elif isinstance(model, str):
        if model not in MODEL_PRESETS:
            raise InvalidInput(f"request.model: unknown preset {model!r}; use one of {', '.join(MODEL_PRESETS)} "
                               "or a dict of Llama dims")
    elif isinstance(model, dict):
        try:
            dims = model_dims(model)
        except ValueError as e:
            raise InvalidInput(f"request.model: {e}") from e
        if any(v > MAX_DIM for v in dims.values()):
            raise InvalidInput(f"request.model: every dimension must be <= {MAX_DIM}")
    else:
        raise InvalidInput(f"request.model must be a preset name ({', '.join(MODEL_PRESETS)}) or a dict of Llama "
                           f"dims, got {type(model).__name__}")
    r["formats"] = _choices("formats", r["formats"], FORMATS)
    r["modes"] = _choices("modes", r["modes"], MODES)
    for name in ("gated_mlp", "no_gqa", "compile_quant"):
        r[name] = _bool(name, r[name])
    if r["vocab_size"] is not None:
        r["vocab_size"] = _int("vocab_size", r["vocab_size"], 1, MAX_DIM)
    if r["repeats"] is not None:
        r["repeats"] = _int("repeats", r["repeats"], 1, 10_000)
    if r["warmup"] is not None:
        r["warmup"] = _int("warmup", r["warmup"], 0, 10_000)
    r["seed"] = _int("seed", r["seed"], 0, 2**63 - 1)
    device = r["device"]
    if not isinstance(device, str) or not (device in ("auto", "cpu", "cuda")
                                           or (device.startswith("cuda:") and device[5:].isdigit())):
        raise InvalidInput(f"request.device must be auto, cpu, cuda or cuda:N, got {device!r}")
    step = r["bf16_step_time_s"]
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                             or not math.isfinite(step) or step <= 0):
        raise InvalidInput(f"request.bf16_step_time_s must be positive seconds, got {step!r}")
    return r


def validate_result(result: Any) -> dict:
    """A result dict as `run_gemm_benchmark` returns it (its `request` re-validated), or InvalidInput."""
    if not isinstance(result, dict):
        raise InvalidInput("result must be the JSON object returned by run_gemm_benchmark")
    if result.get("schema") != RESULT_SCHEMA:
        raise InvalidInput(f"result.schema must be {RESULT_SCHEMA!r} (the output of training.gemm's "
                           f"run_gemm_benchmark), got {result.get('schema')!r}")
    for key, kind in (("request", dict), ("device", dict), ("results", list), ("totals", dict),
                      ("prediction", dict), ("failures", list), ("shapes", list)):
        if not isinstance(result.get(key), kind):
            raise InvalidInput(f"result.{key} must be a JSON {'object' if kind is dict else 'array'}")
    if not isinstance(result["device"].get("name"), str):
        raise InvalidInput("result.device.name must be a string")
    for i, rec in enumerate(result["results"]):
        if not isinstance(rec, dict) or not all(k in rec for k in ("layer", "gemm", "m", "k", "n", "format", "mode")):
            raise InvalidInput(f"result.results[{i}] must have layer, gemm, m, k, n, format and mode")
    validate_request(result["request"])
    return _finite(result)


def _finite(value: Any) -> Any:
    """NaN/Inf (a failed check's relative error) become null: JSON has no such numbers and PostgreSQL refuses them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _experiment(session: Session, experiment_id: int | None) -> None:
    if experiment_id is not None and session.get(Experiment, experiment_id) is None:
        raise NotFound(f"experiment {experiment_id} does not exist")


def create_benchmark(session: Session, *, request: dict | None = None, result: dict | None = None,
                     experiment_id: int | None = None, name: str = "") -> GemmBenchmark:
    """A queued benchmark from `request`, or a finished one from a `result` the CLI measured (exactly one)."""
    if (request is None) == (result is None):
        raise InvalidInput("give exactly one of 'request' (to queue a benchmark on a worker) or 'result' (to store "
                           "a finished run_gemm_benchmark result)")
    _experiment(session, experiment_id)
    if result is not None:
        result = validate_result(result)
        bench = GemmBenchmark(experiment_id=experiment_id, name=name, request=result["request"], status="succeeded",
                              device_name=result["device"]["name"][:200], result=result)
    else:
        bench = GemmBenchmark(experiment_id=experiment_id, name=name, request=validate_request(request),
                              status="queued", result={})
    session.add(bench)
    session.flush()
    return bench


def get_benchmark(session: Session, benchmark_id: int, lock: bool = False) -> GemmBenchmark:
    bench = session.get(GemmBenchmark, benchmark_id, with_for_update=lock)
    if bench is None:
        raise NotFound(f"GEMM benchmark {benchmark_id} does not exist")
    return bench


def list_benchmarks(session: Session, *, experiment_id: int | None, status: str | None, limit: int,
                    offset: int) -> tuple[int, list[GemmBenchmark]]:
    q = select(GemmBenchmark)
    if experiment_id is not None:
        q = q.where(GemmBenchmark.experiment_id == experiment_id)
    if status is not None:
        q = q.where(GemmBenchmark.status == status)
    total = session.scalar(select(func.count()).select_from(q.subquery()))
    rows = session.scalars(q.order_by(GemmBenchmark.id.desc()).limit(limit).offset(offset)).all()
    return total, list(rows)


def update_status(session: Session, benchmark_id: int, *, status: str, device_name: str | None = None,
                  error_message: str | None = None, result: dict | None = None, worker_host: str | None = None,
                  stale_s: float = 60.0) -> GemmBenchmark:
    """Worker-facing: queued → running → succeeded (with its result) | failed (with a message). `running` claims
    the benchmark for its job (`leases.claim`: 409 while another job holds it)."""
    bench = get_benchmark(session, benchmark_id, lock=status == "running")  # as a heartbeat locks it
    if status not in STATUSES or status == "queued":
        raise InvalidInput(f"status must be one of running, succeeded, failed; got {status!r}")
    # The report is checked first, whatever the state: a retried report is the same valid report.
    if status == "succeeded":
        if result is None:
            raise InvalidInput("status 'succeeded' needs the 'result' returned by run_gemm_benchmark")
        result = validate_result(result)
    elif result is not None:
        raise InvalidInput(f"a result is only stored with status 'succeeded', not '{status}'")
    if bench.status in FINAL:
        if bench.status == status:
            return bench  # a retried report of the same outcome
        raise Conflict(f"GEMM benchmark {benchmark_id} is already '{bench.status}'; it cannot become '{status}'")
    if status not in TRANSITIONS[bench.status]:
        raise Conflict(f"GEMM benchmark {benchmark_id} cannot go from '{bench.status}' to '{status}'")
    if status == "running":
        leases.claim(bench, stale_s, worker_host, "GEMM benchmark")
    if status == "succeeded":
        bench.result = result
        bench.device_name = (device_name or result["device"]["name"])[:200]
    if status == "failed":
        bench.error_message = error_message or "the benchmark failed without a message"
    if device_name and status != "succeeded":
        bench.device_name = device_name[:200]
    bench.status = status
    session.flush()
    return bench


def heartbeat(session: Session, benchmark_id: int, holder: str | None = None) -> GemmBenchmark:
    """A running benchmark's lease renewed (its job beats while it times the GEMMs; a job naming itself renews
    only its own lease)."""
    return leases.renew(session, GemmBenchmark, benchmark_id, "GEMM benchmark", holder)


def summarize(result: dict) -> dict:
    """What a list shows without the full result: device, formats that ran emulated, whole-step speedups."""
    if not result:
        return {}
    # A CPU's FP8 kernel (backend "cpu") is software too: listed with the emulated formats, as training labels it.
    emulated = sorted({r["format"] for r in result.get("results", []) if r.get("backend") in ("emulated", "cpu")})
    return {
        "device": result.get("device", {}),
        "n_shapes": len(result.get("shapes", [])),
        "n_failures": len(result.get("failures", [])),
        "emulated_formats": emulated,
        "gemm_speedup": {mode: {fmt: t.get("speedup") for fmt, t in per.items()}
                         for mode, per in result.get("totals", {}).items()},
    }


def benchmark_out(bench: GemmBenchmark, *, detail: bool = False) -> GemmBenchmarkOut:
    """A benchmark as the API answers it: with its `summary`, and the full `result` when `detail`."""
    out = (GemmBenchmarkDetail if detail else GemmBenchmarkOut).model_validate(bench)
    out.summary = summarize(bench.result or {})
    return out
