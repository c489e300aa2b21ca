//! The decoded instruction forms: a closed set, so any PTX form outside it is a parse error.
//! Registers are dense slot indices into a thread's register file (one `u64` per register,
//! predicates included); special registers and symbol addresses are slots too, filled when a
//! block starts, so executing never looks up a name.

/// A register slot in a thread's register file.
pub type Slot = u32;

/// A source operand: a register slot or an immediate (its bit pattern, f32/f64 immediates
/// included).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Src {
    Reg(Slot),
    Imm(u64),
}

/// The integer and bit types of ALU forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntTy {
    U16,
    U32,
    U64,
    S16,
    S32,
    S64,
}

impl IntTy {
    pub fn bits(self) -> u32 {
        match self {
            IntTy::U16 | IntTy::S16 => 16,
            IntTy::U32 | IntTy::S32 => 32,
            IntTy::U64 | IntTy::S64 => 64,
        }
    }
    pub fn signed(self) -> bool {
        matches!(self, IntTy::S16 | IntTy::S32 | IntTy::S64)
    }
}

/// Two-operand integer operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntOp {
    Add,
    Sub,
    MulLo,
    /// `mul.wide`: the full product of two `bits`-wide operands, 2*bits wide.
    MulWide,
    MulHi,
    Div,
    Rem,
    Min,
    Max,
    And,
    Or,
    Xor,
    Shl,
    Shr,
}

/// Floating-point binary operations (`.rn` where a rounding applies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FOp {
    Add,
    Sub,
    Mul,
    Div,
    Min,
    Max,
    /// `max.NaN` / `min.NaN`: a NaN operand gives the canonical NaN.
    MinNaN,
    MaxNaN,
    Copysign,
}

/// Floating-point unary operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FUn {
    Neg,
    Abs,
    /// `sqrt.rn` (correctly rounded).
    Sqrt,
    /// `rcp.rn` (correctly rounded).
    Rcp,
    Ex2Approx,
    Lg2Approx,
    RcpApprox,
    RsqrtApprox,
    SqrtApprox,
    SinApprox,
    CosApprox,
    TanhApprox,
}

/// Comparison operators of `setp`; the `u` forms are true when either operand is NaN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

/// What `setp` compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpTy {
    Int(IntTy),
    /// `.b16/.b32/.b64`: compared as unsigned bits (only eq/ne are valid).
    F32,
    F64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoolOp {
    And,
    Or,
    Xor,
}

/// The value types `cvt` converts between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CvtTy {
    Int(IntTy),
    F32,
    F64,
}

/// A `cvt`'s rounding modifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CvtRound {
    None,
    Float(crate::convert::Rounding),
    Int(crate::convert::IntRounding),
}

/// The state spaces of memory instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Global,
    Shared,
    Param,
}

/// A memory operand `[base+offset]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Addr {
    pub base: Slot,
    pub offset: i64,
}

/// `shfl.sync` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShflMode {
    Up,
    Down,
    Bfly,
    Idx,
}

/// Where a register's slot value comes from when a thread starts: specials and symbols.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Special {
    Tid(usize),
    Ntid(usize),
    Ctaid(usize),
    Nctaid(usize),
    LaneId,
    WarpId,
    /// The address of the entry's i-th symbol (param, shared or global variable).
    Symbol(usize),
}

