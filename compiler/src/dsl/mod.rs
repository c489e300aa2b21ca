//! The experiment language: RON read by serde, sizes as logos-lexed expressions, and the
//! spans that let every later error point at the user's line.

pub mod ast;
pub mod compare;
pub mod expr;
pub mod overrides;
pub mod settings;
pub mod spans;
pub mod validate;

use crate::diag::{suggest, Diagnostic, Loc, Span};
use crate::Error;
use ast::Experiment;
use ron::error::Error as RonError;
use spans::{Rewritten, SpanTree};

/// A parsed experiment with the source it came from.
#[derive(Debug, Clone)]
pub struct Source {
    pub text: String,
    pub experiment: Experiment,
    pub spans: SpanTree,
    /// Set when `--set` overrides made this experiment from a file (then `text` is written
    /// out by `to_ron`, not the user's).
    pub overridden: Option<Box<overrides::Overridden>>,
}

impl Source {
    /// The text errors about this experiment are shown against, and the errors in its terms:
    /// the user's file, or for an overridden experiment the file as written (an error inside
    /// an override names it instead).
    pub fn for_user(&self, diags: Vec<Diagnostic>) -> (&str, Vec<Diagnostic>) {
        match &self.overridden {
            None => (&self.text, diags),
            Some(o) => (
                &o.file.text,
                diags
                    .into_iter()
                    .map(|d| overrides::relocate(o, &self.text, &self.spans, d))
                    .collect(),
            ),
        }
    }
    /// The span of the value at `path`, or the nearest enclosing one found.
    pub fn span(&self, path: &spans::Path) -> Option<Span> {
        self.spans.find(path)
    }
    /// The span of the head of the value at `path` (a layer's name, a field's name).
    pub fn head(&self, path: &spans::Path) -> Option<Span> {
        self.spans.head(path, &self.text)
    }
}

/// The experiment as RON with every default written out (a run's `experiment.ron`).
pub fn to_ron(e: &Experiment) -> String {
    let config = ron::ser::PrettyConfig::new()
        .struct_names(true)
        .indentor("    ".to_string());
    ron::ser::to_string_pretty(e, config).unwrap_or_else(|err| format!("// cannot write: {err}\n"))
}

/// Nesting deeper than this is refused (serde would otherwise recurse on the stack).
const RECURSION_LIMIT: usize = 128;

/// Reads a file's bytes: they must be UTF-8.
pub fn parse_bytes(bytes: &[u8]) -> Result<Source, Error> {
    match std::str::from_utf8(bytes) {
        Ok(s) => parse(s),
        Err(e) => {
            let at = e.valid_up_to();
            // Offsets into the valid prefix are offsets into the lossy text the CLI shows.
            let valid = String::from_utf8_lossy(&bytes[..at]).into_owned();
            Err(Error::Syntax(
                Diagnostic::new(
                    format!(
                        "the file is not valid UTF-8 (byte 0x{:02x} at offset {at})",
                        bytes[at]
                    ),
                    Some(Span::new(at.min(valid.len()), at.min(valid.len()))),
                )
                .with_hint("save the file as UTF-8 text"),
            ))
        }
    }
}

/// Parses and validates an experiment.
pub fn parse(text: &str) -> Result<Source, Error> {
    // Editors may start a UTF-8 file with a byte-order mark: read it as three spaces, which
    // keeps every byte offset (and so every error position) where it was.
    let unmarked;
    let text = match text.strip_prefix('\u{feff}') {
        Some(rest) => {
            unmarked = format!("   {rest}");
            unmarked.as_str()
        }
        None => text,
    };
    if text.trim().is_empty() {
        return Err(Error::Syntax(
            Diagnostic::new("the file is empty", Some(Span::new(0, 0)))
                .with_hint("an experiment is written `Experiment(name: ..., model: ..., ...)`"),
        ));
    }
    let rewritten = Rewritten::new(text, ast::BARE_OK);
    let options = ron::Options::default()
        .with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME)
        .with_recursion_limit(RECURSION_LIMIT);
    let experiment: Experiment = options
        .from_str(&rewritten.text)
        .map_err(|e| Error::Syntax(ron_diagnostic(&e, &rewritten, text)))?;
    let source = Source {
        text: text.to_string(),
        experiment,
        spans: SpanTree::scan(text),
        overridden: None,
    };
    let problems = validate::validate(&source);
    if !problems.is_empty() {
        return Err(Error::Invalid(problems));
    }
    Ok(source)
}

