# Sourced by scripts/gpu-check.sh (its `want`, `row`, `why`, $BIN, $MPI_BIN, $LOG): the real
# ranks on a GPU.
#
# NCCL ranks: comm-check --backend cuda under mpirun (a binary built with --features mpi). The
# fixed-tree all-reduce on the GPU over NCCL against the host's sum, bit for bit: (a) one
# rank, its NCCL id broadcast over MPI; (b) two processes on the one GPU (NCCL >= 2.30 with
# NCCL_MULTI_RANK_GPU_ENABLE=1; the installed one, or NCCL_WHEEL, a wheel file of
# nvidia-nccl-cu13, installed from the file: nothing is downloaded); (c) the same with rank 1
# leaving in the middle: what rank 0 reports, and how long it took.
#
# GPU ranks in train: the bits of --gpus 1 on --gpus 2 (two ranks sharing the one GPU), with
# sums on the host, on the GPU over NCCL, a pipeline split, and a process per rank under
# mpirun and under torchrun.

MPIRUN="mpirun --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH -x NCCL_SOCKET_IFNAME -x NCCL_DEBUG"
NOTES=$(mktemp)
# nccl_run NAME SECONDS CMD...: runs CMD within the budget, leaving its output in $RUN_OUT,
# its exit status in $RUN_RC and its seconds in $RUN_SECS; fails when there is no time.
nccl_run() {
    local name=$1 t start
    t=$(want "$2") || return 1
    shift 2
    echo "-- $name"
    RUN_OUT=$(mktemp)
    start=$(date +%s.%N)
    timeout "$t" "$@" >"$RUN_OUT" 2>&1
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
# A comm-check run passed: exit 0, a table, and no row saying `no`.
nccl_passed() {
    [ "$RUN_RC" = 0 ] && grep -q '| yes |' "$RUN_OUT" && ! grep -q '| no |' "$RUN_OUT"
}

# An NCCL new enough for two ranks on one GPU: the one found, or NCCL_WHEEL's.
NCCL2=""
have=$("$BIN" devices 2>/dev/null | grep -o 'NCCL [0-9]*\.[0-9]*' | head -1 | cut -d' ' -f2)
if [ -n "$have" ] && awk -v v="$have" 'BEGIN { split(v, p, "."); exit !(p[1] > 2 || (p[1] == 2 && p[2] >= 30)) }'; then
    NCCL2=$LD_LIBRARY_PATH
    NCCL_WHY=""
elif [ -f "${NCCL_WHEEL:-}" ]; then
    NEW=/tmp/parallax-nccl-new
    rm -rf "$NEW" && mkdir -p "$NEW/lib"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
        --target "$NEW/site" "$NCCL_WHEEL" >"$NEW/pip.log" 2>&1
    so=$(find "$NEW/site" -name 'libnccl.so.2' 2>/dev/null | head -1)
    [ -n "$so" ] && ln -sf "$so" "$NEW/lib/libnccl.so" && NCCL2=$NEW/lib:$LD_LIBRARY_PATH
    NCCL_WHY="installing $NCCL_WHEEL failed: $(tail -1 "$NEW/pip.log" | tr '|' '/' | cut -c1-100)"
else
    NCCL_WHY="NCCL ${have:-not found} is older than 2.30 and NCCL_WHEEL names no wheel file"
fi

HASH1=""
if ! command -v mpirun >/dev/null; then
    for c in "(a) 1 rank" "(b) 2 ranks on one GPU" "(c) 2 ranks, --fail-rank 1"; do
        row "comm-check cuda $c: mpirun not found" fp32 SKIP
    done
else
    if ! nccl_run "(a) mpirun -np 1 comm-check --backend cuda" 120 \
        $MPIRUN -np 1 "$MPI_BIN" comm-check --backend cuda --timeout 60; then
        row "comm-check cuda (a) 1 rank" fp32 "SKIP (budget)"
    elif nccl_passed; then
        HASH1=$(nccl_hashes)
        row "comm-check cuda (a) 1 rank, NCCL id over MPI: same bits" fp32 ok
    else
        row "comm-check cuda (a) 1 rank" fp32 FAIL
        echo "(a) 1 rank: $(nccl_reason)" >>"$NOTES"
    fi
    if [ -z "$NCCL2" ]; then
        for c in "(b) 2 ranks on one GPU" "(c) 2 ranks, --fail-rank 1"; do
            row "comm-check cuda $c: no NCCL >= 2.30" fp32 SKIP
            echo "$c: $NCCL_WHY" >>"$NOTES"
        done
    else
        TWO="env LD_LIBRARY_PATH=$NCCL2 NCCL_MULTI_RANK_GPU_ENABLE=1"
        echo "NCCL for two ranks on one GPU: $($TWO "$BIN" devices 2>&1 | grep -i nccl | head -1)"
        if ! nccl_run "(b) mpirun -np 2 comm-check --backend cuda, one GPU" 180 \
            $TWO $MPIRUN -x NCCL_MULTI_RANK_GPU_ENABLE -np 2 "$MPI_BIN" comm-check --backend cuda --timeout 60; then
            row "comm-check cuda (b) 2 ranks on one GPU" fp32 "SKIP (budget)"
        elif nccl_passed; then
            # The hashes per length and shard count must be those of one rank.
            if [ -z "$HASH1" ]; then
                same="ok"; what="same bits as the host (no 1-rank run to compare)"
            elif [ "$HASH1" = "$(nccl_hashes)" ]; then
                same="ok"; what="same bits as 1 rank"
            else
                same="FAIL"; what="bits differ from 1 rank"
            fi
            row "comm-check cuda (b) 2 ranks on one GPU: $what" fp32 "$same"
        else
            row "comm-check cuda (b) 2 ranks on one GPU" fp32 FAIL
            echo "(b) 2 ranks: $(nccl_reason)" >>"$NOTES"
        fi
        # mpirun must not end rank 0 when rank 1 exits, so that rank 0 shows what it sees.
        if ! nccl_run "(c) the same, rank 1 exits in the middle (--fail-rank 1, --timeout 20)" 100 \
            $TWO $MPIRUN -x NCCL_MULTI_RANK_GPU_ENABLE --mca orte_abort_on_non_zero_status 0 \
            -np 2 "$MPI_BIN" comm-check --backend cuda --timeout 20 --fail-rank 1; then
            row "comm-check cuda (c) --fail-rank 1" fp32 "SKIP (budget)"
        else
            said=$(grep -m1 'error: rank 0' "$RUN_OUT" | tr '|' '/')
            echo "(c) after ${RUN_SECS}s (mpirun exit $RUN_RC), rank 0 said: ${said:-nothing; $(nccl_reason)}" >>"$NOTES"
            # Expected: rank 0 fails within its 20 s timeout (plus setup), naming the tree
            # all-reduce; a hang (124) or silence is a FAIL. mpirun's own status says nothing
            # here: with abort_on_non_zero_status off it can exit 0 whatever the ranks did.
            if [ "$RUN_RC" != 124 ] && echo "$said" | grep -q 'tree all-reduce' \
                && awk -v s="$RUN_SECS" 'BEGIN { exit !(s < 80) }'; then
                row "comm-check cuda (c) --fail-rank 1: rank 0 failed after ${RUN_SECS}s" fp32 ok
            else
                row "comm-check cuda (c) --fail-rank 1: after ${RUN_SECS}s (notes below)" fp32 FAIL
            fi
        fi
    fi
fi

# ranks_train DIR MODEL SECONDS LAUNCHER OPTIONS: trains MODEL 12 steps on CUDA into DIR as
# `LAUNCHER train MODEL ... OPTIONS` (each word-split: the launcher ends with the binary, and
# the options follow the subcommand, where the command line takes them). Sets SKIPPED=1
# when there is no time; otherwise returns the run's status.
ranks_train() {
    local dir=$1 model=$2 t
    SKIPPED=0
    if ! t=$(want "$3"); then
        SKIPPED=1
        return 1
    fi
    rm -rf "$dir"
    # shellcheck disable=SC2086
    timeout "$t" $4 train "$model" --backend cuda --steps 12 --run-dir "$dir" $5 >"$dir.log" 2>&1
}
step_ms() { grep -o '"step_time_ms_median": [0-9.]*' "$1/summary.json" | grep -o '[0-9.]*$'; }
first_error() { grep -m1 error "$1" | tr '|' '/' | cut -c1-80; }
SHARE="env PARALLAX_SHARE_GPUS=1"
for model in $RANK_MODELS; do
    m=$(basename "$model" .ron)
    ranks_train /tmp/parallax-r1 "$model" 90 "$BIN" "--gpus 1"
    rc=$?
    if [ "$SKIPPED" = 1 ]; then
        row "train $m --gpus 1 --backend cuda" tf32 "SKIP (budget)"
        continue
    elif [ "$rc" != 0 ]; then
        row "train $m --gpus 1 --backend cuda: $(first_error /tmp/parallax-r1.log)" tf32 "FAIL ($(why $rc 90))"
        continue
    fi
    row "train $m --gpus 1 --backend cuda" tf32 ok "$(step_ms /tmp/parallax-r1)"
    # label|launcher|options
    variants=("host sums|$SHARE $BIN|--gpus 2"
        "pp2|$SHARE $BIN|--gpus 2 --strategy pp2")
    [ -n "$NCCL2" ] && variants+=("NCCL sums|$SHARE PARALLAX_NCCL=1 NCCL_MULTI_RANK_GPU_ENABLE=1 LD_LIBRARY_PATH=$NCCL2 $BIN|--gpus 2")
    command -v mpirun >/dev/null && variants+=("mpirun -np 2|$SHARE mpirun --allow-run-as-root --oversubscribe -x PARALLAX_SHARE_GPUS -x LD_LIBRARY_PATH -np 2 $MPI_BIN|")
    [ -n "$NCCL2" ] && command -v mpirun >/dev/null && variants+=("mpirun -np 2, NCCL sums|$SHARE PARALLAX_NCCL=1 NCCL_MULTI_RANK_GPU_ENABLE=1 LD_LIBRARY_PATH=$NCCL2 mpirun --allow-run-as-root --oversubscribe -x PARALLAX_SHARE_GPUS -x PARALLAX_NCCL -x NCCL_MULTI_RANK_GPU_ENABLE -x LD_LIBRARY_PATH -x NCCL_SOCKET_IFNAME -np 2 $MPI_BIN|")
    # torchrun's ranks meet over TCP through rank 0 (no MPI); its port picked per run.
    command -v torchrun >/dev/null && variants+=("torchrun 2 ranks|$SHARE torchrun --nproc-per-node 2 --master-port $((20000 + RANDOM % 20000)) --no-python $BIN|")
    for v in "${variants[@]}"; do
        IFS='|' read -r what launcher options <<<"$v"
        ranks_train /tmp/parallax-r2 "$model" 120 "$launcher" "$options"
        rc=$?
        if [ "$SKIPPED" = 1 ]; then
            row "train $m --gpus 2, $what" tf32 "SKIP (budget)"
        elif [ "$rc" != 0 ]; then
            row "train $m --gpus 2, $what: $(first_error /tmp/parallax-r2.log)" tf32 "FAIL ($(why $rc 120))"
        elif cmp -s /tmp/parallax-r1/final.safetensors /tmp/parallax-r2/final.safetensors; then
            row "train $m --gpus 2, $what: the bits of --gpus 1" tf32 ok "$(step_ms /tmp/parallax-r2)"
        else
            row "train $m --gpus 2, $what: bits differ from --gpus 1" tf32 FAIL "$(step_ms /tmp/parallax-r2)"
        fi
    done
done
if [ -s "$NOTES" ]; then
    echo
    echo "NCCL ranks, what the runs reported:"
    cat "$NOTES"
fi
