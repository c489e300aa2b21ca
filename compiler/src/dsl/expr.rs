//! Size expressions: `"d_model * 4"`, `"heads * head_dim"`, `"(d + 1) // 2"`. Lexed with
//! logos, parsed by precedence, evaluated with the file's parameters into a [`Dim`] (so a
//! symbolic sequence length can be scaled, but not added to).

use crate::ir::dim::{Dim, MAX_DIM};
use logos::Logos;

#[derive(Logos, Debug, Clone, Copy, PartialEq, Eq)]
#[logos(skip r"[ \t]+")]
enum Tok {
    #[regex(r"[0-9][0-9_]*")]
    Int,
    #[regex(r"[A-Za-z_][A-Za-z0-9_]*")]
    Ident,
    #[token("+")]
    Plus,
    #[token("-")]
    Minus,
    #[token("*")]
    Star,
    #[token("/")]
    Slash,
    #[token("//")]
    FloorDiv,
    #[token("%")]
    Percent,
    #[token("(")]
    LParen,
    #[token(")")]
    RParen,
}

/// An error in an expression, at a byte range within the expression text.
#[derive(Debug, Clone, PartialEq)]
pub struct ExprError {
    pub message: String,
    pub at: (usize, usize),
    pub hint: Option<String>,
}

fn err(message: impl Into<String>, at: (usize, usize)) -> ExprError {
    ExprError {
        message: message.into(),
        at,
        hint: None,
    }
}

/// A value during evaluation: a size, or an intermediate integer that may be negative.
#[derive(Debug, Clone, PartialEq)]
enum Val {
    Int(i64),
    Dim(Dim),
}

const MAX_DEPTH: usize = 64;

struct Parser<'a, 'e> {
    toks: Vec<(Tok, (usize, usize))>,
    pos: usize,
    text: &'a str,
    env: &'e dyn Fn(&str) -> Option<Dim>,
    names: &'e dyn Fn() -> Vec<String>,
}

impl Parser<'_, '_> {
    fn peek(&self) -> Option<Tok> {
        self.toks.get(self.pos).map(|t| t.0)
    }
    fn end_span(&self) -> (usize, usize) {
        (self.text.len(), self.text.len())
    }

    fn expr(&mut self, min_prec: u8, depth: usize) -> Result<(Val, (usize, usize)), ExprError> {
        if depth > MAX_DEPTH {
            // Point at where the nesting went too deep, not at the end of the text.
            let at = self.toks.get(self.pos).map_or(self.end_span(), |t| t.1);
            return Err(err("expression nested too deeply", at));
        }
        let (mut lhs, mut span) = self.atom(depth)?;
        while let Some(op) = self.peek() {
            let prec = match op {
                Tok::Plus | Tok::Minus => 1,
                Tok::Star | Tok::Slash | Tok::FloorDiv | Tok::Percent => 2,
                _ => break,
            };
            if prec < min_prec {
                break;
            }
            let op_span = self.toks[self.pos].1;
            self.pos += 1;
            let (rhs, rspan) = self.expr(prec + 1, depth + 1)?;
            let whole = (span.0, rspan.1);
            lhs = binop(op, lhs, rhs, op_span, whole)?;
            span = whole;
        }
        Ok((lhs, span))
    }

    fn atom(&mut self, depth: usize) -> Result<(Val, (usize, usize)), ExprError> {
        let Some(&(tok, span)) = self.toks.get(self.pos) else {
            return Err(err("expression ends too early", self.end_span()));
        };
        self.pos += 1;
        let s = &self.text[span.0..span.1];
        match tok {
            Tok::Int => {
                let n: i64 = s
                    .replace('_', "")
                    .parse()
                    .map_err(|_| err(format!("`{s}` is too large"), span))?;
                Ok((Val::Int(n), span))
            }
            Tok::Ident => match (self.env)(s) {
                Some(d) => Ok((Val::Dim(d), span)),
                None => {
                    let names = (self.names)();
                    let mut e = err(format!("unknown parameter `{s}`"), span);
                    e.hint = Some(crate::diag::suggest(
                        s,
                        "parameters",
                        names.iter().map(|n| n.as_str()),
                    ));
                    Err(e)
                }
            },
            Tok::Minus => {
                let (v, vs) = self.expr(3, depth + 1)?;
                let whole = (span.0, vs.1);
                let n = match v {
                    Val::Int(n) => n,
                    Val::Dim(d) => match d.as_known() {
                        Some(n) => {
                            i64::try_from(n).map_err(|_| err("size arithmetic overflows", whole))?
                        }
                        None => return Err(err("cannot negate a symbolic size", whole)),
                    },
                };
                n.checked_neg()
                    .map(|n| (Val::Int(n), whole))
                    .ok_or_else(|| err("size arithmetic overflows", whole))
            }
            Tok::LParen => {
                let (v, _) = self.expr(0, depth + 1)?;
                match self.toks.get(self.pos) {
                    Some((Tok::RParen, close)) => {
                        let close = *close;
                        self.pos += 1;
                        Ok((v, (span.0, close.1)))
                    }
                    _ => Err(err("missing `)`", self.end_span())),
                }
            }
            _ => Err(err(
                format!("expected a number or a name, found `{s}`"),
                span,
            )),
        }
    }
}

