//! The fields that differ between two experiment files (`parallax diff`), found on the span
//! tree of each: it keeps what serde's values drop, the variant names (`Sgd` or `AdamW`)
//! and each value as written.

use super::spans::{Kind, Node, SpanTree, Tok};
use logos::Logos;
use std::fmt;

/// A value whose one-line form is longer than this is shown as `Name(..)`.
const BRIEF: usize = 60;

/// A file ron cannot read: `line:col: what`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SyntaxError(String);

/// One experiment file, scanned.
pub struct Written<'s> {
    src: &'s str,
    root: Node,
}

impl<'s> Written<'s> {
    pub fn scan(src: &'s str) -> Result<Written<'s>, SyntaxError> {
        // ron finds the syntax error and its line and column; the scan follows any file ron
        // reads (and, after ron, nests no deeper than ron's recursion limit).
        let options = ron::Options::default();
        (options.from_str::<serde::de::IgnoredAny>(src)).map_err(|e| SyntaxError(e.to_string()))?;
        let root = SpanTree::scan(src).root;
        let root = root.ok_or_else(|| SyntaxError("1:1: not one RON value".into()))?;
        Ok(Written { src, root })
    }
}

/// A field that differs: its path (`optimizer.lr`, empty for the whole experiment) and its
/// values as written on one line, `None` where a side lacks it.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub path: String,
    pub before: Option<String>,
    pub after: Option<String>,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |v: &Option<String>| v.clone().unwrap_or_else(|| "(absent)".into());
        let at = if self.path.is_empty() {
            "experiment"
        } else {
            &self.path
        };
        write!(f, "{at}: {} -> {}", side(&self.before), side(&self.after))
    }
}

/// Every field that differs between `a` and `b`, in `a`'s order, then those only in `b`.
pub fn changes(a: &Written, b: &Written) -> Vec<Change> {
    let mut out = Vec::new();
    walk(
        "",
        Value::new(a.src, &a.root),
        Value::new(b.src, &b.root),
        &mut out,
    );
    out
}

/// A node of the file `src` and its value's text (a field's without its `name:`).
#[derive(Clone, Copy)]
struct Value<'a> {
    src: &'a str,
    node: &'a Node,
    text: &'a str,
}

impl<'a> Value<'a> {
    fn new(src: &'a str, node: &'a Node) -> Value<'a> {
        let text = &src[node.span.start..node.span.end];
        Value { src, node, text }
    }

    /// The items of a group, keyed by field name or map key, or by position.
    fn items(self) -> Vec<(String, Value<'a>)> {
        match &self.node.kind {
            Kind::Leaf => Vec::new(),
            Kind::Named(fields) => (fields.iter())
                .map(|(k, n)| {
                    let v = Value::new(self.src, n);
                    let text = after_key(v.text);
                    (k.clone(), Value { text, ..v })
                })
                .collect(),
            Kind::Seq(elems) => (elems.iter().enumerate())
                .map(|(i, n)| (i.to_string(), Value::new(self.src, n)))
                .collect(),
        }
    }
}

/// The tokens of `text`, as written (comments and whitespace dropped).
fn tokens(text: &str) -> impl Iterator<Item = (Tok, &str)> + '_ {
    let mut lexer = Tok::lexer(text);
    std::iter::from_fn(move || Some((lexer.next()?.ok()?, lexer.slice())))
}

/// A group's name and opening bracket (`("Sgd", '(')`, `("", '[')`); `None` for an atom.
fn head(text: &str) -> Option<(&str, char)> {
    let mut toks = tokens(text);
    let (name, open) = match toks.next()? {
        (Tok::Ident, name) => (name, toks.next()?.0),
        (open, _) => ("", open),
    };
    match open {
        Tok::LParen => Some((name, '(')),
        Tok::LBracket if name.is_empty() => Some((name, '[')),
        Tok::LBrace if name.is_empty() => Some((name, '{')),
        _ => None,
    }
}

fn closing(open: char) -> char {
    match open {
        '[' => ']',
        '{' => '}',
        _ => ')',
    }
}

