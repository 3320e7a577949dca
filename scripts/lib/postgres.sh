#!/usr/bin/env bash
# Private, throwaway PostgreSQL servers for the quickstart, the tests and the
# benchmark. usage: source scripts/lib/postgres.sh
# (needs root, as on CI; the servers run as 'postgres')
#
# Sourcing starts one server with wal_level=logical on PG_PORT (55432) and
# exports SKEIN_PG_URL (its admin URL), unless SKEIN_PG_URL is already set.
# `skein_pg_start PORT WAL_LEVEL` starts another one and prints its URL.
# Every server started here is stopped on EXIT unless SKEIN_PG_KEEP=1.
set -euo pipefail

skein_pg_bin() {
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
  if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2 && apt-get install -y -q --no-install-recommends postgresql postgresql-client >&2
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  fi
  echo "$bin"
}

SKEIN_PG_STOPS=${SKEIN_PG_STOPS:-}
skein_pg_stop_all() {
  local d
  for d in $SKEIN_PG_STOPS; do
    runuser -u postgres -- "$PGBIN/pg_ctl" -D "$d" -m immediate stop >/dev/null 2>&1 || true
  done
}

# skein_pg_start PORT WAL_LEVEL: (re)creates the cluster under /tmp/skein-pg-PORT
# and prints postgres://postgres@127.0.0.1:PORT/postgres.
skein_pg_start() {
  local port=$1 wal=$2 base=/tmp/skein-pg-$1
  if [ -f "$base/data/postmaster.pid" ]; then
    runuser -u postgres -- "$PGBIN/pg_ctl" -D "$base/data" -m immediate stop >/dev/null 2>&1 || true
  fi
  rm -rf "$base"; mkdir -p "$base/data"; touch "$base/pg.log"
  chown -R postgres: "$base"; chmod 700 "$base/data"
  runuser -u postgres -- "$PGBIN/initdb" -D "$base/data" -U postgres -A trust -E UTF8 --no-locale --no-sync >"$base/initdb.log"
  cat >>"$base/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$base'
wal_level = $wal
max_replication_slots = 256
max_wal_senders = 64
max_connections = 300
fsync = off                 # throwaway cluster: speed over durability
full_page_writes = off
# keep synchronous_commit = on: a just-committed transaction must be visible to decoding
CONF
  if ! runuser -u postgres -- "$PGBIN/pg_ctl" -D "$base/data" -l "$base/pg.log" -w -t 60 start >/dev/null; then
    cat "$base/pg.log" >&2; return 1
  fi
  local url="postgres://postgres@127.0.0.1:$port/postgres"
  echo "PostgreSQL ready at $url ($("$PGBIN/psql" "$url" -Atc "select current_setting('server_version')||', wal_level='||current_setting('wal_level')"))" >&2
  echo "$url"
}

# skein_pg_start_tls PORT: a server with ssl=on whose certificate (signed by
# a CA generated here) names only `localhost`, and a second CA that signed
# nothing. Role `skein_tls` (password `skein_tls`, superuser) may connect
# over TCP only with TLS; `postgres` connects without, as the tests' admin.
# Prints the admin URL; the PEM files are in /tmp/skein-pg-PORT/tls
# (ca.pem, wrong-ca.pem).
skein_pg_start_tls() {
  local port=$1 base=/tmp/skein-pg-$1 url
  command -v openssl >/dev/null || { apt-get update -q >&2 && apt-get install -y -q openssl >&2; }
  url=$(skein_pg_start "$port" logical)
  local tls=$base/tls data=$base/data
  mkdir -p "$tls"
  (
    cd "$tls"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=skein test CA" \
      -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=skein wrong CA" \
      -keyout wrong-ca.key -out wrong-ca.pem 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
      -keyout server.key -out server.csr 2>/dev/null
    printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >ext.cnf
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
      -extfile ext.cnf -out server.pem 2>/dev/null
  )
  install -o postgres -m 600 "$tls/server.key" "$data/server.key"
  install -o postgres -m 644 "$tls/server.pem" "$data/server.crt"
  cat >>"$data/postgresql.conf" <<CONF
ssl = on
ssl_cert_file = 'server.crt'
ssl_key_file = 'server.key'
password_encryption = 'scram-sha-256'
CONF
  cat >"$data/pg_hba.conf" <<HBA
local     all  all                     trust
hostnossl all  skein_tls  0.0.0.0/0    reject
hostssl   all  skein_tls  127.0.0.1/32 scram-sha-256
host      all  postgres   127.0.0.1/32 trust
HBA
  runuser -u postgres -- "$PGBIN/pg_ctl" -D "$data" -l "$base/pg.log" -w -t 60 restart >/dev/null \
    || { cat "$base/pg.log" >&2; return 1; }
  "$PGBIN/psql" "$url" -qAtc "CREATE ROLE skein_tls LOGIN SUPERUSER REPLICATION PASSWORD 'skein_tls'" >&2
  echo "$url"
}

PGBIN=$(skein_pg_bin)
export PATH="$PGBIN:$PATH"
id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
if [ "${SKEIN_PG_KEEP:-0}" != 1 ]; then
  trap skein_pg_stop_all EXIT
fi

# Registers the cluster of PORT for the stop on EXIT (a function's own
# variables do not survive the $(...) it is called in).
skein_pg_register() { SKEIN_PG_STOPS="$SKEIN_PG_STOPS /tmp/skein-pg-$1/data"; }

if [ -n "${SKEIN_PG_URL:-}" ]; then
  echo "using PostgreSQL at SKEIN_PG_URL" >&2
else
  PG_PORT=${PG_PORT:-55432}
  SKEIN_PG_URL=$(skein_pg_start "$PG_PORT" logical)
  skein_pg_register "$PG_PORT"
  export SKEIN_PG_URL
fi
