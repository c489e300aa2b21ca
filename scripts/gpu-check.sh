#!/usr/bin/env bash
# The GPU check: for a machine with an NVIDIA GPU, driver 580 and the CUDA 13 libraries from
# Python wheels, and no Rust toolchain. Build the binary beforehand (`cargo build --release`)
# and copy it along (or point PARALLAX at it). The checks under mpirun need a second binary
# built with `--features mpi` (PARALLAX_MPI; it links libmpi, so it starts only where Open MPI
# is installed) and mpirun on the GPU machine; without them those rows say SKIP and why, and
# the GPU ranks are still checked in one process and under torchrun (no MPI).
#
# A GPU is lent briefly, so the checks run most important first, within a time budget: a
# check that would not finish inside it is not started (its row says SKIP), and the table is
# printed whatever happens (also on Ctrl-C or TERM). The rows and the whole log are written
# to $OUT when it is set (the device tool brings that folder back). Nothing is downloaded:
# the GPU machine may have no network (NCCL_WHEEL may name a wheel file to install from).
#
#   scripts/gpu-check.sh                       # every section, within 540 s
#   BUDGET=300 scripts/gpu-check.sh            # stop starting checks after 300 s
#   SECTIONS="speed" scripts/gpu-check.sh      # only some: base interp speed stored ranks use more
#   LOCKSTEP=1 scripts/gpu-check.sh            # also compare every kernel with the oracle
#   BASE_MODELS="models/mlp.ron" RANK_MODELS="models/mlp.ron" scripts/gpu-check.sh
#                                              # fewer models in base, interp, stored, ranks
#   WHEEL_LIBS=0 scripts/emulated-gpu scripts/gpu-check.sh
#                                              # a rehearsal: keep the library path as given
#
# Sections, in the order they run: base (the CUDA executor against the CPU oracle on the
# small models, fp32/tf32/bf16; a step replayed from a CUDA graph), interp (every kernel of
# the small models on the GPU and on the PTX interpreter from the same inputs, with the
# tensor cores modelled as Hopper's: where they differ in bits, to $OUT/gpu-check-interp.txt),
# speed (gpt-gpu's bf16 step
# against PyTorch eager, SDPA and torch.compile in the same run; as a CUDA graph; per-kernel
# profile; PyTorch's attention backends and GEMM
# rates at its shapes), stored (activations stored in bf16, in lockstep with the oracle),
# ranks (train on CUDA, resume, collectives, NCCL ranks, GPU ranks in train), use (a
# Shakespeare run's eval and sample on CUDA, through the key/value cache, against the CPU's;
# USE_STEPS, USE_TOKENS), more (the bench
# models, the cuBLAS and bias-launch variants of gpt-gpu, mlp-gpu).
set -u
cd "$(dirname "$0")/.."
START=$SECONDS
BUDGET=${BUDGET:-540}
SECTIONS=${SECTIONS:-"base interp speed stored ranks use more"}
BIN=${PARALLAX:-target/release/parallax}
BASE_MODELS=${BASE_MODELS:-"models/mlp.ron models/cnn.ron models/transformer.ron benches/models/transformer.ron"}
# The ranks section's models (scripts/gpu-ranks.sh).
RANK_MODELS=${RANK_MODELS:-"models/mlp.ron models/transformer.ron"}
MPI_BIN=${PARALLAX_MPI:-$BIN}
if [ ! -x "$BIN" ]; then
    echo "no parallax binary at $BIN: build it with 'cargo build --release' and copy it along" >&2
    exit 1
