//! Where each value of a RON file is written. serde hands us values without positions, so a
//! small structural scan of the same source (logos tokens, no values) records the span of
//! every struct field, list element and map entry; errors found after parsing (a shape
//! mismatch in layer 7) look their spot up here by path.
//!
//! The scan also lets layers with only optional settings be written bare (`LayerNorm` as well
//! as `LayerNorm(eps: 1e-6)`): it inserts `()` after such names before serde sees the text, and
//! maps positions in the rewritten text back to the user's.

use crate::diag::{Loc, Span};
use logos::Logos;

#[derive(Logos, Debug, Clone, Copy, PartialEq, Eq)]
#[logos(skip r"[ \t\r\n\f]+")]
// Line comments, and `#![enable(...)]` attributes (not values), are skipped alike.
#[logos(skip(r"//[^\n]*|#!\[[^\]]*\]", allow_greedy = true))]
pub(super) enum Tok {
    #[token("(")]
    LParen,
    #[token(")")]
    RParen,
    #[token("[")]
    LBracket,
    #[token("]")]
    RBracket,
    #[token("{")]
    LBrace,
    #[token("}")]
    RBrace,
    #[token(",")]
    Comma,
    #[token(":")]
    Colon,
    #[token("/*", block_comment)]
    Comment,
    #[regex(r#""([^"\\]|\\(.|\n))*""#)]
    Str,
    #[regex(r##"r#*""##, raw_string)]
    RawStr,
    #[regex(r"'([^'\\]|\\.)+'")]
    Char,
    #[regex(r"[A-Za-z_][A-Za-z0-9_]*")]
    Ident,
    #[regex(r"[0-9][0-9A-Za-z_]*(\.[0-9A-Za-z_]*)?([eE][+-]?[0-9_]+)?")]
    #[regex(r"\.[0-9][0-9_]*([eE][+-]?[0-9_]+)?")]
    Number,
    #[regex(r"[+-]")]
    Sign,
}

fn block_comment(lex: &mut logos::Lexer<Tok>) -> logos::FilterResult<(), ()> {
    // RON block comments nest.
    let rest = lex.remainder();
    let mut depth = 1usize;
    let bytes = rest.as_bytes();
    let mut i = 0;
    while i + 1 < bytes.len() {
        match (bytes[i], bytes[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    lex.bump(i);
                    return logos::FilterResult::Skip;
                }
            }
            _ => i += 1,
        }
    }
    logos::FilterResult::Error(())
}

fn raw_string(lex: &mut logos::Lexer<Tok>) -> Option<()> {
    let hashes = lex.slice().len() - 2;
    let close = format!("\"{}", "#".repeat(hashes));
    let end = lex.remainder().find(&close)?;
    lex.bump(end + close.len());
    Some(())
}

/// One step of a path into the file: a struct field or map key, or a list/tuple position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    Name(String),
    Index(usize),
}

impl From<&str> for Seg {
    fn from(s: &str) -> Self {
        Seg::Name(s.to_string())
    }
}
impl From<usize> for Seg {
    fn from(i: usize) -> Self {
        Seg::Index(i)
    }
}

/// A path into the file, e.g. `model.layers[3]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Path(pub Vec<Seg>);

impl Path {
    pub fn root() -> Self {
        Path(Vec::new())
    }
    pub fn join(&self, seg: impl Into<Seg>) -> Path {
        let mut p = self.0.clone();
        p.push(seg.into());
        Path(p)
    }
}

#[macro_export]
macro_rules! path {
    ($($seg:expr),* $(,)?) => { $crate::dsl::spans::Path(vec![$($crate::dsl::spans::Seg::from($seg)),*]) };
}

#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) span: Span,
    pub(super) kind: Kind,
}

#[derive(Debug, Clone)]
pub(super) enum Kind {
    Leaf,
    /// Struct fields or map entries, by name (map keys unquoted).
    Named(Vec<(String, Node)>),
    /// List or tuple elements.
    Seq(Vec<Node>),
}

/// The spans of a parsed file, looked up by path.
#[derive(Debug, Clone)]
pub struct SpanTree {
    pub(super) root: Option<Node>,
}

const MAX_DEPTH: usize = 512;

