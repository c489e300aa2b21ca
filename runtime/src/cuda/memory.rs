//! The CUDA executor's device memory: every plan buffer in one arena (sized for the largest
//! batch), the scratch and the bf16 staging beside it, each step's address, and the copies
//! of values to and from the host. The launcher (`launch`) reads addresses here; the
//! executor (`exec`) owns both.

use super::CudaError;
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use parallax_compiler::codegen::Module;
use parallax_compiler::ir::Op;
use parallax_compiler::Plan;
use std::sync::Arc;

/// Device memory freed on drop. It keeps its context alive and current for the free: an
/// arena lent to another executor (`stepwise`) can outlive the executor that allocated it.
pub(super) struct DeviceBuffer {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) bytes: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated by `malloc_sync`, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// The address a lent buffer's slot holds (`stepwise`): never a real allocation.
pub(super) const LENT: u64 = 0;

/// The parameters and optimizer state one executor lends another of the same rank, on the
/// same GPU (see `stepwise`).
pub struct Loan {
    /// `(plan buffer, device address, elements)`, parameters then state.
    pub(super) buffers: Vec<(usize, u64, u64)>,
    /// The arena the addresses point into.
    pub(super) home: Arc<DeviceBuffer>,
    pub(super) ordinal: usize,
    /// The lender's stream: its queued updates must land before another stream reads them.
    pub(super) stream: Arc<CudaStream>,
}

/// The plan's buffers on one GPU.
pub(super) struct Memory {
    pub(super) plan: Arc<Plan>,
    pub(super) ctx: Arc<CudaContext>,
    /// The executor's stream: copies to and from the host, and (outside a graph's capture)
    /// every launch.
    pub(super) stream: Arc<CudaStream>,
    /// One allocation for every buffer of the plan (the memory plan's arena).
    pub(super) arena: Arc<DeviceBuffer>,
    /// Each plan buffer's device address: inside the arena, inside the arena of the executor
    /// that lent this one its parameters and state, or `LENT` while lent out.
    pub(super) buffers: Vec<u64>,
    /// Each plan buffer's size in elements (at the largest batch).
    pub(super) capacity: Vec<u64>,
    /// The arena of the parameters and state installed here (`stepwise`), kept alive while
    /// this executor addresses it.
    pub(super) persistent_home: Arc<DeviceBuffer>,
    /// The steps whose values a rank may read and write here (all, unless restricted to a
    /// pipeline stage's kernels by `hold_only`).
    pub(super) held: Vec<bool>,
    /// A loan `put_persistent` refused, for the lender to take back.
    pub(super) refused: Option<Loan>,
    /// Each step's plan buffer.
    pub(super) slot: Vec<Option<usize>>,
    pub(super) scratch: DeviceBuffer,
    /// Where bf16 GEMMs take their f32 operands rounded to bf16 (`codegen::Arg::Staging`).
    pub(super) staging: DeviceBuffer,
    pub(super) max_batch: usize,
}

pub(super) fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

