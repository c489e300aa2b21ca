//! `--set path=value` overrides: applied to the experiment written out with every default
//! (`to_ron`), then parsed again, so an override is type-checked exactly as the file is.

use super::spans::{Path, Seg, SpanTree};
use super::{parse, to_ron, Source};
use crate::diag::{suggest, Diagnostic};
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
        if path.is_empty() || value.is_empty() {
            return Err(format!(
                "`{s}`: expected PATH=VALUE, e.g. optimizer.lr=3e-4"
            ));
        }
        Ok(Override {
            path: path.to_string(),
            value: value.to_string(),
        })
    }
}

/// The experiment of `source` with the overrides applied: its text (every default written out,
/// then the overrides) and the parsed result. Errors name the override.
pub fn apply(source: &Source, overrides: &[Override]) -> Result<Source, Error> {
    let text = to_ron(&source.experiment);
    let tree = SpanTree::scan(&text);
    let mut edits = Vec::new();
    for o in overrides {
        let path = Path(
            o.path
                .split('.')
                .map(|p| match p.parse::<usize>() {
                    Ok(i) => Seg::Index(i),
                    Err(_) => Seg::Name(p.to_string()),
                })
                .collect(),
        );
        let span = tree.find_exact(&path).map_err(|names| {
            let last = o.path.rsplit('.').next().unwrap_or(&o.path);
            Error::Syntax(
                Diagnostic::new(
                    format!("--set {}: the experiment has no field `{}`", o.path, o.path),
                    None,
                )
                .with_hint(suggest(
                    last,
                    "fields",
                    names.iter().map(String::as_str),
                )),
            )
        })?;
        // A field's span starts at its name: the value follows the colon.
        let mut span = span;
        if let Some(Seg::Name(n)) = path.0.last() {
            let t = &text[span.start..span.end];
            if let Some(rest) = t.strip_prefix(n.as_str()) {
                if let Some(after) = rest.trim_start().strip_prefix(':') {
                    span.start = span.end - after.trim_start().len();
                }
            }
        }
        let old = &text[span.start..span.end];
        let v = o.value.as_str();
        let value = if old.starts_with('"') && !v.starts_with('"') {
            // A string field takes a bare word as a string.
            format!("{v:?}")
        } else if (old == "None" || old.starts_with("Some("))
            && v != "None"
            && !v.starts_with("Some(")
        {
            // An optional field takes its value as `Some(value)`.
            format!("Some({v})")
        } else {
            v.to_string()
        };
        edits.push((span, value, o));
    }
    edits.sort_by_key(|e| std::cmp::Reverse(e.0.start));
    for w in edits.windows(2) {
        if w[1].0.end > w[0].0.start {
            return Err(Error::Syntax(Diagnostic::new(
                format!("--set {} and --set {} overlap", w[1].2.path, w[0].2.path),
                None,
            )));
        }
    }
    let mut out = text.clone();
    for (span, value, _) in &edits {
        out.replace_range(span.start..span.end, value);
    }
    parse(&out).map_err(|e| {
        let names: Vec<String> = overrides
            .iter()
            .map(|o| format!("{}={}", o.path, o.value))
            .collect();
        let d = e.diagnostics().into_iter().next().unwrap_or_else(|| {
            Diagnostic::new("the overrides do not make a valid experiment", None)
        });
        Error::Syntax(
            Diagnostic::new(
                format!("--set {}: {}", names.join(" --set "), d.message),
                None,
            )
            .with_hint(d.hint.unwrap_or_else(|| "check the value's type".into())),
        )
    })
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
}
