//! A PTX interpreter for exactly the subset Parallax's code generator writes, with the PTX
//! ISA's semantics, and sanitizer checks while it runs (what compute-sanitizer's memcheck,
//! initcheck, racecheck and synccheck report on a GPU). Pure Rust, no GPU, no system library.
//!
//! Files: `parse` reads PTX text into decoded instructions (any instruction form not modelled
//! is a parse error, so a new opcode in codegen cannot slip past); `memory` the global address
//! space of allocations; `exec` runs a launch, block by block, warp by warp; `tensor` the
//! warp-wide matrix instructions (`mma.sync`, `ldmatrix`); `approx` the approximate functions;
//! `convert` `cvt`'s conversions and rounding modes; `sanitizer` the findings; `blas` the
//! GEMMs cuBLAS runs, on the host with defined semantics.

pub mod approx;
pub mod blas;
pub mod convert;
mod decode;
mod decode_mem;
mod exec;
mod exec_alu;
mod exec_mem;
mod exec_warp;
mod inst;
pub mod memory;
pub mod parse;
pub mod sanitizer;
mod shared;
pub mod tensor;

pub use memory::{MemError, Memory};
pub use parse::{Module, ParseError};
pub use sanitizer::{Finding, FindingKind};
pub use tensor::MmaModel;

/// A kernel parameter's value, as the launch passes it.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    U64(u64),
    U32(u32),
    F32(f32),
    /// A parameter of `.b8 [n]` (a table passed by value): exactly its bytes.
    Bytes(Vec<u8>),
}

/// One launch of an entry of a module.
#[derive(Debug, Clone)]
pub struct Launch<'a> {
    pub entry: &'a str,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory (the `.extern .shared` array's size).
    pub dynamic_shared: u32,
    pub params: Vec<ParamValue>,
}

/// How the interpreter runs a launch.
#[derive(Debug, Clone)]
pub struct Options {
    /// How `mma.sync` adds its products (see `tensor::MmaModel`).
    pub mma: MmaModel,
    /// Stop the launch after this many findings (the report keeps them all up to here).
    pub max_findings: usize,
    /// Lane-instructions a launch may execute before it is `EmuError::Aborted` (so an
    /// endless loop ends).
    pub max_instructions: u64,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            mma: MmaModel::OracleOrder,
            max_findings: 16,
            max_instructions: 1 << 34,
        }
    }
}

/// What a launch did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Sanitizer findings, in the order found.
    pub findings: Vec<Finding>,
    /// Lane-instructions executed (one per active lane per instruction).
    pub instructions: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    #[error("no entry `{0}` in the module")]
    NoEntry(String),
    #[error("`{entry}` takes {expected} parameters; the launch passed {got}")]
    ParamCount {
        entry: String,
        expected: usize,
        got: usize,
    },
    #[error("`{entry}` parameter {index} (`{name}`) is {expected}; the launch passed {got}")]
    ParamType {
        entry: String,
        index: usize,
        name: String,
        expected: String,
        got: String,
    },
    #[error("launch of `{entry}`: {message}")]
    BadLaunch { entry: String, message: String },
    /// The launch could not go on: a deadlock at a barrier, a fault, a step limit. The
    /// findings up to here are in the report.
    #[error("`{entry}` line {line}: {message}")]
    Aborted {
        entry: String,
        line: usize,
        message: String,
        report: Box<Report>,
    },
}

/// Runs `launch` of `module` over `memory` (every block, every thread), with the sanitizer's
/// checks. Findings do not make this an `Err`: they are in the report; `Err` means the launch
/// could not run or could not finish.
pub fn launch(
    module: &Module,
    launch: &Launch,
    memory: &mut Memory,
    options: &Options,
) -> Result<Report, EmuError> {
    exec::run(module, launch, memory, options)
}