impl Memory {
    /// Allocates every buffer of `plan` on GPU `ordinal` (`ctx`) for batches up to
    /// `max_batch`, with the scratch and staging `code` (the module at the largest batch)
    /// needs; refused before allocating anything when it does not fit.
    pub(super) fn new(
        plan: Plan,
        max_batch: usize,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        ordinal: usize,
        code: &Module,
    ) -> Result<Memory, CudaError> {
        let shape = |id: usize| plan.shape_at(&plan.steps[id].ty.shape, max_batch as u64);
        let mut capacity = vec![0u64; plan.buffers.len()];
        let slot: Vec<Option<usize>> = plan.steps.iter().map(|s| s.buffer).collect();
        let mut first_step = vec![usize::MAX; plan.buffers.len()];
        for (id, b) in slot.iter().enumerate() {
            if let Some(b) = *b {
                // In 4-byte units: a bf16 buffer takes half its elements' (rounded up).
                let n = numel(&shape(id)) * plan.buffers[b].dtype.bytes();
                capacity[b] = capacity[b].max(n.div_ceil(4));
                first_step[b] = first_step[b].min(id);
            }
        }
        let predicted = plan.memory.peak_bytes;
        let alloc = |elems: u64, what: &str| -> Result<DeviceBuffer, CudaError> {
            let bytes = (elems.max(1) * 4) as usize;
            ctx.bind_to_thread()?;
            // SAFETY: a plain device allocation, freed by `DeviceBuffer`.
            match unsafe { result::malloc_sync(bytes) } {
                Ok(ptr) => Ok(DeviceBuffer {
                    ptr,
                    bytes,
                    ctx: ctx.clone(),
                }),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                    let free = result::mem_get_info().map(|m| m.0 as u64).unwrap_or(0);
                    Err(CudaError::OutOfMemory {
                        tensor: what.to_string(),
                        bytes: bytes as u64,
                        predicted,
                        free,
                    })
                }
                Err(e) => Err(e.into()),
            }
        };
        // The arena: every buffer at a 256-byte aligned offset.
        let mut offsets = Vec::with_capacity(capacity.len());
        let mut total = 0u64;
        for &c in &capacity {
            offsets.push(total);
            total += (c.max(1) * 4).div_ceil(256) * 256;
        }
        let largest = (0..capacity.len()).max_by_key(|&b| capacity[b]);
        let what = largest.map_or_else(
            || "the plan's buffers".to_string(),
            |b| {
                let name = plan
                    .steps
                    .get(first_step[b])
                    .map_or_else(|| format!("buffer {b}"), |s| describe(&s.op, &s.layer));
                format!(
                    "the plan's {} buffers (largest: `{name}`, {} bytes)",
                    capacity.len(),
                    capacity[b] * 4
                )
            },
        );
        // Refused before allocating anything: a plan past the device's free memory fails
        // here, naming both, rather than at whichever allocation runs out. The scratch is
        // the largest any batch size needs (the module's at the largest batch).
        let needed = total + (code.scratch.max(1) + code.staging.div_ceil(2).max(1)) * 4;
        ctx.bind_to_thread()?;
        let (free, device) = result::mem_get_info()?;
        if needed > free as u64 {
            return Err(CudaError::PlanTooLarge {
                gpu: ordinal,
                needed,
                what,
                free: free as u64,
                total: device as u64,
            });
        }
        let arena = Arc::new(alloc(total / 4, &what)?);
        let buffers: Vec<u64> = offsets.iter().map(|&o| arena.ptr + o).collect();
        let scratch = alloc(code.scratch, "scratch")?;
        let staging = alloc(code.staging.div_ceil(2), "the bf16 GEMM operands' staging")?;
        let held = plan.steps_touched(None);
        Ok(Memory {
            plan: Arc::new(plan),
            ctx,
            stream,
            persistent_home: arena.clone(),
            arena,
            buffers,
            capacity,
            held,
            refused: None,
            slot,
            scratch,
            staging,
            max_batch,
        })
    }

    pub(super) fn ptr(&self, step: usize) -> Result<u64, CudaError> {
        let b = self.slot.get(step).copied().flatten();
        match b.map(|b| self.buffers[b]) {
            None => Err(CudaError::Exec(format!("step {step} has no buffer"))),
            // Never hand a kernel a null address: it would fault, not fail.
            Some(LENT) => Err(CudaError::Exec(format!(
                "step {step}'s buffer (a parameter or optimizer state) is lent to another executor of this rank"
            ))),
            Some(p) => Ok(p),
        }
    }

    pub(super) fn shape(&self, step: usize, batch: usize) -> Vec<u64> {
        self.plan
            .shape_at(&self.plan.steps[step].ty.shape, batch as u64)
    }

    pub(super) fn upload<T>(&self, step: usize, v: &[T]) -> Result<(), CudaError> {
        let p = self.ptr(step)?;
        // SAFETY: the buffer holds at least the value's elements (checked by the callers),
        // and the copy completes before `v` is released (synchronised).
        unsafe { result::memcpy_htod_async(p, v, self.stream.cu_stream())? };
        self.stream.synchronize()?;
        Ok(())
    }

    /// Uploads f32 values, rounded to bf16 when the step is stored so.
    pub(super) fn upload_f32(&self, step: usize, v: &[f32]) -> Result<(), CudaError> {
        if self.plan.stored_in_bf16(step) {
            let bits: Vec<u16> = v.iter().map(|&x| bf16_bits(x)).collect();
            return self.upload(step, &bits);
        }
        self.upload(step, v)
    }

    /// A step's first `n` values as f32 (widened exactly from bf16 when stored so).
    pub(super) fn download_f32(&self, step: usize, n: usize) -> Result<Vec<f32>, CudaError> {
        let p = self.ptr(step)?;
        self.stream.synchronize()?;
        let v = if self.plan.stored_in_bf16(step) {
            let mut bits = vec![0u16; n];
            // SAFETY: reads `n` bf16 elements of a buffer that holds at least that many.
            unsafe { result::memcpy_dtoh_async(&mut bits, p, self.stream.cu_stream())? };
            self.stream.synchronize()?;
            bits.iter()
                .map(|&b| f32::from_bits(u32::from(b) << 16))
                .collect()
        } else {
            let mut v = vec![0f32; n];
            // SAFETY: reads `n` elements of a buffer that holds at least that many.
            unsafe { result::memcpy_dtoh_async(&mut v, p, self.stream.cu_stream())? };
            self.stream.synchronize()?;
            v
        };
        Ok(v)
    }
}

/// `matmul in layer fc1` for messages.
pub(super) fn describe(op: &Op, layer: &str) -> String {
    match op {
        Op::Param { name, .. } | Op::Input { name, .. } | Op::State { name, .. } => name.clone(),
        _ => format!("{} in layer `{layer}`", op.name()),
    }
}

/// The bits of `x` rounded to the nearest bf16 (ties to even), as the kernels store it.
pub(super) fn bf16_bits(x: f32) -> u16 {
    (parallax_compiler::scalar::math::round_bf16(x).to_bits() >> 16) as u16
}
