//! `--set path=value` overrides: applied to the experiment written out with every default
//! (`to_ron`), then parsed again, so an override is type-checked exactly as the file is.

use super::spans::{is_one_value, Path, Seg, SpanTree};
use super::{parse, to_ron, Source};
use crate::diag::{suggest, Diagnostic, Span};
use crate::Error;

/// One `--set`: a dotted path (`optimizer.lr`, `model.layers.0.out`) and a RON value.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub path: String,
    pub value: String,
}

impl Override {
    /// Reads `path=value`.
    pub fn parse(s: &str) -> Result<Override, String> {
        let (path, value) = s
            .split_once('=')
            .ok_or_else(|| format!("`{s}`: expected PATH=VALUE, e.g. optimizer.lr=3e-4"))?;
        let (path, value) = (path.trim(), value.trim());
        if path.is_empty() {
            return Err(format!(
                "`{s}`: no field before `=`; expected PATH=VALUE, e.g. optimizer.lr=3e-4"
            ));
        }
        if value.is_empty() {
            return Err(format!(
                "`{s}`: no value after `=` (an empty string is written `{path}=\"\"`)"
            ));
        }
        Ok(Override {
            path: path.to_string(),
            value: value.to_string(),
        })
    }
}

/// The file as the user wrote it and the overrides applied to it, kept with the overridden
/// experiment: its text was written out by `to_ron`, so errors about it are told in these terms.
#[derive(Debug, Clone)]
pub struct Overridden {
    pub file: Source,
    pub overrides: Vec<Override>,
}

/// One override placed in the written-out text.
struct Edit<'o> {
    /// The field, from its name, and its value, in the written-out text.
    field: Span,
    value: Span,
    /// What replaces the value.
    new: String,
    o: &'o Override,
}

/// `--set train.steps=N` replaces the file's budget as `--steps N` does: the other of
/// `steps`/`epochs` is cleared unless it is set too.
fn implied(overrides: &[Override]) -> Vec<Override> {
    let sets = |p: &str| overrides.iter().any(|o| o.path == p);
    [
        ("train.steps", "train.epochs"),
        ("train.epochs", "train.steps"),
    ]
    .into_iter()
    .filter(|(a, b)| overrides.iter().any(|o| o.path == *a && o.value != "None") && !sets(b))
    .map(|(_, b)| Override {
        path: b.to_string(),
        value: "None".to_string(),
    })
    .collect()
}

/// The experiment of `source` with the overrides applied: its text (every default written out,
/// then the overrides) and the parsed result. Errors name the override.
pub fn apply(source: &Source, overrides: &[Override]) -> Result<Source, Error> {
    let text = to_ron(&source.experiment);
    let tree = SpanTree::scan(&text);
    let implied = implied(overrides);
    let mut edits = Vec::new();
    for o in overrides.iter().chain(&implied) {
        edits.push(place(o, &text, &tree)?);
    }
    edits.sort_by_key(|e| std::cmp::Reverse(e.value.start));
    for w in edits.windows(2) {
        if w[1].field.end > w[0].field.start {
            return Err(Error::Syntax(Diagnostic::new(
                format!("--set {} and --set {} overlap", w[1].o.path, w[0].o.path),
                None,
            )));
        }
    }
    let mut out = text.clone();
    for e in &edits {
        out.replace_range(e.value.start..e.value.end, &e.new);
    }
    match parse(&out) {
        Ok(mut s) => {
            s.overridden = Some(Box::new(Overridden {
                file: source.clone(),
                overrides: overrides.to_vec(),
            }));
            Ok(s)
        }
        Err(err) => {
            let syntax = matches!(err, Error::Syntax(_));
            let tree_out = SpanTree::scan(&out);
            let at = Where {
                file: source,
                text: &out,
                tree: &tree_out,
                overrides,
            };
            let written = syntax.then_some((text.as_str(), &tree));
            let mut diags: Vec<Diagnostic> = err
                .diagnostics()
                .into_iter()
                .map(|d| at.relocate(d, written))
                .collect();
            Err(if diags.len() == 1 {
                Error::Syntax(diags.remove(0))
            } else {
                Error::Invalid(diags)
            })
        }
    }
}

/// Errors about an overridden experiment's text, told in terms of what the user wrote.
pub(crate) fn relocate(o: &Overridden, text: &str, tree: &SpanTree, d: Diagnostic) -> Diagnostic {
    Where {
        file: &o.file,
        text,
        tree,
        overrides: &o.overrides,
    }
    .relocate(d, None)
}

