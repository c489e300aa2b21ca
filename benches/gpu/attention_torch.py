"""What the GPU can do at benches/models/gpt-gpu.ron's shapes, measured with PyTorch: causal
attention forward + backward at (B 16, H 16, T 1024, D 64) in bf16 under each of
`scaled_dot_product_attention`'s backends (cuDNN, flash, memory-efficient, the default) and
written out (matmul, softmax, matmul), then the bf16 GEMMs of the model (the QKV/projection,
MLP and vocabulary products and their gradients' transposes) in TFLOP/s. CUDA events, the
median of 20 after 5 warm-up runs. Prints `ATT|<form>|<ms>|<TFLOP/s>` and
`GEMM|<m>x<k>x<n>|<ms>|<TFLOP/s>` lines (the targets of issue 20: attention near cuDNN's,
GEMMs near these).

    python3 benches/gpu/attention_torch.py [--device cpu --small]   # --small: a CPU smoke run
"""
import argparse
import math
import statistics

import torch
import torch.nn.functional as F


def timed(fn, device, warmup=5, runs=20):
    for _ in range(warmup):
        fn()
    if device == "cuda":
        times = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    import time

    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    b, h, t, d = (2, 2, 128, 64) if args.small else (16, 16, 1024, 64)
    q, k, v = (torch.randn(b, h, t, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    dy = torch.randn(b, h, t, d, device=dev, dtype=dtype)
    # Causal: half the scores; forward 2 products, backward 5 (FlashAttention's count).
    flops = 4 * b * h * t * t * d / 2 * 3.5

    def sdpa():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(dy)

    def written_out():
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).triu(1)
        y = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v
        y.backward(dy)

    forms = [("matmul+softmax+matmul", written_out, None), ("sdpa default", sdpa, None)]
    if dev == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, backend in [
            ("sdpa cuDNN", SDPBackend.CUDNN_ATTENTION),
            ("sdpa flash", SDPBackend.FLASH_ATTENTION),
            ("sdpa memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
        ]:
            forms.append((name, sdpa, backend))
    for name, fn, backend in forms:
        try:
            if backend is None:
                ms = timed(fn, dev)
            else:
                with sdpa_kernel([backend]):
                    ms = timed(fn, dev)
            print(f"ATT|{name}|{ms:.3f}|{flops / ms / 1e9:.1f}", flush=True)
        except Exception as e:  # a backend this GPU or build lacks: say so, go on
            print(f"ATT|{name}|-|unavailable: {str(e).splitlines()[0][:60]}", flush=True)
    tokens, dm, vocab = (256, 128, 1024) if args.small else (16384, 1024, 50304)
    shapes = [
        (tokens, dm, 3 * dm),
        (tokens, dm, dm),
        (tokens, dm, 4 * dm),
        (tokens, 4 * dm, dm),
        (tokens, dm, vocab),
        (dm, tokens, 4 * dm),
        (tokens, vocab, dm),
    ]
    for m, kk, n in shapes:
        a = torch.randn(m, kk, device=dev, dtype=dtype)
        w = torch.randn(kk, n, device=dev, dtype=dtype)
        ms = timed(lambda: a @ w, dev)
        print(f"GEMM|{m}x{kk}x{n}|{ms:.3f}|{2 * m * kk * n / ms / 1e9:.1f}", flush=True)


if __name__ == "__main__":
    main()