struct Scanner<'s> {
    toks: Vec<(Tok, Span)>,
    pos: usize,
    src: &'s str,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<Tok> {
        self.toks.get(self.pos).map(|t| t.0)
    }
    fn next(&mut self) -> Option<(Tok, Span)> {
        let t = self.toks.get(self.pos).copied();
        self.pos += 1;
        t
    }
    fn eat(&mut self, t: Tok) -> bool {
        if self.peek() == Some(t) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<Node> {
        if depth > MAX_DEPTH {
            return None;
        }
        let (tok, span) = self.next()?;
        match tok {
            Tok::Sign => {
                let inner = self.value(depth + 1)?;
                Some(Node {
                    span: Span::new(span.start, inner.span.end),
                    kind: Kind::Leaf,
                })
            }
            Tok::Ident => {
                if self.peek() == Some(Tok::LParen) {
                    self.pos += 1;
                    let mut node = self.group(depth + 1, Tok::RParen)?;
                    node.span.start = span.start;
                    Some(node)
                } else {
                    Some(Node {
                        span,
                        kind: Kind::Leaf,
                    })
                }
            }
            Tok::Number | Tok::Str | Tok::RawStr | Tok::Char => Some(Node {
                span,
                kind: Kind::Leaf,
            }),
            Tok::LParen => {
                let mut n = self.group(depth + 1, Tok::RParen)?;
                n.span.start = span.start;
                Some(n)
            }
            Tok::LBracket => {
                let mut n = self.group(depth + 1, Tok::RBracket)?;
                n.span.start = span.start;
                Some(n)
            }
            Tok::LBrace => {
                let mut n = self.map(depth + 1)?;
                n.span.start = span.start;
                Some(n)
            }
            _ => None,
        }
    }

    /// After an opening `(` or `[`: named fields `(a: 1, b: 2)` or positional elements.
    fn group(&mut self, depth: usize, close: Tok) -> Option<Node> {
        let start = self.toks.get(self.pos.saturating_sub(1))?.1.start;
        let named = close == Tok::RParen
            && self.peek() == Some(Tok::Ident)
            && self.toks.get(self.pos + 1).map(|t| t.0) == Some(Tok::Colon);
        let mut fields = Vec::new();
        let mut elems = Vec::new();
        loop {
            if let Some((Tok::RParen | Tok::RBracket, s)) = self.toks.get(self.pos).copied() {
                self.pos += 1;
                let span = Span::new(start, s.end);
                let kind = if named {
                    Kind::Named(fields)
                } else {
                    Kind::Seq(elems)
                };
                return Some(Node { span, kind });
            }
            if named {
                let (t, s) = self.next()?;
                if t != Tok::Ident || !self.eat(Tok::Colon) {
                    return None;
                }
                let name = self.src[s.start..s.end].to_string();
                let v = self.value(depth)?;
                // Point at the field name, not only its value.
                let node = Node {
                    span: Span::new(s.start, v.span.end),
                    kind: v.kind,
                };
                fields.push((name, node));
            } else {
                elems.push(self.value(depth)?);
            }
            if !self.eat(Tok::Comma) && !matches!(self.peek(), Some(Tok::RParen | Tok::RBracket)) {
                return None;
            }
        }
    }

    fn map(&mut self, depth: usize) -> Option<Node> {
        let start = self.toks.get(self.pos.saturating_sub(1))?.1.start;
        let mut entries = Vec::new();
        loop {
            if let Some((Tok::RBrace, s)) = self.toks.get(self.pos).copied() {
                self.pos += 1;
                return Some(Node {
                    span: Span::new(start, s.end),
                    kind: Kind::Named(entries),
                });
            }
            let key = self.value(depth)?;
            let text = self.src[key.span.start..key.span.end].trim_matches('"');
            let text = text.to_string();
            if !self.eat(Tok::Colon) {
                return None;
            }
            let v = self.value(depth)?;
            entries.push((
                text,
                Node {
                    span: Span::new(key.span.start, v.span.end),
                    kind: v.kind,
                },
            ));
            if !self.eat(Tok::Comma) && self.peek() != Some(Tok::RBrace) {
                return None;
            }
        }
    }
}

fn lex(src: &str) -> Vec<(Tok, Span)> {
    let mut out = Vec::new();
    let mut lexer = Tok::lexer(src);
    while let Some(t) = lexer.next() {
        let s = lexer.span();
        match t {
            Ok(t) => out.push((t, Span::new(s.start, s.end))),
            Err(()) => break,
        }
    }
    out
}

