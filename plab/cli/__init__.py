"""`plab`: the command line of Precision Lab (`python -m plab.cli` runs the same).

    plab demo [--no-serve]        embedded one-shot: server + worker + a BF16-vs-formats comparison (SQLite, no services)
    plab serve                    the API and dashboard
    plab worker [--gpus 0,1]      a Celery worker (one job per GPU slot)
    plab db upgrade               apply database migrations
    plab token create|list|revoke scoped API tokens
    plab submit FILE              create an experiment from a YAML/JSON file through the API
    plab train FILE               train one run directly, no server
    plab eval ...                 evaluate checkpoints with lm-evaluation-harness
    plab gemm-bench ...           per-layer GEMM benchmark

One module per command group; each adds its subcommands to the parser. `eval` and `gemm-bench` hand their
arguments to the parsers of training.evaluation and training.gemm, so they are dispatched before argparse.
"""
from __future__ import annotations

import argparse
import sys

from plab.cli import demo, runs, services, tokens
from plab.cli.common import UsageError
from plab.cli.evaluate import cmd_eval
from plab.cli.gemm import cmd_gemm
from plab.settings import SettingsError

DELEGATED = {"eval": cmd_eval, "gemm-bench": cmd_gemm}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plab", description="Precision Lab: low-precision training against BF16.")
    sub = p.add_subparsers(dest="command", required=True)
    services.add_parsers(sub)
    runs.add_parsers(sub)
    tokens.add_parsers(sub)
    demo.add_parser(sub)
    sub.add_parser("eval", help="evaluate with lm-evaluation-harness (plab eval --help)", add_help=False)
    sub.add_parser("gemm-bench", help="per-layer GEMM benchmark (plab gemm-bench --help)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in DELEGATED:
            return DELEGATED[argv[0]](argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (UsageError, SettingsError) as e:
        print(f"plab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, without a traceback
        hint = " (the same command resumes the run from its last checkpoint)" if argv[:1] == ["train"] else ""
        print(f"plab: interrupted{hint}", file=sys.stderr)
        return 130
