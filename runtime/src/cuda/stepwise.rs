//! The CUDA executor driven step by step by a rank (`ranks::rank`, through `RankExecutor`),
//! as the CPU executor is (`cpu::stepwise`): the step kernel by kernel, a step's value copied
//! to or from the host for a collective or a transfer, and the parameters and optimizer
//! state lent between the executors of one rank's micro-shards.
//!
//! Lending hands over device addresses, not memory: every plan buffer lives in its
//! executor's arena (one allocation), so a loan is the persistent buffers' addresses plus a
//! handle on the arena holding them, which keeps it alive while lent. The borrower's kernels
//! then read and update the lender's copy in place. The lender's slots hold `LENT` until the
//! loan comes back, so a use meanwhile is an error, never a fault. A loan only works on the
//! GPU it was made on: another device cannot address that memory, so it is refused.
//! What this does not save: a borrower's arena still has room for its own copy (the CPU
//! executors of a rank drop theirs); separating the persistent buffers from the arena would.

use super::exec::CudaExecutor;
use super::memory::{describe, Loan, LENT};
use super::CudaError;
use crate::exec::{ExecError, Mode, RankExecutor};
use parallax_compiler::ir::DType;

/// A tensor's shape and values, copied to the host.
pub type Shaped = (Vec<usize>, Vec<f32>);

/// What a step's kernels share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCtx {
    pub mode: Mode,
    pub step: u64,
    pub first_sample: u64,
}

impl RankExecutor for CudaExecutor {
    type Ctx = StepCtx;
    type Persistent = Loan;

    fn begin_step(
        &mut self,
        batch: usize,
        mode: Mode,
        step: u64,
        first_sample: u64,
    ) -> Result<StepCtx, ExecError> {
        if batch > self.mem.max_batch {
            return Err(ExecError::BatchTooLarge {
                batch,
                max: self.mem.max_batch,
            });
        }
        // A rank's thread may not be the one that built the executor: raw driver calls
        // (copies) act on the thread's current context.
        let fail = |e: CudaError| ExecError::Cuda {
            step: 0,
            what: "the step's constants".into(),
            source: Box::new(e),
        };
        self.mem.ctx.bind_to_thread().map_err(|e| fail(e.into()))?;
        self.begin(batch, mode).map_err(fail)?;
        Ok(StepCtx {
            mode,
            step,
            first_sample,
        })
    }

    fn run_kernel(&mut self, k: usize, ctx: &StepCtx) -> Result<(), ExecError> {
        let step = self.mem.plan.kernels[k].steps.last().copied().unwrap_or(0);
        // `begin_step` ran on the caller's thread; a rank's kernels run on its own, and the
        // raw cuBLASLt and driver calls act on the thread's current context (without it,
        // device 0's, or none). Cheap when already current.
        self.mem
            .ctx
            .bind_to_thread()
            .map_err(|e| self.failed(step, format!("kernel {k}: binding its GPU"), e.into()))?;
        CudaExecutor::run_kernel(self, k, ctx.mode, ctx.step, ctx.first_sample)
            .map_err(|e| self.failed(step, format!("kernel {k}"), e))
    }

    fn read(&self, step: usize) -> Result<Option<Vec<f32>>, ExecError> {
        if !self.readable(step) {
            return Ok(None);
        }
        let n = self.elements(step);
        // Any thread may read (see `run_kernel`).
        self.mem
            .ctx
            .bind_to_thread()
            .map_err(|e| self.failed(step, "binding its GPU".into(), e.into()))?;
        self.mem
            .download_f32(step, n)
            .map(Some)
            .map_err(|e| self.failed(step, "copying to the host".into(), e))
    }

    fn write(&mut self, step: usize, values: &[f32]) -> Result<(), ExecError> {
        // A step without a buffer of its own (kept inside a kernel) keeps nothing.
        if !self.stored(step) {
            return Ok(());
        }
        if !self.readable(step) {
            return Err(ExecError::Device(format!(
                "step {step} received values, but this executor holds no f32 value of it (another stage's, or not f32)"
            )));
        }
        check_len(step, &self.mem.shape(step, self.launch.batch), values.len())?;
        self.mem
            .ctx
            .bind_to_thread()
            .map_err(|e| self.failed(step, "binding its GPU".into(), e.into()))?;
        self.mem
            .upload_f32(step, values)
            .map_err(|e| self.failed(step, "copying from the host".into(), e))
    }

