//! A small PTX writer: typed virtual registers, kernel parameters, structured loops and the
//! math the op table needs. Every generated kernel goes through it, so the PTX conventions
//! (rounding modes that forbid FMA contraction, NaN-propagating max, 64-bit addressing) are
//! decided once, here.

use super::Arg;
use std::fmt::Write;

/// An f32 register (the op table's maps write their PTX bodies in these).
pub use crate::ir::maps::Reg as F;
/// A 32-bit integer register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R(u32);
/// A 64-bit integer register (indices, addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rd(u32);
/// A predicate register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P(u32);

impl std::fmt::Display for F {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "%f{}", self.0)
    }
}
impl std::fmt::Display for R {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "%r{}", self.0)
    }
}
impl std::fmt::Display for Rd {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "%rd{}", self.0)
    }
}
impl std::fmt::Display for P {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "%p{}", self.0)
    }
}

/// An f32 immediate in PTX's exact hexadecimal form.
pub fn imm(x: f32) -> String {
    format!("0f{:08X}", x.to_bits())
}

/// The type of a kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamType {
    U64,
    F32,
    /// `.align 8 .b8 [8 * words]`: a table of 64-bit words passed by value (`param_table`).
    Table(u32),
}

/// One `.entry` being written.
pub struct Kernel {
    name: String,
    params: Vec<(String, ParamType)>,
    args: Vec<Arg>,
    body: String,
    shared: String,
    /// Bytes of dynamic shared memory carved out so far (`dynamic_shared`).
    dynamic: u64,
    nf: u32,
    nr: u32,
    nrd: u32,
    np: u32,
    labels: u32,
    /// The plan's values stored in bf16 (`param_ptr` marks their pointers).
    bf16_values: std::sync::Arc<std::collections::BTreeSet<usize>>,
    /// The pointer registers whose elements are bf16 (the others address f32 values).
    bf16_ptrs: std::collections::BTreeSet<u32>,
}

impl Kernel {
    pub fn new(name: &str) -> Kernel {
        Kernel {
            name: name.to_string(),
            params: Vec::new(),
            args: Vec::new(),
            body: String::new(),
            shared: String::new(),
            dynamic: 0,
            nf: 0,
            nr: 0,
            nrd: 0,
            np: 0,
            labels: 0,
            bf16_values: Default::default(),
            bf16_ptrs: Default::default(),
        }
    }

    /// A kernel whose `param_ptr`s address bf16 elements for the values in `bf16_values`.
    pub fn with_bf16(
        name: &str,
        bf16_values: std::sync::Arc<std::collections::BTreeSet<usize>>,
    ) -> Kernel {
        Kernel {
            bf16_values,
            ..Kernel::new(name)
        }
    }

