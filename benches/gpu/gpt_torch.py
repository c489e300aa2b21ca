"""PyTorch eager on the shapes of benches/models/gpt-gpu.ron: a training step (forward,
backward, Adam) under bf16 autocast, timed with CUDA events (median after warm-up). Two
attention forms: explicit matmul + causal softmax (what Parallax's plan computes) and
scaled_dot_product_attention (PyTorch's fused kernel); with `--compile`, then the SDPA model
under torch.compile (its compile time not counted: it happens in the warm-up). Prints
`TORCH|<variant>|<ms>` lines as each is measured.

    python3 benches/gpu/gpt_torch.py [--compile]"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H, L, T, B = 50257, 1024, 16, 12, 1024, 16


class Block(nn.Module):
    def __init__(self, sdpa):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.sdpa = sdpa

    def attention(self, x):
        split = lambda t: t.view(B, T, H, D // H).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = q @ k.transpose(-1, -2) / math.sqrt(D // H)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            y = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, D))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, sdpa):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.ModuleList(Block(sdpa) for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def step_ms(sdpa, steps=10, warmup=3, compiled=False):
    torch.manual_seed(0)
    model = Gpt(sdpa).cuda()
    if compiled:
        model = torch.compile(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    tokens = torch.randint(0, V, (B, T), device="cuda")
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().view(-1, V), tokens.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    del model, opt
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("TORCH|no CUDA device|-")
        sys.exit(0)
    print(f"TORCH|eager, matmul + softmax attention|{step_ms(False):.2f}", flush=True)
    print(f"TORCH|eager, scaled_dot_product_attention|{step_ms(True):.2f}", flush=True)
    if "--compile" in sys.argv[1:]:
        try:
            ms = f"{step_ms(True, compiled=True):.2f}"
        except Exception as e:  # torch.compile needs a working Triton and C compiler
            print(f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            ms = "-"
        print(f"TORCH|torch.compile, scaled_dot_product_attention|{ms}", flush=True)
