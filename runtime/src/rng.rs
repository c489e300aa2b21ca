//! Counter-based randomness: every random number is a pure function of (seed, purpose,
//! index), never of a thread, a device or the time. The same file and seed give the same bits
//! on any number of threads or devices.

use parallax_compiler::ir::Init;

/// What a random stream is for; each purpose gets independent numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Purpose {
    Init = 1,
    Shuffle = 2,
    Split = 3,
    Dropout = 4,
    Synthetic = 5,
    /// Where the windows of a token file start (`data::tokens`).
    Windows = 6,
    /// An image's random crop and flip (`data::image_folder`).
    Augment = 7,
    /// The draws of `parallax sample` (`trained::sample`).
    Sample = 8,
}

/// SplitMix64's finaliser: a bijective mix with good avalanche.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of a stream: (seed, purpose, stream number), e.g. a parameter's index.
#[inline]
pub fn stream(seed: u64, purpose: Purpose, n: u64) -> u64 {
    mix(mix(mix(seed ^ 0x9e37_79b9_7f4a_7c15).wrapping_add(purpose as u64)).wrapping_add(n))
}

/// The `index`-th 64 random bits of a stream.
#[inline]
pub fn bits(stream: u64, index: u64) -> u64 {
    mix(stream.wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

/// Uniform in [0, 1), with 24 bits (every value exactly representable in f32).
#[inline]
pub fn uniform(stream: u64, index: u64) -> f32 {
    (bits(stream, index) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// A standard normal (Box-Muller on two uniforms of the index).
#[inline]
pub fn normal(stream: u64, index: u64) -> f32 {
    let b = bits(stream, index);
    let u1 = ((b >> 40) as f64 + 0.5) / (1u64 << 24) as f64;
    let u2 = ((b & 0xff_ffff) as f64) / (1u64 << 24) as f64;
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// A uniform integer below `n` (n > 0), by multiply-shift (bias below 2^-32 for n < 2^32).
#[inline]
pub fn below(stream: u64, index: u64, n: u64) -> u64 {
    ((bits(stream, index) as u128 * n as u128) >> 64) as u64
}

/// A permutation of `0..n` determined by the stream (Fisher-Yates).
pub fn permutation(stream: u64, n: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = below(stream, i as u64, i as u64 + 1) as usize;
        p.swap(i, j);
    }
    p
}

/// The initial values of parameter number `index` (in plan order), keyed by (seed, index):
/// the same on every backend and machine.
pub fn init_param(init: &Init, seed: u64, index: usize, v: &mut [f32]) {
    let key = stream(seed, Purpose::Init, index as u64);
    match *init {
        Init::Uniform { bound } => {
            let b = bound as f32;
            for (i, x) in v.iter_mut().enumerate() {
                *x = (2.0 * uniform(key, i as u64) - 1.0) * b;
            }
        }
        Init::Normal { std } => {
            let s = std as f32;
            for (i, x) in v.iter_mut().enumerate() {
                *x = normal(key, i as u64) * s;
            }
        }
        Init::Zeros => v.fill(0.0),
        Init::Ones => v.fill(1.0),
    }
}

/// The key of dropout stream `id` at training step `step`: every backend's masks.
pub fn dropout_key(seed: u64, step: u64, id: u64) -> u64 {
    stream(mix(seed ^ mix(step)), Purpose::Dropout, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_independent_and_reproducible() {
        let a = stream(42, Purpose::Dropout, 0);
        let b = stream(42, Purpose::Dropout, 1);
        let c = stream(42, Purpose::Shuffle, 0);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, stream(42, Purpose::Dropout, 0));
        assert_eq!(uniform(a, 7), uniform(a, 7));
    }

    #[test]
    fn distributions_have_the_right_moments() {
        let s = stream(1, Purpose::Init, 0);
        let n = 200_000;
        let (mut m, mut v, mut mu) = (0f64, 0f64, 0f64);
        for i in 0..n {
            let x = normal(s, i) as f64;
            m += x;
            v += x * x;
            mu += uniform(s, i + n) as f64;
        }
        let (m, v, mu) = (m / n as f64, v / n as f64, mu / n as f64);
        assert!(m.abs() < 0.01, "{m}");
        assert!((v - 1.0).abs() < 0.02, "{v}");
        assert!((mu - 0.5).abs() < 0.005, "{mu}");
        let p = permutation(s, 1000);
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_ne!(p, (0..1000).collect::<Vec<_>>());
    }
}
