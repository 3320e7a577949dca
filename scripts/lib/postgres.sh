#!/usr/bin/env bash
# Starts a private, throwaway PostgreSQL with wal_level=logical.
# usage: source scripts/lib/postgres.sh   (needs root, as on CI; the server runs as 'postgres')
# Exports SKEIN_PG_URL (admin URL) and registers a stop on EXIT unless SKEIN_PG_KEEP=1.
# Honors an existing SKEIN_PG_URL: then nothing is started.
set -euo pipefail
if [ -n "${SKEIN_PG_URL:-}" ]; then
  echo "using PostgreSQL at SKEIN_PG_URL" >&2
  return 0 2>/dev/null || exit 0
fi
PG_PORT=${PG_PORT:-55432}
PG_BASE=${PG_BASE:-/tmp/skein-pg-$PG_PORT}
PGBIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$PGBIN" ] || [ ! -x "$PGBIN/initdb" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q && apt-get install -y -q --no-install-recommends postgresql postgresql-client
  PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
fi
id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
if [ -f "$PG_BASE/data/postmaster.pid" ]; then
  runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PG_BASE/data" -m immediate stop >/dev/null 2>&1 || true
fi
rm -rf "$PG_BASE"; mkdir -p "$PG_BASE/data"; touch "$PG_BASE/pg.log"
chown -R postgres: "$PG_BASE"; chmod 700 "$PG_BASE/data"
runuser -u postgres -- "$PGBIN/initdb" -D "$PG_BASE/data" -U postgres -A trust -E UTF8 --no-locale --no-sync >"$PG_BASE/initdb.log"
cat >>"$PG_BASE/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_BASE'
wal_level = logical
max_replication_slots = 64
max_wal_senders = 64
max_connections = 300
fsync = off                 # throwaway cluster: speed over durability
full_page_writes = off
# keep synchronous_commit = on: a just-committed transaction must be visible to decoding
CONF
if ! runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PG_BASE/data" -l "$PG_BASE/pg.log" -w -t 60 start >/dev/null; then
  cat "$PG_BASE/pg.log"; exit 1
fi
if [ "${SKEIN_PG_KEEP:-0}" != 1 ]; then
  trap 'runuser -u postgres -- "'"$PGBIN"'/pg_ctl" -D "'"$PG_BASE"'/data" -m immediate stop >/dev/null 2>&1 || true' EXIT
fi
export SKEIN_PG_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
export PATH="$PGBIN:$PATH"
echo "PostgreSQL ready at $SKEIN_PG_URL ($(psql "$SKEIN_PG_URL" -Atc "select current_setting('server_version')||', wal_level='||current_setting('wal_level')"))" >&2
