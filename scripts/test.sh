#!/usr/bin/env bash
# One command on a fresh machine: install, start the local services the tests use, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
. .venv/bin/activate

# Real services for the integration tests: PostgreSQL and Redis on this machine.
if ! redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
fi
for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && break; sleep 1; done
# Headless Chromium for the dashboard's browser tests (Debian's package; Playwright drives it), and a real Slurm
# (slurmctld, slurmd, munge from Debian) for the cluster tests, which start their own daemons.
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null
fi

if [ -z "${PLAB_DATA_DIR:-}" ] && [ -d ../shared/data ]; then export PLAB_DATA_DIR="$(cd ../shared/data && pwd)"; fi
export PYTHONUNBUFFERED=1
# With several pytest workers on this many cores, one intra-op thread per process (a second one spins against
# the other worker's).
if [ "${PLAB_TEST_WORKERS:-4}" -gt 1 ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
# Four pytest workers on a 2-core machine: the CPU-bound tests run one torch thread each (tests/training,
# tests/precision conftests), and the service, cluster and browser tests spend much of their time waiting on other
# processes (a served stack, slurmd, Chromium). With two workers the cores were busy 1.7 of 2 on average and a fresh
# clone's suite took 902 s; with three, 808 s (2026-11-26). On 2026-11-27, a slower day on this machine, three took
# 977 s and four 881 s, fresh clones of the same tests one after the other; a third fresh clone, four workers, took
# 1,033 s: the day's spread is as large as the gain (PLAB_TEST_WORKERS=N to change it).
exec python -m pytest -q -p no:cacheprovider --durations=40 -n "${PLAB_TEST_WORKERS:-4}" --dist worksteal "$@"