/// The value on one line: `Name(a: 1, b: [2, 3])`, without trailing commas; a variant
/// written `Name()` as `Name`.
fn one_line(text: &str) -> String {
    let toks: Vec<(Tok, &str)> = tokens(text).collect();
    let kind = |i: usize| toks.get(i).map(|t| t.0);
    let mut out = String::new();
    let mut i = 0;
    while let Some(&(tok, s)) = toks.get(i) {
        i += 1;
        match tok {
            Tok::Comma if matches!(kind(i), Some(Tok::RParen | Tok::RBracket | Tok::RBrace)) => {}
            Tok::Comma | Tok::Colon => out += &format!("{s} "),
            Tok::Ident if (kind(i), kind(i + 1)) == (Some(Tok::LParen), Some(Tok::RParen)) => {
                out += s;
                i += 2;
            }
            _ => out += s,
        }
    }
    out
}

/// [`one_line`], shortened to `Name(..)` (or `[..]`, `{..}`) when long.
fn brief(v: Value) -> String {
    let full = one_line(v.text);
    match head(v.text) {
        Some((name, open)) if full.len() > BRIEF => format!("{name}{open}..{}", closing(open)),
        _ => full,
    }
}

/// The text after a field's `name:` (or a map entry's `key:`).
fn after_key(text: &str) -> &str {
    let mut lexer = Tok::lexer(text);
    while let Some(t) = lexer.next() {
        if t == Ok(Tok::Colon) {
            return text[lexer.span().end..].trim_start();
        }
    }
    text
}

/// Collects a change for every field that differs between `a` and `b`.
fn walk(path: &str, a: Value, b: Value, out: &mut Vec<Change>) {
    let changed = || Change {
        path: path.to_string(),
        before: Some(brief(a)),
        after: Some(brief(b)),
    };
    let same_kind = |x: &Kind, y: &Kind| std::mem::discriminant(x) == std::mem::discriminant(y);
    match (&a.node.kind, &b.node.kind) {
        (Kind::Leaf, Kind::Leaf) => {
            // `5e-3` and `0.005` are the same number.
            let num = |s: &str| s.replace('_', "").parse::<f64>().ok();
            let (x, y) = (one_line(a.text), one_line(b.text));
            if x != y && (num(&x).is_none() || num(&x) != num(&y)) {
                out.push(changed());
            }
            return;
        }
        (x, y) if same_kind(x, y) && head(a.text) == head(b.text) => {}
        _ => return out.push(changed()),
    }
    let (ia, ib) = (a.items(), b.items());
    let at = |k: &str| match path {
        "" => k.to_string(),
        _ => format!("{path}.{k}"),
    };
    let find = |items: &[(String, Value<'_>)], k: &str| items.iter().position(|i| i.0 == k);
    let mut inner = Vec::new();
    for (k, va) in &ia {
        match find(&ib, k) {
            Some(j) => walk(&at(k), *va, ib[j].1, &mut inner),
            None => inner.push(Change {
                path: at(k),
                before: Some(brief(*va)),
                after: None,
            }),
        }
    }
    for (k, vb) in ib.iter().filter(|(k, _)| find(&ia, k).is_none()) {
        inner.push(Change {
            path: at(k),
            before: None,
            after: Some(brief(*vb)),
        });
    }
    // A one-value tuple (`Some(30)`, `Dropout(0.1)`) reads best whole.
    let tuple = matches!(a.node.kind, Kind::Seq(_)) && head(a.text).is_some_and(|h| h.1 == '(');
    if !inner.is_empty() && tuple && ia.len() == 1 && ib.len() == 1 {
        out.push(changed());
    } else {
        out.extend(inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(a: &str, b: &str) -> Vec<String> {
        let (a, b) = (Written::scan(a).unwrap(), Written::scan(b).unwrap());
        changes(&a, &b).iter().map(ToString::to_string).collect()
    }

    #[test]
    fn names_fields_variants_and_entries() {
        let a = r#"E(params: {"d": 1}, steps: Some(30), lr: 5e-3, l: [Relu, Dropout(0.1)])"#;
        let b = "E(params: {\"e\": 2}, steps: Some(40), lr: 0.005, // same\n l: [Gelu, Dropout(0.1),],)";
        assert_eq!(
            lines(a, b),
            [
                "params.d: 1 -> (absent)",
                "params.e: (absent) -> 2",
                "steps: Some(30) -> Some(40)",
                "l.0: Relu -> Gelu",
            ]
        );
        assert_eq!(
            lines("A(x: 1)", "B(x: 1)"),
            ["experiment: A(x: 1) -> B(x: 1)"]
        );
        assert!(lines(a, a).is_empty());
    }

    #[test]
    fn a_syntax_error_has_its_line_and_column() {
        let e = Written::scan("E(\n  a: (b: 1)").err().unwrap();
        assert!(e.to_string().starts_with("2:"), "{e}");
    }
}
