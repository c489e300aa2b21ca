#!/usr/bin/env bash
# Is loading hidden behind the step? Trains, with the release binary on THREADS threads (default
# 2), the bench transformer's block as a language model on the Tiny Shakespeare token files
# (benches/models/gpt-tokens.ron: memory-mapped windows), and prints the share of the time the
# steps waited for their batch (summary.json's data_wait_share; the target is under 5%), the
# median step and the windows per second.
#
#   benches/loader.sh [STEPS] [THREADS]      (defaults 200 and 2)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-200}
threads=${2:-2}
export RAYON_NUM_THREADS=$threads
cargo build --release --quiet --bin parallax
bin=target/release/parallax
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1/summary.json" "$2"; }

echo "| data | steps | median step (ms) | waited for data | samples/s |"
echo "|---|---|---|---|---|"
run() {
    local name=$1 file=$2
    "$bin" train "$file" --steps "$steps" --run-dir "$tmp/$name" >/dev/null 2>&1
    awk -v n="$name" -v s="$steps" -v m="$(field "$tmp/$name" step_time_ms_median)" \
        -v w="$(field "$tmp/$name" data_wait_share)" -v r="$(field "$tmp/$name" samples_per_sec)" \
        'BEGIN { printf "| %s | %d | %.2f | %.2f%% | %.0f |\n", n, s, m, 100 * w, r }'
}
run "token file (gpt-tokens)" benches/models/gpt-tokens.ron
