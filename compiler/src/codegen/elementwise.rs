//! Elementwise chains: one grid-stride kernel evaluates every op of the chain for element `i`
//! in registers and stores the values read outside the kernel. Operands from memory are read
//! at `i` (same shape), 0 (one value), `i % len` (a bias repeated along the leading axes), or
//! through numpy broadcasting coordinates otherwise.

use super::builder::{Kernel, Rd, F};
use super::{grid_for, Arg, CodegenError, Gen, Launch, BLOCK};
use crate::ir::Op;
use crate::plan::Plan;

/// The index into an operand of shape `small` for element `i` of `out`.
pub(super) fn broadcast_index(k: &mut Kernel, i: Rd, out: &[u64], small: &[u64]) -> Rd {
    let n: u64 = out.iter().product();
    let len: u64 = small.iter().product();
    if len == n {
        return i;
    }
    if len <= 1 {
        return k.u64c(0);
    }
    let suffix = small.len() <= out.len() && out[out.len() - small.len()..] == *small;
    if suffix {
        return k.op64("rem", i, len);
    }
    // General broadcasting: the coordinates of `i`, kept where `small` is not 1.
    let offset = out.len() - small.len();
    let mut idx = k.u64c(0);
    let (mut out_stride, mut in_stride) = (1u64, 1u64);
    for d in (0..out.len()).rev() {
        let size = out[d];
        let in_size = if d >= offset { small[d - offset] } else { 1 };
        if in_size != 1 {
            let q = k.op64("div", i, out_stride);
            let c = k.op64("rem", q, size);
            let t = k.op64("mul.lo", c, in_stride);
            idx = k.op64("add", idx, t);
        }
        out_stride *= size;
        in_stride *= in_size;
    }
    idx
}

/// SplitMix64's finaliser, as `rng::mix`.
fn mix(k: &mut Kernel, z: Rd) -> Rd {
    let a = k.op64("shr", z, 30);
    let z = k.op64_xor(z, a);
    let z = k.op64("mul.lo", z, "0xBF58476D1CE4E5B9");
    let a = k.op64("shr", z, 27);
    let z = k.op64_xor(z, a);
    let z = k.op64("mul.lo", z, "0x94D049BB133111EB");
    let a = k.op64("shr", z, 31);
    k.op64_xor(z, a)
}

/// Supplies a dropout op's (threshold, scale, random bits of the element) registers.
pub(super) type DropoutBits<'a> = dyn FnMut(&mut Kernel, f64, u64) -> (F, F, Rd) + 'a;

/// The value of one elementwise op on its operand registers.
pub(super) fn apply(
    k: &mut Kernel,
    op: &Op,
    a: F,
    b: Option<F>,
    dropout: &mut DropoutBits,
) -> Result<F, CodegenError> {
    let two = |b: Option<F>| {
        b.ok_or(CodegenError::Bad {
            op: op.name(),
            message: "expects two operands".into(),
        })
    };
    use crate::ir::maps::Elementwise;
    Ok(match (op.map(), op) {
        (Some(Elementwise::Unary(m)), _) => (m.map.ptx)(k, a, m.p),
        (Some(Elementwise::Binary(m)), _) => (m.0.ptx)(k, a, two(b)?),
        (None, Op::Dropout { p, stream }) => {
            let (threshold, scale, index) = dropout(k, *p, *stream);
            // uniform = (bits >> 40) * 2^-24, as `rng::uniform`.
            let bits = k.op64("shr", index, 40);
            let u = k.u64_to_f32(bits);
            let u = k.mulc(u, 1.0 / (1u64 << 24) as f32);
            let drop = k.cmpf("lt", u, threshold);
            let kept = k.mul(a, scale);
            let z = k.fc(0.0);
            k.sel(z, kept, drop)
        }
        (None, other) => {
            return Err(CodegenError::Bad {
                op: other.name(),
                message: "is not elementwise".into(),
            })
        }
    })
}

/// Where an operand of a chain op comes from.
#[derive(Clone, Copy)]
enum Src {
    Register(usize),
    Memory(Rd, usize),
}

/// An elementwise chain's parameters, declared on a kernel, and its evaluation at an element:
/// the grid-stride chain kernel's body, and the first pass of a row kernel that normalizes the
/// chain's value (`rows::norm_of_chain`).
pub(super) struct Chain<'a> {
    plan: &'a Plan,
    shapes: &'a [Vec<u64>],
    steps: &'a [usize],
    srcs: Vec<[Option<Src>; 2]>,
    /// Per step, where its value is stored.
    stores: Vec<Vec<Rd>>,
    drop_params: Vec<(u64, F, F, Rd)>,
    first: Option<Rd>,
    per_sample: u64,
}