/// Where an error in the overridden text `text` lies for the user.
struct Where<'a> {
    file: &'a Source,
    text: &'a str,
    tree: &'a SpanTree,
    overrides: &'a [Override],
}

impl Where<'_> {
    /// `d` (its span in the overridden text) in the user's terms: inside an override's value
    /// it names the override (without a span: the user never saw that text); elsewhere it
    /// points at the same value in the user's file and says which overrides were applied.
    /// `written` (the text before the overrides, and its tree) rewords a value that did not
    /// parse as what its field takes.
    fn relocate(&self, d: Diagnostic, written: Option<(&str, &SpanTree)>) -> Diagnostic {
        let inside = d.span.and_then(|s| {
            self.overrides.iter().find(|o| {
                self.tree
                    .find_exact(&path_of(&o.path))
                    .is_ok_and(|f| f.start <= s.start && s.start <= f.end)
            })
        });
        if let Some(o) = inside {
            let head = format!("--set {}={}", o.path, shown(&o.value));
            let old = written.and_then(|(text, tree)| {
                let f = tree.find_exact(&path_of(&o.path)).ok()?;
                Some(&text[value_span(text, f, &o.path).start..f.end])
            });
            let Some(old) = old else {
                // The value parsed but breaks a rule of the experiment: the rule says why.
                return Diagnostic::new(format!("{head}: {}", d.message), None).hint_opt(d.hint);
            };
            let field = o.path.rsplit('.').next().unwrap_or(&o.path);
            let v = shown(&o.value);
            let takes = self.takes(o, old);
            let message = match number(&o.value) {
                Some(Num::Fraction) if takes.whole && !takes.number => format!(
                    "`{v}` is not a whole number; {field} takes an integer{}",
                    like(old, Num::Integer)
                ),
                Some(Num::Integer) if takes.whole => format!(
                    "`{v}` is out of range for {field}, which takes {}",
                    takes.describe(old)
                ),
                _ => format!("`{v}` is not {}", takes.describe(old)),
            };
            // RON's own `expected ...` is about the spliced text, which the user never saw.
            let hint = d
                .hint
                .or((!d.message.starts_with("expected")).then_some(d.message));
            return Diagnostic::new(format!("{head}: {message}"), None).hint_opt(hint);
        }
        let all: Vec<String> = self
            .overrides
            .iter()
            .map(|o| format!("--set {}={}", o.path, shown(&o.value)))
            .collect();
        let with = format!("with {}", all.join(" "));
        match d.span.and_then(|s| self.in_file(s)) {
            Some(span) => {
                let hint = match d.hint {
                    Some(h) => format!("{h} ({with})"),
                    None => with,
                };
                Diagnostic::new(d.message, Some(span)).with_hint(hint)
            }
            // Nowhere in the file: the message says what it is about.
            None => Diagnostic::new(format!("{with}: {}", d.message), None).hint_opt(d.hint),
        }
    }

    /// The span in the user's file of what `s` points at in the overridden text: the same
    /// characters where the value is written alike, else the head of the closest enclosing
    /// value the file writes.
    fn in_file(&self, s: Span) -> Option<Span> {
        let path = self.tree.path_at(s.start);
        let here = self.tree.find_exact(&path).ok()?;
        if let Ok(there) = self.file.spans.find_exact(&path) {
            if self.text.get(here.start..here.end) == self.file.text.get(there.start..there.end) {
                let start = there.start + (s.start - here.start);
                let end = (there.start + s.end.saturating_sub(here.start)).min(there.end);
                return Some(Span::new(start, end.max(start)));
            }
        }
        self.file.head(&path)
    }
}

/// `model.layers.0.out` as a path.
fn path_of(dotted: &str) -> Path {
    Path(
        dotted
            .split('.')
            .map(|p| match p.parse::<usize>() {
                Ok(i) => Seg::Index(i),
                Err(_) => Seg::Name(p.to_string()),
            })
            .collect(),
    )
}

/// The value of the field whose span (from its name, or a map entry's quoted key) is `field`.
fn value_span(text: &str, field: Span, dotted: &str) -> Span {
    let mut value = field;
    if let Some(Seg::Name(n)) = path_of(dotted).0.last() {
        let t = &text[field.start..field.end];
        let rest = t
            .strip_prefix(n.as_str())
            .or_else(|| t.strip_prefix(format!("{n:?}").as_str()));
        if let Some(after) = rest.and_then(|r| r.trim_start().strip_prefix(':')) {
            value.start = field.end - after.trim_start().len();
        }
    }
    value
}

