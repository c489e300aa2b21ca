//! Loops compiled for the widest vector unit the CPU has (AVX-512, AVX2 with FMA, or the
//! baseline), chosen once at run time. `vectorised!` makes a function that runs an
//! `#[inline(always)]` body compiled for the detected level, so the elementwise rows of the op
//! table (`ir::maps`) and the CPU executor's row kernels vectorise as wide as the CPU allows.
//!
//! Determinism: vectorising a loop does not change its bits (every lane does the scalar's f32
//! operations; Rust never contracts a multiply and an add into an FMA by itself, and the
//! explicit `mul_add`s of `math` round once at every level, in software on a CPU without
//! FMA), so every level gives the same results.

use std::sync::atomic::{AtomicU8, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Baseline = 1,
    Avx2 = 2,
    Avx512 = 3,
}

/// The vector level in use (detected on first use; `PARALLAX_NO_SIMD` forces the baseline,
/// `PARALLAX_NO_AVX512` stops at AVX2, to measure those paths on an AVX-512 machine).
pub fn level() -> Level {
    static LEVEL: AtomicU8 = AtomicU8::new(0);
    match LEVEL.load(Ordering::Relaxed) {
        1 => Level::Baseline,
        2 => Level::Avx2,
        3 => Level::Avx512,
        _ => {
            let l = detect();
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if std::env::var_os("PARALLAX_NO_SIMD").is_some() {
            return Level::Baseline;
        }
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("fma")
            && std::env::var_os("PARALLAX_NO_AVX512").is_none()
        {
            return Level::Avx512;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Level::Avx2;
        }
    }
    Level::Baseline
}

/// `vectorised! { fn name(args) -> R = body; }` defines `name`, which runs the
/// `#[inline(always)]` function `body` compiled for the detected level. Every level gives
/// the same bits, for the reasons in the module's comment.
#[macro_export]
macro_rules! vectorised {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            use $crate::scalar::simd::{level, Level};
            match level() {
                // SAFETY: the level was detected on this CPU.
                #[cfg(target_arch = "x86_64")]
                Level::Avx512 => unsafe { avx512($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                Level::Avx2 => unsafe { avx2($($arg),*) },
                _ => $body($($arg),*),
            }
        }
    };
}

/// The second operand of a binary map: one value per element, or one value for all.
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    Each(&'a [f32]),
    All(f32),
}

/// `out[i] = f(a[i], p)` over the shorter of the two: the body a unary row's loop vectorises.
#[inline(always)]
pub fn unary_loop(f: impl Fn(f32, f32) -> f32, out: &mut [f32], a: &[f32], p: f32) {
    for (o, &x) in out.iter_mut().zip(a) {
        *o = f(x, p);
    }
}

/// `out[i] = f(a[i], b[i])` (`f(b[i], a[i])` when `swap`) over the shortest operand.
#[inline(always)]
pub fn binary_loop(
    f: impl Fn(f32, f32) -> f32,
    out: &mut [f32],
    a: &[f32],
    b: Operand,
    swap: bool,
) {
    match (b, swap) {
        (Operand::Each(b), false) => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = f(x, y);
            }
        }
        (Operand::Each(b), true) => {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = f(y, x);
            }
        }
        (Operand::All(y), false) => {
            for (o, &x) in out.iter_mut().zip(a) {
                *o = f(x, y);
            }
        }
        (Operand::All(y), true) => {
            for (o, &x) in out.iter_mut().zip(a) {
                *o = f(y, x);
            }
        }
    }
}