    fn finish_step(&mut self, mode: Mode) -> Result<(), ExecError> {
        let bound = self.mem.ctx.bind_to_thread().map_err(CudaError::from);
        bound
            .and_then(|()| self.finish(mode))
            .map_err(|e| ExecError::Cuda {
                step: 0,
                what: "the updates' copies".into(),
                source: Box::new(e),
            })
    }

    fn take_persistent(&mut self) -> Loan {
        if let Some(refused) = self.mem.refused.take() {
            return refused;
        }
        let buffers = self
            .persistent_buffers()
            .into_iter()
            .map(|b| {
                let lent = (b, self.mem.buffers[b], self.mem.capacity[b]);
                self.mem.buffers[b] = LENT;
                lent
            })
            .collect();
        Loan {
            buffers,
            home: self.mem.persistent_home.clone(),
            ordinal: self.mem.ctx.ordinal(),
            stream: self.mem.stream.clone(),
        }
    }

    fn put_persistent(&mut self, loan: Loan) -> Result<(), ExecError> {
        let mine: Vec<(usize, u64)> = self
            .persistent_buffers()
            .into_iter()
            .map(|b| (b, self.mem.capacity[b]))
            .collect();
        let theirs: Vec<(usize, u64)> = loan.buffers.iter().map(|l| (l.0, l.2)).collect();
        if let Some(why) = loan_refusal(self.mem.ctx.ordinal(), &mine, loan.ordinal, &theirs) {
            self.mem.refused = Some(loan);
            return Err(ExecError::Device(format!(
                "parameters and optimizer state lent between executors: {why}"
            )));
        }
        // Executors of one GPU share its default stream (in order); any other stream must
        // finish the lender's updates first.
        if loan.stream.cu_stream() != self.mem.stream.cu_stream() {
            if let Err(e) = loan.stream.synchronize() {
                self.mem.refused = Some(loan);
                return Err(ExecError::Cuda {
                    step: 0,
                    what: "waiting for the lender's stream".into(),
                    source: Box::new(CudaError::from(e)),
                });
            }
        }
        for &(b, address, _) in &loan.buffers {
            self.mem.buffers[b] = address;
        }
        self.mem.persistent_home = loan.home;
        Ok(())
    }
}

impl CudaExecutor {
    /// Restricts the values a rank reads and writes here to those of the kernels `owned`
    /// marks (a pipeline stage's, as `plan.kernel_mask` gives them); `None`: every value.
    /// Every buffer stays allocated: this changes what `read` offers, not memory.
    pub fn hold_only(&mut self, owned: Option<&[bool]>) {
        self.mem.held = self.mem.plan.steps_touched(owned);
    }

    /// Bytes its allocations hold: the arena of the plan's buffers and the scratch.
    pub fn allocated_bytes(&self) -> u64 {
        (self.mem.arena.bytes + self.mem.scratch.bytes) as u64
    }

    /// Parameter (or, with `state`, optimizer state) `name` and its values, copied to the
    /// host; `None` when the plan has none of that name.
    pub fn persistent_value(&self, name: &str, state: bool) -> Result<Option<Shaped>, CudaError> {
        let Some(shape) = self.persistent_shape(name, state) else {
            return Ok(None);
        };
        let id = self.persistent_step(name, state).unwrap_or(0);
        let v = self.mem.download_f32(id, shape.iter().product())?;
        Ok(Some((shape, v)))
    }

    /// The shape of parameter (or state) `name`.
    pub fn persistent_shape(&self, name: &str, state: bool) -> Option<Vec<usize>> {
        let id = self.persistent_step(name, state)?;
        Some(self.mem.shape(id, 1).iter().map(|&d| d as usize).collect())
    }

    fn persistent_step(&self, name: &str, state: bool) -> Option<usize> {
        let list = if state { &self.states } else { &self.params };
        list.iter().find(|(n, _)| n == name).map(|p| p.1)
    }

    /// Step `step`'s shape at the current batch.
    pub fn value_shape(&self, step: usize) -> Vec<usize> {
        self.mem
            .shape(step, self.launch.batch)
            .iter()
            .map(|&d| d as usize)
            .collect()
    }

    fn readable(&self, step: usize) -> bool {
        readable(
            self.mem.slot.get(step).copied().flatten(),
            self.mem.held.get(step).copied().unwrap_or(false),
            self.mem.plan.steps.get(step).map(|s| s.ty.dtype),
        )
    }