/// Why `dotted` names nothing where the value it stops at has no fields: that value is a single
/// one, or holds values by position only.
fn no_names(tree: &SpanTree, dotted: &str) -> String {
    let segs: Vec<&str> = dotted.split('.').collect();
    let found = (0..segs.len())
        .rev()
        .find(|&k| tree.find_exact(&path_of(&segs[..k].join("."))).is_ok() || k == 0)
        .unwrap_or(0);
    let prefix = segs[..found].join(".");
    let at = path_of(&prefix);
    let n = (0..)
        .take_while(|&i| tree.find_exact(&at.join(i)).is_ok())
        .count();
    match n {
        0 => format!("`{prefix}` is a single value: set it whole, e.g. `--set {prefix}=...`"),
        1 => format!("`{prefix}` holds one value, by position: `{prefix}.0`"),
        n => format!(
            "`{prefix}` holds {n} values, by position: `{prefix}.0` to `{prefix}.{}`",
            n - 1
        ),
    }
}

/// Finds the value `o` replaces and what replaces it.
fn place<'o>(o: &'o Override, text: &str, tree: &SpanTree) -> Result<Edit<'o>, Error> {
    let field = tree.find_exact(&path_of(&o.path)).map_err(|names| {
        let last = o.path.rsplit('.').next().unwrap_or(&o.path);
        Error::Syntax(
            Diagnostic::new(
                format!("--set {}: the experiment has no field `{}`", o.path, o.path),
                None,
            )
            .with_hint(if names.is_empty() {
                no_names(tree, &o.path)
            } else {
                suggest(last, "fields", names.iter().map(String::as_str))
            }),
        )
    })?;
    let value = value_span(text, field, &o.path);
    let old = &text[value.start..value.end];
    let v = o.value.as_str();
    let new = if old.starts_with('"') && !v.starts_with('"') {
        // A string field takes a bare word as a string.
        format!("{v:?}")
    } else if (old == "None" || old.starts_with("Some(")) && v != "None" && !v.starts_with("Some(")
    {
        // An optional field takes its value as `Some(value)`.
        format!("Some({v})")
    } else {
        v.to_string()
    };
    // One value, so that `64, steps: 5` cannot set a second field behind the path's back.
    if !is_one_value(&new) {
        return Err(Error::Syntax(
            Diagnostic::new(
                format!(
                    "--set {}={}: `{}` is not one value",
                    o.path,
                    shown(v),
                    shown(v)
                ),
                None,
            )
            .with_hint(format!(
                "{} is now `{}`; check for an unclosed bracket or quote, or text after the value",
                o.path,
                shown(&example(old))
            )),
        ));
    }
    Ok(Edit {
        field,
        value,
        new,
        o,
    })
}

/// What a field takes, found by putting a value of each kind in its place.
struct Takes {
    number: bool,
    whole: bool,
    boolean: bool,
    text: bool,
    optional: bool,
}

impl Takes {
    /// `old`: the field's value before the overrides, as `to_ron` writes it.
    fn describe(&self, old: &str) -> String {
        let what = if self.number {
            format!("a number{}", like(old, Num::Fraction))
        } else if self.whole && self.text {
            "a whole number or a size expression in quotes, like \"d * 4\"".to_string()
        } else if self.whole {
            format!("a whole number{}", like(old, Num::Integer))
        } else if self.boolean {
            "`true` or `false`".to_string()
        } else if self.text {
            format!("a string like {}", unwrapped(old))
        } else {
            format!("a value like `{}`", example(old))
        };
        if self.optional {
            format!("`None` or {what}")
        } else {
            what
        }
    }
}

impl Where<'_> {
    /// What the field `o` sets takes (`old`: its value before the overrides): each probe that
    /// parses, or fails only a rule of the experiment, is of a kind the field takes.
    fn takes(&self, o: &Override, old: &str) -> Takes {
        let optional = old == "None" || old.starts_with("Some(");
        let value = self
            .tree
            .find_exact(&path_of(&o.path))
            .map(|f| value_span(self.text, f, &o.path));
        let accepts = |probe: &str| {
            let Ok(v) = value else { return false };
            let mut t = self.text.to_string();
            if optional {
                t.replace_range(v.start..v.end, &format!("Some({probe})"));
            } else {
                t.replace_range(v.start..v.end, probe);
            }
            !matches!(parse(&t), Err(Error::Syntax(_)))
        };
        Takes {
            number: accepts("0.5"),
            whole: accepts("1"),
            boolean: accepts("true"),
            text: accepts("\"x\""),
            optional,
        }
    }
}