/// One decoded operation.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// `mov`, `cvta.to.global` (global addresses are generic addresses here) and the like:
    /// `d = a` masked to `bits`.
    Mov {
        d: Slot,
        a: Src,
        bits: u32,
    },
    /// `mov.b64 d, {lo, hi}`.
    Pack {
        d: Slot,
        lo: Src,
        hi: Src,
    },
    /// `mov.b64 {lo, hi}, a`.
    Unpack {
        lo: Slot,
        hi: Slot,
        a: Src,
    },
    Int {
        op: IntOp,
        ty: IntTy,
        d: Slot,
        a: Src,
        b: Src,
    },
    /// `mad.lo`.
    MadLo {
        ty: IntTy,
        d: Slot,
        a: Src,
        b: Src,
        c: Src,
    },
    /// `mad.wide`.
    MadWide {
        ty: IntTy,
        d: Slot,
        a: Src,
        b: Src,
        c: Src,
    },
    /// `neg`, `not`, `abs` on integers.
    IntNeg {
        ty: IntTy,
        d: Slot,
        a: Src,
    },
    IntNot {
        bits: u32,
        d: Slot,
        a: Src,
    },
    IntAbs {
        ty: IntTy,
        d: Slot,
        a: Src,
    },
    Bfind {
        ty: IntTy,
        shiftamt: bool,
        d: Slot,
        a: Src,
    },
    Popc {
        bits: u32,
        d: Slot,
        a: Src,
    },
    Clz {
        bits: u32,
        d: Slot,
        a: Src,
    },
    F32 {
        op: FOp,
        ftz: bool,
        d: Slot,
        a: Src,
        b: Src,
    },
    F64 {
        op: FOp,
        d: Slot,
        a: Src,
        b: Src,
    },
    Fma32 {
        ftz: bool,
        d: Slot,
        a: Src,
        b: Src,
        c: Src,
    },
    Fma64 {
        d: Slot,
        a: Src,
        b: Src,
        c: Src,
    },
    Un32 {
        op: FUn,
        ftz: bool,
        d: Slot,
        a: Src,
    },
    Un64 {
        op: FUn,
        d: Slot,
        a: Src,
    },
    Setp {
        cmp: Cmp,
        ty: CmpTy,
        d: Slot,
        a: Src,
        b: Src,
        /// `.and/.or/.xor` with a (possibly negated) predicate.
        combine: Option<(BoolOp, Slot, bool)>,
    },
    /// `selp`: `d = p ? a : b`.
    Selp {
        d: Slot,
        a: Src,
        b: Src,
        p: Slot,
        bits: u32,
    },
    /// `and/or/xor.pred`.
    PredBool {
        op: BoolOp,
        d: Slot,
        a: Src,
        b: Src,
    },
    PredNot {
        d: Slot,
        a: Src,
    },
    Cvt {
        dt: CvtTy,
        at: CvtTy,
        round: CvtRound,
        ftz: bool,
        sat: bool,
        d: Slot,
        a: Src,
    },
    /// `cvt.rn.bf16x2.f32 d, a, b`: a to the upper half.
    CvtBf16x2 {
        d: Slot,
        a: Src,
        b: Src,
    },
    Ld {
        space: Space,
        /// Bytes per element (1, 2, 4, 8).
        size: u32,
        /// Sign-extend the loaded element (`.s8/.s16/.s32`).
        signed: bool,
        d: [Slot; 4],
        n: u8,
        addr: Addr,
    },
    St {
        space: Space,
        size: u32,
        a: [Src; 4],
        n: u8,
        addr: Addr,
    },
    /// `atom.global.add.u32`.
    AtomAdd {
        size: u32,
        d: Slot,
        addr: Addr,
        b: Src,
    },
    Bar,
    Membar,
    Bra {
        target: u32,
    },
    Ret,
    Shfl {
        mode: ShflMode,
        d: Slot,
        p: Option<Slot>,
        a: Src,
        b: Src,
        c: Src,
        mask: Src,
    },
    /// `vote.sync.ballot.b32 d, {!}p, mask`.
    Ballot {
        d: Slot,
        p: Slot,
        neg: bool,
        mask: Src,
    },
    Mma {
        d: [Slot; 4],
        a: [Src; 4],
        b: [Src; 2],
        c: [Src; 4],
    },
    Ldmatrix {
        num: u8,
        trans: bool,
        d: [Slot; 4],
        addr: Addr,
    },
    CpAsync {
        size: u32,
        dst: Addr,
        src: Addr,
        src_size: Option<Src>,
    },
    CpCommit,
    /// `cp.async.wait_group n`; `wait_all` is `commit_group; wait_group 0`.
    CpWait {
        n: u32,
        all: bool,
    },
}

/// An instruction: its guard predicate, operation and PTX line.
#[derive(Debug, Clone, PartialEq)]
pub struct Inst {
    /// `@p` (false) or `@!p` (true).
    pub guard: Option<(Slot, bool)>,
    pub op: Op,
    pub line: u32,
}
