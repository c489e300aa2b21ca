#!/usr/bin/env bash
# Parallax's CPU executor against PyTorch (eager, fp32, 2 threads) on the models of
# benches/models/: milliseconds of one training step (forward, loss, backward, SGD with
# momentum) after warm-up, and their ratio (Parallax / PyTorch; above 1 is slower).
#
#   benches/compare.sh [WARMUP] [ROUNDS] [CHUNK]      (defaults 10, 40 and 10)
#
# Both run side by side in one process pair (benches/pytorch_compare.py --paired): after the
# warm-up, each round times CHUNK steps of Parallax and CHUNK of PyTorch back to back (10 ms
# apart, so that one side's spinning threads are done before the other's chunk), the first
# side alternating, so a busy spell of a shared machine falls on both. The table gives
# each side's median and least step over all rounds, and the median over rounds of the ratio
# of the two chunks' medians (the paired ratio: the figure to quote). A line before each row
# gives that ratio in the rounds each side went first, and the rounds' quartiles: a bound such
# as "at most 0.8x" holds in a run whose upper quartile is under it. A side's first steps
# after the other's chunk run with cold caches: with chunks of 3 the MLP's (1-2 ms steps) gave
# 0.50x in the rounds Parallax went first and 0.90x in the others; with 10, 0.49x and 0.49x.
#
# Then the limit: the CPU's fp32 FMA peak on the same threads (runtime/examples/fma_peak.rs),
# and per model the FLOPs of a step (the op table's cost rules), the GFLOP/s each side
# reached at its median step, each side's share of the peak, and the share Parallax would
# need to take 0.8x PyTorch's median step (PyTorch's share / 0.8): above about 90%, a step
# that is not all products cannot get there.
#
# Without PyTorch it says so and prints Parallax's numbers alone.
#
# With ISA=avx2 in the environment, both sides stop at AVX2, to measure the AVX2 paths on an
# AVX-512 machine: Parallax built without the GEMM crates' AVX-512 kernels (in
# target/avx2/) and run with PARALLAX_NO_AVX512, PyTorch with ATEN_CPU_CAPABILITY,
# ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS; the peak is then AVX2's.
set -euo pipefail

cd "$(dirname "$0")/.."
WARMUP=${1:-10}
ROUNDS=${2:-40}
CHUNK=${3:-10}
THREADS=2
MODELS=(mlp cnn transformer transformer-512)
export RAYON_NUM_THREADS=$THREADS

FEATURES=()
if [ "${ISA:-}" = avx2 ]; then
    export PARALLAX_NO_AVX512=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2 MMTEST_FEATURE=sse2,avx,avx2,fma
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}/avx2
    FEATURES=(--no-default-features)
fi

echo "building runtime/examples/step_time.rs (release)..." >&2
cargo build --release -q -p parallax-runtime "${FEATURES[@]}" --example step_time --example fma_peak
RELEASE=${CARGO_TARGET_DIR:-target}/release
BIN=$RELEASE/examples/step_time
# Each model's median milliseconds, per side, for the table of the limit.
MEDIANS=$(mktemp)
trap 'rm -f "$MEDIANS"' EXIT

# The peak first, on an idle machine: measured after the paired runs it came out at half
# (PyTorch's worker threads still spinning), and shares of the peak above 100%.
peak_line=$("$RELEASE/examples/fma_peak" "$THREADS")

PYTHON=${PYTHON:-python3}
echo
echo "training step in ms: $ROUNDS rounds of $CHUNK steps after $WARMUP warm-up; $THREADS threads, fp32"
if command -v "$PYTHON" >/dev/null && "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    printf '%-12s %12s %12s %12s %12s %8s\n' model "Parallax med" "PyTorch med" "Parallax min" \
        "PyTorch min" ratio
    "$PYTHON" benches/pytorch_compare.py --paired "$BIN" --warmup "$WARMUP" --rounds "$ROUNDS" \
        --chunk "$CHUNK" --threads "$THREADS" "${MODELS[@]}" |
        while read -r m px pt pxmin ptmin ratio; do
            printf '%-12s %12.3f %12.3f %12.3f %12.3f %7.2fx\n' "$m" "$px" "$pt" "$pxmin" "$ptmin" \
                "$ratio"
            echo "$m $px $pt" >>"$MEDIANS"
        done
else
    echo "PyTorch is not installed for $PYTHON (pip install torch): Parallax's numbers alone." >&2
    printf '%-12s %12s %12s\n' model "Parallax med" "Parallax min"
    for m in "${MODELS[@]}"; do
        line=$("$BIN" "benches/models/$m.ron" "$WARMUP" $((ROUNDS * CHUNK)))
        med=$(awk '{ print $3 }' <<<"$line")
        least=$(awk '{ v = $6; gsub(/,/, "", v); print v }' <<<"$line")
        printf '%-12s %12.3f %12.3f\n' "$m" "$med" "$least"
        echo "$m $med -" >>"$MEDIANS"
    done
fi

peak=$(awk '{ print $3 }' <<<"$peak_line")
echo
echo "$peak_line"
echo "GFLOP/s at the median step, each side's share of the peak, and the share Parallax would need"
echo "for 0.8x PyTorch's median step (the issue's target):"
printf '%-16s %11s %16s %16s %8s %8s %10s\n' model "GFLOP/step" "Parallax GFLOP/s" "PyTorch GFLOP/s" \
    "of peak" PyTorch "0.8x needs"
while read -r m px pt; do
    flops=$("$BIN" "benches/models/$m.ron" --flops)
    awk -v m="$m" -v f="$flops" -v px="$px" -v pt="$pt" -v peak="$peak" 'BEGIN {
        g = f / 1e9; a = g / (px / 1e3);
        b = (pt == "-") ? "-" : sprintf("%.1f", g / (pt / 1e3));
        c = (pt == "-") ? "-" : sprintf("%.0f%%", 100 * b / peak);
        d = (pt == "-") ? "-" : sprintf("%.0f%%", 100 * b / 0.8 / peak);
        printf "%-16s %11.3f %16.1f %16s %7.0f%% %8s %10s\n", m, g, a, b, 100 * a / peak, c, d }'
done <"$MEDIANS"