fn as_int(v: &Val) -> Option<i64> {
    match v {
        Val::Int(n) => Some(*n),
        Val::Dim(d) => d.as_known().and_then(|n| i64::try_from(n).ok()),
    }
}

fn binop(
    op: Tok,
    a: Val,
    b: Val,
    op_span: (usize, usize),
    whole: (usize, usize),
) -> Result<Val, ExprError> {
    let overflow = || err("size arithmetic overflows", whole);
    if let (Some(x), Some(y)) = (as_int(&a), as_int(&b)) {
        let r = match op {
            Tok::Plus => x.checked_add(y),
            Tok::Minus => x.checked_sub(y),
            Tok::Star => x.checked_mul(y),
            Tok::Slash | Tok::FloorDiv | Tok::Percent if y == 0 => {
                return Err(err("division by zero", whole))
            }
            Tok::Slash if x % y != 0 => {
                let mut e = err(format!("{x} / {y} does not divide exactly"), whole);
                e.hint = Some("sizes must divide evenly; use `//` to round down".into());
                return Err(e);
            }
            Tok::Slash => x.checked_div(y),
            Tok::FloorDiv => x.checked_div_euclid(y),
            Tok::Percent => x.checked_rem_euclid(y),
            _ => None,
        };
        return r.map(Val::Int).ok_or_else(overflow);
    }
    // At least one side is symbolic.
    let to_dim = |v: Val| -> Result<Dim, ExprError> {
        match v {
            Val::Dim(d) => Ok(d),
            Val::Int(n) if n > 0 => Ok(Dim::known(n as u64)),
            Val::Int(n) => Err(err(
                format!("a symbolic size cannot be combined with {n}"),
                whole,
            )),
        }
    };
    let (a, b) = (to_dim(a)?, to_dim(b)?);
    match op {
        Tok::Star => a.mul(&b).map(Val::Dim).ok_or_else(overflow),
        Tok::Slash => a.div_exact(&b).map(Val::Dim).ok_or_else(|| {
            err(
                "a symbolic size can only be divided by a factor it has",
                whole,
            )
        }),
        _ => Err(err(
            "only `*` and `/` apply to symbolic sizes (the batch or a sequence length)",
            op_span,
        )),
    }
}

/// Looks a name up in the file's parameters.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<Dim>;
/// Lists the names in scope, for hints.
pub type Names<'a> = &'a dyn Fn() -> Vec<String>;
/// An evaluator: [`eval_size`] or [`eval_int`].
pub type Evaluator<T> = fn(&str, Env, Names) -> Result<T, ExprError>;

/// Evaluates `text` to a positive size. `env` gives each name's value; `names` lists them
/// for "did you mean" hints.
pub fn eval_size(
    text: &str,
    env: &dyn Fn(&str) -> Option<Dim>,
    names: &dyn Fn() -> Vec<String>,
) -> Result<Dim, ExprError> {
    let v = eval(text, env, names)?;
    let whole = (0, text.len());
    match v {
        Val::Int(n) if n <= 0 => Err(ExprError {
            message: format!("`{text}` is {n}; sizes must be positive"),
            at: whole,
            hint: None,
        }),
        Val::Int(n) => check_max(Dim::known(n as u64), text),
        Val::Dim(d) => check_max(d, text),
    }
}

