//! The Parallax compiler: the RON experiment language (`dsl`), the graph IR (`ir`), the pass
//! pipeline (`passes`) and the plan it produces (`plan`). Pure: no GPU, no I/O beyond the
//! source text it is handed, and compiling a model allocates none of its weights.

pub mod codegen;
pub mod devices;
pub mod diag;
pub mod dsl;
#[doc(hidden)]
pub mod fixtures;
pub mod ir;
pub mod lr_schedule;
pub mod partition;
pub mod passes;
pub mod plan;
pub mod scalar;
pub mod target;
pub mod verdict;
// Sharding is part of what a plan says; the old path stays for callers.
pub use plan::shards;

pub use diag::{Diagnostic, Loc, Span};
pub use dsl::{parse, parse_bytes, Source};
pub use passes::{compile, compile_decode, Compiled, Options, PIPELINE};
pub use plan::{Plan, Summary};

/// Everything the compiler can refuse. Each carries diagnostics that point into the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is not a well-formed experiment (RON syntax, unknown names, missing fields).
    #[error("{}", .0.message)]
    Syntax(Diagnostic),
    /// Sections that parse but make no sense (a negative learning rate, no step budget).
    #[error("{}", .0.first().map_or("invalid experiment", |d| d.message.as_str()))]
    Invalid(Vec<Diagnostic>),
    /// The model does not build: shapes that do not fit, unknown node names, cycles, limits.
    #[error("{}", .0.message)]
    Model(Diagnostic),
    /// A pass broke an invariant of the IR: a compiler bug, never the user's fault.
    #[error("internal error: pass `{pass}` left an invalid graph: {message}")]
    Verify { pass: String, message: String },
}

impl Error {
    /// The diagnostics to show the user.
    pub fn diagnostics(&self) -> Vec<Diagnostic> {
        match self {
            Error::Syntax(d) | Error::Model(d) => vec![d.clone()],
            Error::Invalid(ds) => ds.clone(),
            Error::Verify { .. } => vec![Diagnostic::new(self.to_string(), None)
                .with_hint("this is a bug in Parallax; please report it with the file")],
        }
    }
}
