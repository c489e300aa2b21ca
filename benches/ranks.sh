#!/usr/bin/env bash
# The step of a partitioned plan four ways, measured in one run: on N MPI processes (one per
# device), on N processes meeting over TCP (torchrun-style variables, no MPI), on N rank
# threads in one process (--gpus N), and on one device (--gpus 1, the same per-shard plan); then the fixed-tree all-reduce against MPI_Allreduce on the same buffers
# (`parallax comm-check --bench`). Prints each model's median step times and their ratios.
# Needs Open MPI and a build with `--features mpi`. Usage: benches/ranks.sh [N] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2}
steps=${2:-30}
cargo build --release --quiet --features mpi
bin=target/release/parallax
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['step_time_ms_median'])" "$1/summary.json"; }
# N processes with torchrun's variables, by hand (rank 0 listens at a port picked per run).
tcp() {
    local port=$((20000 + RANDOM % 20000)) pids=() r
    for r in $(seq 0 $((n - 1))); do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            "$bin" train "$@" >/dev/null 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
}
echo "| model | one device | $n rank threads | $n MPI processes | $n TCP processes | threads / one | MPI / threads | TCP / MPI |"
echo "|---|---|---|---|---|---|---|---|"
for model in mlp cnn transformer; do
    f=models/$model.ron
    "$bin" train "$f" --steps "$steps" --gpus 1 --run-dir "$tmp/$model-one" >/dev/null 2>&1
    "$bin" train "$f" --steps "$steps" --gpus "$n" --run-dir "$tmp/$model-threads" >/dev/null 2>&1
    mpirun --oversubscribe -np "$n" "$bin" train "$f" --steps "$steps" --run-dir "$tmp/$model-mpi" >/dev/null 2>&1
    tcp "$f" --steps "$steps" --run-dir "$tmp/$model-tcp"
    for way in mpi tcp; do
        cmp -s "$tmp/$model-one/final.safetensors" "$tmp/$model-$way/final.safetensors" \
            || { echo "$model: the $way processes' weights differ from one device's" >&2; exit 1; }
    done
    one=$(median "$tmp/$model-one"); th=$(median "$tmp/$model-threads"); mp=$(median "$tmp/$model-mpi"); tc=$(median "$tmp/$model-tcp")
    python3 -c "import sys; o,t,m,c=map(float,sys.argv[2:]); print(f'| {sys.argv[1]} | {o:.2f} ms | {t:.2f} ms | {m:.2f} ms | {c:.2f} ms | {t/o:.2f} | {m/t:.2f} | {c/m:.2f} |')" "$model" "$one" "$th" "$mp" "$tc"
done
echo
mpirun --oversubscribe -np "$n" "$bin" comm-check --bench
