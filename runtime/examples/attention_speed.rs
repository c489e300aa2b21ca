//! Times the CPU's flash attention alone, forward and backward, on one shape:
//! `attention_speed B H T D [causal] [REPS]` prints the median milliseconds of the forward
//! (with its log-sum-exp) and the backward (the query, key and value gradients in one kernel), and the
//! GFLOP/s of the whole (`4 T S D` multiply-add FLOPs per problem forward, `10 T S D`
//! backward with the recomputed scores; halved when causal).
//!
//! `attention_speed B H T D [causal] --serve` instead reads a count `N` per line and answers
//! with `N` times (ms) of forward plus backward, so that `benches/attention_compare.py` can
//! pair it with PyTorch's `scaled_dot_product_attention` in alternating chunks.
//!
//! The operands are token-major, `[B, T, H, D]`, as a projection's output reshaped. With
//! `COLD` set in the environment, every operand and output is flushed from the caches before
//! each timed call.

use parallax_runtime::cpu::kernels::attention::{attention, attention_grads, Grads, Saved};
use parallax_runtime::cpu::spin::on_spinning_pool;
use parallax_runtime::cpu::tensor::Tensor;
use std::io::BufRead;
use std::time::Instant;

mod common;
use common::{evict, filled};

/// One attention's operands, outputs and gradients.
struct Problem {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dy: Tensor,
    y: Tensor,
    lse: Tensor,
    delta: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    causal: bool,
    scale: f64,
}

impl Problem {
    fn new(b: usize, h: usize, t: usize, d: usize, causal: bool) -> Problem {
        let x = [b, t, h, d];
        let zeros = |s: &[usize]| Tensor::from_f32(s.to_vec(), vec![0.0; s.iter().product()]);
        Problem {
            q: filled(x.to_vec(), 1),
            k: filled(x.to_vec(), 2),
            v: filled(x.to_vec(), 3),
            dy: filled(x.to_vec(), 4),
            y: zeros(&x),
            lse: zeros(&[b, t, h]),
            delta: zeros(&[b, t, h]),
            dq: zeros(&x),
            dk: zeros(&x),
            dv: zeros(&x),
            causal,
            scale: 1.0 / (d as f64).sqrt(),
        }
    }

    /// Flushes every operand and output from the caches when `COLD` is set.
    fn chill(&self, cold: bool) {
        if cold {
            let p = self;
            for t in [
                &p.q, &p.k, &p.v, &p.dy, &p.y, &p.lse, &p.delta, &p.dq, &p.dk, &p.dv,
            ] {
                evict(t.f32());
            }
        }
    }

    fn forward(&mut self) {
        let p = self;
        attention(
            &p.q,
            &p.k,
            &p.v,
            p.causal,
            p.scale,
            &mut p.y,
            Some(&mut p.lse),
        )
        .expect("the forward");
        // delta = rowsum(dy * y), as the backward's graph computes it before the kernels.
        let d = *p.q.shape.last().unwrap();
        let (dy, y) = (p.dy.f32(), p.y.f32());
        for (i, out) in p.delta.f32_mut().iter_mut().enumerate() {
            let r = i * d..(i + 1) * d;
            *out = dy[r.clone()].iter().zip(&y[r]).map(|(a, b)| a * b).sum();
        }
    }

    fn backward(&mut self) {
        let p = self;
        let saved = Saved {
            dy: &p.dy,
            lse: &p.lse,
            delta: &p.delta,
        };
        let grads = Grads {
            dq: Some(&mut p.dq),
            dk: Some(&mut p.dk),
            dv: Some(&mut p.dv),
        };
        attention_grads((&p.q, &p.k, &p.v), &saved, p.causal, p.scale, grads)
            .expect("the gradients");
    }
}

/// Milliseconds of `f`, run as a step runs its kernels: on a worker of rayon's pool with the
/// others spinning (`top_up` before it; see `on_spinning_pool`).
fn ms(top_up: &dyn Fn(), f: &mut dyn FnMut()) -> f64 {
    top_up();
    let s = Instant::now();
    f();
    s.elapsed().as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: attention_speed B H T D [causal] [REPS | --serve]";
    let size = |i: usize| -> usize { args.get(i).and_then(|s| s.parse().ok()).expect(usage) };
    let (b, h, t, d) = (size(1), size(2), size(3), size(4));
    let causal = args.iter().any(|a| a == "causal");
    let serve = args.iter().any(|a| a == "--serve");
    let reps: usize = args[5..]
        .iter()
        .find_map(|a| a.parse().ok())
        .unwrap_or(20)
        .max(1);
    let mut p = Problem::new(b, h, t, d, causal);
    on_spinning_pool(|top_up| run(&mut p, [b, h, t, d], serve, reps, top_up));
}

fn run(p: &mut Problem, [b, h, t, d]: [usize; 4], serve: bool, reps: usize, top_up: &dyn Fn()) {
    let causal = p.causal;
    if serve {
        for line in std::io::stdin().lock().lines() {
            let n: usize = line.unwrap().trim().parse().expect("a count per line");
            let times: Vec<String> = (0..n)
                .map(|_| {
                    let f = ms(top_up, &mut || p.forward()) + ms(top_up, &mut || p.backward());
                    format!("{f:.4}")
                })
                .collect();
            println!("{}", times.join(" "));
        }
        return;
    }
    for _ in 0..3 {
        p.forward();
        p.backward();
    }
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    let cold = std::env::var_os("COLD").is_some();
    for _ in 0..reps {
        p.chill(cold);
        fwd.push(ms(top_up, &mut || p.forward()));
        p.chill(cold);
        bwd.push(ms(top_up, &mut || p.backward()));
    }
    let (f, g) = (median(fwd), median(bwd));
    let half = if causal { 0.5 } else { 1.0 };
    let unit = (b * h * t * t * d) as f64 * half;
    println!(
        "B {b} H {h} T {t} D {d}{}: forward {f:.3} ms ({:.0} GFLOP/s), backward {g:.3} ms \
         ({:.0} GFLOP/s), both {:.3} ms ({:.0} GFLOP/s)",
        if causal { " causal" } else { "" },
        4.0 * unit / f / 1e6,
        10.0 * unit / g / 1e6,
        f + g,
        14.0 * unit / (f + g) / 1e6,
    );
}
