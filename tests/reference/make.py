#!/usr/bin/env python3
"""Reference fixtures from PyTorch for `tests/reference.rs`.

For each case below this builds a small model in PyTorch (float32, CPU), fixes its weights and
data, trains it a few steps and writes, under `tests/reference/<case>/`:

- `experiment.ron`: the same experiment for Parallax (data from the NPY files beside it, read
  in file order: `train: (..., shuffle: false)`);
- `init.safetensors`: the PyTorch `state_dict` before training (PyTorch's names and shapes,
  `num_batches_tracked` included), which Parallax reads with `--init`;
- `x.npy`, `y.npy`: the inputs and the labels (or MSE targets);
- `losses.json`: every step's loss, as PyTorch computed it;
- `final.safetensors`: PyTorch's `state_dict` after the last step.

Run it from anywhere with PyTorch, NumPy and safetensors installed:

    python3 tests/reference/make.py             # every case; or name some: ... make.py cnn gpt
    python3 tests/reference/make.py --load cnn RUN/final.safetensors   # strict load_state_dict

The learning rate of each step is Parallax's formula (`compiler/src/schedule.rs`), set by a
`LambdaLR`; the script also checks it against PyTorch's own schedulers (StepLR, LinearLR,
CosineAnnealingLR chained with SequentialLR) and fails if they differ.
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


# ---- layers as Parallax lowers them (compiler/src/passes/lower/) ----


class Attention(nn.Module):
    """Parallax's `Attention`: q, k, v and out Linear layers, scores scaled by 1/sqrt(hd)."""

    def __init__(self, d, heads, causal, bias=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(d, d, bias=bias)
        self.v = nn.Linear(d, d, bias=bias)
        self.out = nn.Linear(d, d, bias=bias)

    def forward(self, x):
        b, s, d = x.shape
        h, hd = self.heads, d // self.heads

        def split(t):
            return t.reshape(b, s, h, hd).permute(0, 2, 1, 3)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        ctx = torch.softmax(scores, dim=-1) @ v
        return self.out(ctx.permute(0, 2, 1, 3).reshape(b, s, d))


ACTS = {
    "Relu": nn.ReLU,
    "Gelu": nn.GELU,
    "Tanh": nn.Tanh,
    "Sigmoid": nn.Sigmoid,
    "Silu": nn.SiLU,
}


class Mlp(nn.Module):
    def __init__(self, d, hidden, act="Gelu", bias=True):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=bias)
        self.act = ACTS[act]()
        self.fc2 = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class GatedMlp(nn.Module):
    """Parallax's `Mlp(gated: true)`: LLaMA's MLP (SwiGLU with SiLU), its parameter names."""

    def __init__(self, d, hidden, act="Silu", bias=True):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d, bias=bias)
        self.act = ACTS[act]()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PositionalEmbedding(nn.Module):
    def __init__(self, max_len, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, d) * 0.02)

    def forward(self, x):
        return x + self.weight[: x.shape[1]]


class Block(nn.Module):
    """The decoder block of the `gpt` case (`blocks: {"decoder": ...}`)."""

    def __init__(self, d, heads, hidden):
        super().__init__()
        self.n1 = nn.LayerNorm(d)
        self.att = Attention(d, heads, causal=True)
        self.n2 = nn.LayerNorm(d)
        self.mlp = Mlp(d, hidden, "Gelu")

    def forward(self, x):
        r1 = x + self.att(self.n1(x))
        return r1 + self.mlp(self.n2(r1))


