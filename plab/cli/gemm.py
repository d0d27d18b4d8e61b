"""`plab gemm-bench`: training.gemm's per-layer GEMM benchmark on this machine, optionally stored through the API."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from plab.cli.common import UsageError


def _options_parser() -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup]:
    # allow_abbrev=False: an abbreviation of a benchmark option (e.g. --mo for --model) must reach the benchmark's
    # parser, not be taken for one of these.
    p = argparse.ArgumentParser(prog="plab gemm-bench", add_help=False, allow_abbrev=False,
                                usage="plab gemm-bench [benchmark options] [--post] [--experiment ID] [--name NAME] "
                                      "[--api-url URL]")
    g = p.add_argument_group("storing the result through the API (token: $PLAB_API_TOKEN)")
    g.add_argument("--post", action="store_true",
                   help="after the run, store the result as a GEMM benchmark on the API server")
    g.add_argument("--experiment", type=int, metavar="ID",
                   help="attach the result to experiment ID (its page shows the GEMM panel); implies --post")
    g.add_argument("--name", default="", help="a label for the stored benchmark")
    g.add_argument("--api-url", help="the API server (default: $PLAB_API_URL or http://127.0.0.1:8000)")
    return p, g


def _result_poster(opts, rest: list[str]) -> Callable[[dict], None]:
    """Checks the API before the benchmark runs (a long GPU run whose result cannot be stored is time lost) and
    returns the function that stores the result."""
    import httpx

    from workers.client import ApiError, PlabClient

    client = PlabClient.from_env(opts.api_url, retries=1)
    url = opts.api_url or client.base_url
    try:
        client.health()
        if opts.experiment is not None:
            client.get_experiment(opts.experiment)
    except ApiError as e:
        raise UsageError(f"{url}: {e.message}") from e
    except httpx.HTTPError as e:
        raise UsageError(f"cannot reach the API at {url} ({e}); start it with `plab serve` or pass --api-url")

    def post_result(result: dict) -> None:
        try:
            bench = client.post_gemm_result(result, experiment_id=opts.experiment, name=opts.name)
        except (ApiError, httpx.HTTPError) as e:
            raise UsageError(f"the benchmark ran but {url} did not store its result: {e}"
                             + ("" if "--output" in rest else "; add --output FILE to keep the JSON")) from e
        where = (f"{url.rstrip('/')}/experiments/{opts.experiment}" if opts.experiment is not None
                 else f"{url.rstrip('/')}/api/v1/gemm-benchmarks/{bench['id']}")
        print(f"\nstored as GEMM benchmark {bench['id']}: {where}")

    return post_result


def cmd_gemm(argv: list[str]) -> int:
    """`plab gemm-bench ...` runs training.gemm's benchmark on this machine; with `--post` (or `--experiment ID`)
    the result is also stored through the API, where the experiment page shows it next to the training runs."""
    from training.gemm import main as gemm_main

    p, g = _options_parser()
    opts, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        try:
            gemm_main(["--help"])
        except SystemExit:
            pass
        print("\n" + g.title + ":")
        print("\n".join(line for line in p.format_help().splitlines()[2:] if line.strip() and not line.endswith(":")))
        return 0
    if opts.experiment is not None and opts.experiment < 1:
        raise UsageError(f"--experiment must be a positive experiment id, got {opts.experiment}")
    post_result = _result_poster(opts, rest) if opts.post or opts.experiment is not None else None
    return gemm_main(rest, post_result=post_result) or 0
