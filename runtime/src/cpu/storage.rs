//! Activations stored in bf16 (`devices.activations: Bf16`): the CPU holds them as f32, each
//! rounded to the nearest bf16 (ties to even, as PTX's `cvt.rn.bf16.f32`) when its kernel
//! finishes, so that every reader sees what a GPU storing bf16 would load.

use super::Executor;
use parallax_compiler::scalar::math::round_bf16 as round;
use rayon::prelude::*;

impl Executor {
    /// Rounds the values kernel `k` stores in bf16 buffers, but those already rounded as
    /// they were stored (and clears those marks).
    pub(super) fn round_bf16_stores(&mut self, k: usize) {
        let plan = self.plan.clone();
        for &step in &plan.kernels[k].steps {
            if !std::mem::take(&mut self.rounded[step]) {
                self.round_bf16_step(step);
            }
        }
    }

    /// Whether step `step`'s value is stored in a bf16 buffer.
    pub(super) fn stored_in_bf16(&self, step: usize) -> bool {
        self.plan.stored_in_bf16(step)
    }

    /// Rounds step `step`'s stored value if its buffer is bf16.
    pub(super) fn round_bf16_step(&mut self, step: usize) {
        if let (true, Some(b)) = (self.stored_in_bf16(step), self.slot[step]) {
            round_bf16(self.buffers[b].f32_mut());
        }
    }

    /// Rounds step `step` of the running kernel now (before the kernel reads it), once.
    pub(super) fn round_bf16_early(&mut self, step: usize) {
        if self.stored_in_bf16(step) {
            self.round_bf16_step(step);
            self.rounded[step] = true;
        }
    }
}

/// Rounds every value to the nearest bf16 (ties to even), in place.
pub fn round_bf16(values: &mut [f32]) {
    // Elementwise, so any split gives the same bits.
    const CHUNK: usize = 1 << 15;
    let round_all = |c: &mut [f32]| {
        for x in c {
            *x = round(*x);
        }
    };
    if values.len() <= CHUNK {
        round_all(values);
    } else {
        values.par_chunks_mut(CHUNK).for_each(round_all);
    }
}

#[cfg(test)]
mod tests {
    use super::round_bf16;
    use parallax_compiler::scalar::math::round_bf16 as round;

    fn round_bits(bits: u32) -> u32 {
        round(f32::from_bits(bits)).to_bits()
    }

    #[test]
    fn rounds_as_the_half_crate_does_over_spread_bit_patterns() {
        // Every exponent, with mantissas around the ties, and a stride through the rest.
        let mut checked = 0;
        let mut bits = 0u32;
        loop {
            let x = f32::from_bits(bits);
            let ours = f32::from_bits(round_bits(bits));
            let theirs = half::bf16::from_f32(x).to_f32();
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "{bits:#010x}: {ours:e} vs {theirs:e}"
            );
            checked += 1;
            match bits.checked_add(0x0000_7ff1) {
                Some(b) => bits = b,
                None => break,
            }
        }
        assert!(checked > 100_000);
        for tie in [
            0x3f80_8000u32,
            0x3f81_8000,
            0xbf80_8000,
            0x7f7f_8000,
            0x0000_8000,
        ] {
            for b in [tie - 1, tie, tie + 1] {
                let theirs = half::bf16::from_f32(f32::from_bits(b)).to_f32();
                assert_eq!(round_bits(b), theirs.to_bits(), "{b:#010x}");
            }
        }
    }

    #[test]
    fn rounds_to_the_nearest_bf16_with_ties_to_even() {
        // bf16 keeps 8 significant bits: 1 + 2^-7 is the next value after 1.
        let ulp = 2f32.powi(-7);
        let mut v = vec![
            1.0 + ulp / 2.0,                 // a tie: to even (1.0)
            1.0 + ulp + ulp / 2.0,           // a tie: to even (1 + 2 ulp)
            1.0 + ulp / 2.0 + ulp / 64.0,    // above the tie: up
            -(1.0 + ulp / 2.0 - ulp / 64.0), // below the tie: down
            f32::MAX,                        // past bf16's largest: infinity
            3.0e-39,                         // subnormal, kept as bf16 holds it
        ];
        round_bf16(&mut v);
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], 1.0 + 2.0 * ulp);
        assert_eq!(v[2], 1.0 + ulp);
        assert_eq!(v[3], -1.0);
        assert_eq!(v[4], f32::INFINITY);
        assert_eq!(v[5].to_bits() & 0xffff, 0);
        assert!(v[5] > 0.0 && (v[5] - 3.0e-39).abs() < 3.0e-39 / 10.0);
    }
}
