#!/usr/bin/env bash
# The test command: installs, once, into .tools/: ptxas (the PyPI wheel nvidia-cuda-nvcc, ~37 MB)
# so the generated PTX of every model is assembled for sm_80 and sm_90, and TensorBoard's event
# reader; Open MPI and what the `mpi` crate's build needs, from Debian's packages (apt-get, as
# root); then runs the whole test suite with the `mpi` feature on (the multi-process tests),
# and checks that the default build, which needs no MPI, still compiles. Needs the Rust
# toolchain and python3 with pip; no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PTXAS=.tools/nvcc/nvidia/cu13/bin/ptxas
if [ ! -x "$PTXAS" ]; then
    rm -rf .tools/nvcc .tools/nvcc.partial
    python3 -m pip install --quiet --disable-pip-version-check --no-deps \
        --target .tools/nvcc.partial nvidia-cuda-nvcc==13.0.88
    mv .tools/nvcc.partial .tools/nvcc
fi
"$PTXAS" --version | tail -1
# TensorBoard's own event reader, for runtime/tests/tensorboard.rs (~90 MB, once, into
# .tools/tb): only what its EventAccumulator imports, not the server's dependencies (grpcio,
# werkzeug, pillow, ...: 160 MB). Installed beside, then moved, so an interrupted install is
# retried rather than found half done.
if [ ! -d .tools/tb/tensorboard ]; then
    rm -rf .tools/tb .tools/tb.partial
    python3 -m pip install --quiet --disable-pip-version-check --no-deps \
        --target .tools/tb.partial tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 numpy==2.4.6
    mv .tools/tb.partial .tools/tb
fi
# Open MPI 4 (mpirun, libmpi) and libclang, which the `mpi` crate's bindgen loads; iproute2
# for the test of two hosts (network namespaces joined by a veth pair, as root).
if ! command -v mpirun >/dev/null || ! pkg-config --exists ompi 2>/dev/null \
    || ! command -v ip >/dev/null \
    || ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1; then
    # As root (CI) directly, else through sudo; without either, say what to install.
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || {
            echo "scripts/test.sh needs Open MPI: apt-get install openmpi-bin libopenmpi-dev libclang-dev pkgconf iproute2 (as root)" >&2
            exit 1
        }
        SUDO=sudo
    fi
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        openmpi-bin libopenmpi-dev libclang-dev pkgconf iproute2 >/dev/null
fi
mpirun --version | head -1
cargo test --workspace --locked --features mpi "$@"
cargo check --workspace --locked --all-targets
