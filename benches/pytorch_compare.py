#!/usr/bin/env python3
"""PyTorch twins of benches/models/*.ron, timed the way runtime/examples/step_time.rs times
Parallax: one training step (forward, loss, backward, SGD with momentum 0.9) on the CPU, eager
mode, fp32, 2 threads, the median (and the least) of 30 steps after 10 warm-up steps.

    python3 benches/pytorch_compare.py [--warmup 10] [--steps 30] [--threads 2] [MODEL ...]

Prints one line per model: `NAME MEDIAN_MS MIN_MS` (milliseconds per step). MODEL is one of mlp, cnn,
transformer (all three by default). Exits 3 when PyTorch is not installed.

The shapes match the Parallax files exactly: Linear weights [out, in] with biases; Conv2d
without padding; the exact (erf) GELU; LayerNorm with eps 1e-5 and an affine weight and bias;
attention as q, k, v and out Linear projections (with bias), scores scaled by 1/sqrt(head_dim),
softmax, no mask, through `F.scaled_dot_product_attention` (PyTorch's fused CPU kernel;
`--attention composed` writes the scores, softmax and products out as before); MSE (mean over
every element) against a fixed random target. transformer-512 is the same block over
sequences of 512 (batch 4), where attention weighs more.

    python3 benches/pytorch_compare.py --paired BIN [--warmup 10] [--rounds 40] [--chunk 5] [MODEL ...]

pairs PyTorch with Parallax in one run: `BIN FILE --serve` (runtime/examples/step_time.rs) is
started for benches/models/MODEL.ron, both warm up, and then each round times `--chunk` steps
of each side back to back (which goes first alternates), so a busy spell of a shared machine
falls on both. Prints one line per model: `NAME PX_MEDIAN PT_MEDIAN PX_MIN PT_MIN RATIO`, the
medians and least of all timed steps of each side, and RATIO the median over rounds of the
ratio of the two sides' chunk medians (Parallax / PyTorch); on standard error, that ratio's
median in the rounds each side went first and the rounds' lower and upper quartiles.
"""

import argparse
import math
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from ab import Server, pair  # benches/ab.py: the paired-run protocol

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("PyTorch is not installed (pip install torch)", file=sys.stderr)
    sys.exit(3)


class Attention(nn.Module):
    """Multi-head self-attention as Parallax lowers `Attention(heads, causal: false)`."""

    fused = True

    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.reshape(b, s, self.heads, self.hd).permute(0, 2, 1, 3)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if Attention.fused:
            ctx = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
            ctx = torch.softmax(scores, dim=-1) @ v
        return self.out(ctx.permute(0, 2, 1, 3).reshape(b, s, d))


class Block(nn.Module):
    """benches/models/transformer.ron: one pre-LayerNorm block."""

    def __init__(self, d=256, heads=4, hidden=1024):
        super().__init__()
        self.n1 = nn.LayerNorm(d, eps=1e-5)
        self.att = Attention(d, heads)
        self.n2 = nn.LayerNorm(d, eps=1e-5)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        r1 = x + self.att(self.n1(x))
        return r1 + self.fc2(F.gelu(self.fc1(self.n2(r1)), approximate="none"))


def mlp():
    model = nn.Sequential(
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )
    x = torch.randn(128, 784)
    y = torch.randint(0, 10, (128,))
    return model, x, y, F.cross_entropy


def cnn():
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1600, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    x = torch.randn(64, 1, 28, 28)
    y = torch.randint(0, 10, (64,))
    return model, x, y, F.cross_entropy


def transformer():
    model = Block()
    x = torch.randn(16, 64, 256)
    target = torch.randn(16, 64, 256)
    return model, x, target, F.mse_loss


def transformer_512():
    model = Block()
    x = torch.randn(4, 512, 256)
    target = torch.randn(4, 512, 256)
    return model, x, target, F.mse_loss


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "transformer-512": transformer_512}
# Parameter counts `parallax check` reports for benches/models/*.ron.
PARAMETERS = {"mlp": 669_706, "cnn": 225_034, "transformer": 789_760, "transformer-512": 789_760}


def stepper(name):
    """A function that runs one training step of model `name` and returns its milliseconds."""
    model, x, y, loss_fn = MODELS[name]()
    params = sum(p.numel() for p in model.parameters())
    assert params == PARAMETERS[name], f"{name}: {params} parameters, Parallax has {PARAMETERS[name]}"
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()

    def step():
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        elapsed = (time.perf_counter() - t) * 1e3
        assert math.isfinite(loss.item()), f"{name}: the loss became {loss.item()}"
        return elapsed

    return step


def step_time(name, warmup, steps):
    step = stepper(name)
    times = [step() for _ in range(warmup + steps)][warmup:]
    return statistics.median(times), min(times)


def paired(name, binary, warmup, rounds, chunk):
    """Alternates chunks of PyTorch's steps with chunks of Parallax's (see the module doc)."""
    step = stepper(name)
    parallax = Server(binary, name, {})
    px_all, pt_all, ratios = pair(
        parallax.steps, lambda n: [step() for _ in range(n)], warmup, rounds, chunk
    )
    parallax.close()
    # The side that goes first in a round follows its own chunk of the round before; the
    # other follows it. Without the pause between chunks (`ab.PAUSE`) the two orders differed
    # by 3-7% either way; with it, in the run that checked, by 1.5% at most. Alternating the
    # order shares out what is left, and the two halves show how much it weighs.
    # The rounds' spread: a target such as "at most 0.8x" is met by a run whose upper
    # quartile is under it, not by a median that happens to be.
    q1, q3 = statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else ratios * 2

    def half(rs):
        # One round has no round with PyTorch first.
        return f"{statistics.median(rs):.3f}" if rs else "-"

    print(
        f"{name}: paired ratio {half(ratios[0::2])} with Parallax first, "
        f"{half(ratios[1::2])} with PyTorch first; rounds' quartiles {q1:.3f} and {q3:.3f}",
        file=sys.stderr,
    )
    return (
        statistics.median(px_all),
        statistics.median(pt_all),
        min(px_all),
        min(pt_all),
        statistics.median(ratios),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", metavar="MODEL", help=", ".join(MODELS))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paired", metavar="BIN", help="Parallax's step_time example, run alongside")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--chunk", type=int, default=5)
    ap.add_argument("--attention", choices=["sdpa", "composed"], default="sdpa")
    args = ap.parse_args()
    Attention.fused = args.attention == "sdpa"
    for name in args.models:
        if name not in MODELS:
            ap.error(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name in args.models or list(MODELS):
        if args.paired:
            stats = paired(name, args.paired, args.warmup, args.rounds, args.chunk)
            print(name, " ".join(f"{v:.3f}" for v in stats), flush=True)
        else:
            median, least = step_time(name, args.warmup, args.steps)
            print(f"{name} {median:.3f} {least:.3f}", flush=True)


if __name__ == "__main__":
    main()