fi
DIR=${OUT:-$(mktemp -d)}
mkdir -p "$DIR"
LOG=$DIR/gpu-check-rows.txt
: >"$LOG"
: >"$DIR/gpu-check-interp.txt"
print_table() {
    echo
    echo "gpt-large: not run (13 B parameters with Adam state need about 210 GB, more than one GPU holds; the CPU oracle cannot run it)"
    echo "took $((SECONDS - START)) s of a budget of $BUDGET s"
    echo
    printf '%-64s %-5s %-10s %-10s %-14s %-9s %-8s %-6s\n' check prec loss-diff param-diff result step-ms TFLOP/s peak
    grep '^ROW|' "$LOG" | while IFS='|' read -r _ name prec ld pd ok ms tf share; do
        printf '%-64s %-5s %-10s %-10s %-14s %-9s %-8s %-6s\n' "$name" "$prec" "$ld" "$pd" "$ok" "$ms" "$tf" "$share"
    done
}

# want SECONDS: prints the timeout for a check that may take SECONDS: that, or what is left of
# the budget; fails (prints nothing) when under 20 s are left.
want() {
    local left=$((BUDGET - (SECONDS - START)))
    [ "$left" -ge 20 ] || return 1
    echo $(($1 < left ? $1 : left))
}
row() { echo "ROW|$1|$2|-|-|$3|${4:--}|-|-" >>"$LOG"; }
# Why a command under `timeout T` failed, for a table cell.
why() { [ "$1" = 124 ] && echo "timeout ${2}s" || echo "exit $1"; }
section() { [[ " $SECTIONS " == *" $1 "* ]]; }
# Whether a model is among BASE_MODELS.
has() { [[ " $BASE_MODELS " == *" $1 "* ]]; }

# check LABEL PREC SECONDS CMD...: runs CMD (a `parallax gpu-check`, which prints one ROW
# line) within the budget; its row is relabelled LABEL. A run that prints no row gets a FAIL
# row; one there is no time for, a SKIP row.
check() {
    local label=$1 prec=$2 t out rc
    if ! t=$(want "$3"); then
        row "$label" "$prec" "SKIP (budget)"
        return 1
    fi
    shift 3
    echo "== $label $prec ($*)"
    out=$(mktemp)
    timeout "$t" "$@" >"$out" 2>&1
    rc=$?
    grep -v '^ROW|' "$out" | head -60
    # The GPU against the interpreter, kept whole.
    grep '^INTERP' "$out" | sed "s#^#$label: #" >>"$DIR/gpu-check-interp.txt"
    if grep -q '^ROW|' "$out"; then
        grep '^ROW|' "$out" | tail -1 | sed "s#^ROW|[^|]*|#ROW|$label|#" | tee -a "$LOG"
    else
        # The first error line names the reason (the log has the rest).
        local said
        said=$(grep -m1 -o 'error: .*' "$out" | tr '|' '/' | cut -c8-70)
        row "$label${said:+: $said}" "$prec" "FAIL ($(why $rc "$t"))"
    fi
    return $rc
}

