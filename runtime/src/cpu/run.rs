//! Running a step: kernel by kernel on a worker of rayon's pool, each kernel one op, a fused
//! elementwise chain (chunk by chunk, in registers), a matmul and its epilogue, or a chain
//! ending in a reduction.

use super::kernels::gemm::matmul_strided;
use super::kernels::{execute, rows, Ctx, KernelError};
use super::{fused, tensor, views, ExecError, Executor, Mode, EMPTY};
use parallax_compiler::ir::{KernelKind, Op};

impl Executor {
    /// Runs one step on a batch of `batch` samples whose first sample has index `first_sample`
    /// in the global batch. Training also replaces parameters and optimizer state.
    pub fn run(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<(), ExecError> {
        let ctx = self.begin_step(batch, mode, step, first_sample)?;
        // The step runs on a worker of rayon's pool, so that each parallel kernel splits
        // among the workers directly instead of waking the pool from this thread and
        // sleeping until it is done; the other workers spin between kernels.
        let this = SendPtr(self as *mut Executor);
        super::spin::on_spinning_pool(|top_up| {
            let this = this;
            // SAFETY: `self` is borrowed mutably for the whole call, which ends before
            // `run` returns; only this closure touches it.
            unsafe { &mut *this.0 }.run_kernels(mode, &ctx, top_up)
        })?;
        self.finish_step(mode);
        Ok(())
    }

    fn run_kernels(
        &mut self,
        mode: Mode,
        ctx: &Ctx,
        before_kernel: &dyn Fn(),
    ) -> Result<(), ExecError> {
        for k in 0..self.plan.kernels.len() {
            if !self.wanted(k, mode) {
                continue;
            }
            before_kernel();
            let t = self.profile.as_mut().map(|p| {
                p.epilogue = None;
                std::time::Instant::now()
            });
            self.run_kernel_at(k, ctx)?;
            if let (Some(t), Some(p)) = (t, self.profile.as_mut()) {
                let secs = t.elapsed().as_secs_f64();
                p.by_kernel[k] += secs;
                let epilogue = p.epilogue.take();
                if let Some(secs) = epilogue {
                    let e = p.by_kind.entry("epilogue of a matmul").or_insert((0.0, 0));
                    e.0 += secs;
                    e.1 += 1;
                }
                let kern = &self.plan.kernels[k];
                let name = match kern.kind {
                    _ if self.folds.skipped[k] => "permute (folded)",
                    KernelKind::Single => self.plan.steps[kern.steps[0]].op.name(),
                    KernelKind::Elementwise => "fused elementwise",
                    KernelKind::ElementwiseReduce => "fused elementwise+reduce",
                    KernelKind::Gemm {
                        bias: false,
                        activation: None,
                    } => "matmul",
                    KernelKind::Gemm { .. } => "matmul (with an epilogue)",
                    KernelKind::Attention => "attention",
                    KernelKind::AttentionGrads => "attention gradients",
                    KernelKind::Grouped { reduce: false, .. } => "grouped elementwise",
                    KernelKind::Grouped { reduce: true, .. } => "grouped elementwise+reduce",
                    KernelKind::NormGradAdd => "norm gradient + add",
                };
                let e = p.by_kind.entry(name).or_insert((0.0, 0));
                e.0 += secs - epilogue.unwrap_or(0.0);
                e.1 += 1;
            }
        }
        Ok(())
    }

    /// Sets up a step (shapes, constants) and returns the kernels' context. `run` does this
    /// itself; a coordinator that drives a step kernel by kernel (`run_kernel_at`, then
    /// `finish_step`: simulated devices interleave shards and collectives this way) calls it.
    pub fn begin_step(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<Ctx, ExecError> {
        if batch > self.max_batch {
            return Err(ExecError::BatchTooLarge {
                batch,
                max: self.max_batch,
            });
        }
        self.ensure_shapes(batch);
        self.last_mode = Some(mode);
        // Constants are sources too: fill them for this batch.
        for k in 0..self.fills.len() {
            let (step, value) = self.fills[k];
            self.shape_buffer(step);
            self.buf_mut(step).f32_mut().fill(value);
        }
        let training = mode != Mode::Eval;
        for k in 0..self.training_flags.len() {
            let step = self.training_flags[k];
            self.buf_mut(step)
                .f32_mut()
                .fill(f32::from(u8::from(training)));
        }
        Ok(Ctx {
            seed: self.seed,
            step,
            training,
            first_sample,
        })
    }

    /// Copies the new parameters and state over the old at the end of a training step (those
    /// not already written in place).
    pub fn finish_step(&mut self, mode: Mode) {
        if mode == Mode::Train {
            for i in 0..self.plan.updates.len() {
                let (p, u) = self.plan.updates[i];
                // Another pipeline stage's parameter: not held here.
                if !self.needed[u] {
                    continue;
                }
                let (bp, bu) = (self.slot[p].expect("stored"), self.slot[u].expect("stored"));
                // Written in place (see the schedule pass).
                if bp == bu {
                    continue;
                }
                let src = std::mem::take(&mut self.buffers[bu]);
                self.buffers[bp].f32_mut().copy_from_slice(src.f32());
                self.buffers[bu] = src;
            }
        }
    }

    /// Runs a step kernel by kernel, calling `after(k, self)` after each kernel that runs
    /// (lockstep comparisons with another backend); only the kernels marked in `owned` when
    /// given (a device's of a partitioned plan: the executor's `for_kernels`).
    pub fn run_observed(
        &mut self,
        batch: usize,
        (mode, owned): (Mode, Option<&[bool]>),
        step: u64,
        first_sample: u64,
        after: &mut dyn FnMut(usize, &mut Executor),
    ) -> Result<(), ExecError> {
        let ctx = self.begin_step(batch, mode, step, first_sample)?;
        for k in 0..self.plan.kernels.len() {
            let mine = owned.is_none_or(|o| o.get(k).copied().unwrap_or(false));
            if mine && self.wanted(k, mode) {
                // Every kernel stores what the plan says, to be compared as it says.
                self.run_kernel(k, &ctx, false)?;
                after(k, self);
            }
        }
        self.finish_step(mode);
        Ok(())
    }

    /// Whether kernel `k` runs in `mode`.
    pub fn wanted(&self, k: usize, mode: Mode) -> bool {
        mode.runs(&self.plan, k)
    }

    pub(super) fn kernel_err(&self, step: usize, source: KernelError) -> ExecError {
        let s = &self.plan.steps[step];
        ExecError::Kernel {
            step,
            op: s.op.name(),
            layer: s.layer.clone(),
            source,
        }
    }

    /// Runs one op from its operands' buffers into `out` (its own buffer, or the scratch).
    pub(super) fn run_single(
        &mut self,
        step: usize,
        ctx: &Ctx,
        into_scratch: bool,
    ) -> Result<(), ExecError> {
        self.shape_operands(step);
        // A reshape sharing its operand's buffer (see the schedule pass) is only a new shape.
        if !into_scratch && self.writes_over_operand(step) {
            if let Op::Reshape { .. } = self.plan.steps[step].op {
                self.shape_buffer(step);
                return Ok(());
            }
        }
        let mut out = if into_scratch {
            std::mem::take(&mut self.scratch)
        } else {
            std::mem::take(self.buf_mut(step))
        };
        out.reshape_in_place(&self.shapes[step]);
        let s = &self.plan.steps[step];
        let get = |k: usize| s.operands.get(k).map_or(&EMPTY, |&o| self.buf(o));
        let ins = [get(0), get(1), get(2), get(3), get(4), get(5)];
        let r = execute(&s.op, &ins[..s.operands.len()], &mut out, ctx);
        if into_scratch {
            self.scratch = out;
        } else {
            *self.buf_mut(step) = out;
        }
        r.map_err(|e| self.kernel_err(step, e))
    }

    /// Runs kernel `k` of the step `begin_step` started.
    pub fn run_kernel_at(&mut self, k: usize, ctx: &Ctx) -> Result<(), ExecError> {
        self.run_kernel(k, ctx, true)
    }

    /// Runs kernel `k`; with `fold`, a permute folded into its operand's kernel (see
    /// `views`) is written there and its own kernel does nothing. What it stores in bf16 is
    /// rounded as the kernel finishes, as a GPU kernel rounds what it stores.
    fn run_kernel(&mut self, k: usize, ctx: &Ctx, fold: bool) -> Result<(), ExecError> {
        self.run_kernel_unrounded(k, ctx, fold)?;
        self.round_bf16_stores(k);
        Ok(())
    }

    fn run_kernel_unrounded(&mut self, k: usize, ctx: &Ctx, fold: bool) -> Result<(), ExecError> {
        let plan = self.plan.clone();
        let kind = plan.kernels[k].kind;
        let steps = &plan.kernels[k].steps;
        if fold && self.folds.skipped[k] {
            self.shape_buffer(steps[0]);
            return Ok(());
        }
        // A matmul alone, writing its permute's tensor.
        if let (true, [mm]) = (fold, &steps[..]) {
            if let Some(f) = self.folds.by_producer[*mm] {
                return self.run_matmul_permuted(*mm, f);
            }
        }
        if let KernelKind::Grouped { .. } = kind {
            // Member by member, each as the kernel it would be alone: the same bits.
            for (kind, member) in parallax_compiler::ir::kernels::members_of(kind, steps) {
                match kind {
                    KernelKind::ElementwiseReduce => self.run_chain_then_reduce(member, ctx)?,
                    _ => self.run_kernel_kind(kind, member, k, ctx, fold)?,
                }
            }
            return Ok(());
        }
        self.run_kernel_kind(kind, steps, k, ctx, fold)
    }

    /// Runs kernel `k`'s `steps` as a kernel of `kind`.
    fn run_kernel_kind(
        &mut self,
        kind: KernelKind,
        steps: &[usize],
        k: usize,
        ctx: &Ctx,
        fold: bool,
    ) -> Result<(), ExecError> {
        let plan = self.plan.clone();
        match kind {
            // An update written over its operand (see the schedule pass) runs as a fused
            // kernel, which reads each element before writing it.
            KernelKind::Single
                if self.writes_over_operand(steps[0])
                    && fused::Kind::of(&plan.steps[steps[0]].op).is_some() =>
            {
                self.run_fused(steps, None, ctx, None, None)
            }
            // A cross-entropy's gradient written over its logits, row by row.
            KernelKind::Single
                if self.writes_over_operand(steps[0])
                    && matches!(plan.steps[steps[0]].op, Op::CrossEntropyGrad { .. }) =>
            {
                self.run_xent_grad_in_place(steps[0])
            }
            KernelKind::Single
                if self.writes_over_operand(steps[0])
                    && plan.steps[steps[0]].op == Op::CacheWrite =>
            {
                self.run_cache_write_in_place(steps[0])
            }
            KernelKind::Single => self.run_single(steps[0], ctx, false),
            KernelKind::Elementwise => self.run_fused(steps, None, ctx, None, None),
            KernelKind::Gemm { .. } => self.run_gemm(steps, ctx, fold),
            KernelKind::Attention | KernelKind::AttentionGrads if steps.len() == 1 => {
                self.run_single(steps[0], ctx, false)
            }
            KernelKind::Attention => self.run_attention(steps),
            KernelKind::AttentionGrads => self.run_attention_grads(steps),
            KernelKind::ElementwiseReduce => match self.scaled_softmax(k) {
                Some((x, by, causal)) => self.run_scaled_softmax(x, by, causal, steps[1]),
                None if self.ends_in_norm(steps) => self.run_chain_then_norm(steps, ctx),
                None => self.run_chain_then_reduce(steps, ctx),
            },
            KernelKind::Grouped { .. } => unreachable!("members run one by one"),
            KernelKind::NormGradAdd => self.run_norm_grad_add(steps),
        }
    }

    /// `CrossEntropyGrad` step `step`, whose buffer is its logits' (see `run_kernel`).
    fn run_xent_grad_in_place(&mut self, step: usize) -> Result<(), ExecError> {
        let Op::CrossEntropyGrad { smoothing } = self.plan.steps[step].op else {
            unreachable!("called for a cross-entropy's gradient");
        };
        self.shape_operands(step);
        let mut logits = self.take_shaped(step);
        let ops = &self.plan.steps[step].operands;
        let (labels, dloss) = (self.buf(ops[1]), self.buf(ops[2]));
        let r = rows::cross_entropy_grad_in_place(&mut logits, labels, dloss, smoothing as f32);
        *self.buf_mut(step) = logits;
        r.map_err(|e| self.kernel_err(step, e))
    }

    /// Step `step`'s buffer, taken out and shaped for this batch (put it back after).
    pub(super) fn take_shaped(&mut self, step: usize) -> tensor::Tensor {
        let mut t = std::mem::take(self.buf_mut(step));
        t.reshape_in_place(&self.shapes[step]);
        t
    }

    /// `softmax(x * by)` into step `red`'s buffer in one pass (see `scaled_softmax`).
    fn run_scaled_softmax(
        &mut self,
        x: usize,
        by: f32,
        causal: bool,
        red: usize,
    ) -> Result<(), ExecError> {
        // The scale's operand: shaped for this batch before it is read.
        self.shape_buffer(x);
        let mut out = std::mem::take(self.buf_mut(red));
        out.reshape_in_place(&self.shapes[red]);
        let r = rows::softmax_scaled(self.buf(x), Some(by), causal, &mut out);
        *self.buf_mut(red) = out;
        r.map_err(|e| self.kernel_err(red, e))
    }

    /// An elementwise chain staged in the scratch, then the reduction reading it.
    fn run_chain_then_reduce(&mut self, steps: &[usize], ctx: &Ctx) -> Result<(), ExecError> {
        let (&red, chain) = steps.split_last().expect("a reduction and its chain");
        let last = *chain.last().expect("a chain before the reduction");
        self.scratch.reshape_in_place(&self.shapes[last]);
        let stage = self.scratch.f32_mut().as_mut_ptr();
        self.run_fused(chain, None, ctx, Some((last, stage)), None)?;
        let mut out = std::mem::take(self.buf_mut(red));
        out.reshape_in_place(&self.shapes[red]);
        let r = execute(&self.plan.steps[red].op, &[&self.scratch], &mut out, ctx);
        *self.buf_mut(red) = out;
        r.map_err(|e| self.kernel_err(red, e))
    }

    /// `(x, by, causal)` when the plan runs kernel `k`, `softmax(scale(x, by))`, in one pass
    /// (see `parallax_compiler::plan::views`).
    fn scaled_softmax(&self, k: usize) -> Option<(usize, f32, bool)> {
        if !self.plan.views.scaled_softmax.contains(&k) {
            return None;
        }
        let [scale, red] = self.plan.kernels[k].steps[..] else {
            return None;
        };
        let (Op::Scale { by }, Op::Softmax { causal }) =
            (&self.plan.steps[scale].op, &self.plan.steps[red].op)
        else {
            return None;
        };
        Some((self.plan.steps[scale].operands[0], *by as f32, *causal))
    }

    /// Gives the operands' buffers their values' shapes: a buffer shared by a value and its
    /// reshapes holds the shape of the one last written.
    pub(super) fn shape_operands(&mut self, step: usize) {
        for i in 0..self.plan.steps[step].operands.len() {
            self.shape_buffer(self.plan.steps[step].operands[i]);
        }
    }

    /// Whether step `step` is stored in the buffer of one of its operands.
    fn writes_over_operand(&self, step: usize) -> bool {
        let out = self.slot[step];
        out.is_some()
            && self.plan.steps[step]
                .operands
                .iter()
                .any(|&o| self.slot[o] == out)
    }

    /// Matmul `step` written permuted into the buffer of `fold`'s permute.
    fn run_matmul_permuted(&mut self, step: usize, fold: views::Fold) -> Result<(), ExecError> {
        let plan = self.plan.clone();
        let (Op::MatMul { trans_a, trans_b }, Op::Permute { perm }) =
            (&plan.steps[step].op, &plan.steps[fold.permute].op)
        else {
            unreachable!("folds pair a matmul with a permute");
        };
        self.shape_operands(step);
        self.shape_buffer(fold.permute);
        let strides = views::permuted_strides(&self.shapes[step], perm, &self.shapes[fold.permute]);
        let mut out = std::mem::take(self.buf_mut(fold.permute));
        let ops = &plan.steps[step].operands;
        let (a, b) = (self.buf(ops[0]), self.buf(ops[1]));
        let r = matmul_strided(
            a,
            b,
            *trans_a,
            *trans_b,
            &self.shapes[step],
            out.f32_mut(),
            &strides,
        );
        *self.buf_mut(fold.permute) = out;
        r.map_err(|e| self.kernel_err(step, e))
    }

    /// Evaluates elementwise `steps` chunk by chunk. `given` are values already in memory
    /// (a matmul's result); `stage` also writes one value to a scratch buffer; `permuted`
    /// writes the last value permuted, into its permute's buffer instead of its own.
    pub(super) fn run_fused(
        &mut self,
        steps: &[usize],
        given: Option<(usize, (*const f32, usize))>,
        ctx: &Ctx,
        stage: Option<(usize, *mut f32)>,
        permuted: Option<views::Fold>,
    ) -> Result<(), ExecError> {
        let run = |ops: &[fused::FusedOp], n, per_sample| fused::run(ops, n, per_sample, ctx);
        self.run_fused_with(steps, given, stage, permuted, run)
    }

    /// `run_fused`, with `run(ops, n, per_sample)` evaluating the ops (`fused::run`, or
    /// `fused::run_blocks` before a row kernel).
    pub(super) fn run_fused_with(
        &mut self,
        steps: &[usize],
        given: Option<(usize, (*const f32, usize))>,
        stage: Option<(usize, *mut f32)>,
        permuted: Option<views::Fold>,
        run: impl FnOnce(&[fused::FusedOp], usize, usize) -> Result<(), KernelError>,
    ) -> Result<(), ExecError> {
        let last = *steps.last().expect("a kernel has steps");
        let shape = &self.shapes[last];
        let n = tensor::numel(shape);
        let per_sample = if shape.is_empty() {
            1
        } else {
            (n / shape[0].max(1)).max(1)
        };
        // Shape every stored output for this batch, and every operand read from memory,
        // before taking pointers into them.
        for &s in steps {
            self.shape_buffer(s);
            self.shape_operands(s);
        }
        let permute = permuted.map(|f| f.permute);
        let permuted = permuted.map(|f| {
            self.shape_buffer(f.permute);
            let Op::Permute { perm } = &self.plan.steps[f.permute].op else {
                unreachable!("folds name a permute");
            };
            let value = &self.shapes[f.value];
            let strides = views::permuted_strides(value, perm, &self.shapes[f.permute]);
            let (run, outer) = views::runs_of(value, &strides);
            let ptr = self.buf_mut(f.permute).f32_mut().as_mut_ptr();
            fused::Store::Runs { ptr, run, outer }
        });
        let mut ops = self.fused_ops.take();
        for &s in steps {
            let st = &self.plan.steps[s];
            let mut operands = [fused::Source::Register(0); 2];
            for (j, &o) in st.operands.iter().enumerate().take(2) {
                operands[j] = if let Some(r) = steps.iter().position(|&x| x == o) {
                    fused::Source::Register(r)
                } else if let Some((_, (p, len))) = given.filter(|(g, _)| *g == o) {
                    fused::Source::Memory(p, len)
                } else {
                    let t = self.buf(o);
                    if !t.is_f32() {
                        return Err(self.kernel_err(
                            s,
                            KernelError::Bad {
                                op: st.op.name(),
                                message: "expects f32 operands".into(),
                            },
                        ));
                    }
                    fused::Source::Memory(t.f32().as_ptr(), t.numel().max(1))
                };
            }
            let round = match permute {
                Some(p) if s == last => self.stored_in_bf16(p),
                _ => self.stored_in_bf16(s),
            };
            let store = match (self.slot[s], stage) {
                _ if s == last && permuted.is_some() => permuted.clone(),
                (Some(b), _) => Some(fused::Store::Dense(self.buffers[b].f32_mut().as_mut_ptr())),
                (None, Some((x, p))) if x == s => Some(fused::Store::Dense(p)),
                _ => None,
            };
            let Some(kind) = fused::Kind::of(&st.op) else {
                return Err(self.kernel_err(
                    s,
                    KernelError::Bad {
                        op: st.op.name(),
                        message: "is not elementwise".into(),
                    },
                ));
            };
            ops.push(fused::FusedOp {
                kind,
                operands,
                store,
                round,
            });
        }
        // A staged value that is also stored is copied to the scratch after the pass.
        let copy_stage = stage.filter(|(x, _)| self.slot[*x].is_some());
        let r = run(&ops, n, per_sample);
        self.fused_ops.keep(ops);
        r.map_err(|e| self.kernel_err(last, e))?;
        // What the chain rounded into its own buffer needs no rounding at the kernel's end.
        for &s in steps {
            if self.stored_in_bf16(s) && !(permute.is_some() && s == last) {
                self.rounded[s] = true;
            }
        }
        if let Some((x, p)) = copy_stage {
            let src = self.buf(x).f32();
            // SAFETY: the scratch was shaped to this value's size; it is not the source buffer.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        }
        Ok(())
    }
}

/// The executor, handed to the pool's worker that runs a step.
struct SendPtr(*mut Executor);
// SAFETY: see `Executor::run`: the pointee is exclusively borrowed while the worker uses it.
unsafe impl Send for SendPtr {}