impl SpanTree {
    /// Scans `src`. A file the scan cannot follow gives an empty tree (errors then carry no
    /// position rather than a wrong one); serde reports the syntax error itself.
    pub fn scan(src: &str) -> SpanTree {
        let toks = lex(src);
        let mut sc = Scanner { toks, pos: 0, src };
        // `#![enable(...)]` attributes were skipped by the lexer: they are not values.
        let root = sc.value(0);
        SpanTree { root }
    }

    /// The span of the value at `path`, or of its deepest ancestor that was found.
    pub fn find(&self, path: &Path) -> Option<Span> {
        let mut node = self.root.as_ref()?;
        for seg in &path.0 {
            let next = match (seg, &node.kind) {
                (Seg::Name(n), Kind::Named(fields)) => {
                    fields.iter().find(|(k, _)| k == n).map(|(_, v)| v)
                }
                (Seg::Index(i), Kind::Seq(elems)) => elems.get(*i),
                // A newtype wrapper such as `Some(x)`: look through it.
                (Seg::Name(_), Kind::Seq(elems)) if elems.len() == 1 => match &elems[0].kind {
                    Kind::Named(fields) => match seg {
                        Seg::Name(n) => fields.iter().find(|(k, _)| k == n).map(|(_, v)| v),
                        Seg::Index(_) => None,
                    },
                    _ => None,
                },
                _ => None,
            };
            match next {
                Some(n) => node = n,
                None => break,
            }
        }
        Some(node.span)
    }

    /// The span of the value at exactly `path`, and the names found where the path stops
    /// matching (for suggestions).
    pub fn find_exact(&self, path: &Path) -> Result<Span, Vec<String>> {
        let mut node = self.root.as_ref().ok_or_else(Vec::new)?;
        for seg in &path.0 {
            let fields = match &node.kind {
                Kind::Named(fields) => Some(fields),
                // A newtype wrapper such as `Some(x)`: look through it.
                Kind::Seq(elems) if elems.len() == 1 && matches!(seg, Seg::Name(_)) => {
                    match &elems[0].kind {
                        Kind::Named(fields) => Some(fields),
                        _ => None,
                    }
                }
                _ => None,
            };
            let next = match (seg, fields, &node.kind) {
                (Seg::Name(n), Some(fields), _) => {
                    fields.iter().find(|(k, _)| k == n).map(|(_, v)| v)
                }
                (Seg::Index(i), _, Kind::Seq(elems)) => elems.get(*i),
                _ => None,
            };
            node = next.ok_or_else(|| {
                fields.map_or_else(Vec::new, |f| f.iter().map(|(k, _)| k.clone()).collect())
            })?;
        }
        Ok(node.span)
    }

    /// The path of the innermost value whose span holds `offset`.
    pub fn path_at(&self, offset: usize) -> Path {
        let mut path = Path::root();
        let Some(mut node) = self.root.as_ref() else {
            return path;
        };
        let holds = |n: &Node| n.span.start <= offset && offset < n.span.end;
        loop {
            let next = match &node.kind {
                Kind::Leaf => None,
                Kind::Named(fields) => fields
                    .iter()
                    .find(|(_, n)| holds(n))
                    .map(|(k, n)| (Seg::Name(k.clone()), n)),
                Kind::Seq(elems) => elems
                    .iter()
                    .enumerate()
                    .find(|(_, n)| holds(n))
                    .map(|(i, n)| (Seg::Index(i), n)),
            };
            match next {
                Some((seg, n)) => {
                    path.0.push(seg);
                    node = n;
                }
                None => return path,
            }
        }
    }

    /// The span of just the head of the value at `path`: a variant's name (`Linear` in
    /// `Linear(out: 3)`), a field's name, or the whole value when it is short.
    pub fn head(&self, path: &Path, src: &str) -> Option<Span> {
        let s = self.find(path)?;
        let text = src.get(s.start..s.end)?;
        let n = text
            .char_indices()
            .find(|(_, c)| !(c.is_alphanumeric() || *c == '_' || *c == '"' || *c == '-'))
            .map_or(text.len(), |(i, _)| i);
        let n = if n == 0 { text.len().min(1) } else { n };
        Some(Span::new(s.start, s.start + n))
    }
}