# The CUDA 13 wheels: every folder holding a shared library goes on the library path, and
# libnccl.so.2 gets the libnccl.so name cudarc looks for.
# WHEEL_LIBS=0 keeps the library path as given (a rehearsal on the emulated GPU).
LIBS=/tmp/parallax-cuda-libs
rm -rf "$LIBS"
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
if [ "${WHEEL_LIBS:-1}" != 0 ] && [ -n "$SITE" ] && [ -d "$SITE/nvidia" ]; then
    mkdir -p "$LIBS"
    for d in $(find "$SITE/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u); do
        LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    nccl=$(find "$SITE/nvidia" -name 'libnccl.so.2' | head -1)
    [ -n "$nccl" ] && ln -sf "$nccl" "$LIBS/libnccl.so"
    LD_LIBRARY_PATH="$LIBS:$LD_LIBRARY_PATH"
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64"
export NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=WARN
# The driver's JIT cache keeps each module's machine code: a plan's PTX is compiled once.
export CUDA_CACHE_MAXSIZE=4294967296

checks() {
    timeout 30 "$BIN" devices
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>/dev/null

    if section base; then
        if [ "${LOCKSTEP:-0}" = 1 ]; then
            for m in models/mlp.ron models/cnn.ron models/transformer.ron; do
                check "lockstep $m" fp32 90 "$BIN" gpu-check "$m" --steps 1 --time-steps 1 --lockstep
            done
        fi
        # benches/models/transformer.ron has heads 64 wide: its bf16 row runs the tensor-core
        # attention forward and backward against the oracle.
        for m in $BASE_MODELS; do
            for p in bf16 tf32 fp32; do
                check "$m" "$p" 60 "$BIN" gpu-check "$m" --steps 3 --precision "$p"
            done
        done
        # The step as a CUDA graph (captured at step 2, replayed at step 3) against the oracle:
        # the small transformer's many launches, or the first of BASE_MODELS without it.
        g=models/transformer.ron
        has $g || g=${BASE_MODELS%% *}
        check "$g, CUDA graph" tf32 60 env PARALLAX_CUDA_GRAPH=1 \
            "$BIN" gpu-check "$g" --steps 3 --precision tf32
    fi

    if section interp; then
        # Every kernel on the GPU and on the PTX interpreter from the oracle's inputs: the
        # values that differ in bits, by kernel, and a line per kernel family (exact kernels
        # should be bit-equal; approximate functions and tensor cores show the hardware's own
        # rounding against the models).
        for m in models/mlp.ron models/cnn.ron; do
            has "$m" && check "interp $m" fp32 60 "$BIN" gpu-check "$m" --steps 1 --time-steps 1 --interpreter
        done
        has models/transformer.ron && check "interp models/transformer.ron" tf32 90 "$BIN" \
            gpu-check models/transformer.ron --steps 1 --time-steps 1 --precision tf32 \
            --interpreter --set train.batch_size=8
        has benches/models/transformer.ron && check "interp bench transformer (tensor cores)" \
            bf16 120 "$BIN" gpu-check benches/models/transformer.ron --steps 1 --time-steps 1 \
            --precision bf16 --interpreter --set train.batch_size=2 --set params.seq=32
    fi

    if section speed; then
        # (Asked here: importing torch takes seconds of the budget.)
        HAS_TORCH=0
        python3 -c 'import torch' 2>/dev/null && HAS_TORCH=1
        check gpt-gpu bf16 150 "$BIN" gpu-check benches/models/gpt-gpu.ron --steps 0 --precision bf16 --time-steps 10
        ours=$(grep '^ROW|gpt-gpu|' "$LOG" | tail -1 | cut -d'|' -f7)
        if [ "$HAS_TORCH" = 1 ] && t=$(want 240); then
            # Eager, SDPA, then torch.compile (a minute or two to compile): lines as they come.
            TORCH=$(mktemp)
            echo "== PyTorch at gpt-gpu's shapes"
            timeout "$t" env PYTHONUNBUFFERED=1 python3 benches/gpu/gpt_torch.py --compile | tee "$TORCH"
            while IFS='|' read -r _ variant ms; do
                ratio=$(awk -v a="$ours" -v b="$ms" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b; else print "-" }')
                row "PyTorch $variant; Parallax/PyTorch $ratio" bf16 - "$ms"
            done < <(grep '^TORCH|' "$TORCH")
        else
            row "PyTorch at gpt-gpu's shapes" bf16 "SKIP (no torch or budget)"
        fi
        check "gpt-gpu, CUDA graph" bf16 150 env PARALLAX_CUDA_GRAPH=1 "$BIN" gpu-check \
            benches/models/gpt-gpu.ron --steps 0 --precision bf16 --time-steps 10
        check "gpt-gpu, activations bf16" bf16 150 "$BIN" gpu-check benches/models/gpt-gpu.ron \
            --steps 0 --precision bf16 --time-steps 10 --set devices.activations=Bf16
        if t=$(want 150); then
            echo "== benches/models/gpt-gpu.ron, bf16: time per kind of kernel (attention, GEMMs, the rest)"
            timeout "$t" "$BIN" gpu-check benches/models/gpt-gpu.ron --steps 0 --precision bf16 \
                --time-steps 3 --profile | grep -v '^ROW|' || echo "(the profile failed)"
        fi
        if [ "$HAS_TORCH" = 1 ] && t=$(want 200); then
            echo "== PyTorch at gpt-gpu's shapes: attention backends, GEMM throughput (the targets)"
            ATT=$(mktemp)
            timeout "$t" env PYTHONUNBUFFERED=1 python3 benches/gpu/attention_torch.py | tee "$ATT"
            while IFS='|' read -r kind what ms tf; do
                echo "ROW|PyTorch ${kind,,} $what|bf16|-|-|-|$ms|$tf|-" >>"$LOG"
            done < <(grep -E '^(ATT|GEMM)\|' "$ATT")
        fi
    fi

    if section stored; then
        # Activations stored in bf16 (two-byte loads and stores in every kernel family, GEMMs of
        # bf16 operands): the oracle rounds where each value is made; tolerance 2e-2. In lockstep:
        # a kernel family that loads or stores bf16 wrongly is named at once.
        for m in $BASE_MODELS; do
            check "$m (bf16-stored, lockstep)" bf16 120 "$BIN" gpu-check "$m" --steps 3 --time-steps 1 \
                --precision bf16 --set devices.activations=Bf16 --lockstep
        done
    fi

    if section ranks; then
        echo "== train models/mlp.ron on CUDA (the main job on the GPU)"
        rm -rf /tmp/parallax-gpu-run
        if ! t=$(want 120); then
            row "train mlp --backend cuda" tf32 "SKIP (budget)"
        elif timeout "$t" "$BIN" train models/mlp.ron --backend cuda --run-dir /tmp/parallax-gpu-run; then
            acc=$(grep -o '"val_accuracy": [0-9.]*' /tmp/parallax-gpu-run/summary.json | grep -o '[0-9.]*$')
            ms=$(grep -o '"step_time_ms_median": [0-9.]*' /tmp/parallax-gpu-run/summary.json | grep -o '[0-9.]*$')
            ok=$(awk -v a="$acc" 'BEGIN { print (a >= 0.95) ? "ok" : "FAIL" }')
            pct=$(awk -v a="$acc" 'BEGIN { printf "%.2f%%", 100 * a }')
            row "train mlp --backend cuda, val accuracy $pct" tf32 "$ok" "$(awk -v m="$ms" 'BEGIN { printf "%.3f", m }')"
        else
            row "train mlp --backend cuda" tf32 FAIL
        fi
        echo "== checkpoint and resume on CUDA (bitwise)"
        rm -rf /tmp/parallax-ck1 /tmp/parallax-ck2
        if ! t=$(want 90); then
            row "resume from step 200 on CUDA" tf32 "SKIP (budget)"
        elif timeout "$t" "$BIN" train models/mlp.ron --backend cuda --steps 300 --checkpoint-every 100 \
            --run-dir /tmp/parallax-ck1 >/dev/null 2>&1; then
            cp -r /tmp/parallax-ck1 /tmp/parallax-ck2
            rm /tmp/parallax-ck2/final.safetensors /tmp/parallax-ck2/checkpoints/step-00000300.safetensors
            timeout 60 "$BIN" train --resume /tmp/parallax-ck2 --backend cuda >/dev/null 2>&1
            if cmp -s /tmp/parallax-ck1/final.safetensors /tmp/parallax-ck2/final.safetensors; then
                row "resume from step 200 on CUDA: final.safetensors identical" tf32 ok
            else
                row "resume from step 200 on CUDA: final.safetensors identical" tf32 FAIL
            fi
        else
            row "checkpointing run on CUDA" tf32 FAIL
        fi
        check collectives fp32 90 "$BIN" collectives-check models/mlp.ron
        # NCCL ranks and GPU ranks in train: uses want, row and why.
        . scripts/gpu-ranks.sh
    fi

    if section use; then
        # A trained run used on the GPU: Shakespeare trained a few hundred steps on the CPU,
        # then its validation loss (eval) and its text (sample, through the decode step's
        # key/value cache) on CUDA in fp32 against the CPU's.
        echo "== Shakespeare: eval and sample on CUDA against the CPU"
        U=/tmp/parallax-use
        rm -rf "$U" && mkdir -p "$U"
        if ! t=$(want 120); then
            row "use: train shakespeare on the CPU" fp32 "SKIP (budget)"
        elif ! timeout "$t" "$BIN" train models/shakespeare.ron --backend cpu \
            --steps "${USE_STEPS:-300}" --run-dir "$U/run" >"$U/train.log" 2>&1; then
            row "use: train shakespeare on the CPU: $(grep -m1 error "$U/train.log" | cut -c1-60)" fp32 FAIL
        else
            for b in cpu cuda; do
                timeout 120 "$BIN" eval "$U/run" --backend "$b" --precision fp32 --format json \
                    >"$U/eval-$b.json" 2>"$U/eval-$b.err"
            done
            lc=$(grep -o '"loss": [-0-9.e]*' "$U/eval-cpu.json" | grep -o '[-0-9.e]*$')
            lg=$(grep -o '"loss": [-0-9.e]*' "$U/eval-cuda.json" | grep -o '[-0-9.e]*$')
            ok=$(awk -v a="$lc" -v b="$lg" 'BEGIN { d = (a - b) / a; if (d < 0) d = -d;
                print (a != "" && b != "" && d < 1e-5) ? "ok" : "FAIL" }')
            row "use: eval on CUDA, loss $lg (CPU $lc)" fp32 "$ok"
            for draw in "greedy|--temperature 0" "seeded|--temperature 0.8 --seed 7"; do
                IFS='|' read -r what opts <<<"$draw"
                for b in cpu cuda; do
                    # shellcheck disable=SC2086
                    timeout 120 "$BIN" sample "$U/run" --prompt "ROMEO:" --backend "$b" \
                        --precision fp32 --max-new-tokens "${USE_TOKENS:-200}" $opts \
                        >"$U/$what-$b.txt" 2>"$U/$what-$b.err"
                done
                cat "$U/$what-cuda.err"
                if ! grep -q 'key/value cache of' "$U/$what-cuda.err"; then
                    row "use: sample $what on CUDA: not through the cache" fp32 FAIL
                elif [ -s "$U/$what-cpu.txt" ] && cmp -s "$U/$what-cpu.txt" "$U/$what-cuda.txt"; then
                    row "use: sample $what on CUDA (key/value cache): the CPU's text" fp32 ok
                else
                    row "use: sample $what on CUDA: text differs from the CPU's" fp32 FAIL
                fi
            done
            head -c 300 "$U/seeded-cuda.txt"; echo
        fi
    fi

    if section more; then
        for m in benches/models/transformer-512.ron benches/models/mlp.ron benches/models/cnn.ron; do
            for p in bf16 tf32 fp32; do
                check "$m" "$p" 90 "$BIN" gpu-check "$m" --steps 3 --precision "$p"
            done
        done
        # GEMMs through cuBLAS instead of cuBLASLt's cached plans; biases by a launch of their own.
        for v in PARALLAX_CUBLASLT=0 PARALLAX_GEMM_BIAS=0; do
            check "gpt-gpu, $v" bf16 150 env "$v" "$BIN" gpu-check benches/models/gpt-gpu.ron \
                --steps 0 --precision bf16 --time-steps 10
        done
        for p in fp32 tf32; do
            check "bench-mlp-gpu (timing only)" "$p" 90 "$BIN" gpu-check benches/models/mlp-gpu.ron \
                --steps 0 --precision "$p"
        done
    fi
}

# The table is printed however the checks end (also on Ctrl-C or TERM, after the check in
# flight); the whole log is kept beside the rows.
{
    trap 'echo "stopped by a signal"; print_table; exit 130' INT TERM
    checks
    print_table
    ! grep -q '^ROW|.*|FAIL' "$LOG"
} 2>&1 | tee "$DIR/gpu-check.log"
exit "${PIPESTATUS[0]}"
