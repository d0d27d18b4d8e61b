#!/usr/bin/env bash
# One command on a fresh machine: install, then run the embedded demo (SQLite + embedded broker, no services).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
. .venv/bin/activate
if [ -z "${PLAB_DATA_DIR:-}" ] && [ -d ../shared/data ]; then export PLAB_DATA_DIR="$(cd ../shared/data && pwd)"; fi
exec plab demo "$@"
