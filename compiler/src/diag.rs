//! Diagnostics: what went wrong, where in the user's file, and how to fix it.
//! The compiler builds them; the CLI alone prints them and picks exit codes.

use serde::Serialize;

/// A byte range in the source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }
}

/// A 1-based line and character column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Loc {
    pub line: usize,
    pub col: usize,
}

impl Loc {
    /// The line and column of byte offset `at` in `src` (clamped to the source).
    pub fn of(src: &str, at: usize) -> Loc {
        let mut at = at.min(src.len());
        while !src.is_char_boundary(at) {
            at -= 1;
        }
        let before = &src[..at];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        Loc {
            line,
            col: src[line_start..at].chars().count() + 1,
        }
    }

    /// The byte offset of this line and column in `src` (clamped).
    pub fn offset(self, src: &str) -> usize {
        let mut line_start = 0;
        for _ in 1..self.line {
            match src[line_start..].find('\n') {
                Some(i) => line_start += i + 1,
                None => return src.len(),
            }
        }
        let line_end = src[line_start..]
            .find('\n')
            .map_or(src.len(), |i| line_start + i);
        src[line_start..line_end]
            .char_indices()
            .nth(self.col.saturating_sub(1))
            .map_or(line_end, |(i, _)| line_start + i)
    }
}

/// One error about the user's file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnostic {
    pub message: String,
    pub span: Option<Span>,
    pub hint: Option<String>,
}

impl Diagnostic {
    pub fn new(message: impl Into<String>, span: Option<Span>) -> Self {
        Diagnostic {
            message: message.into(),
            span,
            hint: None,
        }
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    pub fn hint_opt(mut self, hint: Option<String>) -> Self {
        if hint.is_some() {
            self.hint = hint;
        }
        self
    }

    /// The location of the diagnostic in `src`, if it has one.
    pub fn loc(&self, src: &str) -> Option<Loc> {
        self.span.map(|s| Loc::of(src, s.start))
    }

    /// The diagnostic as `--format json` reports it.
    pub fn to_json(&self, file: &str, src: &str) -> serde_json::Value {
        let loc = self.loc(src);
        serde_json::json!({
            "file": file,
            "line": loc.map(|l| l.line),
            "col": loc.map(|l| l.col),
            "message": self.message,
            "hint": self.hint,
        })
    }

    /// `FILE:LINE:COL: error: MESSAGE`, the source line, a caret under the spot, then the hint.
    pub fn render(&self, file: &str, src: &str) -> String {
        let mut out = String::new();
        let Some(span) = self.span else {
            out.push_str(&format!("{file}: error: {}\n", self.message));
            if let Some(h) = &self.hint {
                out.push_str(&format!("  = hint: {h}\n"));
            }
            return out;
        };
        let loc = Loc::of(src, span.start);
        out.push_str(&format!(
            "{file}:{}:{}: error: {}\n",
            loc.line, loc.col, self.message
        ));
        let line_text = src.lines().nth(loc.line - 1).unwrap_or("");
        let gutter = loc.line.to_string().len();
        // Tabs are shown as spaces so the caret lines up.
        let shown: String = line_text
            .chars()
            .map(|c| if c == '\t' { ' ' } else { c })
            .collect();
        let line_chars = shown.chars().count();
        let end = Loc::of(src, span.end.max(span.start));
        let width = if end.line == loc.line && end.col > loc.col {
            end.col - loc.col
        } else {
            1
        };
        let width = width.min(line_chars.saturating_sub(loc.col - 1).max(1));
        out.push_str(&format!("{:gutter$} |\n", ""));
        out.push_str(&format!("{} | {}\n", loc.line, shown));
        out.push_str(&format!(
            "{:gutter$} | {}{}\n",
            "",
            " ".repeat(loc.col - 1),
            "^".repeat(width)
        ));
        if let Some(h) = &self.hint {
            out.push_str(&format!("{:gutter$} = hint: {h}\n", ""));
        }
        out
    }
}

/// Edit distance, for "did you mean" hints.
pub fn levenshtein(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(!ca.eq_ignore_ascii_case(cb));
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The closest candidate to `found`, if it is close enough to be a likely typo.
pub fn closest<'a>(found: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (found.chars().count() / 3).max(2);
    candidates
        .into_iter()
        .map(|c| (levenshtein(found, c), c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// `did you mean "X"?` when a candidate is close, else the list of valid ones.
pub fn suggest<'a>(
    found: &str,
    what: &str,
    candidates: impl IntoIterator<Item = &'a str> + Clone,
) -> String {
    match closest(found, candidates.clone()) {
        Some(c) => format!("did you mean `{c}`?"),
        None => {
            let all: Vec<String> = candidates.into_iter().map(|c| format!("`{c}`")).collect();
            if all.is_empty() {
                format!("no {what} is defined here")
            } else {
                format!("valid {what}: {}", all.join(", "))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loc_round_trips() {
        let src = "ab\ncdé\nf";
        for at in 0..src.len() {
            if src.is_char_boundary(at) {
                assert_eq!(Loc::of(src, at).offset(src), at);
            }
        }
        assert_eq!(Loc::of(src, 4), Loc { line: 2, col: 2 });
    }

    #[test]
    fn render_has_caret() {
        let src = "a\n  Linaer(out: 3)\n";
        let d = Diagnostic::new("unknown layer `Linaer`", Some(Span::new(4, 10)))
            .with_hint("did you mean `Linear`?");
        let r = d.render("f.ron", src);
        assert!(r.starts_with("f.ron:2:3: error: unknown layer `Linaer`\n"));
        assert!(r.contains("2 |   Linaer(out: 3)\n  |   ^^^^^^\n"), "{r}");
        assert!(r.contains("hint: did you mean `Linear`?"));
    }

    #[test]
    fn suggestions() {
        assert_eq!(closest("Linaer", ["Linear", "Conv2d"]), Some("Linear"));
        assert_eq!(closest("xyz", ["Linear", "Conv2d"]), None);
    }
}
