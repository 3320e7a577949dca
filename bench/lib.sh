#!/usr/bin/env bash
# Shared by bench/run (in-process) and bench/kafka: the database, the
# seeded pgbench workload and the latency query. Needs SKEIN_PG_URL,
# SKEIN_SOURCE_URL, OUT, PER_TX, AGGREGATES, SEED set by the caller.

admin() { psql "$SKEIN_PG_URL" -v ON_ERROR_STOP=1 -Atq "$@"; }
src() { psql "$SKEIN_SOURCE_URL" -v ON_ERROR_STOP=1 -Atq "$@"; }
now() { date +%s.%N; }
# Rows PostgreSQL counts as inserted, updated or deleted (not statements).
changes_so_far() {
  src -c "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables WHERE schemaname = 'public'"
}

# bench_db DB: a fresh database with the quickstart schema, and the pgbench
# transaction script ($PER_TX random changes) in $OUT/tx.pgbench.
bench_db() {
  local db=$1
  admin -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '$db'" >/dev/null
  admin -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" 2>/dev/null
  admin -c "CREATE DATABASE $db"
  src -q -f examples/quickstart/schema.sql 2>/dev/null
  { echo "BEGIN;"; for _ in $(seq 1 "$PER_TX"); do grep -v '^--' bench/workload.pgbench; done; echo "COMMIT;"; } > "$OUT/tx.pgbench"
}

# bench_pgbench NAME SEED ARGS...: plays the workload (2 clients) and
# prints the number of changed rows.
bench_pgbench() {
  local name=$1 seed=$2 before; shift 2
  before=$(changes_so_far)
  pgbench -n -c 2 -j 2 --random-seed="$seed" -D aggregates="$AGGREGATES" -D addresses=$((AGGREGATES * 2)) \
    -f "$OUT/tx.pgbench" "$@" "$SKEIN_SOURCE_URL" > "$OUT/pgbench-$name.txt"
  sleep 1.5 # statistics reach pg_stat_user_tables within a second
  echo $(( $(changes_so_far) - before ))
}

# bench_outbox_latency MIN_ID: "events p50 p99 max" of source commit ->
# outbox insert, in ms, over outbox rows with id > MIN_ID.
bench_outbox_latency() {
  src -F' ' -c "
    SELECT count(*),
           round(1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM enqueued_at - commit_time))::numeric, 1),
           round(1000 * percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM enqueued_at - commit_time))::numeric, 1),
           round(1000 * max(extract(epoch FROM enqueued_at - commit_time))::numeric, 1)
    FROM skein.outbox WHERE id > $1"
}

peak_rss_mib() { awk '/VmHWM/ {printf "%d", $2 / 1024}' "/proc/$1/status"; }
