//! Gradients from the op table's VJP rules against central finite differences: each op on
//! its own in a hand-built graph, then whole models (`mlp`, `cnn`, `transformer`).
//!
//! The executor computes in f32, so each check compares the directional derivative `g . v`
//! along a few random unit directions `v` with `(L(p + h v) - L(p - h v)) / 2h`, both summed
//! in f64. Whole models use `h = 1e-3` (each element moves by about `1e-3 / sqrt(n)`, rarely
//! across a ReLU's or a max pool's kink); single ops, with losses of a few units, `h = 1e-2`.
//! Tolerance: 2% of the larger of the two, plus 3e-4 absolute (f32 rounding of the loss
//! divided by `2h`).

mod common;
use common::plan_of;

use parallax_compiler::ir::{DType, Dim, Graph, Init, NodeIndex, Op, TensorType};
use parallax_compiler::passes::{autodiff, Ctx};
use parallax_compiler::plan::Plan;
use parallax_compiler::shards::{Sharding, INV_BATCH, SHARD_WEIGHT};
use parallax_compiler::{parse, parse_bytes, Options, Source};
use parallax_runtime::cpu::{Executor, Mode};
use parallax_runtime::rng;
use parallax_runtime::train::Session;

fn loss(e: &mut Executor, batch: usize) -> f64 {
    e.run(batch, Mode::Gradients, 0, 0).unwrap();
    e.output("loss").unwrap().f32()[0] as f64
}

/// Checks every parameter's gradient along `directions` random directions.
fn check(e: &mut Executor, batch: usize, directions: u64, h: f32, what: &str) {
    e.run(batch, Mode::Gradients, 0, 0).unwrap();
    let grads: Vec<(String, Vec<f32>)> = e
        .gradients()
        .into_iter()
        .map(|(n, _, g)| (n.to_string(), g.f32().to_vec()))
        .collect();
    assert!(!grads.is_empty(), "{what}: no gradients");
    for (k, (name, g)) in grads.iter().enumerate() {
        for d in 0..directions {
            let key = rng::stream(7, rng::Purpose::Synthetic, (k as u64) << 8 | d);
            let v: Vec<f32> = (0..g.len()).map(|i| rng::normal(key, i as u64)).collect();
            let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt() as f32;
            let v: Vec<f32> = v.iter().map(|&x| x / norm).collect();
            let analytic: f64 = g.iter().zip(&v).map(|(&g, &v)| g as f64 * v as f64).sum();
            let original = e.param_mut(name).unwrap().to_vec();
            let at = |sign: f32, e: &mut Executor| {
                let p = e.param_mut(name).unwrap();
                for i in 0..p.len() {
                    p[i] = original[i] + sign * h * v[i];
                }
                loss(e, batch)
            };
            let numeric = (at(1.0, e) - at(-1.0, e)) / (2.0 * h as f64);
            e.param_mut(name).unwrap().copy_from_slice(&original);
            let tol = 0.02 * analytic.abs().max(numeric.abs()) + 3e-4;
            assert!(
                (analytic - numeric).abs() <= tol,
                "{what}: gradient of `{name}` along direction {d}: analytic {analytic}, finite differences {numeric}"
            );
        }
    }
}

// ---- whole models ----

fn model(name: &str) {
    model_with(name, Options::default());
}

fn model_with(name: &str, options: Options) {
    let path = format!("{}/models/{name}.ron", env!("CARGO_MANIFEST_DIR"));
    let source = parse_bytes(&std::fs::read(path).unwrap()).unwrap();
    let plan = plan_of(&source, &options);
    let mut s = Session::new(&source, plan, 8, 1, std::path::Path::new(".")).unwrap();
    let batch = s.next_batch().unwrap().size;
    // A sharded plan alone is one shard holding the whole batch.
    for (input, v) in [(SHARD_WEIGHT, 1.0), (INV_BATCH, 1.0 / batch as f32)] {
        if s.exec.has_input(input) {
            s.exec.set_f32(input, 1, &[v]).unwrap();
        }
    }
    check(&mut s.exec, batch, 2, 1e-3, name);
}

/// The per-shard plan: synchronised BatchNorm built from sums, an all-reduce, a division and
/// a square root, differentiated by their VJP rules.
#[test]
fn sharded_cnn_gradients() {
    let options = Options {
        shards: Some(Sharding::new(1, 8)),
        ..Options::default()
    };
    model_with("cnn", options);
}

#[test]
fn mlp_gradients() {
    model("mlp");
}

#[test]
fn cnn_gradients() {
    model("cnn");
}

#[test]
fn transformer_gradients() {
    model("transformer");
}

