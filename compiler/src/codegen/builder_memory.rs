//! The builder's memory accesses: which pointers address bf16 elements (a bf16-stored
//! value's, and addresses derived from one), element addresses, and loads and stores that
//! widen bf16 exactly and round to the nearest bf16 when storing.

use super::{Kernel, Rd, F, R};

impl Kernel {
    /// Whether pointer `p` addresses bf16 elements (a bf16-stored value's, or derived from
    /// one with `like`, `addr` or `offset_const`); otherwise f32 (or other 4-byte) elements.
    pub fn is_bf16(&self, p: Rd) -> bool {
        self.bf16_ptrs.contains(&p.0)
    }
    /// Bytes per element at pointer `p`: 2 for bf16, else 4.
    pub fn elem_bytes(&self, p: Rd) -> u64 {
        if self.is_bf16(p) {
            2
        } else {
            4
        }
    }
    /// Marks pointer `p` as addressing bf16 elements when `bf16` (a table's addresses).
    pub fn mark_bf16(&mut self, p: Rd, bf16: bool) -> Rd {
        if bf16 {
            self.bf16_ptrs.insert(p.0);
        }
        p
    }
    /// Marks `derived` (an address computed from `base`) as addressing `base`'s elements.
    pub fn like(&mut self, derived: Rd, base: Rd) -> Rd {
        if self.is_bf16(base) {
            self.bf16_ptrs.insert(derived.0);
        }
        derived
    }

    /// `base + n` elements (a constant `n`), a pointer to the same kind of elements.
    pub fn offset_const(&mut self, base: Rd, n: u64) -> Rd {
        let bytes = n * self.elem_bytes(base);
        let a = self.op64("add", base, bytes);
        self.like(a, base)
    }
    /// The address of element `i` of the array at `base` (4-byte or bf16 elements), itself
    /// a pointer to such elements.
    pub fn addr(&mut self, base: Rd, i: Rd) -> Rd {
        let a = self.rd();
        let bytes = self.elem_bytes(base);
        self.ins(format!("mad.lo.u64 {a}, {i}, {bytes}, {base}"));
        self.like(a, base)
    }
    pub fn load(&mut self, base: Rd, i: Rd) -> F {
        let bf16 = self.is_bf16(base);
        let a = self.addr(base, i);
        self.load_elem(None, &format!("[{a}]"), bf16)
    }
    /// Loads one element at `at` (a PTX address such as `[%rd3+8]`) into an f32 register,
    /// widening a bf16 (exactly), under `guard` (a predicate such as `%p2` or `!%p2`) if any:
    /// an unguarded lane leaves the register as it was.
    pub fn load_elem(&mut self, guard: Option<&str>, at: &str, bf16: bool) -> F {
        let d = self.f();
        self.load_elem_into(d, guard, at, bf16);
        d
    }
    /// `load_elem` into an existing register.
    pub fn load_elem_into(&mut self, d: F, guard: Option<&str>, at: &str, bf16: bool) {
        let g = guard.map_or(String::new(), |p| format!("@{p} "));
        if bf16 {
            let r = self.r();
            self.ins(format!("{g}ld.global.u16 {r}, {at}"));
            self.ins(format!("{g}shl.b32 {r}, {r}, 16"));
            self.ins(format!("{g}mov.b32 {d}, {r}"));
        } else {
            self.ins(format!("{g}ld.global.f32 {d}, {at}"));
        }
    }
    /// Stores `v` at `at` (as `load_elem`), rounded to the nearest bf16 if `bf16`.
    pub fn store_elem(&mut self, guard: Option<&str>, at: &str, v: F, bf16: bool) {
        let g = guard.map_or(String::new(), |p| format!("@{p} "));
        if bf16 {
            // The pair's low half is `v` rounded (ties to even); its low 16 bits are stored.
            let (r, zero) = (self.r(), self.fc(0.0));
            self.ins(format!("{g}cvt.rn.bf16x2.f32 {r}, {zero}, {v}"));
            self.ins(format!("{g}st.global.u16 {at}, {r}"));
        } else {
            self.ins(format!("{g}st.global.f32 {at}, {v}"));
        }
    }
    pub fn load_s32(&mut self, base: Rd, i: Rd) -> R {
        let a = self.addr(base, i);
        let d = self.r();
        self.ins(format!("ld.global.s32 {d}, [{a}]"));
        d
    }
    pub fn store(&mut self, base: Rd, i: Rd, v: F) {
        let bf16 = self.is_bf16(base);
        let a = self.addr(base, i);
        self.store_elem(None, &format!("[{a}]"), v, bf16);
    }
    /// Stores `x` and `y` as elements `e` and `e + 1` past pointer `p`, under `guard` (as
    /// `load_elem`): one 8-byte store, or one 4-byte store of the bf16 pair, each rounded.
    pub fn store_pair(&mut self, guard: Option<&str>, p: Rd, e: u64, (x, y): (F, F)) {
        let g = guard.map_or(String::new(), |p| format!("@{p} "));
        if self.is_bf16(p) {
            // The first operand goes to the upper half: the higher element.
            let r = self.r();
            self.ins(format!("{g}cvt.rn.bf16x2.f32 {r}, {y}, {x}"));
            self.ins(format!("{g}st.global.b32 [{p}+{}], {r}", 2 * e));
        } else {
            self.ins(format!("{g}st.global.v2.f32 [{p}+{}], {{{x}, {y}}}", 4 * e));
        }
    }
    /// `v` rounded to the nearest bf16 (ties to even), kept in f32: what a bf16 store keeps
    /// and a later load gives back.
    pub fn round_bf16(&mut self, v: F) -> F {
        crate::ir::maps::PtxScalar::round_bf16(self, v)
    }

    /// Writes this thread's f64 partial `acc` as two 32-bit words to slot `slot` of the
    /// block-shared buffer `s` (`shared_f32`, two words a slot), then syncs the block; returns
    /// the buffer's address. The reductions keep f64 partials and add them in lane order.
    pub fn share_f64(&mut self, s: &str, slot: Rd, acc: Rd) -> Rd {
        let sb = self.rd();
        self.ins(format!("mov.u64 {sb}, {s}"));
        let a = self.rd();
        self.ins(format!("mad.lo.u64 {a}, {slot}, 8, {sb}"));
        let (lo, hi) = (self.r(), self.r());
        self.ins(format!("mov.b64 {{{lo}, {hi}}}, {acc}"));
        self.ins(format!("st.shared.b32 [{a}], {lo}"));
        self.ins(format!("st.shared.b32 [{a}+4], {hi}"));
        self.ins("bar.sync 0");
        sb
    }
    /// The f64 sum, in address order from 0, of the partials `share_f64` wrote at `start`,
    /// `start + step`, ... below `stop`.
    pub fn sum_shared_f64(&mut self, start: Rd, stop: Rd, step: u64) -> Rd {
        let sum = self.rd();
        self.ins(format!("mov.b64 {sum}, 0d0000000000000000"));
        self.for_range(start, stop, step, |k, a| {
            let (lo, hi, w) = (k.r(), k.r(), k.rd());
            k.ins(format!("ld.shared.b32 {lo}, [{a}]"));
            k.ins(format!("ld.shared.b32 {hi}, [{a}+4]"));
            k.ins(format!("mov.b64 {w}, {{{lo}, {hi}}}"));
            k.ins(format!("add.rn.f64 {sum}, {sum}, {w}"));
        });
        sum
    }
}