    /// Whether value `id` of the plan is stored in bf16.
    pub fn value_is_bf16(&self, id: usize) -> bool {
        self.bf16_values.contains(&id)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Emits one instruction line (without the semicolon).
    pub fn ins(&mut self, line: impl AsRef<str>) {
        let _ = writeln!(self.body, "\t{};", line.as_ref());
    }

    pub fn f(&mut self) -> F {
        self.nf += 1;
        F(self.nf)
    }
    pub fn r(&mut self) -> R {
        self.nr += 1;
        R(self.nr)
    }
    pub fn rd(&mut self) -> Rd {
        self.nrd += 1;
        Rd(self.nrd)
    }
    pub fn p(&mut self) -> P {
        self.np += 1;
        P(self.np)
    }
    pub fn label(&mut self) -> String {
        self.labels += 1;
        format!("$L{}", self.labels)
    }
    pub fn place(&mut self, label: &str) {
        let _ = writeln!(self.body, "{label}:");
    }
    pub fn bra(&mut self, label: &str) {
        self.ins(format!("bra.uni {label}"));
    }
    pub fn bra_if(&mut self, p: P, label: &str) {
        self.ins(format!("@{p} bra {label}"));
    }
    pub fn bra_unless(&mut self, p: P, label: &str) {
        self.ins(format!("@!{p} bra {label}"));
    }

    // ---- parameters ----

    fn param(&mut self, arg: Arg) -> String {
        let name = format!("{}_p{}", self.name, self.params.len());
        self.params.push((name.clone(), arg.param_type()));
        self.args.push(arg);
        name
    }
    /// A global-memory pointer parameter (`Arg::Value` or `Arg::Scratch`).
    pub fn param_ptr(&mut self, arg: Arg) -> Rd {
        let name = self.param(arg);
        let (a, b) = (self.rd(), self.rd());
        self.ins(format!("ld.param.u64 {a}, [{name}]"));
        self.ins(format!("cvta.to.global.u64 {b}, {a}"));
        if let Arg::Value(id) = arg {
            if self.value_is_bf16(id) {
                self.bf16_ptrs.insert(b.0);
            }
        }
        b
    }
    /// Pointer parameters of `args`, declared in order (a kernel's inputs, then its output).
    pub fn param_ptrs<const N: usize>(&mut self, args: [Arg; N]) -> [Rd; N] {
        args.map(|a| self.param_ptr(a))
    }
    pub fn param_u64(&mut self, arg: Arg) -> Rd {
        let name = self.param(arg);
        let a = self.rd();
        self.ins(format!("ld.param.u64 {a}, [{name}]"));
        a
    }
    pub fn param_f32(&mut self, arg: Arg) -> F {
        let name = self.param(arg);
        let a = self.f();
        self.ins(format!("ld.param.f32 {a}, [{name}]"));
        a
    }
    /// A table of 64-bit words (addresses, counts) passed by value as one parameter, as
    /// apex passes its tensor lists; returns its address in the parameter space, which
    /// `ld.param` reads at any offset. Its argument is `Arg::Table`, then the words.
    pub fn param_table(&mut self, words: &[Arg]) -> Rd {
        let n = words.len() as u32;
        let name = format!("{}_p{}", self.name, self.params.len());
        self.params.push((name.clone(), ParamType::Table(n)));
        self.args.push(Arg::Table { words: n });
        self.args.extend_from_slice(words);
        let a = self.rd();
        self.ins(format!("mov.u64 {a}, {name}"));
        a
    }
    /// The 64-bit word at `at` bytes into a table `param_table` returned.
    pub fn table_u64(&mut self, table: Rd, at: impl std::fmt::Display) -> Rd {
        let (a, d) = (self.rd(), self.rd());
        self.ins(format!("add.u64 {a}, {table}, {at}"));
        self.ins(format!("ld.param.u64 {d}, [{a}]"));
        d
    }
    /// The global address in the word at `at` bytes into a table.
    pub fn table_ptr(&mut self, table: Rd, at: impl std::fmt::Display) -> Rd {
        let a = self.table_u64(table, at);
        let b = self.rd();
        self.ins(format!("cvta.to.global.u64 {b}, {a}"));
        b
    }
    /// The arguments a launch passes, in parameter order (a table's words after it).
    pub fn args(&self) -> &[Arg] {
        &self.args
    }

    /// Declares a block-shared f32 array and returns its name.
    pub fn shared_f32(&mut self, len: u32) -> String {
        let name = format!("{}_s{}", self.name, self.shared.lines().count());
        let _ = writeln!(self.shared, "\t.shared .align 4 .f32 {name}[{len}];");
        name
    }

    /// Declares a block-shared array of `len` 16-bit values, 16-byte aligned (`ldmatrix`
    /// rows), and returns its name.
    pub fn shared_b16(&mut self, len: u32) -> String {
        let name = format!("{}_s{}", self.name, self.shared.lines().count());
        let _ = writeln!(self.shared, "\t.shared .align 16 .b16 {name}[{len}];");
        name
    }

    /// Carves `bytes` (rounded up to 16) out of the block's dynamic shared memory (static
    /// stops at 48 KB) and returns a register holding its shared address.
    pub fn dynamic_shared(&mut self, bytes: u64) -> Rd {
        let at = self.dynamic;
        self.dynamic += bytes.next_multiple_of(16);
        let (b, d) = (self.rd(), self.rd());
        self.ins(format!("mov.u64 {b}, {}_dyn", self.name));
        self.ins(format!("add.u64 {d}, {b}, {at}"));
        d
    }

    /// The bytes of dynamic shared memory its launch passes.
    pub fn dynamic_bytes(&self) -> u64 {
        self.dynamic
    }

    // ---- integers ----

    pub fn u64c(&mut self, v: u64) -> Rd {
        let d = self.rd();
        self.ins(format!("mov.u64 {d}, {v}"));
        d
    }
    pub fn u32c(&mut self, v: u32) -> R {
        let d = self.r();
        self.ins(format!("mov.u32 {d}, {v}"));
        d
    }
    /// `op` is `add`, `sub`, `mul.lo`, `div`, `rem`, `min`, `max`: `d = a op b` on u64.
    pub fn op64(&mut self, op: &str, a: Rd, b: impl std::fmt::Display) -> Rd {
        let d = self.rd();
        self.ins(format!("{op}.u64 {d}, {a}, {b}"));
        d
    }
    pub fn op64_xor(&mut self, a: Rd, b: Rd) -> Rd {
        let d = self.rd();
        self.ins(format!("xor.b64 {d}, {a}, {b}"));
        d
    }
    pub fn op32(&mut self, op: &str, a: R, b: impl std::fmt::Display) -> R {
        let d = self.r();
        self.ins(format!("{op}.u32 {d}, {a}, {b}"));
        d
    }
    pub fn wide(&mut self, a: R) -> Rd {
        let d = self.rd();
        self.ins(format!("cvt.u64.u32 {d}, {a}"));
        d
    }
    pub fn narrow(&mut self, a: Rd) -> R {
        let d = self.r();
        self.ins(format!("cvt.u32.u64 {d}, {a}"));
        d
    }
    /// A special register (`%tid.x`, `%ctaid.x`, `%ntid.x`, `%nctaid.x`, `%laneid`) as u32.
    pub fn special(&mut self, reg: &str) -> R {
        let d = self.r();
        self.ins(format!("mov.u32 {d}, {reg}"));
        d
    }
    /// `a cmp b` on u64 (`lt`, `ge`, `eq`, `ne`, ...).
    pub fn cmp64(&mut self, cmp: &str, a: Rd, b: impl std::fmt::Display) -> P {
        let p = self.p();
        self.ins(format!("setp.{cmp}.u64 {p}, {a}, {b}"));
        p
    }
    pub fn cmp32s(&mut self, cmp: &str, a: R, b: impl std::fmt::Display) -> P {
        let p = self.p();
        self.ins(format!("setp.{cmp}.s32 {p}, {a}, {b}"));
        p
    }

    // ---- f32 arithmetic (round-to-nearest forms, so no FMA contraction: the CPU rounds
    // every product and sum) ----

    pub fn fc(&mut self, v: f32) -> F {
        let d = self.f();
        self.ins(format!("mov.f32 {d}, {}", imm(v)));
        d
    }
    pub fn bin(&mut self, op: &str, a: F, b: F) -> F {
        let d = self.f();
        let op = match op {
            "add" | "sub" | "mul" | "div" => format!("{op}.rn.f32"),
            "max" => "max.NaN.f32".to_string(),
            other => format!("{other}.f32"),
        };
        self.ins(format!("{op} {d}, {a}, {b}"));
        d
    }
    pub fn add(&mut self, a: F, b: F) -> F {
        self.bin("add", a, b)
    }
    pub fn sub(&mut self, a: F, b: F) -> F {
        self.bin("sub", a, b)
    }
    pub fn mul(&mut self, a: F, b: F) -> F {
        self.bin("mul", a, b)
    }
    pub fn div(&mut self, a: F, b: F) -> F {
        self.bin("div", a, b)
    }
    pub fn addc(&mut self, a: F, c: f32) -> F {
        let d = self.f();
        self.ins(format!("add.rn.f32 {d}, {a}, {}", imm(c)));
        d
    }
    pub fn mulc(&mut self, a: F, c: f32) -> F {
        let d = self.f();
        self.ins(format!("mul.rn.f32 {d}, {a}, {}", imm(c)));
        d
    }
    pub fn un(&mut self, op: &str, a: F) -> F {
        let d = self.f();
        self.ins(format!("{op} {d}, {a}"));
        d
    }
    pub fn sqrt(&mut self, a: F) -> F {
        self.un("sqrt.rn.f32", a)
    }
    pub fn abs(&mut self, a: F) -> F {
        self.un("abs.f32", a)
    }
    pub fn neg(&mut self, a: F) -> F {
        self.un("neg.f32", a)
    }
    pub fn mov(&mut self, a: F) -> F {
        self.un("mov.f32", a)
    }
    pub fn cmpf(&mut self, cmp: &str, a: F, b: F) -> P {
        let p = self.p();
        self.ins(format!("setp.{cmp}.f32 {p}, {a}, {b}"));
        p
    }
    /// `p ? a : b`
    pub fn sel(&mut self, a: F, b: F, p: P) -> F {
        let d = self.f();
        self.ins(format!("selp.f32 {d}, {a}, {b}, {p}"));
        d
    }
    /// Assigns `v` into an existing register (loop-carried values).
    pub fn set(&mut self, d: F, v: F) {
        self.ins(format!("mov.f32 {d}, {v}"));
    }
    pub fn set64(&mut self, d: Rd, v: Rd) {
        self.ins(format!("mov.u64 {d}, {v}"));
    }
    pub fn u64_to_f32(&mut self, a: Rd) -> F {
        let d = self.f();
        self.ins(format!("cvt.rn.f32.u64 {d}, {a}"));
        d
    }

    /// Sum (or max) across the 32 lanes of a warp; every lane gets the result.
    pub fn warp_reduce(&mut self, v: F, op: &str) -> F {
        let mut acc = v;
        for shift in [16, 8, 4, 2, 1] {
            let o = self.f();
            self.ins(format!("shfl.sync.bfly.b32 {o}, {acc}, {shift}, 31, -1"));
            acc = self.bin(op, acc, o);
        }
        acc
    }

    /// `for i in start..end step stride` over u64 with the body given `i`.
    pub fn for_range(
        &mut self,
        start: Rd,
        end: Rd,
        stride: impl std::fmt::Display,
        body: impl FnOnce(&mut Kernel, Rd),
    ) {
        let top = self.label();
        let done = self.label();
        let i = self.rd();
        self.set64(i, start);
        self.place(&top);
        let p = self.cmp64("ge", i, end);
        self.bra_if(p, &done);
        body(self, i);
        self.ins(format!("add.u64 {i}, {i}, {stride}"));
        self.bra(&top);
        self.place(&done);
    }

    /// The global thread index and the grid's thread count, as u64.
    pub fn global_index(&mut self) -> (Rd, Rd) {
        let (c, n, t, g) = (
            self.special("%ctaid.x"),
            self.special("%ntid.x"),
            self.special("%tid.x"),
            self.special("%nctaid.x"),
        );
        let i = self.rd();
        self.ins(format!("mul.wide.u32 {i}, {c}, {n}"));
        let tw = self.wide(t);
        let i = self.op64("add", i, tw);
        let s = self.rd();
        self.ins(format!("mul.wide.u32 {s}, {g}, {n}"));
        (i, s)
    }

    /// A grid-stride loop over `0..n`.
    pub fn grid_stride(&mut self, n: u64, body: impl FnOnce(&mut Kernel, Rd)) {
        let (i, s) = self.global_index();
        let end = self.u64c(n);
        self.for_range(i, end, s, body);
    }

    /// The finished `.entry` (no module header).
    pub fn finish(self) -> String {
        let mut s = String::new();
        if self.dynamic > 0 {
            // Module scope: PTX takes no `.extern .shared` inside a function.
            let _ = writeln!(s, ".extern .shared .align 16 .b8 {}_dyn[];", self.name);
        }
        let _ = writeln!(s, ".visible .entry {}(", self.name);
        for (k, (name, ty)) in self.params.iter().enumerate() {
            let comma = if k + 1 < self.params.len() { "," } else { "" };
            let _ = match ty {
                ParamType::U64 => writeln!(s, "\t.param .u64 {name}{comma}"),
                ParamType::F32 => writeln!(s, "\t.param .f32 {name}{comma}"),
                ParamType::Table(n) => {
                    writeln!(s, "\t.param .align 8 .b8 {name}[{}]{comma}", 8 * n)
                }
            };
        }
        s.push_str(")\n{\n");
        s.push_str(&self.shared);
        let _ = writeln!(s, "\t.reg .pred %p<{}>;", self.np + 1);
        let _ = writeln!(s, "\t.reg .b32 %r<{}>;", self.nr + 1);
        let _ = writeln!(s, "\t.reg .f32 %f<{}>;", self.nf + 1);
        let _ = writeln!(s, "\t.reg .b64 %rd<{}>;", self.nrd + 1);
        s.push_str(&self.body);
        s.push_str("\tret;\n}\n");
        s
    }
}

/// The PTX module header for a target (`sm_80`, `sm_90`).
pub fn header(target: &str) -> String {
    format!(".version 8.0\n.target {target}\n.address_size 64\n\n")
}

/// The instructions of the op table's map bodies (`ir::maps`), as this builder writes them.
impl crate::ir::maps::PtxScalar for Kernel {
    fn constant(&mut self, v: f32) -> F {
        self.fc(v)
    }
    fn add(&mut self, a: F, b: F) -> F {
        Kernel::add(self, a, b)
    }
    fn sub(&mut self, a: F, b: F) -> F {
        Kernel::sub(self, a, b)
    }
    fn mul(&mut self, a: F, b: F) -> F {
        Kernel::mul(self, a, b)
    }
    fn div(&mut self, a: F, b: F) -> F {
        Kernel::div(self, a, b)
    }
    fn add_const(&mut self, a: F, c: f32) -> F {
        self.addc(a, c)
    }
    fn mul_const(&mut self, a: F, c: f32) -> F {
        self.mulc(a, c)
    }
    fn min(&mut self, a: F, b: F) -> F {
        // `min.f32` returns the number when one operand is NaN, as Rust's `f32::min`.
        self.bin("min", a, b)
    }
    fn max(&mut self, a: F, b: F) -> F {
        // Plain `max.f32` (not `bin`'s NaN-propagating form): NaN gives the number, as
        // Rust's `f32::max` does.
        let d = self.f();
        self.ins(format!("max.f32 {d}, {a}, {b}"));
        d
    }
    fn select_gt(&mut self, a: F, b: F, then: F, otherwise: F) -> F {
        let p = self.cmpf("gt", a, b);
        self.sel(then, otherwise, p)
    }
    fn sqrt(&mut self, a: F) -> F {
        Kernel::sqrt(self, a)
    }
    fn tanh(&mut self, a: F) -> F {
        Kernel::tanh(self, a)
    }
    fn sigmoid(&mut self, a: F) -> F {
        Kernel::sigmoid(self, a)
    }
    fn gelu(&mut self, a: F) -> F {
        Kernel::gelu(self, a)
    }
    fn gelu_grad(&mut self, a: F) -> F {
        Kernel::gelu_grad(self, a)
    }
    fn round_bf16(&mut self, a: F) -> F {
        // The pair's high half is `a` rounded, its low half bf16 zero: the f32's bits.
        let (bits, zero, d) = (self.r(), self.fc(0.0), self.f());
        self.ins(format!("cvt.rn.bf16x2.f32 {bits}, {a}, {zero}"));
        self.ins(format!("mov.b32 {d}, {bits}"));
        d
    }
}

#[path = "builder_math.rs"]
mod math;
#[path = "builder_memory.rs"]
mod memory;