class Gpt(nn.Module):
    def __init__(self, vocab, d, heads, layers, max_len):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = PositionalEmbedding(max_len, d)
        self.h = nn.ModuleList([Block(d, heads, 2 * d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.logits = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.pos(self.emb(tokens))
        for b in self.h:
            x = b(x)
        return self.logits(self.norm(x))


class Gated(nn.Module):
    """The `mse` case's graph: permute, two Linears, a sigmoid gate, concat, reshape,
    transpose, softmax over the first axis of a sample, a residual Add, flatten, Linear."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(4, 8)
        self.o = nn.Linear(96, 3)

    def forward(self, x):
        n = x.shape[0]
        p = x.permute(0, 2, 1)  # [6, 4]
        a = self.a(p)
        m = a * torch.sigmoid(self.b(p))
        c = torch.cat([a, m], dim=-1)  # [6, 16]
        t = c.reshape(n, 12, 8).transpose(1, 2)  # [8, 12]
        s = torch.softmax(t, dim=1)
        return self.o((t + s).flatten(1))


# ---- schedules: Parallax's formula (compiler/src/schedule.rs) ----


def parallax_lr(base, schedule, step, total):
    kind = schedule["kind"]

    def warm(w):
        return base * (step + 1) / w if (w > 0 and step < w) else None

    def progress(w):
        span = max(total - w, 1)
        return min(max(step - w, 0) / span, 1.0)

    if kind == "Constant":
        return base
    if kind == "Step":
        return base * schedule["gamma"] ** (step // max(schedule["every"], 1))
    if kind == "Cosine":
        w, lo = schedule.get("warmup", 0), schedule.get("min_lr", 0.0)
        v = warm(w)
        if v is not None:
            return v
        return lo + (base - lo) * 0.5 * (1.0 + math.cos(math.pi * progress(w)))
    if kind == "Linear":
        w, end = schedule.get("warmup", 0), schedule.get("end_lr", 0.0)
        v = warm(w)
        return v if v is not None else base + (end - base) * progress(w)
    if kind == "Warmup":
        v = warm(schedule["steps"])
        return v if v is not None else base
    raise ValueError(kind)


def torch_scheduler(opt, base, schedule, total):
    """PyTorch's own schedulers for the same schedule (to check the formula against)."""
    S = torch.optim.lr_scheduler
    kind = schedule["kind"]
    if kind == "Constant":
        return S.ConstantLR(opt, factor=1.0, total_iters=0)
    if kind == "Step":
        return S.StepLR(opt, step_size=schedule["every"], gamma=schedule["gamma"])
    w = schedule.get("warmup", schedule.get("steps", 0))
    warm = S.LinearLR(opt, start_factor=1.0 / w, end_factor=1.0, total_iters=w - 1) if w else None
    if kind == "Warmup":
        return warm
    if kind == "Cosine":
        after = S.CosineAnnealingLR(opt, T_max=total - w, eta_min=schedule.get("min_lr", 0.0))
    else:
        end = schedule.get("end_lr", 0.0) / base
        after = S.LinearLR(opt, start_factor=1.0, end_factor=end, total_iters=total - w)
    if warm is None:
        return after
    return S.SequentialLR(opt, [warm, after], milestones=[w])


def check_schedule(base, schedule, total):
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base)
    sch = torch_scheduler(opt, base, schedule, total)
    worst = 0.0
    for step in range(total):
        got = opt.param_groups[0]["lr"]
        want = parallax_lr(base, schedule, step, total)
        worst = max(worst, abs(got - want) / abs(want))
        opt.step()
        sch.step()
    if worst > 1e-12:
        sys.exit(f"schedule {schedule}: PyTorch's scheduler differs from Parallax's formula by {worst:.3g}")
    return worst


# ---- the cases ----


def ron_schedule(s):
    kind = s["kind"]
    args = ", ".join(f"{k}: {v}" for k, v in s.items() if k != "kind")
    return f"{kind}({args})" if args else kind


def ron_optimizer(o):
    fields = [f"lr: {o['lr']}"]
    for k in ("momentum", "nesterov", "weight_decay", "clip_norm"):
        if k in o:
            v = o[k]
            fields.append(f"{k}: {'true' if v is True else 'false' if v is False else v}")
    if "betas" in o:
        fields.append(f"betas: ({o['betas'][0]}, {o['betas'][1]})")
    fields.append(f"schedule: {ron_schedule(o['schedule'])}")
    return f"{o['kind']}({', '.join(fields)})"


def torch_optimizer(o, params):
    if o["kind"] == "Sgd":
        return torch.optim.SGD(
            params,
            lr=o["lr"],
            momentum=o.get("momentum", 0.0),
            nesterov=o.get("nesterov", False),
            weight_decay=o.get("weight_decay", 0.0),
        )
    cls = torch.optim.Adam if o["kind"] == "Adam" else torch.optim.AdamW
    default_wd = 0.0 if o["kind"] == "Adam" else 0.01
    return cls(
        params,
        lr=o["lr"],
        betas=tuple(o.get("betas", (0.9, 0.999))),
        eps=1e-8,
        weight_decay=o.get("weight_decay", default_wd),
        foreach=False,
    )


def class_data(rng, n, shape, classes):
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    return x, y


def case_mlp(rng):
    # Linear, LayerNorm, Gelu, Dropout(0), Linear without bias, RmsNorm, Tanh, Linear, Sigmoid,
    # Mlp (Relu), Linear; label smoothing; AdamW with clipping and a cosine schedule.
    model = nn.Sequential(
        nn.Linear(12, 16),
        nn.LayerNorm(16),
        nn.GELU(),
        nn.Dropout(0.0),
        nn.Linear(16, 16, bias=False),
        nn.RMSNorm(16, eps=1e-6),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Sigmoid(),
        Mlp(16, 24, "Relu"),
        nn.Linear(16, 5),
    )
    layers = """[
            Linear(out: 16),
            LayerNorm,
            Gelu,
            Dropout(0.0),
            Linear(out: 16, bias: false),
            RmsNorm,
            Tanh,
            Linear(out: 16),
            Sigmoid,
            Mlp(hidden: 24, act: Relu),
            Linear(out: 5),
        ]"""
    x, y = class_data(rng, 24, (12,), 5)
    return dict(
        model=model,
        ron_model=f"Sequential(\n        input: (shape: [12]),\n        layers: {layers},\n    )",
        x=x,
        y=y,
        loss=dict(kind="CrossEntropy", label_smoothing=0.1),
        optimizer=dict(
            kind="AdamW",
            lr=0.01,
            weight_decay=0.05,
            clip_norm=0.05,
            schedule=dict(kind="Cosine", warmup=2, min_lr=0.001),
        ),
    )


def case_cnn(rng):
    # Strided and grouped convolutions, BatchNorm2d (affine and not, another momentum), both
    # poolings (average with padding), Flatten; label smoothing; SGD with Nesterov momentum,
    # weight decay, clipping and a step schedule.
    model = nn.Sequential(
        nn.Conv2d(2, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=4),
        nn.BatchNorm2d(8, momentum=0.2, affine=False),
        nn.ReLU(),
        nn.MaxPool2d(2, stride=1),
        nn.AvgPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(32, 6),
    )
    layers = """[
            Conv2d(out: 8, kernel: 3, stride: 2, padding: 1),   // 8 x 5 x 5
            BatchNorm2d,
            Relu,
            Conv2d(out: 8, kernel: 3, padding: 1, groups: 4),
            BatchNorm2d(momentum: 0.2, affine: false),
            Relu,
            MaxPool2d(kernel: 2, stride: 1),                    // 8 x 4 x 4
            AvgPool2d(kernel: 3, stride: 2, padding: 1),        // 8 x 2 x 2
            Flatten,
            Linear(out: 6),
        ]"""
    x, y = class_data(rng, 24, (2, 10, 10), 6)
    return dict(
        model=model,
        ron_model=f"Sequential(\n        input: (shape: [2, 10, 10]),\n        layers: {layers},\n    )",
        x=x,
        y=y,
        loss=dict(kind="CrossEntropy", label_smoothing=0.2),
        optimizer=dict(
            kind="Sgd",
            lr=0.05,
            momentum=0.9,
            nesterov=True,
            weight_decay=0.001,
            clip_norm=0.1,
            schedule=dict(kind="Step", every=2, gamma=0.5),
        ),
    )


GPT_RON = """Graph(
        params: { "d": 16, "heads": 2, "layers": 2, "vocab": 11 },
        inputs: { "tokens": (shape: [8], dtype: I32) },
        blocks: {
            "decoder": [
                ("n1",  LayerNorm,                               ["x"]),
                ("att", Attention(heads: "heads", causal: true), ["n1"]),
                ("r1",  Add,                                     ["x", "att"]),
                ("n2",  LayerNorm,                               ["r1"]),
                ("mlp", Mlp(hidden: "d * 2", act: Gelu),         ["n2"]),
                ("out", Add,                                     ["r1", "mlp"]),
            ],
        },
        nodes: [
            ("emb",    Embedding(vocab: "vocab", dim: "d"),       ["tokens"]),
            ("pos",    PositionalEmbedding(max_len: 12),          ["emb"]),
            ("h",      Repeat(block: "decoder", times: "layers"), ["pos"]),
            ("norm",   LayerNorm,                                 ["h"]),
            ("logits", Linear(out: "vocab"),                      ["norm"]),
        ],
    )"""


def case_gpt(rng):
    # Embedding, PositionalEmbedding, a repeated block of LayerNorm, causal Attention, Mlp and
    # residual Adds; ignored labels (-100) whose count varies from sample to sample, with label
    # smoothing; Adam with L2 weight decay, clipping and a linear schedule after warm-up.
    model = Gpt(vocab=11, d=16, heads=2, layers=2, max_len=12)
    n, s = 24, 8
    x = rng.integers(0, 11, size=(n, s)).astype(np.int64)
    y = rng.integers(0, 11, size=(n, s)).astype(np.int64)
    for i in range(n):
        # 0 to 7 ignored positions per sample, never a whole batch.
        k = int(rng.integers(0, s))
        y[i, rng.permutation(s)[:k]] = -100
    return dict(
        model=model,
        ron_model=GPT_RON,
        x=x,
        y=y,
        loss=dict(kind="CrossEntropy", label_smoothing=0.1),
        optimizer=dict(
            kind="Adam",
            lr=0.01,
            weight_decay=0.01,
            clip_norm=0.1,
            schedule=dict(kind="Linear", warmup=1, end_lr=0.002),
        ),
    )


MSE_RON = """Graph(
        inputs: { "x": (shape: [4, 6]) },
        nodes: [
            ("p",   Permute([1, 0]),          ["x"]),      // 6 x 4
            ("a",   Linear(out: 8),           ["p"]),
            ("b",   Linear(out: 8),           ["p"]),
            ("g",   Sigmoid,                  ["b"]),
            ("m",   Mul,                      ["a", "g"]),
            ("c",   Concat(axis: -1),         ["a", "m"]), // 6 x 16
            ("r",   Reshape([12, 8]),         ["c"]),
            ("t",   Transpose(0, 1),          ["r"]),      // 8 x 12
            ("s",   Softmax(axis: 0),         ["t"]),
            ("res", Add,                      ["t", "s"]),
            ("f",   Flatten,                  ["res"]),
            ("o",   Linear(out: 3),           ["f"]),
        ],
    )"""


def case_mse(rng):
    # A graph of Permute, Linear, Sigmoid, Mul, Concat, Reshape, Transpose, Softmax on another
    # axis, Add, Flatten; MSE; plain SGD with weight decay, clipping and a warm-up schedule.
    model = Gated()
    x = rng.standard_normal((24, 4, 6)).astype(np.float32)
    y = rng.standard_normal((24, 3)).astype(np.float32)
    return dict(
        model=model,
        ron_model=MSE_RON,
        x=x,
        y=y,
        loss=dict(kind="Mse"),
        optimizer=dict(
            kind="Sgd",
            lr=0.2,
            weight_decay=0.01,
            clip_norm=0.05,
            schedule=dict(kind="Warmup", steps=3),
        ),
    )


def case_attention(rng):
    # Attention without a mask and without biases on float inputs, RmsNorm, an Mlp without
    # biases (Tanh); SGD with momentum (no Nesterov), a constant rate, no clipping.
    model = nn.Sequential(
        Attention(8, 2, causal=False, bias=False),
        nn.RMSNorm(8, eps=1e-6),
        Mlp(8, 16, "Tanh", bias=False),
        nn.Flatten(),
        nn.Linear(48, 4),
    )
    layers = """[
            Attention(heads: 2, bias: false),
            RmsNorm,
            Mlp(hidden: 16, act: Tanh, bias: false),
            Flatten,
            Linear(out: 4),
        ]"""
    x, y = class_data(rng, 24, (6, 8), 4)
    return dict(
        model=model,
        ron_model=f"Sequential(\n        input: (shape: [6, 8]),\n        layers: {layers},\n    )",
        x=x,
        y=y,
        loss=dict(kind="CrossEntropy"),
        optimizer=dict(
            kind="Sgd", lr=0.1, momentum=0.9, schedule=dict(kind="Constant")
        ),
    )


def case_swiglu(rng):
    # A gated Mlp with SiLU as LLaMA's (no biases), a standalone SiLU, then one with biases;
    # AdamW with active clipping and a linear schedule.
    model = nn.Sequential(
        GatedMlp(8, 16, "Silu", bias=False),
        nn.SiLU(),
        GatedMlp(8, 12, "Silu", bias=True),
        nn.Flatten(),
        nn.Linear(48, 4),
    )
    layers = """[
            Mlp(hidden: 16, act: Silu, gated: true, bias: false),
            Silu,
            Mlp(hidden: 12, act: Silu, gated: true),
            Flatten,
            Linear(out: 4),
        ]"""
    x, y = class_data(rng, 24, (6, 8), 4)
    return dict(
        model=model,
        ron_model=f"Sequential(\n        input: (shape: [6, 8]),\n        layers: {layers},\n    )",
        x=x,
        y=y,
        loss=dict(kind="CrossEntropy"),
        optimizer=dict(
            kind="AdamW",
            lr=0.02,
            weight_decay=0.01,
            clip_norm=0.05,
            schedule=dict(kind="Linear", warmup=1, end_lr=0.002),
        ),
    )


CASES = {
    "mlp": case_mlp,
    "cnn": case_cnn,
    "gpt": case_gpt,
    "mse": case_mse,
    "attention": case_attention,
    "swiglu": case_swiglu,
}
BATCH = 8
STEPS = 5


def ron_loss(loss):
    if loss["kind"] == "Mse":
        return "Mse"
    s = loss.get("label_smoothing", 0.0)
    return f"CrossEntropy(label_smoothing: {s})" if s else "CrossEntropy"


def experiment(name, c):
    return f"""// Written by tests/reference/make.py (PyTorch {torch.__version__}); do not edit.
Experiment(
    name: "reference-{name}",
    model: {c['ron_model']},
    loss: {ron_loss(c['loss'])},
    data: Npy(inputs: "x.npy", labels: "y.npy", validation: 0.0),
    optimizer: {ron_optimizer(c['optimizer'])},
    train: (batch_size: {BATCH}, steps: {STEPS}, seed: 0, shuffle: false),
)
"""


def state(model):
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def make(name, build, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    c = build(rng)
    model, o = c["model"], c["optimizer"]
    # Biases and norms away from their defaults, so that a mix-up of any tensor shows.
    with torch.no_grad():
        for k, p in model.named_parameters():
            if k.endswith("bias") or p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for k, b in model.named_buffers():
            if k.endswith("running_mean"):
                b.add_(torch.randn_like(b) * 0.1)
            elif k.endswith("running_var"):
                b.mul_(torch.rand_like(b) + 0.5)
    d = os.path.join(HERE, name)
    os.makedirs(d, exist_ok=True)
    save_file(state(model), os.path.join(d, "init.safetensors"))
    np.save(os.path.join(d, "x.npy"), c["x"])
    np.save(os.path.join(d, "y.npy"), c["y"])
    with open(os.path.join(d, "experiment.ron"), "w") as f:
        f.write(experiment(name, c))

    check_schedule(o["lr"], o["schedule"], STEPS)
    opt = torch_optimizer(o, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: parallax_lr(o["lr"], o["schedule"], s, STEPS) / o["lr"]
    )
    x = torch.from_numpy(c["x"])
    y = torch.from_numpy(c["y"])
    n = len(x)
    model.train()
    losses = []
    for step in range(STEPS):
        # Batch `step` in file order, epoch after epoch (`shuffle: false`).
        first = (step * BATCH) % n
        idx = torch.arange(first, first + BATCH)
        xb, yb = x[idx], y[idx]
        opt.zero_grad()
        out = model(xb)
        if c["loss"]["kind"] == "Mse":
            loss = F.mse_loss(out, yb)
        else:
            loss = F.cross_entropy(
                out.reshape(-1, out.shape[-1]),
                yb.reshape(-1),
                ignore_index=-100,
                label_smoothing=c["loss"].get("label_smoothing", 0.0),
            )
        loss.backward()
        if "clip_norm" in o:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_norm"])
            assert norm > o["clip_norm"], f"{name}: clipping is not active at step {step}"
        opt.step()
        sched.step()
        losses.append(loss.item())
    with open(os.path.join(d, "losses.json"), "w") as f:
        json.dump({"steps": STEPS, "batch_size": BATCH, "losses": losses}, f, indent=1)
        f.write("\n")
    save_file(state(model), os.path.join(d, "final.safetensors"))
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"{name}: losses {['%.6f' % v for v in losses]}, {size / 1024:.1f} KiB")


def load(name, path):
    """Loads a Parallax `final.safetensors` of case `name` into its PyTorch module, strictly."""
    from safetensors.torch import load_file

    model = CASES[name](np.random.default_rng(0))["model"]
    model.load_state_dict(load_file(path), strict=True)
    print(f"{path}: loads into the `{name}` module with strict=True")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load"]:
        # python3 tests/reference/make.py --load CASE RUN_DIR/final.safetensors
        load(sys.argv[2], sys.argv[3])
        sys.exit(0)
    for i, (name, build) in enumerate(CASES.items()):
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        make(name, build, 1000 + i)