/// `Some(64)` as `64`.
fn unwrapped(old: &str) -> &str {
    old.strip_prefix("Some(")
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or(old)
        .trim()
}

/// A written-out value as an example: a long one by its head.
fn example(old: &str) -> String {
    let inner = unwrapped(old);
    match inner.find(['(', '[', '{', '\n']) {
        Some(i) => {
            let close = match &inner[i..i + 1] {
                "[" => "]",
                "{" => "}",
                _ => ")",
            };
            format!("{}...{close}", &inner[..=i])
        }
        None => inner.to_string(),
    }
}

/// ` like 64` where the old value is a number of the kind the field takes.
fn like(old: &str, kind: Num) -> String {
    let inner = unwrapped(old);
    match (number(inner), kind) {
        (Some(Num::Integer), Num::Integer) | (Some(_), Num::Fraction) => format!(" like {inner}"),
        _ => String::new(),
    }
}

enum Num {
    Integer,
    Fraction,
}

/// Whether `v` is written as a RON integer or as some other number.
fn number(v: &str) -> Option<Num> {
    let digits = v.strip_prefix(['-', '+']).unwrap_or(v);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
        Some(Num::Integer)
    } else if matches!(digits, "inf" | "NaN")
        || (v.parse::<f64>().is_ok()
            && v.starts_with(|c: char| c.is_ascii_digit() || "+-.".contains(c)))
    {
        Some(Num::Fraction)
    } else {
        None
    }
}

/// A value as errors quote it: a long one cut short.
fn shown(v: &str) -> String {
    const MAX: usize = 40;
    if v.chars().count() <= MAX {
        v.to_string()
    } else {
        format!("{}...", v.chars().take(MAX).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp() -> Source {
        let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/mlp.ron");
        parse(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn set(s: &[&str]) -> Result<Source, Error> {
        let o: Vec<Override> = s.iter().map(|x| Override::parse(x).unwrap()).collect();
        apply(&mlp(), &o)
    }

    #[test]
    fn overrides_change_fields_and_defaults() {
        let s = set(&["train.batch_size=256", "train.seed=7"]).unwrap();
        assert_eq!(s.experiment.train.batch_size, 256);
        assert_eq!(s.experiment.train.seed, 7);
        // Everything else is as the file says.
        let base = mlp();
        assert_eq!(
            format!("{:?}", s.experiment.model),
            format!("{:?}", base.experiment.model)
        );
        // A field the file leaves at its default can be set too, an optional one as well.
        let s = set(&["train.drop_last=true", "train.steps=5", "train.epochs=None"]).unwrap();
        assert!(s.experiment.train.drop_last);
        assert_eq!(s.experiment.train.steps, Some(5));
    }

    #[test]
    fn overrides_are_type_checked_and_named_in_errors() {
        let e = set(&["train.batch_size=lots"]).unwrap_err().to_string();
        assert!(e.contains("--set train.batch_size=lots"), "{e}");
        let e = set(&["train.batch_sise=3"]).unwrap_err();
        let d = &e.diagnostics()[0];
        assert!(
            d.message.contains("no field `train.batch_sise`"),
            "{}",
            d.message
        );
        assert!(
            d.hint.as_deref().unwrap_or("").contains("batch_size"),
            "{d:?}"
        );
        assert!(Override::parse("optimizer.lr").is_err());
    }

    #[test]
    fn params_entries_and_budgets_are_set_like_the_flags() {
        // A `params` map entry (its span starts at the quoted key).
        let s = set(&["params.hidden=64"]).unwrap();
        assert_eq!(
            s.experiment.params.get("hidden").map(|d| d.text()),
            Some("64".to_string())
        );
        // `steps` replaces the file's `epochs`, as `--steps` does; and the reverse.
        let s = set(&["train.steps=5"]).unwrap();
        assert_eq!(
            (s.experiment.train.steps, s.experiment.train.epochs),
            (Some(5), None)
        );
        let s = apply(&s, &[Override::parse("train.epochs=2").unwrap()]).unwrap();
        assert_eq!(
            (s.experiment.train.steps, s.experiment.train.epochs),
            (None, Some(2))
        );
        // Both given: the experiment's own rule refuses them.
        let e = set(&["train.steps=5", "train.epochs=2"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.epochs=2") && e.contains("not both"),
            "{e}"
        );
    }
}
