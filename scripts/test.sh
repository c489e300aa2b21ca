#!/usr/bin/env bash
# The test command: installs ptxas (from the PyPI wheel nvidia-cuda-nvcc, ~37 MB, once, into
# .tools/) so the generated PTX of every model is assembled for sm_80 and sm_90, then runs the
# whole test suite. Needs the Rust toolchain and python3 with pip; no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PTXAS=.tools/nvcc/nvidia/cu13/bin/ptxas
if [ ! -x "$PTXAS" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --no-deps \
        --target .tools/nvcc nvidia-cuda-nvcc==13.0.88
fi
"$PTXAS" --version | tail -1
cargo test --workspace --locked "$@"