// ---- one op at a time ----

const ANY: &str = r#"Experiment(name: "op", model: Sequential(input: (shape: [1]), layers: [Relu]),
    loss: Mse, data: Synthetic(samples: 1), optimizer: Sgd(lr: 0.1), train: (batch_size: 1, steps: 1))"#;

fn ty(shape: &[u64]) -> TensorType {
    TensorType::f32(shape.iter().map(|&d| Dim::known(d)).collect())
}

struct OpGraph {
    g: Graph,
    params: usize,
}

impl OpGraph {
    fn new() -> Self {
        OpGraph {
            g: Graph::new(),
            params: 0,
        }
    }
    fn param(&mut self, shape: &[u64]) -> NodeIndex {
        self.params += 1;
        let op = Op::Param {
            name: format!("p{}", self.params),
            ty: ty(shape),
            init: Init::Normal { std: 1.0 },
        };
        self.g.add(op, &[], "p", None).unwrap()
    }
    fn op(&mut self, op: Op, ins: &[NodeIndex]) -> NodeIndex {
        self.g.add(op, ins, "op", None).unwrap()
    }
    /// An input `name` of `n` integers (indices, labels).
    fn i32_input(&mut self, name: &str, n: u64) -> NodeIndex {
        let ty = TensorType::new(DType::I32, vec![Dim::known(n)]);
        let name = name.into();
        self.op(Op::Input { name, ty }, &[])
    }
    /// `loss = sum(y * r)` for a random parameter `r`, differentiated, planned and checked.
    fn check_through(mut self, y: NodeIndex, what: &str, feed: &dyn Fn(&mut Executor)) {
        let shape: Vec<u64> = self.g.g[y].ty.shape.iter().map(|d| d.factor).collect();
        let r = self.param(&shape);
        let yr = self.op(Op::Mul, &[y, r]);
        let axes = (0..shape.len()).collect();
        let l = self.op(Op::ReduceSum { axes }, &[yr]);
        self.g.outputs.push(("loss".into(), l));
        let source: Source = parse(ANY).unwrap();
        let options = Options::default();
        let ctx = Ctx {
            source: &source,
            options: &options,
        };
        autodiff::run(&mut self.g, &ctx).unwrap();
        parallax_compiler::ir::verify::verify(&self.g).unwrap();
        let plan = Plan::single_device(&self.g, &source, &options);
        let mut e = Executor::new(plan, 1, 11);
        feed(&mut e);
        check(&mut e, 1, 3, 1e-2, what);
    }
}

fn unary(op: Op, shape: &[u64]) {
    let mut g = OpGraph::new();
    let x = g.param(shape);
    let y = g.op(op.clone(), &[x]);
    g.check_through(y, op.name(), &|_| {});
}

fn binary(op: Op, a: &[u64], b: &[u64]) {
    let mut g = OpGraph::new();
    let (x, z) = (g.param(a), g.param(b));
    let y = g.op(op.clone(), &[x, z]);
    g.check_through(y, &format!("{} {a:?} {b:?}", op.name()), &|_| {});
}

/// Every elementwise row of the op table with a VJP, walked from the table: a new op is
/// checked here without an edit (the gradients themselves and the clipping's clamp have
/// none: `vjp::none`).
#[test]
fn elementwise_ops() {
    for op in parallax_compiler::ir::ops::elementwise_examples() {
        if !op.def().has_vjp {
            continue;
        }
        match op {
            // Their derivatives blow up at 0: `sqrt_and_div_away_from_zero`.
            Op::Sqrt | Op::Div => continue,
            // A weight's bf16 copy passes its gradient through unchanged, as mixed precision
            // means it; its own derivative (a step function's) is zero almost everywhere.
            Op::RoundBf16 => continue,
            _ => {}
        }
        if op.def().arity.accepts(1) {
            unary(op, &[4, 6]);
        } else {
            binary(op.clone(), &[3, 4], &[3, 4]);
            binary(op.clone(), &[2, 3, 4], &[4]);
            binary(op, &[2, 1, 4], &[3, 1]);
        }
    }
}

/// Sqrt and Div, whose derivatives blow up at 0: taken of `p * p + 1` (at least 1).
#[test]
fn sqrt_and_div_away_from_zero() {
    let positive = |g: &mut OpGraph, shape: &[u64]| {
        let p = g.param(shape);
        let sq = g.op(Op::Mul, &[p, p]);
        g.op(Op::AddScalar { value: 1.0 }, &[sq])
    };
    let mut g = OpGraph::new();
    let x = positive(&mut g, &[3, 5]);
    let y = g.op(Op::Sqrt, &[x]);
    g.check_through(y, "sqrt", &|_| {});
    for (a, b) in [([3, 4].as_slice(), [3, 4].as_slice()), (&[2, 3, 4], &[4])] {
        let mut g = OpGraph::new();
        let x = g.param(a);
        let z = positive(&mut g, b);
        let y = g.op(Op::Div, &[x, z]);
        g.check_through(y, &format!("div {a:?} {b:?}"), &|_| {});
    }
}

