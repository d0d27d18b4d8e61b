"""Dashboard pages: HTML shells rendered with Jinja2, data fetched by the browser from the REST API.

The pages hold no data of their own: every number on screen comes from `/api/v1`, so what the dashboard
shows is exactly what an API client would see. plotly.js is served from the installed `plotly` package
so the dashboard works on a machine with no internet access. The JavaScript is plain ES modules under
static/js (no build step).

Pages and the element ids tests rely on:
  /                    experiments list: #experiments-table (rows tr[data-experiment-id]), .status-counts, .summary,
                       #experiment-search (#search-q, #search-tag, #search-archived; mirrored in the URL)
  /experiments/new     #experiment-form, #form-error (the API's 4xx message), #field-* inputs, #field-ablation
  /experiments/{id}    #loss-chart, #val-loss-chart (one trace per run), #relative-chart (one per non-BF16 run),
                       #throughput-chart, #memory-chart, #numerics-chart, #runs-table (tr[data-run-id][data-status],
                       button.cancel-run), #x-axis, #smoothing, #log-scale, #live-status[data-polling],
                       #export-json/#export-csv (links to the API's full export)/#export-html, #explorer-panel
                       (#explore-<key with / as _> charts, #explorer-key, #explorer-run-id), #experiment-housekeeping
                       (#hk-edit, #hk-archive, #hk-delete, #hk-tags, #hk-notes); `window.plabExperiment` holds the
                       page state (firstRenderMs, tableReadyMs for bench/dashboard_bench.py)
  /runs                #runs-list, #filter-status, #filter-recipe, #filter-q, #filter-tag, #filter-archived
                       (filters mirrored in the URL)
  /runs/{id}           #run-name, #run-spec, #run-spec-diff, #conversion-report, #run-events, #run-checkpoints
                       (a.checkpoint-download), #run-evaluations, #run-metrics (one chart per logged key)
  anything missing     the 404 page (#not-found), status 404: a missing experiment or run, a mistyped path
Signing in (#api-token-box in the top bar) trades an API token for an HttpOnly session cookie (backend/auth.py).
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.models import BASELINE_RECIPE, Experiment, Run
from frontend.assets import VENDOR_CACHE, CompressedStaticFiles, asset_response, prepare

FRONTEND_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = FRONTEND_DIR / "templates"
STATIC_DIR = FRONTEND_DIR / "static"
PLOTLY_URL = "/static/vendor/plotly-cartesian.min.js"

# The form offers the presets of training.model.PRESETS (docs/INTERFACES.md); the server validates the spec,
# so a preset missing here only costs the user a custom-dimensions entry, never a wrong run.
MODEL_PRESETS = ("tiny", "125m", "350m", "1b")


def plotly_js_path() -> Path:
    """plotly.js as the dashboard serves it: the official "cartesian" partial bundle (scatter, bar, heatmap - every
    trace type the dashboard draws; npm `plotly.js-cartesian-dist-min`, MIT), vendored in frontend/static/vendor at
    the plotly.js version of the `plotly` Python package (a test keeps the two in step). 1.5 MB instead of the full
    bundle's 4.8 MB: a browser that had never seen the page spent ~1.1 s of a 2.1 s first visit (8 runs x 100k
    steps) compiling the full one."""
    path = STATIC_DIR / "vendor" / "plotly-cartesian.min.js"
    if not path.is_file():
        raise RuntimeError(f"plotly.js not found at {path}: the package was installed without its static files; "
                           "reinstall it (pip install -e .)")
    return path


def recipe_names() -> tuple[str, ...]:
    # The form offers exactly what the API accepts: the recipe catalog, which loads without torch (importing
    # torch would stall the first page view for seconds).
    from training.precision import catalog

    return catalog.recipe_names()


def mount(app: FastAPI) -> None:
    """Add the dashboard's HTML pages and static assets (plotly.js included) to `app`."""
    if not isinstance(app, FastAPI):
        raise TypeError(f"mount() needs the FastAPI application, got {type(app).__name__}")
    templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
    plotly_js = plotly_js_path()
    prepare(plotly_js)

    def render(request: Request, template: str, status_code: int = 200, **context) -> HTMLResponse:
        return templates.TemplateResponse(request, template, {"plotly_url": PLOTLY_URL, **context},
                                          status_code=status_code)

    def not_found(request: Request, message: str) -> HTMLResponse:
        return render(request, "404.html", status_code=404, page="notfound", message=message)

    # Registered before the /static mount: Starlette matches routes in order, and the mount would
    # otherwise answer 404 for a file that is not in frontend/static.
    @app.get(PLOTLY_URL, include_in_schema=False)
    def plotly_bundle(request: Request):
        return asset_response(plotly_js, request.headers, "text/javascript", VENDOR_CACHE)

    app.mount("/static", CompressedStaticFiles(directory=str(STATIC_DIR)), name="static")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def experiments_page(request: Request) -> HTMLResponse:
        return render(request, "experiments.html", page="experiments")

    @app.get("/experiments/new", response_class=HTMLResponse, include_in_schema=False)
    def new_experiment_page(request: Request) -> HTMLResponse:
        return render(request, "new_experiment.html", page="new", recipes=recipe_names(),
                      baseline=BASELINE_RECIPE, presets=MODEL_PRESETS)

    @app.get("/experiments/{experiment_id}", response_class=HTMLResponse, include_in_schema=False)
    def experiment_page(request: Request, experiment_id: str) -> HTMLResponse:
        if not _exists(request, Experiment, experiment_id):
            return not_found(request, f"There is no experiment {experiment_id}: it may have been deleted, or the "
                                      "link is mistyped.")
        # The baseline comes with the experiment's JSON (`baseline`), which the page loads.
        return render(request, "experiment.html", page="experiment", experiment_id=experiment_id)

    @app.get("/runs", response_class=HTMLResponse, include_in_schema=False)
    def runs_page(request: Request) -> HTMLResponse:
        return render(request, "runs.html", page="runs", recipes=recipe_names())

    @app.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
    def run_page(request: Request, run_id: str) -> HTMLResponse:
        if not _exists(request, Run, run_id):
            return not_found(request, f"There is no run {run_id}: it may have been deleted, or the link is "
                                      "mistyped.")
        return render(request, "run.html", page="run", run_id=run_id)

    api_errors = app.exception_handlers.get(StarletteHTTPException)

    async def page_or_api_error(request: Request, exc: StarletteHTTPException):
        # A person following a wrong link gets the site's 404 page; API clients keep their JSON errors.
        if exc.status_code == 404 and not request.url.path.startswith("/api/"):
            return not_found(request, f"Nothing lives at {request.url.path}.")
        return await api_errors(request, exc)

    app.add_exception_handler(StarletteHTTPException, page_or_api_error)


def _exists(request: Request, table, object_id: str) -> bool:
    """Whether the page's object exists (ids are 32-bit integers in the database): a missing one gets the 404
    page at once instead of a page that waits for data that will never come."""
    if not object_id.isdigit() or not 1 <= int(object_id) <= 2**31 - 1:
        return False
    with request.app.state.sessionmaker() as session:
        return session.get(table, int(object_id)) is not None
