#!/usr/bin/env bash
# Headless Locust against a running local server (fly-serve serve, or
# python -m deployments.launch): 1, 4 and 8 users, each bounded in time and request count.
#   loadtest/run.sh            # FLY_MODE=ar loadtest/run.sh for the baseline
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${HOST:-http://127.0.0.1:8000}
RUN_TIME=${RUN_TIME:-120s}
mkdir -p loadtest/results
for users in 1 4 8; do
  locust -f loadtest/locustfile.py --headless --host "$HOST" -u "$users" -r "$users" --run-time "$RUN_TIME" \
    --stop-timeout 60 --only-summary --csv "loadtest/results/${FLY_MODE:-fly}-u${users}"
done
