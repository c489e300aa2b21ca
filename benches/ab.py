#!/usr/bin/env python3
"""Two builds (or settings) of Parallax's CPU step, paired on one shared machine: A / B.

    python3 benches/ab.py BIN_A BIN_B [MODEL ...] [--env-a K=V ...] [--env-b K=V ...]
                          [--warmup 10] [--rounds 40] [--chunk 5]

BIN_A and BIN_B are builds of runtime/examples/step_time.rs (copy one aside before changing the
code: `cp target/release/examples/step_time /tmp/before`); `--env-a`/`--env-b` add environment
variables to one side. Both serve steps of benches/models/MODEL.ron (`--serve`); after the
warm-up, each round times `--chunk` steps of each, back to back, the first side alternating,
so a busy spell falls on both. Prints per model each side's median and least step (ms) and
the median over rounds of the ratio of the chunks' medians (A / B; below 1: A is faster).
Single runs on this machine move by 10% or more; paired ratios repeat to about 2%.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


class Server:
    """A `step_time FILE --serve` process (or `BINARY ARGS... --serve` when `args` are given):
    `steps(n)` runs n steps and returns their ms."""

    def __init__(self, binary, model, env, args=None):
        self.binary = binary
        self.proc = subprocess.Popen(
            [binary, *(args or [f"benches/models/{model}.ron"]), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, **env},
        )

    def steps(self, n):
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"{self.binary} stopped answering")
        return [float(v) for v in line.split()]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


# Seconds between two chunks: longer than either side's threads keep spinning after its last
# step (OpenMP's, PyTorch's, spin up to a few ms before they sleep), so that neither side's
# spinning threads take cores from the other's chunk.
PAUSE = 0.01


def pair(first, second, warmup, rounds, chunk):
    """Alternating chunks of two step functions: (all of first's, all of second's, ratios)."""
    first(warmup)
    second(warmup)
    a_all, b_all, ratios = [], [], []

    def run(side):
        time.sleep(PAUSE)
        return side(chunk)

    for r in range(rounds):
        if r % 2 == 0:
            a, b = run(first), run(second)
        else:
            b, a = run(second), run(first)
        a_all += a
        b_all += b
        ratios.append(statistics.median(a) / statistics.median(b))
    return a_all, b_all, ratios


def env_pairs(items):
    return dict(item.split("=", 1) for item in items)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", metavar="BIN_A")
    ap.add_argument("b", metavar="BIN_B")
    ap.add_argument("models", nargs="*", metavar="MODEL", default=["mlp", "cnn", "transformer"])
    ap.add_argument("--env-a", action="append", default=[], metavar="K=V")
    ap.add_argument("--env-b", action="append", default=[], metavar="K=V")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--chunk", type=int, default=5)
    args = ap.parse_args()
    threads = {"RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS", "2")}
    print(f"{'model':<12} {'A med':>9} {'B med':>9} {'A min':>9} {'B min':>9} {'A / B':>7}")
    for model in args.models:
        a = Server(args.a, model, {**threads, **env_pairs(args.env_a)})
        b = Server(args.b, model, {**threads, **env_pairs(args.env_b)})
        xs, ys, ratios = pair(a.steps, b.steps, args.warmup, args.rounds, args.chunk)
        a.close()
        b.close()
        print(
            f"{model:<12} {statistics.median(xs):9.3f} {statistics.median(ys):9.3f} "
            f"{min(xs):9.3f} {min(ys):9.3f} {statistics.median(ratios):6.3f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
