//! Per-thread scratch vectors for kernels (im2col columns, pooling windows), kept between
//! calls so that a steady-state step does not allocate them. A vector is taken out while in
//! use, so a nested use on the same thread (a stolen task inside a kernel) gets its own.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

thread_local! {
    static KEPT: RefCell<HashMap<TypeId, Rc<dyn Any>>> = RefCell::new(HashMap::new());
}

/// Runs `f` on this thread's kept vector of `T` (any length, any contents), or on a new one
/// when the kept one is in use further up this thread's stack.
pub fn with_vec<T: 'static, R>(f: impl FnOnce(&mut Vec<T>) -> R) -> R {
    let kept = KEPT.with(|k| {
        let mut k = k.borrow_mut();
        let any = k
            .entry(TypeId::of::<Vec<T>>())
            .or_insert_with(|| Rc::new(RefCell::new(Vec::<T>::new())));
        Rc::clone(any)
            .downcast::<RefCell<Vec<T>>>()
            .expect("kept by its type")
    });
    let borrowed = kept.try_borrow_mut();
    match borrowed {
        Ok(mut v) => f(&mut v),
        Err(_) => f(&mut Vec::new()),
    }
}

/// Runs `f` on `len` default values (zeros) in this thread's kept vector of `T`.
pub fn with<T: Copy + Default + 'static, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    with_vec(|v: &mut Vec<T>| {
        v.clear();
        v.resize(len, T::default());
        f(v)
    })
}

/// Runs `f` on `len` values of this thread's kept vector of `T` as an earlier use left them
/// (defaults where none reached): for callers that write every element before they read
/// it, to whom zeroing a large buffer on every call is a pass over memory for nothing.
pub fn with_stale<T: Copy + Default + 'static, R>(len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    with_vec(|v: &mut Vec<T>| {
        if v.len() < len {
            v.resize(len, T::default());
        }
        f(&mut v[..len])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_vectors_are_zeroed_reused_and_nest() {
        with(3, |a: &mut [f32]| {
            a.copy_from_slice(&[1.0, 2.0, 3.0]);
            // A nested use gets its own vector.
            with(2, |b: &mut [f32]| assert_eq!(b, &[0.0, 0.0]));
        });
        with(4, |a: &mut [f32]| assert_eq!(a, &[0.0; 4]));
        let kept = with_vec(|v: &mut Vec<f32>| v.capacity());
        assert!(kept >= 4);
        // Stale scratch is as the last use left it, and grows with defaults.
        with(2, |a: &mut [u16]| a.copy_from_slice(&[7, 8]));
        with_stale(3, |a: &mut [u16]| assert_eq!(a, &[7, 8, 0]));
    }
}
