//! A generated kernel's arguments (`codegen::Arg`) resolved to the values a launch passes,
//! for the CUDA executor and the PTX interpreter alike: one reading of what each argument
//! means. Where a value's buffer lives is the caller's (`address`).

use super::Mode;
use parallax_compiler::codegen::Arg;

/// A resolved argument.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValue {
    U64(u64),
    F32(f32),
    /// A table of 64-bit words passed by value (`codegen::Arg::Table`).
    Table(Vec<u64>),
}

/// What a step's launches share.
#[derive(Debug, Clone, Copy)]
pub struct LaunchCtx {
    pub seed: u64,
    pub mode: Mode,
    pub step: u64,
    pub first_sample: u64,
}

/// Resolves one argument; `address` gives the device address of a buffer argument
/// (`Value`, `Scratch`, `Staging`).
pub fn resolve(
    a: &Arg,
    ctx: &LaunchCtx,
    address: &dyn Fn(&Arg) -> Result<u64, String>,
) -> Result<ArgValue, String> {
    let training = ctx.mode != Mode::Eval;
    Ok(match *a {
        Arg::Value(_) | Arg::Scratch | Arg::Staging { .. } => ArgValue::U64(address(a)?),
        Arg::DropoutKey { stream } => {
            ArgValue::U64(crate::rng::dropout_key(ctx.seed, ctx.step, stream))
        }
        Arg::DropoutThreshold { p } => ArgValue::F32(if training { p as f32 } else { 0.0 }),
        Arg::DropoutScale { p } => ArgValue::F32(if training {
            (1.0 / (1.0 - p)) as f32
        } else {
            1.0
        }),
        Arg::FirstSample => ArgValue::U64(ctx.first_sample),
        Arg::U64(v) => ArgValue::U64(v),
        Arg::F32(v) => ArgValue::F32(v),
        Arg::Table { .. } => return Err("a table outside a kernel's arguments".into()),
    })
}

/// A buffer argument's address (a copy's or a GEMM's operand).
pub fn resolve_ptr(
    a: &Arg,
    ctx: &LaunchCtx,
    address: &dyn Fn(&Arg) -> Result<u64, String>,
) -> Result<u64, String> {
    match resolve(a, ctx, address)? {
        ArgValue::U64(p) => Ok(p),
        _ => Err("an operand is not a buffer".into()),
    }
}

/// A kernel's arguments resolved, each table's words gathered into one value.
pub fn resolve_all(
    args: &[Arg],
    ctx: &LaunchCtx,
    address: &dyn Fn(&Arg) -> Result<u64, String>,
) -> Result<Vec<ArgValue>, String> {
    let mut values = Vec::with_capacity(args.len());
    let mut rest = args;
    while let Some((a, tail)) = rest.split_first() {
        rest = tail;
        let Arg::Table { words } = *a else {
            values.push(resolve(a, ctx, address)?);
            continue;
        };
        let words = (words as usize).min(rest.len());
        let (table, tail) = rest.split_at(words);
        rest = tail;
        let table = table
            .iter()
            .map(|w| match resolve(w, ctx, address)? {
                ArgValue::U64(x) => Ok(x),
                _ => Err("a table word is not 64-bit".to_string()),
            })
            .collect::<Result<Vec<u64>, String>>()?;
        if table.is_empty() {
            return Err("an empty table argument".into());
        }
        values.push(ArgValue::Table(table));
    }
    Ok(values)
}
