#!/usr/bin/env bash
# Start or stop a throwaway PostgreSQL 15 cluster on a free loopback port.
#   eval "$(tools/pg_cluster.sh start DIR)"   # exports TR_TEST_POSTGRES_URL
#   tools/pg_cluster.sh stop DIR
# Runs the server as user postgres when invoked as root (initdb refuses root).
set -euo pipefail
cmd=${1:?usage: pg_cluster.sh start|stop DIR}
dir=${2:?usage: pg_cluster.sh start|stop DIR}
bin=${PG_BIN:-/usr/lib/postgresql/15/bin}
as_pg=()
if [ "$(id -u)" = 0 ]; then as_pg=(runuser -u postgres --); fi

case "$cmd" in
start)
  [ -x "$bin/initdb" ] || { echo "PostgreSQL 15 not found in $bin (apt-get install postgresql-15)" >&2; exit 1; }
  mkdir -p "$dir"
  [ "$(id -u)" = 0 ] && chown postgres "$dir" && chmod 700 "$dir"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "${as_pg[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1
  "${as_pg[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w \
    -o "-p $port -c listen_addresses=127.0.0.1 -k $dir -c fsync=on -c max_connections=200" start >&2
  "${as_pg[@]}" "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -c "CREATE DATABASE tr_test" >&2
  echo "export TR_TEST_POSTGRES_URL=postgresql+asyncpg://postgres@127.0.0.1:$port/tr_test"
  ;;
stop)
  [ -d "$dir/data" ] && "${as_pg[@]}" "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >&2 || true
  ;;
*) echo "usage: pg_cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