#[test]
fn matmuls() {
    let mm = |ta, tb| Op::MatMul {
        trans_a: ta,
        trans_b: tb,
    };
    binary(mm(false, false), &[3, 4], &[4, 5]);
    binary(mm(false, true), &[3, 4], &[5, 4]);
    binary(mm(false, true), &[2, 3, 4], &[5, 4]);
    binary(mm(false, false), &[2, 3, 3, 4], &[2, 3, 4, 2]);
    binary(mm(false, true), &[2, 3, 3, 4], &[2, 3, 5, 4]);
}

#[test]
fn rows_and_reductions() {
    unary(Op::Softmax { causal: false }, &[2, 3, 5]);
    unary(Op::Softmax { causal: true }, &[2, 4, 4]);
    unary(Op::LayerNorm { eps: 1e-5 }, &[3, 6]);
    unary(Op::RmsNorm { eps: 1e-6 }, &[3, 6]);
    unary(Op::ReduceSum { axes: vec![0, 2] }, &[2, 3, 4]);
    unary(Op::ReduceMean { axes: vec![1] }, &[2, 3, 4]);
}

/// Attention's three gradients (from the saved log-sum-exp), across several key and query
/// tiles (70 > 64) with the causal mask, and with fewer queries than keys without it.
#[test]
fn attention() {
    for (causal, t, s, d, e) in [(false, 3, 5, 4, 6), (true, 70, 70, 8, 8)] {
        let mut g = OpGraph::new();
        // Token-major `[B, T, H, D]`: two heads, rows of one head apart in memory.
        let q = g.param(&[2, t, 2, d]);
        let k = g.param(&[2, s, 2, d]);
        let v = g.param(&[2, s, 2, e]);
        let y = g.op(Op::Attention { causal, scale: 0.5 }, &[q, k, v]);
        g.check_through(y, &format!("attention, causal {causal}"), &|_| {});
    }
}

#[test]
fn layout_ops() {
    unary(
        Op::Reshape {
            shape: vec![Dim::known(6), Dim::known(2)],
        },
        &[3, 4],
    );
    unary(
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        &[2, 3, 4],
    );
    unary(
        Op::Slice {
            axis: 1,
            start: 1,
            len: Dim::known(2),
        },
        &[2, 4, 3],
    );
    binary(Op::Concat { axis: 1 }, &[2, 3], &[2, 2]);
    // Pad (slice's adjoint) places its operand at `start` in zeros of `size`.
    unary(
        Op::Pad {
            axis: 1,
            start: 1,
            size: Dim::known(5),
        },
        &[2, 3, 4],
    );
}

#[test]
fn convolution_and_pooling() {
    let conv = |stride, padding, groups| Op::Conv2d {
        stride,
        padding,
        groups,
    };
    binary(conv(1, 0, 1), &[2, 3, 5, 5], &[4, 3, 3, 3]);
    binary(conv(2, 1, 1), &[2, 2, 6, 6], &[3, 2, 3, 3]);
    binary(conv(1, 1, 2), &[1, 4, 4, 4], &[2, 2, 3, 3]);
    for max in [true, false] {
        unary(
            Op::Pool2d {
                max,
                kernel: 2,
                stride: 2,
                padding: 0,
            },
            &[2, 3, 4, 4],
        );
    }
}

#[test]
fn embedding_and_cross_entropy() {
    // Gather rows of a table at integer indices.
    let mut g = OpGraph::new();
    let table = g.param(&[5, 3]);
    let idx = g.i32_input("idx", 4);
    let y = g.op(Op::Gather, &[table, idx]);
    g.check_through(y, "gather", &|e| {
        e.set_i32("idx", 1, &[1, 4, 1, 0]).unwrap()
    });
    // Cross-entropy with and without label smoothing, one label ignored.
    for smoothing in [0.0, 0.1] {
        let mut g = OpGraph::new();
        let logits = g.param(&[4, 6]);
        let labels = g.i32_input("labels", 4);
        let l = g.op(Op::CrossEntropy { smoothing }, &[logits, labels]);
        g.check_through(l, "cross_entropy", &|e| {
            e.set_i32("labels", 1, &[2, 5, -100, 0]).unwrap()
        });
    }
}
