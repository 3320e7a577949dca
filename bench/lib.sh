#!/usr/bin/env bash
# Shared by bench/run (in-process), bench/kafka and bench/huge-tx: the
# database, the config, starting and stopping `skein run`, the seeded
# pgbench workload and the latency query. Needs SKEIN_PG_URL,
# SKEIN_SOURCE_URL and OUT set by the caller; the pgbench workload also
# PER_TX, AGGREGATES and SEED, the config and `skein run` SKEIN.

admin() { psql "$SKEIN_PG_URL" -v ON_ERROR_STOP=1 -Atq "$@"; }
src() { psql "$SKEIN_SOURCE_URL" -v ON_ERROR_STOP=1 -Atq "$@"; }
now() { date +%s.%N; }
# Rows PostgreSQL counts as inserted, updated or deleted (not statements).
changes_so_far() {
  src -c "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables WHERE schemaname = 'public'"
}

# bench_drop_db DB: drops DB and its replication slots, if there.
bench_drop_db() {
  admin -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '$1'" >/dev/null
  admin -c "DROP DATABASE IF EXISTS $1 WITH (FORCE)" 2>/dev/null
}

# bench_db DB: a fresh database with the quickstart schema, and (when
# PER_TX is set) the pgbench transaction script ($PER_TX random changes)
# in $OUT/tx.pgbench.
bench_db() {
  local db=$1
  bench_drop_db "$db"
  admin -c "CREATE DATABASE $db"
  src -q -f examples/quickstart/schema.sql 2>/dev/null
  if [ -n "${PER_TX:-}" ]; then
    { echo "BEGIN;"; for _ in $(seq 1 "$PER_TX"); do grep -v '^--' bench/workload.pgbench; done; echo "COMMIT;"; } > "$OUT/tx.pgbench"
  fi
}

# bench_config DB [EXTRACTOR] [PARTITIONS]: the quickstart's embedded config
# in $OUT/skein.yaml (CFG), slot and publication named DB, nothing on
# stdout, EXTRACTOR (a YAML mapping) as its extractor section, PARTITIONS
# transport partitions (the quickstart's 4 if empty); then applies
# `skein sql source` and `skein sidecar migrate` to it.
bench_config() {
  CFG=$OUT/skein.yaml
  sed -e "s/skein_quickstart/$1/g" -e 's/also_stdout: true/also_stdout: false/' \
    -e "s/^  partitions: 4\$/  partitions: ${3:-4}/" \
    examples/quickstart/skein.yaml > "$CFG"
  grep -q "^  partitions: ${3:-4}\$" "$CFG" || { echo "bench_config: no partitions line to set" >&2; return 1; }
  if [ -n "${2:-}" ]; then echo "extractor: $2" >> "$CFG"; fi
  $SKEIN sql source --config "$CFG" | src -f - >/dev/null
  $SKEIN sidecar migrate --config "$CFG" >/dev/null
}

# start_skein SLOT: `skein run` on CFG in the background (PID), stderr
# appended to $OUT/skein.log, until it streams SLOT. stop_skein: SIGTERM,
# and waits for it to exit.
start_skein() {
  $SKEIN run --config "$CFG" > /dev/null 2>> "$OUT/skein.log" &
  PID=$!
  skein_wait_streaming "$1" $PID "$OUT/skein.log"
}
stop_skein() { kill -TERM $PID; wait $PID; }

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

# bench_outbox_latency MIN_ID [SKIP_S]: "events p50 p99 max" of source
# commit -> outbox insert, in ms, over outbox rows with id > MIN_ID; with
# SKIP_S, only over those enqueued SKIP_S seconds or more after the first
# of them (the steady state, past the catch-up after a start).
bench_outbox_latency() {
  src -F' ' -c "
    WITH o AS (SELECT enqueued_at, extract(epoch FROM enqueued_at - commit_time) AS l
               FROM skein.outbox WHERE id > $1),
         s AS (SELECT min(enqueued_at) + ${2:-0} * interval '1 second' AS t FROM o)
    SELECT count(*),
           round(1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY l)::numeric, 1),
           round(1000 * percentile_cont(0.99) WITHIN GROUP (ORDER BY l)::numeric, 1),
           round(1000 * max(l)::numeric, 1)
    FROM o, s WHERE o.enqueued_at >= s.t"
}

# bench_processed_at T1: when the last sidecar batch began or the relay
# last moved a cursor past sent events, whichever came later (epoch
# seconds, the sidecar's clock): the end of a backlog's processing,
# without the polling and the slot's once-a-second confirmation that the
# settled check waits for. Call it once the pipeline settled (at T1),
# before anything else is written; with neither a batch nor a cursor it
# says so and answers T1.
bench_processed_at() {
  local p
  p=$(src -c "SELECT extract(epoch FROM greatest((SELECT max(created_at) FROM skein.batch),
                                                  (SELECT max(updated_at) FROM skein.relay_cursor)))")
  if [ -z "$p" ]; then
    echo "bench_processed_at: no sidecar batch and no relay cursor; using the settled time" >&2
    p=$1
  fi
  echo "$p"
}

peak_rss_mib() { awk '/VmHWM/ {printf "%d", $2 / 1024}' "/proc/$1/status"; }
# cpu_s PID...: each process's CPU seconds so far (user + system); 0.0 for
# one not seen here (a broker on another host or of another user).
cpu_s() { local p; for p in "$@"; do awk '{printf "%.1f ", ($14 + $15) / 100}' "/proc/$p/stat" 2>/dev/null || printf '0.0 '; done; }
# walsender_report SLOT T0 T1: how long the walsender serving SLOT has run
# on a CPU and has waited in a run queue for one since it started
# (/proc/PID/schedstat of its process), against the T0..T1 drain; or a
# note that it was not found here (no walsender active, or a server in a
# container or on another host, whose pid means nothing here).
walsender_report() {
  local p gone="the source's walsender was not found on this host (a server elsewhere, or no walsender active): its CPU time is not known"
  p=$(src -c "SELECT active_pid FROM pg_replication_slots WHERE slot_name = '$1'")
  if [ -z "$p" ] || ! grep -qa walsender "/proc/$p/cmdline" 2>/dev/null; then echo "$gone"; return; fi
  awk -v t0="$2" -v t1="$3" '{ r = $1 / 1e9; w = $2 / 1e9; d = t1 - t0
    printf "the source\047s walsender (its logical decoding, single-threaded) ran %.1f s and waited %.1f s for a CPU over the %.1f s drain (%.0f %% and %.0f %%)\n", r, w, d, 100 * r / d, 100 * w / d }' \
    "/proc/$p/schedstat" 2>/dev/null || echo "$gone"
}
# busy: the machine's busy CPU time so far, in ticks.
busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