/// Whether `src` is exactly one value: every bracket and quote closed, nothing after it.
pub fn is_one_value(src: &str) -> bool {
    let mut toks = Vec::new();
    let mut lexer = Tok::lexer(src);
    while let Some(t) = lexer.next() {
        let s = lexer.span();
        match t {
            Ok(t) => toks.push((t, Span::new(s.start, s.end))),
            Err(()) => return false,
        }
    }
    let mut sc = Scanner { toks, pos: 0, src };
    sc.value(0).is_some() && sc.pos == sc.toks.len()
}

/// The source with `()` inserted after bare names of variants whose settings are all
/// optional, and a map from positions in it back to the original.
pub struct Rewritten {
    pub text: String,
    /// Original byte offsets at which `()` was inserted, ascending.
    inserted_at: Vec<usize>,
}

impl Rewritten {
    pub fn new(src: &str, bare_ok: &[&str]) -> Rewritten {
        let toks = lex(src);
        let mut inserted_at = Vec::new();
        for (i, (t, s)) in toks.iter().enumerate() {
            if *t != Tok::Ident || !bare_ok.contains(&&src[s.start..s.end]) {
                continue;
            }
            let next = toks.get(i + 1).map(|t| t.0);
            if matches!(next, Some(Tok::LParen | Tok::Colon)) {
                continue;
            }
            inserted_at.push(s.end);
        }
        let mut text = String::with_capacity(src.len() + 2 * inserted_at.len());
        let mut last = 0;
        for &at in &inserted_at {
            text.push_str(&src[last..at]);
            text.push_str("()");
            last = at;
        }
        text.push_str(&src[last..]);
        Rewritten { text, inserted_at }
    }

    /// A line and column in the rewritten text, as a byte offset in the original.
    pub fn original_offset(&self, loc: Loc) -> usize {
        let at = loc.offset(&self.text);
        let mut shift = 0;
        for &ins in &self.inserted_at {
            // Each insertion of 2 bytes sits at `ins + shift` in the rewritten text.
            if ins + shift + 2 <= at {
                shift += 2;
            } else if ins + shift < at {
                // Inside the inserted `()`: point at the name it follows.
                return ins;
            } else {
                break;
            }
        }
        at - shift
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = r#"Experiment(
    name: "x", // comment (with parens
    params: { "hidden": 128, "d": "hidden * 2" },
    /* block /* nested */ ) */
    model: Sequential(
        input: (shape: [64]),
        layers: [ Linear(out: "hidden"), Relu, Dropout(0.1), Linear(out: -10) ],
    ),
)"#;

    fn text(p: Path) -> String {
        let t = SpanTree::scan(SRC);
        let s = t.find(&p).unwrap();
        SRC[s.start..s.end].to_string()
    }

    #[test]
    fn finds_paths() {
        assert_eq!(text(path!["name"]), "name: \"x\"");
        assert_eq!(text(path!["params", "d"]), "\"d\": \"hidden * 2\"");
        assert_eq!(text(path!["model", "layers", 2]), "Dropout(0.1)");
        assert_eq!(text(path!["model", "layers", 3, "out"]), "out: -10");
        assert_eq!(text(path!["model", "input", "shape", 0]), "64");
        // Missing segments fall back to the deepest ancestor.
        assert_eq!(text(path!["model", "layers", 1, "nope"]), "Relu");
    }

    #[test]
    fn skips_attributes() {
        let src = "#![enable(implicit_some)]\n(a: [LayerNorm], b: 2)";
        let t = SpanTree::scan(src);
        let s = t.find(&path!["b"]).unwrap();
        assert_eq!(&src[s.start..s.end], "b: 2");
        let r = Rewritten::new(src, &["LayerNorm"]);
        assert!(r.text.contains("[LayerNorm()]"), "{}", r.text);
    }

    #[test]
    fn rewrites_bare_variants_and_maps_back() {
        let src = "[LayerNorm, LayerNorm(eps: 1.0), x]";
        let r = Rewritten::new(src, &["LayerNorm"]);
        assert_eq!(r.text, "[LayerNorm(), LayerNorm(eps: 1.0), x]");
        // `x` sits at col 37 in the rewritten text, col 35 in the original.
        assert_eq!(r.original_offset(Loc { line: 1, col: 37 }), 34);
        assert_eq!(r.original_offset(Loc { line: 1, col: 2 }), 1);
    }
}