    /// Elements of `step`'s value at the current batch.
    fn elements(&self, step: usize) -> usize {
        self.mem
            .shape(step, self.launch.batch)
            .iter()
            .product::<u64>() as usize
    }

    /// The plan buffers of the parameters, then the optimizer state.
    fn persistent_buffers(&self) -> Vec<usize> {
        self.params
            .iter()
            .chain(&self.states)
            .filter_map(|p| self.mem.slot[p.1])
            .collect()
    }

    fn failed(&self, step: usize, doing: String, source: CudaError) -> ExecError {
        let what = self.mem.plan.steps.get(step).map_or(doing.clone(), |s| {
            format!("{doing}: {}", describe(&s.op, &s.layer))
        });
        ExecError::Cuda {
            step,
            what,
            source: Box::new(source),
        }
    }
}

/// Whether a rank may read or write a step's value here: it has a buffer, this executor
/// holds it (its stage's), and it is floats (collectives and transfers carry f32 only).
fn readable(buffer: Option<usize>, held: bool, dtype: Option<DType>) -> bool {
    buffer.is_some() && held && dtype == Some(DType::F32)
}

/// Values written to `step` must fill its shape at the current batch exactly: every rank
/// knows the shape from the plan, so a mismatch is a bug elsewhere, reported, not copied.
fn check_len(step: usize, shape: &[u64], got: usize) -> Result<(), ExecError> {
    let expected: u64 = shape.iter().product();
    if expected as usize != got {
        return Err(ExecError::Device(format!(
            "step {step} received {got} f32 values for a tensor of shape {shape:?} ({expected} values)"
        )));
    }
    Ok(())
}

/// Why a loan of `theirs` (buffers and sizes, from GPU `from`) cannot be installed in an
/// executor with `mine` on GPU `here`, if it cannot.
fn loan_refusal(
    here: usize,
    mine: &[(usize, u64)],
    from: usize,
    theirs: &[(usize, u64)],
) -> Option<String> {
    if here != from {
        return Some(format!(
            "GPU {from}'s buffers cannot be lent to an executor on GPU {here}"
        ));
    }
    if mine != theirs {
        return Some(format!(
            "the lender's buffers (plan buffer, elements) {theirs:?} differ from the borrower's {mine:?} (executors of different plans)"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_stored_held_f32_values_are_readable() {
        assert!(readable(Some(3), true, Some(DType::F32)));
        // Kept inside a kernel, another stage's, integer labels, no such step.
        assert!(!readable(None, true, Some(DType::F32)));
        assert!(!readable(Some(3), false, Some(DType::F32)));
        assert!(!readable(Some(3), true, Some(DType::I32)));
        assert!(!readable(Some(3), true, None));
    }

    #[test]
    fn a_write_must_fill_the_shape_at_the_batch() {
        assert!(check_len(7, &[4, 3], 12).is_ok());
        assert!(check_len(7, &[], 1).is_ok());
        let e = check_len(7, &[4, 3], 11).unwrap_err().to_string();
        assert!(
            e.contains("step 7") && e.contains("11") && e.contains("[4, 3]"),
            "{e}"
        );
        assert!(check_len(7, &[0, 3], 1).is_err());
    }

    #[test]
    fn loans_stay_on_one_gpu_and_one_plan() {
        let bufs = [(0, 12), (5, 4)];
        assert_eq!(loan_refusal(0, &bufs, 0, &bufs), None);
        let e = loan_refusal(1, &bufs, 0, &bufs).unwrap();
        assert!(e.contains("GPU 0") && e.contains("GPU 1"), "{e}");
        assert!(loan_refusal(0, &bufs, 0, &[(0, 12), (5, 8)]).is_some());
        assert!(loan_refusal(0, &bufs, 0, &bufs[..1]).is_some());
    }

    #[test]
    fn errors_name_the_step_and_the_cuda_error() {
        let e = ExecError::Cuda {
            step: 9,
            what: "kernel 4: matmul in layer `fc1`".into(),
            source: Box::new(CudaError::Driver("CUDA_ERROR_ILLEGAL_ADDRESS".into())),
        };
        let s = e.to_string();
        assert!(s.contains("step 9") && s.contains("fc1"), "{s}");
        assert!(s.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{s}");
    }
}
