//! Finding NaN and infinities. The loss alone does not show them: ReLU and max-pooling pass a
//! finite value on where a NaN sits beside it, so a NaN can reach the weights while the loss
//! stays finite. Training checks its data when loaded, every gradient, parameter and state
//! after every step, and every tensor it writes.

use std::fmt;

parallax_compiler::vectorised! {
    /// Whether every value is finite. Runs on every gradient, parameter and state after
    /// every step, so it compares bit patterns block by block without a branch per value and
    /// stops at the first block holding a non-finite value; compiled for the CPU's vector
    /// width (the baseline's SSE2 has no unsigned maximum, and ran it value by value: 13% of
    /// the MLP bench's training time).
    pub fn all_finite(v: &[f32]) -> bool = all_finite_at;
}

#[inline(always)]
fn all_finite_at(v: &[f32]) -> bool {
    // Exponent all ones: an infinity or a NaN; the sign bit is masked off.
    const EXPONENT: u32 = 0x7f80_0000;
    v.chunks(256).all(|block| {
        block
            .iter()
            .fold(0u32, |m, x| m.max(x.to_bits() & 0x7fff_ffff))
            < EXPONENT
    })
}

/// What is not finite in a list of values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Count {
    /// The first non-finite value and where it is.
    pub first: usize,
    pub value: f32,
    pub nan: usize,
    pub infinite: usize,
    /// How many values there are in all.
    pub len: usize,
}

impl Count {
    /// `None` when every value is finite.
    pub fn of(v: &[f32]) -> Option<Count> {
        if all_finite(v) {
            return None;
        }
        let first = v.iter().position(|x| !x.is_finite())?;
        Some(Count {
            first,
            value: v[first],
            nan: v.iter().filter(|x| x.is_nan()).count(),
            infinite: v.iter().filter(|x| x.is_infinite()).count(),
            len: v.len(),
        })
    }

    /// Counts over the parts of one tensor (its tensor-parallel slices); `first` and `value`
    /// are the first part's.
    pub fn merge(self, other: Count) -> Count {
        Count {
            nan: self.nan + other.nan,
            infinite: self.infinite + other.infinite,
            len: self.len + other.len,
            ..self
        }
    }

    /// `3 of 144 values are NaN`, `1 of 10 values is infinite`, `3 NaN and 1 infinite of 144
    /// values`.
    pub fn describe(&self) -> String {
        let verb = |n: usize| if n == 1 { "is" } else { "are" };
        match (self.nan, self.infinite) {
            (n, 0) => format!("{n} of {} values {} NaN", self.len, verb(n)),
            (0, i) => format!("{i} of {} values {} infinite", self.len, verb(i)),
            (n, i) => format!("{n} NaN and {i} infinite of {} values", self.len),
        }
    }
}

/// What a tensor that training checks is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gradient,
    Parameter,
    /// The optimizer's state, BatchNorm's running statistics.
    State,
}

/// A tensor found holding non-finite values.
#[derive(Debug, Clone, PartialEq)]
pub struct NonFinite {
    pub kind: Kind,
    /// The parameter's or state's name (a gradient is named by its parameter).
    pub name: String,
    /// Over the whole tensor; `count.first` is an index in the slice that held it.
    pub count: Count,
}

/// `the gradient of `0.weight` (3 of 144 values are NaN)`
impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = &self.name;
        match self.kind {
            Kind::Gradient => write!(f, "the gradient of `{name}`")?,
            Kind::Parameter => write!(f, "the parameter `{name}`")?,
            Kind::State => write!(f, "the state `{name}`")?,
        }
        write!(f, " ({})", self.count.describe())
    }
}

/// The first of `tensors` (name and values, in order) holding a non-finite value: its name,
/// and where and what that value is.
pub fn first_in<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [f32])>,
) -> Option<(&'a str, Count)> {
    tensors
        .into_iter()
        .find_map(|(name, v)| Count::of(v).map(|c| (name, c)))
}

/// What a refusal to write or read a tensor says: `value 17 is NaN (3 of 144 values are
/// NaN)`.
pub fn refusal(c: &Count) -> String {
    format!("value {} is {} ({})", c.first, c.value, c.describe())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nan_and_infinities_anywhere() {
        let mut v = vec![1.0f32; 1000];
        assert!(all_finite(&v));
        assert_eq!(Count::of(&v), None);
        v[999] = f32::NAN;
        assert!(!all_finite(&v));
        v[300] = f32::NEG_INFINITY;
        let c = Count::of(&v).unwrap();
        assert_eq!((c.first, c.nan, c.infinite, c.len), (300, 1, 1, 1000));
        assert_eq!(c.describe(), "1 NaN and 1 infinite of 1000 values");
        v[999] = 0.0;
        assert_eq!(
            refusal(&Count::of(&v).unwrap()),
            "value 300 is -inf (1 of 1000 values is infinite)"
        );
        // The largest finite values and subnormals are finite.
        assert!(all_finite(&[
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE / 2.0,
            -0.0
        ]));
    }
}