impl<'a> Chain<'a> {
    /// Declares the parameters of the elementwise `steps` (all of the last step's shape):
    /// the memory operands (each once), then the stores, then dropout's. `given` is a value
    /// already computed elsewhere (a matmul result at its `Arg`); `stage` is a step whose value
    /// is also written to the scratch buffer (the input of the reduction that follows).
    pub(super) fn declare(
        k: &mut Kernel,
        plan: &'a Plan,
        shapes: &'a [Vec<u64>],
        steps: &'a [usize],
        given: Option<(usize, Arg)>,
        stage: Option<usize>,
    ) -> Result<Chain<'a>, CodegenError> {
        let last = *steps.last().ok_or(CodegenError::Bad {
            op: "elementwise",
            message: "an empty chain".into(),
        })?;
        let out_shape = &shapes[last];
        let n: u64 = out_shape.iter().product();
        let per_sample = if out_shape.is_empty() {
            1
        } else {
            (n / out_shape[0].max(1)).max(1)
        };
        let mut memory: Vec<(usize, Rd)> = Vec::new();
        let mut srcs: Vec<[Option<Src>; 2]> = Vec::new();
        for &s in steps {
            let st = &plan.steps[s];
            let mut ops = [None, None];
            for (j, &o) in st.operands.iter().enumerate().take(2) {
                ops[j] = Some(if let Some(r) = steps.iter().position(|&x| x == o) {
                    Src::Register(r)
                } else {
                    let ptr = match memory.iter().find(|(m, _)| *m == o) {
                        Some(&(_, p)) => p,
                        None => {
                            let arg = match given {
                                Some((gs, at)) if gs == o => at,
                                _ => Arg::Value(o),
                            };
                            if plan.steps[o].ty.dtype != crate::ir::DType::F32 {
                                return Err(CodegenError::Bad {
                                    op: st.op.name(),
                                    message: "expects f32 operands".into(),
                                });
                            }
                            let p = k.param_ptr(arg);
                            memory.push((o, p));
                            p
                        }
                    };
                    Src::Memory(ptr, o)
                });
            }
            srcs.push(ops);
        }
        let mut stores: Vec<Vec<Rd>> = Vec::new();
        for &s in steps {
            let mut v = Vec::new();
            if plan.steps[s].buffer.is_some() {
                v.push(k.param_ptr(Arg::Value(s)));
            }
            if stage == Some(s) {
                v.push(k.param_ptr(Arg::Scratch));
            }
            stores.push(v);
        }
        // Dropout parameters, declared before the loop.
        let mut drop_params: Vec<(u64, F, F, Rd)> = Vec::new();
        let mut first: Option<Rd> = None;
        for &s in steps {
            if let Op::Dropout { p, stream } = plan.steps[s].op {
                let key = k.param_u64(Arg::DropoutKey { stream });
                let t = k.param_f32(Arg::DropoutThreshold { p });
                let sc = k.param_f32(Arg::DropoutScale { p });
                drop_params.push((stream, t, sc, key));
                if first.is_none() {
                    first = Some(k.param_u64(Arg::FirstSample));
                }
            }
        }
        Ok(Chain {
            plan,
            shapes,
            steps,
            srcs,
            stores,
            drop_params,
            first,
            per_sample,
        })
    }

    /// Where the last step's value is stored (its buffer, else the scratch), if anywhere.
    pub(super) fn last_store(&self) -> Option<Rd> {
        self.stores.last().and_then(|v| v.first().copied())
    }

    /// Evaluates every step at element `i`, stores the stored ones and returns the last value.
    pub(super) fn eval(&self, k: &mut Kernel, i: Rd) -> Result<F, CodegenError> {
        let (plan, steps, per_sample) = (self.plan, self.steps, self.per_sample);
        let out_shape = &self.shapes[*steps.last().expect("declared non-empty")];
        let mut regs: Vec<F> = Vec::new();
        // The random index of element `i`, computed once per element if any op drops.
        let mut rand_index: Option<Rd> = None;
        for (r, &s) in steps.iter().enumerate() {
            let st = &plan.steps[s];
            let mut vals = [None, None];
            for (v, src) in vals.iter_mut().zip(self.srcs[r]) {
                *v = match src {
                    None => None,
                    Some(Src::Register(x)) => Some(regs[x]),
                    Some(Src::Memory(ptr, o)) => {
                        let idx = broadcast_index(k, i, out_shape, &self.shapes[o]);
                        Some(k.load(ptr, idx))
                    }
                };
            }
            let Some(a) = vals[0] else {
                return Err(CodegenError::Bad {
                    op: st.op.name(),
                    message: "has no operand".into(),
                });
            };
            let mut dropout = |k: &mut Kernel, _p: f64, stream: u64| {
                let &(_, t, sc, key) = self
                    .drop_params
                    .iter()
                    .find(|d| d.0 == stream)
                    .expect("declared above");
                let index = *rand_index.get_or_insert_with(|| {
                    let fs = self.first.expect("declared with the dropout");
                    let q = k.op64("div", i, per_sample);
                    let rem = k.op64("rem", i, per_sample);
                    let sample = k.op64("add", fs, q);
                    let base = k.op64("mul.lo", sample, per_sample);
                    k.op64("add", base, rem)
                });
                // bits = mix(key + index * golden), as `rng::bits`.
                let t1 = k.op64("mul.lo", index, "0x9E3779B97F4A7C15");
                let z = k.op64("add", key, t1);
                (t, sc, mix(k, z))
            };
            let mut v = apply(k, &st.op, a, vals[1], &mut dropout)?;
            if self.stores[r].iter().any(|&p| k.is_bf16(p)) {
                // Rounded in its register, so this kernel's later ops read what readers
                // outside it load (as the CPU's fused chains do).
                v = k.round_bf16(v);
            }
            regs.push(v);
            for &p in &self.stores[r] {
                k.store(p, i, v);
            }
        }
        Ok(*regs.last().expect("declared non-empty"))
    }
}

