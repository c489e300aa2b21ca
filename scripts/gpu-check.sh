#!/usr/bin/env bash
# The GPU check: for a machine with an NVIDIA GPU, driver 580 and the CUDA 13 libraries from
# Python wheels, and no Rust toolchain. Build the binary beforehand (`cargo build --release`)
# and copy it along (or point PARALLAX at it). The checks under mpirun need a second binary
# built with `--features mpi` (PARALLAX_MPI; it links libmpi, so it starts only where Open MPI
# is installed) and mpirun on the GPU machine; without them those rows say FAIL and why, and
# the GPU ranks are still checked in one process and under torchrun (no MPI). Prints a short
# table last.
#
#   scripts/gpu-check.sh            # every check
#   LOCKSTEP=1 scripts/gpu-check.sh # also compare every kernel with the CPU oracle
set -u
cd "$(dirname "$0")/.."
BIN=${PARALLAX:-target/release/parallax}
MPI_BIN=${PARALLAX_MPI:-$BIN}
if [ ! -x "$BIN" ]; then
    echo "no parallax binary at $BIN: build it with 'cargo build --release' and copy it along" >&2
    exit 1
fi
# The CUDA 13 wheels: every folder holding a shared library goes on the library path, and
# libnccl.so.2 gets the libnccl.so name cudarc looks for.
LIBS=/tmp/parallax-cuda-libs
mkdir -p "$LIBS"
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
if [ -n "$SITE" ] && [ -d "$SITE/nvidia" ]; then
    for d in $(find "$SITE/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u); do
        LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    nccl=$(find "$SITE/nvidia" -name 'libnccl.so.2' | head -1)
    [ -n "$nccl" ] && ln -sf "$nccl" "$LIBS/libnccl.so"
fi
export LD_LIBRARY_PATH="$LIBS:${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64"
export NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=WARN
LOG=$(mktemp)
# benches/models/transformer*.ron have heads 64 wide: their bf16 rows run the tensor-core
# attention forward and backward (transformer-512: several key tiles) against the oracle.
MODELS=${MODELS:-"models/mlp.ron models/cnn.ron models/transformer.ron benches/models/mlp.ron benches/models/cnn.ron benches/models/transformer.ron benches/models/transformer-512.ron"}

"$BIN" devices
if [ "${LOCKSTEP:-0}" = 1 ]; then
    for m in $MODELS; do
        echo "== lockstep $m"
        timeout 90 "$BIN" gpu-check "$m" --steps 1 --time-steps 1 --lockstep \
            | grep -v '^ROW' | head -60
    done
fi
for m in $MODELS; do
    for p in fp32 tf32 bf16; do
        echo "== $m $p"
        timeout 90 "$BIN" gpu-check "$m" --steps 3 --precision "$p" | tee -a "$LOG" \
            || echo "ROW|$m|$p|-|-|FAIL (exit $?)|-|-|-" >>"$LOG"
    done
done
# Activations stored in bf16 (two-byte loads and stores in every kernel family, GEMMs of bf16
# operands): the oracle rounds where each value is made; tolerance 2e-2.
# Lockstep too: a kernel family that loads or stores bf16 wrongly is named at once.
for m in models/mlp.ron models/cnn.ron models/transformer.ron benches/models/transformer.ron; do
    echo "== $m, activations stored in bf16 (lockstep)"
    OUT=$(mktemp)
    timeout 120 "$BIN" gpu-check "$m" --steps 3 --time-steps 1 --precision bf16 \
        --set devices.activations=Bf16 --lockstep >"$OUT" || echo "ROW|$m (bf16-stored)|bf16|-|-|FAIL (exit $?)|-|-|-" >>"$LOG"
    grep '^LOCKSTEP' "$OUT" | head -20
    grep '^ROW|' "$OUT" | sed "s#^ROW|\([^|]*\)|#ROW|\1 (bf16-stored)|#" | tee -a "$LOG"
done
echo "== benches/models/mlp-gpu.ron (timing only: too large for the CPU oracle)"
for p in fp32 tf32; do
    timeout 90 "$BIN" gpu-check benches/models/mlp-gpu.ron --steps 0 --precision "$p" | tee -a "$LOG" \
        || echo "ROW|bench-mlp-gpu|$p|-|-|FAIL|-|-|-" >>"$LOG"
done
echo "== benches/models/gpt-gpu.ron, bf16, against PyTorch eager on the same GPU and shapes"
timeout 150 "$BIN" gpu-check benches/models/gpt-gpu.ron --steps 0 --precision bf16 --time-steps 10 \
    | tee -a "$LOG" || echo "ROW|gpt-gpu|bf16|-|-|FAIL|-|-|-" >>"$LOG"
ours=$(grep '^ROW|gpt-gpu|' "$LOG" | tail -1 | cut -d'|' -f7)
if python3 -c 'import torch' 2>/dev/null; then
    TORCH=$(mktemp)
    timeout 200 python3 benches/gpu/gpt_torch.py | tee "$TORCH"
    while IFS='|' read -r _ variant ms; do
        ratio=$(awk -v a="$ours" -v b="$ms" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b; else print "-" }')
        echo "ROW|PyTorch $variant; Parallax/PyTorch $ratio|bf16|-|-|-|$ms|-|-" >>"$LOG"
    done < <(grep '^TORCH|' "$TORCH")
else
    echo "PyTorch is not installed: no comparison"
fi
echo "== benches/models/gpt-gpu.ron, bf16, GEMMs through cuBLAS instead of cuBLASLt's cached plans"
PARALLAX_CUBLASLT=0 timeout 150 "$BIN" gpu-check benches/models/gpt-gpu.ron --steps 0 --precision bf16 \
    --time-steps 10 | sed 's/^ROW|gpt-gpu|/ROW|gpt-gpu, PARALLAX_CUBLASLT=0|/' | tee -a "$LOG" \
    || echo "ROW|gpt-gpu, PARALLAX_CUBLASLT=0|bf16|-|-|FAIL|-|-|-" >>"$LOG"
echo "== benches/models/gpt-gpu.ron, bf16, biases added by a launch of their own, not in cuBLASLt's epilogue"
PARALLAX_GEMM_BIAS=0 timeout 150 "$BIN" gpu-check benches/models/gpt-gpu.ron --steps 0 --precision bf16 \
    --time-steps 10 | sed 's/^ROW|gpt-gpu|/ROW|gpt-gpu, PARALLAX_GEMM_BIAS=0|/' | tee -a "$LOG" \
    || echo "ROW|gpt-gpu, PARALLAX_GEMM_BIAS=0|bf16|-|-|FAIL|-|-|-" >>"$LOG"
echo "== benches/models/gpt-gpu.ron, bf16, activations stored in bf16"
timeout 150 "$BIN" gpu-check benches/models/gpt-gpu.ron --steps 0 --precision bf16 --time-steps 10 \
    --set devices.activations=Bf16 | sed 's/^ROW|gpt-gpu|/ROW|gpt-gpu, activations bf16|/' | tee -a "$LOG" \
    || echo "ROW|gpt-gpu, activations bf16|bf16|-|-|FAIL|-|-|-" >>"$LOG"
echo "== benches/models/gpt-gpu.ron, bf16: time per kind of kernel (attention, GEMMs, the rest)"
timeout 150 "$BIN" gpu-check benches/models/gpt-gpu.ron --steps 0 --precision bf16 --time-steps 3 \
    --profile | grep -v '^ROW|' || echo "(the profile failed)"
if python3 -c 'import torch' 2>/dev/null; then
    echo "== PyTorch at gpt-gpu's shapes: attention backends, GEMM throughput (the targets)"
    ATT=$(mktemp)
    timeout 200 python3 benches/gpu/attention_torch.py | tee "$ATT" || true
    while IFS='|' read -r kind what ms tf; do
        echo "ROW|PyTorch ${kind,,} $what|bf16|-|-|-|$ms|$tf|-" >>"$LOG"
    done < <(grep -E '^(ATT|GEMM)\|' "$ATT")
fi
echo "== train models/mlp.ron on CUDA (the main job on the GPU)"
rm -rf /tmp/parallax-gpu-run
if timeout 120 "$BIN" train models/mlp.ron --backend cuda --run-dir /tmp/parallax-gpu-run; then
    acc=$(grep -o '"val_accuracy": [0-9.]*' /tmp/parallax-gpu-run/summary.json | grep -o '[0-9.]*$')
    ms=$(grep -o '"step_time_ms_median": [0-9.]*' /tmp/parallax-gpu-run/summary.json | grep -o '[0-9.]*$')
    ok=$(awk -v a="$acc" 'BEGIN { print (a >= 0.95) ? "ok" : "FAIL" }')
    pct=$(awk -v a="$acc" 'BEGIN { printf "%.2f%%", 100 * a }')
    ms=$(awk -v m="$ms" 'BEGIN { printf "%.3f", m }')
    echo "ROW|train mlp --backend cuda, val accuracy $pct|tf32|-|-|$ok|$ms|-|-" >>"$LOG"
else
    echo "ROW|train mlp --backend cuda|tf32|-|-|FAIL|-|-|-" >>"$LOG"
fi
echo "== checkpoint and resume on CUDA (bitwise)"
rm -rf /tmp/parallax-ck1 /tmp/parallax-ck2
if timeout 60 "$BIN" train models/mlp.ron --backend cuda --steps 300 --checkpoint-every 100 \
    --run-dir /tmp/parallax-ck1 >/dev/null 2>&1; then
    cp -r /tmp/parallax-ck1 /tmp/parallax-ck2
    rm /tmp/parallax-ck2/final.safetensors /tmp/parallax-ck2/checkpoints/step-00000300.safetensors
    timeout 60 "$BIN" train --resume /tmp/parallax-ck2 --backend cuda >/dev/null 2>&1
    if cmp -s /tmp/parallax-ck1/final.safetensors /tmp/parallax-ck2/final.safetensors; then
        echo "ROW|resume from step 200 on CUDA: final.safetensors identical|tf32|-|-|ok|-|-|-" >>"$LOG"
    else
        echo "ROW|resume from step 200 on CUDA: final.safetensors identical|tf32|-|-|FAIL|-|-|-" >>"$LOG"
    fi
else
    echo "ROW|checkpointing run on CUDA|tf32|-|-|FAIL|-|-|-" >>"$LOG"
fi
echo "== collectives"
timeout 90 "$BIN" collectives-check models/mlp.ron | tee -a "$LOG" \
    || echo "ROW|collectives|fp32|-|-|FAIL|-|-|-" >>"$LOG"
echo "== NCCL ranks: comm-check --backend cuda under mpirun (a binary built with --features mpi)"
# The fixed-tree all-reduce on the GPU over NCCL against the host's sum, bit for bit: (a) one
# rank, its NCCL id broadcast over MPI; (b) two processes on the one GPU (NCCL >= 2.30 with
# NCCL_MULTI_RANK_GPU_ENABLE=1, from the nvidia-nccl-cu13 wheel; set NCCL_WHEEL to a wheel
# file where the machine has no network); (c) the same with rank 1 leaving in the middle:
# what rank 0 reports, and how long it took. Each under a hard timeout; a failure is a FAIL
# row with its reason, and the script goes on.
MPIRUN="mpirun --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH -x NCCL_SOCKET_IFNAME -x NCCL_DEBUG"
NOTES=$(mktemp)
# nccl_run NAME LIMIT CMD...: runs CMD under `timeout LIMIT`, leaving its output in $RUN_OUT,
# its exit status in $RUN_RC and its seconds in $RUN_SECS.
nccl_run() {
    local name=$1 limit=$2 start
    shift 2
    echo "-- $name"
    RUN_OUT=$(mktemp)
    start=$(date +%s.%N)
    timeout "$limit" "$@" >"$RUN_OUT" 2>&1
    RUN_RC=$?
    RUN_SECS=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
    grep -v '^ *$' "$RUN_OUT" | head -40
}
# The first error line of the last run (or its exit status), fit for a table cell.
nccl_reason() {
    local r
    r=$(grep -m1 'error' "$RUN_OUT" | tr '|' '/' | cut -c1-160)
    [ "$RUN_RC" = 124 ] && r="timed out after ${RUN_SECS}s (a hang); $r"
    echo "${r:-exit $RUN_RC}"
}
# The result hashes of a run's table (one per length and layout), to compare rank counts.
nccl_hashes() {
    grep -E '^\| [0-9]+ \|' "$RUN_OUT" | awk -F'|' '{ print $2, $4, $6 }'
}
HASH1=""
if ! command -v mpirun >/dev/null; then
    for c in "(a) 1 rank" "(b) 2 ranks on one GPU" "(c) 2 ranks, --fail-rank 1"; do
        echo "ROW|comm-check cuda $c: mpirun not found|fp32|-|-|FAIL|-|-|-" >>"$LOG"
    done
else
    nccl_run "(a) mpirun -np 1 comm-check --backend cuda" 180 \
        $MPIRUN -np 1 "$MPI_BIN" comm-check --backend cuda --timeout 60
    if [ "$RUN_RC" = 0 ] && grep -q '| yes |' "$RUN_OUT" && ! grep -q '| no |' "$RUN_OUT"; then
        HASH1=$(nccl_hashes)
        echo "ROW|comm-check cuda (a) 1 rank, NCCL id over MPI: same bits|fp32|-|-|ok|-|-|-" >>"$LOG"
    else
        echo "ROW|comm-check cuda (a) 1 rank|fp32|-|-|FAIL|-|-|-" >>"$LOG"
        echo "(a) 1 rank: $(nccl_reason)" >>"$NOTES"
    fi
    # NCCL >= 2.30 beside the binary: the wheel's libnccl.so.2 under the name cudarc opens.
    NEW=/tmp/parallax-nccl-new
    if [ ! -e "$NEW/lib/libnccl.so" ]; then
        rm -rf "$NEW" && mkdir -p "$NEW/lib"
        timeout 300 python3 -m pip install --quiet --disable-pip-version-check --no-deps \
            --target "$NEW/site" "${NCCL_WHEEL:-nvidia-nccl-cu13}" >"$NEW/pip.log" 2>&1
        so=$(find "$NEW/site" -name 'libnccl.so.2' 2>/dev/null | head -1)
        [ -n "$so" ] && ln -sf "$so" "$NEW/lib/libnccl.so"
    fi
    if [ ! -e "$NEW/lib/libnccl.so" ]; then
        why="pip install ${NCCL_WHEEL:-nvidia-nccl-cu13} failed: $(tail -1 "$NEW/pip.log" 2>/dev/null | tr '|' '/' | cut -c1-120)"
        for c in "(b) 2 ranks on one GPU" "(c) 2 ranks, --fail-rank 1"; do
            echo "ROW|comm-check cuda $c: no NCCL >= 2.30|fp32|-|-|FAIL|-|-|-" >>"$LOG"
            echo "$c: $why" >>"$NOTES"
        done
    else
        TWO="env LD_LIBRARY_PATH=$NEW/lib:$LD_LIBRARY_PATH NCCL_MULTI_RANK_GPU_ENABLE=1"
        echo "NCCL for two ranks on one GPU: $($TWO "$BIN" devices 2>&1 | grep -i nccl | head -1)"
        nccl_run "(b) mpirun -np 2 comm-check --backend cuda, one GPU" 240 \
            $TWO $MPIRUN -x NCCL_MULTI_RANK_GPU_ENABLE -np 2 "$MPI_BIN" comm-check --backend cuda --timeout 60
        if [ "$RUN_RC" = 0 ] && grep -q '| yes |' "$RUN_OUT" && ! grep -q '| no |' "$RUN_OUT"; then
            # The hashes per length and shard count must be those of one rank.
            if [ -z "$HASH1" ]; then
                same="ok"; what="same bits as the host (no 1-rank run to compare)"
            elif [ "$HASH1" = "$(nccl_hashes)" ]; then
                same="ok"; what="same bits as 1 rank"
            else
                same="FAIL"; what="bits differ from 1 rank"
            fi
            echo "ROW|comm-check cuda (b) 2 ranks on one GPU: $what|fp32|-|-|$same|-|-|-" >>"$LOG"
        else
            echo "ROW|comm-check cuda (b) 2 ranks on one GPU|fp32|-|-|FAIL|-|-|-" >>"$LOG"
            echo "(b) 2 ranks: $(nccl_reason)" >>"$NOTES"
        fi
        # mpirun must not end rank 0 when rank 1 exits, so that rank 0 shows what it sees.
        nccl_run "(c) the same, rank 1 exits in the middle (--fail-rank 1, --timeout 20)" 120 \
            $TWO $MPIRUN -x NCCL_MULTI_RANK_GPU_ENABLE --mca orte_abort_on_non_zero_status 0 \
            -np 2 "$MPI_BIN" comm-check --backend cuda --timeout 20 --fail-rank 1
        said=$(grep -m1 'error: rank 0' "$RUN_OUT" | tr '|' '/')
        echo "(c) after ${RUN_SECS}s (mpirun exit $RUN_RC), rank 0 said: ${said:-nothing; $(nccl_reason)}" >>"$NOTES"
        # Expected: rank 0 fails within its 20 s timeout (plus setup), naming the tree
        # all-reduce; a hang (124) or silence is a FAIL. mpirun's own status says nothing
        # here: with abort_on_non_zero_status off it can exit 0 whatever the ranks did.
        if [ "$RUN_RC" != 124 ] && echo "$said" | grep -q 'tree all-reduce' \
            && awk -v s="$RUN_SECS" 'BEGIN { exit !(s < 80) }'; then
            echo "ROW|comm-check cuda (c) --fail-rank 1: rank 0 failed after ${RUN_SECS}s|fp32|-|-|ok|-|-|-" >>"$LOG"
        else
            echo "ROW|comm-check cuda (c) --fail-rank 1: after ${RUN_SECS}s (notes above)|fp32|-|-|FAIL|-|-|-" >>"$LOG"
        fi
    fi
fi
echo "== GPU ranks in train: the bits of --gpus 1 on --gpus 2 (two ranks sharing the one GPU)"
# Each against `--gpus 1 --backend cuda` (one rank, the same micro-shards): final.safetensors
# byte-identical. Sums on the host (the default), on the GPU over NCCL (PARALLAX_NCCL=1), a
# pipeline split, and a process per rank under mpirun and under torchrun.
ranks_train() {
    local dir=$1 model=$2
    shift 2
    rm -rf "$dir"
    timeout 240 "$@" train "$model" --backend cuda --steps 12 --run-dir "$dir" >"$dir.log" 2>&1
}
for model in models/mlp.ron models/transformer.ron; do
    m=$(basename "$model" .ron)
    if ! ranks_train /tmp/parallax-r1 "$model" "$BIN" --gpus 1; then
        echo "ROW|train $m --gpus 1 --backend cuda: $(grep -m1 error /tmp/parallax-r1.log | tr '|' '/' | cut -c1-80)|tf32|-|-|FAIL|-|-|-" >>"$LOG"
        continue
    fi
    ms=$(grep -o '"step_time_ms_median": [0-9.]*' /tmp/parallax-r1/summary.json | grep -o '[0-9.]*$')
    echo "ROW|train $m --gpus 1 --backend cuda|tf32|-|-|ok|$ms|-|-" >>"$LOG"
    variants=("host sums|env PARALLAX_SHARE_GPUS=1 $BIN --gpus 2"
        "pp2|env PARALLAX_SHARE_GPUS=1 $BIN --gpus 2 --strategy pp2")
    [ -e /tmp/parallax-nccl-new/lib/libnccl.so ] && variants+=("NCCL sums|env PARALLAX_SHARE_GPUS=1 PARALLAX_NCCL=1 NCCL_MULTI_RANK_GPU_ENABLE=1 LD_LIBRARY_PATH=/tmp/parallax-nccl-new/lib:$LD_LIBRARY_PATH $BIN --gpus 2")
    command -v mpirun >/dev/null && variants+=("mpirun -np 2|env PARALLAX_SHARE_GPUS=1 mpirun --allow-run-as-root --oversubscribe -x PARALLAX_SHARE_GPUS -x LD_LIBRARY_PATH -np 2 $MPI_BIN")
    # torchrun's ranks meet over TCP through rank 0 (no MPI); its port picked per run.
    command -v torchrun >/dev/null && variants+=("torchrun 2 ranks|env PARALLAX_SHARE_GPUS=1 torchrun --nproc-per-node 2 --master-port $((20000 + RANDOM % 20000)) --no-python $BIN")
    for v in "${variants[@]}"; do
        what=${v%%|*}
        # shellcheck disable=SC2086
        if ranks_train /tmp/parallax-r2 "$model" ${v#*|}; then
            ms=$(grep -o '"step_time_ms_median": [0-9.]*' /tmp/parallax-r2/summary.json | grep -o '[0-9.]*$')
            if cmp -s /tmp/parallax-r1/final.safetensors /tmp/parallax-r2/final.safetensors; then
                echo "ROW|train $m --gpus 2, $what: the bits of --gpus 1|tf32|-|-|ok|$ms|-|-" >>"$LOG"
            else
                echo "ROW|train $m --gpus 2, $what: bits differ from --gpus 1|tf32|-|-|FAIL|$ms|-|-" >>"$LOG"
            fi
        else
            echo "ROW|train $m --gpus 2, $what: $(grep -m1 error /tmp/parallax-r2.log | tr '|' '/' | cut -c1-80)|tf32|-|-|FAIL|-|-|-" >>"$LOG"
        fi
    done
done
echo
echo "NCCL ranks, what the runs reported:"
cat "$NOTES"
echo
echo "gpt-large: not run (13 B parameters with Adam state need about 210 GB, more than one GPU holds; the CPU oracle cannot run it)"
echo
printf '%-60s %-5s %-10s %-10s %-6s %-9s %-8s %-6s\n' check prec loss-diff param-diff result step-ms TFLOP/s peak
grep '^ROW|' "$LOG" | while IFS='|' read -r _ name prec ld pd ok ms tf share; do
    printf '%-60s %-5s %-10s %-10s %-6s %-9s %-8s %-6s\n' "$name" "$prec" "$ld" "$pd" "$ok" "$ms" "$tf" "$share"
done
! grep -q '^ROW|.*|FAIL' "$LOG"