/// Evaluates `text` to an integer (which may be zero or negative: an axis, a padding).
pub fn eval_int(
    text: &str,
    env: &dyn Fn(&str) -> Option<Dim>,
    names: &dyn Fn() -> Vec<String>,
) -> Result<i64, ExprError> {
    let v = eval(text, env, names)?;
    as_int(&v).ok_or_else(|| {
        err(
            format!("`{text}` must be a known integer, not symbolic"),
            (0, text.len()),
        )
    })
}

fn check_max(d: Dim, text: &str) -> Result<Dim, ExprError> {
    if d.factor == 0 {
        return Err(err(
            format!("`{text}` is 0; sizes must be positive"),
            (0, text.len()),
        ));
    }
    if d.factor > MAX_DIM {
        let mut e = err(
            format!(
                "`{text}` is {}, beyond the largest size Parallax accepts",
                d.factor
            ),
            (0, text.len()),
        );
        e.hint = Some(format!("one dimension may be at most 2^40 = {MAX_DIM}"));
        return Err(e);
    }
    Ok(d)
}

fn eval(
    text: &str,
    env: &dyn Fn(&str) -> Option<Dim>,
    names: &dyn Fn() -> Vec<String>,
) -> Result<Val, ExprError> {
    let mut toks = Vec::new();
    let mut lexer = Tok::lexer(text);
    while let Some(t) = lexer.next() {
        let s = lexer.span();
        match t {
            Ok(t) => toks.push((t, (s.start, s.end))),
            Err(()) => {
                return Err(err(
                    format!(
                        "unexpected `{}` in a size expression",
                        &text[s.start..s.end]
                    ),
                    (s.start, s.end),
                ))
            }
        }
    }
    if toks.is_empty() {
        return Err(err("empty size expression", (0, text.len())));
    }
    let mut p = Parser {
        toks,
        pos: 0,
        text,
        env,
        names,
    };
    let (v, _) = p.expr(0, 0)?;
    if let Some(&(_, s)) = p.toks.get(p.pos) {
        return Err(err(
            format!("unexpected `{}` after the expression", &text[s.0..s.1]),
            s,
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::dim::Sym;

    fn env(name: &str) -> Option<Dim> {
        match name {
            "d" => Some(Dim::known(256)),
            "heads" => Some(Dim::known(4)),
            "seq" => Some(Dim::sym(Sym(1))),
            _ => None,
        }
    }
    fn names() -> Vec<String> {
        vec!["d".into(), "heads".into(), "seq".into()]
    }
    fn size(t: &str) -> Result<Dim, ExprError> {
        eval_size(t, &env, &names)
    }

    #[test]
    fn arithmetic() {
        assert_eq!(size("d * 4").unwrap(), Dim::known(1024));
        assert_eq!(size("d / heads").unwrap(), Dim::known(64));
        assert_eq!(size("(d + 1) // 2").unwrap(), Dim::known(128));
        assert_eq!(size("2 + 3 * 4").unwrap(), Dim::known(14));
        assert_eq!(size("1_000").unwrap(), Dim::known(1000));
        assert_eq!(size("seq * 2").unwrap().factor, 2);
    }

    #[test]
    fn errors() {
        let e = size("dd * 4").unwrap_err();
        assert_eq!(e.message, "unknown parameter `dd`");
        assert_eq!(e.at, (0, 2));
        assert_eq!(e.hint.as_deref(), Some("did you mean `d`?"));
        assert!(size("d / 3")
            .unwrap_err()
            .message
            .contains("does not divide"));
        assert!(size("d - 256").unwrap_err().message.contains("positive"));
        assert!(size("d / 0").unwrap_err().message.contains("zero"));
        assert!(size("seq + 1").unwrap_err().message.contains("symbolic"));
        assert!(size("d *").unwrap_err().message.contains("ends too early"));
        assert!(size("d $ 2")
            .unwrap_err()
            .message
            .contains("unexpected `$`"));
        assert!(size("9999999999 * 9999999999")
            .unwrap_err()
            .message
            .contains("overflow"));
        assert!(size("65536 * 65536 * 512")
            .unwrap_err()
            .message
            .contains("largest"));
        let deep = format!("{}1{}", "(".repeat(500), ")".repeat(500));
        assert!(size(&deep).is_err());
        assert_eq!(eval_int("-1", &env, &names).unwrap(), -1);
        assert!(eval_int("-(-9223372036854775807 - 1)", &env, &names)
            .unwrap_err()
            .message
            .contains("overflow"));
    }
}