fn what_enum(outer: Option<&str>) -> &'static str {
    match outer {
        Some("Layer") => "layer",
        Some("Model") => "model kind",
        Some("Loss") => "loss",
        Some("Data") => "data set",
        Some("Optimizer") => "optimizer",
        Some("Schedule") => "schedule",
        Some("Activation") => "activation",
        Some("DType") => "dtype",
        Some("SeqTask") => "sequence task",
        _ => "variant",
    }
}

fn ron_diagnostic(e: &ron::error::SpannedError, rw: &Rewritten, text: &str) -> Diagnostic {
    let start = rw.original_offset(Loc {
        line: e.span.start.line,
        col: e.span.start.col,
    });
    let end = rw
        .original_offset(Loc {
            line: e.span.end.line,
            col: e.span.end.col,
        })
        .max(start);
    let span = Some(Span::new(start, end));
    match &e.code {
        RonError::IntegerOutOfBounds => {
            // RON points past a leading sign; include it, so `-1` is underlined whole.
            let signed = text.get(..start).unwrap_or("").trim_end();
            let start = if signed.ends_with(['-', '+']) {
                signed.len() - 1
            } else {
                start
            };
            Diagnostic::new(
                "this integer is out of range for the field",
                Some(Span::new(start, end)),
            )
            .with_hint("counts and sizes here are whole numbers, 0 or more, of a sensible size")
        }
        RonError::TrailingCharacters => {
            // RON points just past the closing `)`: point at the text itself.
            let at = skip_blank(text, start);
            Diagnostic::new(
                "unexpected text after the end of the experiment",
                Some(Span::new(at, at.max(end))),
            )
            .with_hint("the experiment ends at its closing `)`; remove what follows it")
        }
        RonError::NoSuchEnumVariant {
            expected,
            found,
            outer,
        } => {
            let what = what_enum(outer.as_deref());
            Diagnostic::new(format!("unknown {what} `{found}`"), span).with_hint(suggest(
                found,
                &format!("{what}s"),
                expected.iter().copied(),
            ))
        }
        RonError::NoSuchStructField {
            expected,
            found,
            outer,
        } => {
            let inside = outer.as_deref().unwrap_or("this section");
            let fields: Vec<String> = expected.iter().map(|f| format!("`{f}`")).collect();
            let hint = match crate::diag::closest(found, expected.iter().copied()) {
                Some(c) => format!("did you mean `{c}`? valid fields: {}", fields.join(", ")),
                None => format!("valid fields: {}", fields.join(", ")),
            };
            Diagnostic::new(format!("unknown field `{found}` in `{inside}`"), span).with_hint(hint)
        }
        RonError::MissingStructField { field, outer } => {
            let inside = outer.as_deref().unwrap_or("this section");
            Diagnostic::new(format!("`{inside}` is missing the field `{field}`"), span)
                .with_hint(format!("add `{field}: ...` inside `{inside}(...)`"))
        }
        RonError::DuplicateStructField { field, outer } => {
            let inside = outer.as_deref().unwrap_or("this section");
            Diagnostic::new(
                format!("the field `{field}` is given twice in `{inside}`"),
                span,
            )
        }
        RonError::ExceededRecursionLimit => Diagnostic::new(
            format!("the file nests deeper than {RECURSION_LIMIT} levels"),
            span,
        )
        .with_hint("flatten the structure; a deep model is written with `Repeat`"),
        RonError::Eof => Diagnostic::new("the file ends in the middle of a value", span)
            .with_hint("the file may be truncated: check for a missing `)`, `]` or `}`"),
        RonError::Message(m) => Diagnostic::new(m.clone(), span),
        other => Diagnostic::new(lowercase_first(&other.to_string()), span),
    }
}

/// The first offset at or after `at` that is not whitespace or a comment.
fn skip_blank(text: &str, mut at: usize) -> usize {
    while let Some(rest) = text.get(at..) {
        let trimmed = rest.trim_start();
        at += rest.len() - trimmed.len();
        let skip = if trimmed.starts_with("//") {
            trimmed.find('\n').unwrap_or(trimmed.len())
        } else if trimmed.starts_with("/*") {
            trimmed.find("*/").map_or(trimmed.len(), |i| i + 2)
        } else {
            break;
        };
        at += skip;
    }
    at.min(text.len())
}

fn lowercase_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) if !s.starts_with("RON") => f.to_lowercase().collect::<String>() + c.as_str(),
        _ => s.to_string(),
    }
}
