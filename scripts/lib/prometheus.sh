# Installs what tests/metrics.rs reads the metrics with: Prometheus'
# `promtool` (its `check metrics` lints the text format and the naming
# conventions) and Python's prometheus_client text parser, for the system
# Python (/usr/bin/python3, what tests/metrics.rs runs). Debian packages,
# installed once.
# usage: source scripts/lib/prometheus.sh
if ! command -v promtool >/dev/null || ! /usr/bin/python3 -c 'import prometheus_client' 2>/dev/null; then
  echo "installing promtool and python3-prometheus-client" >&2
  apt-get update -q >&2 && apt-get install -y -q --no-install-recommends prometheus python3-prometheus-client >&2
fi
