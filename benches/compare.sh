#!/usr/bin/env bash
# Parallax's CPU executor against PyTorch (eager, fp32, 2 threads) on the models of
# benches/models/: the median milliseconds of one training step (forward, loss, backward, SGD
# with momentum) after warm-up, and their ratio (Parallax / PyTorch; above 1 is slower); also
# the least step time of each side over all rounds, and its ratio.
# Each round runs every model on both, one after the other; the table gives the median over
# the rounds, so a busy spell of a shared machine moves both sides or neither.
#
#   benches/compare.sh [WARMUP] [STEPS] [ROUNDS]      (defaults 10, 30 and 3)
#
# Without PyTorch it says so and prints Parallax's numbers alone.
set -euo pipefail

cd "$(dirname "$0")/.."
WARMUP=${1:-10}
STEPS=${2:-30}
ROUNDS=${3:-3}
THREADS=2
MODELS=(mlp cnn transformer)
export RAYON_NUM_THREADS=$THREADS

echo "building runtime/examples/step_time.rs (release)..." >&2
cargo build --release -q -p parallax-runtime --example step_time
BIN=target/release/examples/step_time

PYTHON=${PYTHON:-python3}
have_torch=0
if command -v "$PYTHON" >/dev/null && "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    have_torch=1
else
    echo "PyTorch is not installed for $PYTHON (pip install torch): Parallax's numbers alone." >&2
fi

# Model by model, Parallax then PyTorch, so that both see the machine in the same state.
declare -A PX PT PXMIN PTMIN
field() { awk -v k="$1" '{ for (i = 1; i < NF; i++) if ($i == k) { v = $(i + 1); gsub(/[,(]/, "", v); print v } }'; }
for round in $(seq "$ROUNDS"); do
    for m in "${MODELS[@]}"; do
        line=$("$BIN" "benches/models/$m.ron" "$WARMUP" "$STEPS")
        echo "round $round parallax: $line" >&2
        PX[$m]+=" $(field median <<<"$line")"
        PXMIN[$m]+=" $(field '(min' <<<"$line")"
        if [ "$have_torch" = 1 ]; then
            out=$("$PYTHON" benches/pytorch_compare.py --warmup "$WARMUP" --steps "$STEPS" \
                --threads "$THREADS" "$m")
            read -r _ median least <<<"$out"
            PT[$m]+=" $median"
            PTMIN[$m]+=" $least"
            echo "round $round pytorch:  $m median $median ms/step (min $least)" >&2
        fi
    done
done

# The median of the rounds' medians, and the least step of all rounds (the machine at its
# quietest: a shared machine's busy spells slow both sides, but not always equally).
median() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
least() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -g | head -1; }
for m in "${MODELS[@]}"; do
    PX[$m]=$(median "${PX[$m]}")
    PXMIN[$m]=$(least "${PXMIN[$m]}")
    if [ "$have_torch" = 1 ]; then
        PT[$m]=$(median "${PT[$m]}")
        PTMIN[$m]=$(least "${PTMIN[$m]}")
    fi
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
echo
echo "training step: median of $STEPS after $WARMUP warm-up (median of $ROUNDS rounds), and the least step of all rounds; $THREADS threads, fp32"
if [ "$have_torch" = 1 ]; then
    printf '%-12s %12s %12s %7s   %12s %12s %7s\n' model "Parallax med" "PyTorch med" ratio "Parallax min" "PyTorch min" ratio
    for m in "${MODELS[@]}"; do
        printf '%-12s %12.3f %12.3f %7s   %12.3f %12.3f %7s\n' "$m" "${PX[$m]}" "${PT[$m]}" \
            "$(ratio "${PX[$m]}" "${PT[$m]}")" "${PXMIN[$m]}" "${PTMIN[$m]}" \
            "$(ratio "${PXMIN[$m]}" "${PTMIN[$m]}")"
    done
else
    printf '%-12s %12s %12s\n' model "Parallax med" "Parallax min"
    for m in "${MODELS[@]}"; do
        printf '%-12s %12.3f %12.3f\n' "$m" "${PX[$m]}" "${PXMIN[$m]}"
    done
fi
