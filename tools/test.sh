#!/usr/bin/env bash
# Run the whole test suite on both store backends: starts a throwaway
# PostgreSQL 15 cluster on a free loopback port, runs pytest, always stops it.
#   bash tools/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
pgdir=$(mktemp -d /tmp/tr-pg.XXXXXX)
chmod 755 "$pgdir"
cleanup() { bash tools/pg_cluster.sh stop "$pgdir/cluster" || true; rm -rf "$pgdir"; }
trap cleanup EXIT INT TERM
eval "$(bash tools/pg_cluster.sh start "$pgdir/cluster")"
export TR_TEST_POSTGRES_URL
python3 -m pytest -q -p no:cacheprovider "$@"
