#!/usr/bin/env python3
"""Parallax's CPU flash attention against PyTorch's `scaled_dot_product_attention`, forward
and backward, paired in one run (fp32, 2 threads):

    python3 benches/attention_compare.py [--warmup 5] [--rounds 20] [--chunk 3] [--causal]

For each shape (batch, heads, sequence, head width) of the issue's list, sequences of 512
and 1024 at head widths 64 and 128, `runtime/examples/attention_speed B H T D --serve` runs
Parallax's forward (with the log-sum-exp), the row sums the backward reads, and the query,
key and value gradients; PyTorch runs SDPA on `[B, H, T, D]` views of token-major `[B, T, H,
D]` tensors (a projection's output, as in benches/pytorch_compare.py) and its backward for
the same three gradients. Chunks alternate as in benches/ab.py. Prints each side's median
milliseconds, the median of the paired ratios (Parallax / PyTorch; below 1: Parallax is
faster), and each side's GFLOP/s (`14 B H T^2 D` FLOPs: four products of `T x T x D` forward
and backward plus the recomputed scores; halved when causal).

With ISA=avx2 in the environment both sides stop at AVX2, as in benches/compare.sh: the
binary of the `ISA=avx2` build (target/avx2/, built by compare.sh or by
`MMTEST_FEATURE=sse2,avx,avx2,fma CARGO_TARGET_DIR=target/avx2 cargo build --release -p
parallax-runtime --no-default-features --example attention_speed`) run with
PARALLAX_NO_AVX512, and PyTorch with ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and
MKL_ENABLE_INSTRUCTIONS set before it loads.
"""

import argparse
import os
import statistics
import sys
import time

from ab import Server, pair

AVX2 = os.environ.get("ISA") == "avx2"
if AVX2:
    os.environ.update(
        ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2"
    )

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("PyTorch is not installed (pip install torch)", file=sys.stderr)
    sys.exit(3)

SHAPES = [(4, 4, 512, 64), (2, 4, 1024, 64), (4, 2, 512, 128), (2, 2, 1024, 128)]
BIN = f"target/{'avx2/' if AVX2 else ''}release/examples/attention_speed"


def torch_side(b, h, t, d, causal):
    def x():
        return torch.rand(b, t, h, d).sub_(0.5).requires_grad_(True)

    q, k, v = x(), x(), x()
    dy = torch.rand(b, h, t, d).sub_(0.5)

    def steps(n):
        out = []
        for _ in range(n):
            start = time.perf_counter()
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            )
            y.backward(dy)
            out.append((time.perf_counter() - start) * 1e3)
            q.grad = k.grad = v.grad = None
        return out

    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = {"RAYON_NUM_THREADS": str(args.threads)}
    if AVX2:
        env["PARALLAX_NO_AVX512"] = "1"
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} is not built (see the top of benches/attention_compare.py)")
    print(
        f"{'B H T D':<16} {'Parallax ms':>11} {'PyTorch ms':>10} {'ratio':>7} "
        f"{'Parallax GFLOP/s':>16} {'PyTorch GFLOP/s':>15}"
    )
    for b, h, t, d in SHAPES:
        shape = [str(v) for v in (b, h, t, d)] + (["causal"] if args.causal else [])
        px = Server(BIN, None, env, args=shape)
        xs, ys, ratios = pair(
            px.steps, torch_side(b, h, t, d, args.causal), args.warmup, args.rounds, args.chunk
        )
        px.close()
        flops = 14 * b * h * t * t * d * (0.5 if args.causal else 1.0)
        pxm, ptm = statistics.median(xs), statistics.median(ys)
        print(
            f"{' '.join(shape):<16} {pxm:11.3f} {ptm:10.3f} {statistics.median(ratios):6.2f}x "
            f"{flops / pxm / 1e6:16.0f} {flops / ptm / 1e6:15.0f}",
            flush=True,
        )


if __name__ == "__main__":
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, "benches")
    main()