/// `a op b` for a binary elementwise op (an epilogue's add).
pub(super) fn binary(k: &mut Kernel, op: &Op, a: F, b: F) -> Result<F, CodegenError> {
    match op.map() {
        Some(crate::ir::maps::Elementwise::Binary(m)) => Ok((m.0.ptx)(k, a, b)),
        _ => Err(CodegenError::Bad {
            op: op.name(),
            message: "is not a binary elementwise op".into(),
        }),
    }
}

/// One kernel for the elementwise `steps` (all of the last step's shape). `given` is a value
/// already computed elsewhere (a matmul result at its `Arg`); `stage` is a step whose value is
/// also written to the scratch buffer (the input of the reduction that follows).
pub(super) fn chain(
    g: &mut Gen,
    name: &str,
    plan: &Plan,
    shapes: &[Vec<u64>],
    steps: &[usize],
    given: Option<(usize, Arg)>,
    stage: Option<usize>,
) -> Result<Launch, CodegenError> {
    let mut k = g.kernel(&format!("{name}e"));
    let c = Chain::declare(&mut k, plan, shapes, steps, given, stage)?;
    let n: u64 = shapes[*steps.last().expect("declared non-empty")]
        .iter()
        .product();
    let (i0, stride) = k.global_index();
    let end = k.u64c(n);
    let mut result: Result<(), CodegenError> = Ok(());
    k.for_range(i0, end, stride, |k, i| {
        if let Err(e) = c.eval(k, i) {
            result = Err(e);
        }
    });
    result?;
    Ok(g.launch(k, grid_for(n, BLOCK), BLOCK))
}

#[cfg(test)]
mod tests {
    use super::super::testing::assemble;
    use super::*;

    #[test]
    fn every_elementwise_op_assembles() {
        let ops = crate::ir::ops::elementwise_examples();
        let mut g = Gen::new();
        let mut k = Kernel::new("t");
        let x = k.param_ptr(Arg::Value(0));
        let o = k.param_ptr(Arg::Value(1));
        let key = k.param_u64(Arg::DropoutKey { stream: 3 });
        let t = k.param_f32(Arg::DropoutThreshold { p: 0.1 });
        let s = k.param_f32(Arg::DropoutScale { p: 0.1 });
        k.grid_stride(1000, |k, i| {
            let a = k.load(x, i);
            let mut v = a;
            for op in &ops {
                let mut d = |k: &mut Kernel, _: f64, _: u64| {
                    let z = k.op64("add", key, i);
                    (t, s, mix(k, z))
                };
                v = apply(k, op, v, Some(a), &mut d).unwrap();
            }
            k.store(o, i, v);
        });
        g.launch(k, 4, 256);
        assemble(&g.text("sm_80")).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn general_broadcasting_reads_by_coordinates() {
        let mut k = Kernel::new("b");
        let i = k.u64c(5);
        let _ = broadcast_index(&mut k, i, &[2, 3, 4], &[3, 1]);
        let text = k.finish();
        // Axis 1 of the output (stride 4, size 3) maps to stride 1 of the operand.
        assert!(
            text.contains("div.u64") && text.contains("rem.u64"),
            "{text}"
        );
    }
}
