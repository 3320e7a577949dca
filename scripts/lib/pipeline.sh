#!/usr/bin/env bash
# Shell helpers around a running `skein run` (quickstart, benchmark).
# usage: source scripts/lib/pipeline.sh; needs `src` (psql on the source DB).

# skein_target_dir: where cargo puts what it builds, as cargo reports it
# (CARGO_TARGET_DIR, a target-dir in .cargo/config, or ./target), absolute.
skein_target_dir() {
  local dir
  dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  [ -n "$dir" ] || { echo "cargo metadata named no target directory" >&2; return 1; }
  echo "$dir"
}

# skein_wait_streaming SLOT PID LOG: waits until a walsender streams SLOT
# (not merely an active slot: it is also active while being created).
skein_wait_streaming() {
  local slot=$1 pid=$2 log=$3
  for _ in $(seq 1 300); do
    [ "$(src -c "SELECT count(*) FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = '$slot'")" = 1 ] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log"; return 1; }
    sleep 0.1
  done
  echo "skein run did not start streaming in 30 s" >&2; cat "$log"; return 1
}

# skein_wait_settled SLOT PID LOG SECONDS: waits until everything committed so
# far is consumed (a probe message's LSN is confirmed) and relayed.
skein_wait_settled() {
  local slot=$1 pid=$2 log=$3 secs=$4 probe done
  probe=$(src -c "SELECT pg_logical_emit_message(true, 'skein.probe', '')")
  for _ in $(seq 1 $((secs * 10))); do
    done=$(src -c "SELECT (SELECT confirmed_flush_lsn >= '$probe' FROM pg_replication_slots WHERE slot_name = '$slot')
                      AND NOT EXISTS (SELECT 1 FROM skein.outbox WHERE dequeued_at IS NULL)")
    [ "$done" = t ] && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log"; return 1; }
    sleep 0.1
  done
  echo "pipeline did not catch up in $secs s" >&2; cat "$log"; return 1
}

# skein_wait_kafka_settled CONFIG SLOT SECONDS: over Kafka, waits until the
# extractor confirmed everything committed so far, every partition's
# progress is at the log end and the outbox is relayed (`skein status`).
skein_wait_kafka_settled() {
  local cfg=$1 slot=$2 secs=$3 probe
  probe=$(src -c "SELECT pg_logical_emit_message(true, 'skein.probe', '')")
  for _ in $(seq 1 $((secs * 5))); do
    if [ "$(src -c "SELECT confirmed_flush_lsn >= '$probe' FROM pg_replication_slots WHERE slot_name = '$slot'")" = t ] &&
       "$SKEIN" status --config "$cfg" 2>/dev/null |
         python3 -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if s["transport_lag"] == 0 and s["outbox"]["pending"] == 0 else 1)'; then
      return 0
    fi
    sleep 0.2
  done
  echo "pipeline did not catch up in $secs s" >&2; return 1
}
