//! Dimensions: a known size, or a product of a known factor and symbols (the batch `B`, a
//! symbolic sequence length). Products are enough for every layout change the ops make
//! (flatten, head splits), and they compare structurally.

use serde::Serialize;
use std::fmt;

/// A symbolic dimension, by index into the graph's symbol table. `Sym(0)` is the batch.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub struct Sym(pub u32);

pub const BATCH: Sym = Sym(0);

/// The largest size of one dimension we accept (2^40).
pub const MAX_DIM: u64 = 1 << 40;

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub struct Dim {
    /// The known factor, at least 1.
    pub factor: u64,
    /// The symbols, sorted, repeated for powers.
    pub syms: Vec<Sym>,
}

impl Dim {
    pub fn known(n: u64) -> Dim {
        Dim {
            factor: n,
            syms: Vec::new(),
        }
    }
    pub fn sym(s: Sym) -> Dim {
        Dim {
            factor: 1,
            syms: vec![s],
        }
    }
    pub fn batch() -> Dim {
        Dim::sym(BATCH)
    }
    pub fn as_known(&self) -> Option<u64> {
        self.syms.is_empty().then_some(self.factor)
    }
    pub fn is_known(&self) -> bool {
        self.syms.is_empty()
    }
    /// The product, or `None` on overflow.
    pub fn mul(&self, o: &Dim) -> Option<Dim> {
        let mut syms = self.syms.clone();
        syms.extend_from_slice(&o.syms);
        syms.sort();
        Some(Dim {
            factor: self.factor.checked_mul(o.factor)?,
            syms,
        })
    }
    /// `self / o` when it divides exactly.
    pub fn div_exact(&self, o: &Dim) -> Option<Dim> {
        if o.factor == 0 || !self.factor.is_multiple_of(o.factor) {
            return None;
        }
        let mut syms = self.syms.clone();
        for s in &o.syms {
            let i = syms.iter().position(|x| x == s)?;
            syms.remove(i);
        }
        Some(Dim {
            factor: self.factor / o.factor,
            syms,
        })
    }
    /// Its value with each symbol replaced by `value(sym)`, saturating.
    pub fn eval(&self, value: &dyn Fn(Sym) -> u64) -> u64 {
        self.syms
            .iter()
            .fold(self.factor, |acc, s| acc.saturating_mul(value(*s)))
    }
    /// Shown with symbol names: `4*B*seq`, `B`, `64`.
    pub fn show(&self, names: &[String]) -> String {
        let mut parts = Vec::new();
        if self.factor != 1 || self.syms.is_empty() {
            parts.push(self.factor.to_string());
        }
        for s in &self.syms {
            parts.push(
                names
                    .get(s.0 as usize)
                    .cloned()
                    .unwrap_or_else(|| format!("s{}", s.0)),
            );
        }
        parts.join("*")
    }
}

/// The product of several dims, `None` on overflow.
pub fn product<'a>(dims: impl IntoIterator<Item = &'a Dim>) -> Option<Dim> {
    dims.into_iter()
        .try_fold(Dim::known(1), |acc, d| acc.mul(d))
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = vec!["B".to_string()];
        f.write_str(&self.show(&names))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_and_division() {
        let b = Dim::batch();
        let s = Dim::sym(Sym(1));
        let bs4 = b.mul(&s).unwrap().mul(&Dim::known(4)).unwrap();
        assert_eq!(bs4.show(&["B".into(), "seq".into()]), "4*B*seq");
        assert_eq!(bs4.div_exact(&s).unwrap(), Dim::known(4).mul(&b).unwrap());
        assert!(bs4.div_exact(&Dim::known(3)).is_none());
        assert!(Dim::known(u64::MAX).mul(&Dim::known(2)).is_none());
        assert_eq!(bs4.eval(&|_| 2), 16);
    }
}
