//! What `eval` and `predict` print: an evaluation as lines, predictions as CSV or JSON.

use super::eval::Evaluation;
use super::predict::Predictions;
use super::top_k;

impl Evaluation {
    /// The evaluation as `eval` prints it: what was evaluated, then a figure a line.
    pub fn text(&self) -> String {
        let what = match self.data.as_str() {
            "validation" => "the run's validation data",
            _ => "--data",
        };
        let tokens = self
            .tokens
            .map_or(String::new(), |t| format!(", {t} tokens"));
        let mut s = format!(
            "{} on {what}: {} samples{tokens} ({})\nloss        {:.6}\n",
            self.weights, self.samples, self.backend, self.loss
        );
        if let Some(p) = self.perplexity {
            s += &format!("perplexity  {p:.4}\n");
        }
        if let Some(a) = self.accuracy {
            s += &format!("accuracy    {:.2}%\n", a * 100.0);
        }
        if let Some(a) = self.top5.filter(|_| self.tokens.is_none()) {
            s += &format!("top-5       {:.2}%\n", a * 100.0);
        }
        s
    }
}

impl Predictions {
    /// A row per input (`names`): the `k` likeliest classes and their probabilities, named
    /// by `classes` where the run has names, or a regression's outputs.
    pub fn csv(&self, names: &[String], k: usize, classes: Option<&[String]>) -> String {
        let k = k.min(self.per);
        let header: Vec<String> = match self.classifier {
            true => (1..=k)
                .flat_map(|i| [format!("label_{i}"), format!("probability_{i}")])
                .collect(),
            false => (0..self.per).map(|i| format!("output_{i}")).collect(),
        };
        let mut s = format!("input,{}\n", header.join(","));
        for (name, row) in names.iter().zip(self.values.chunks(self.per)) {
            let cells: Vec<String> = match self.classifier {
                true => top_k(row, k)
                    .iter()
                    .flat_map(|&c| [csv_cell(&label(classes, c)), format!("{:.6}", row[c])])
                    .collect(),
                false => row.iter().map(|v| v.to_string()).collect(),
            };
            s += &format!("{},{}\n", csv_cell(name), cells.join(","));
        }
        s
    }

    /// The same as a JSON list of objects.
    pub fn json(
        &self,
        names: &[String],
        k: usize,
        classes: Option<&[String]>,
    ) -> serde_json::Value {
        let rows = names.iter().zip(self.values.chunks(self.per));
        let list = rows.map(|(name, row)| match self.classifier {
            true => {
                let top = top_k(row, k).into_iter().map(|c| {
                    let label = label(classes, c);
                    serde_json::json!({ "class": c, "label": label, "probability": row[c] })
                });
                serde_json::json!({ "input": name, "top": top.collect::<Vec<_>>() })
            }
            false => serde_json::json!({ "input": name, "output": row }),
        });
        serde_json::Value::Array(list.collect())
    }
}

/// Class `c`'s name, or its number.
fn label(classes: Option<&[String]>, c: usize) -> String {
    classes
        .and_then(|n| n.get(c))
        .cloned()
        .unwrap_or_else(|| c.to_string())
}

/// A CSV cell, quoted when it holds a comma, a quote or a line break.
fn csv_cell(s: &str) -> String {
    match s.contains([',', '"', '\n']) {
        true => format!("\"{}\"", s.replace('"', "\"\"")),
        false => s.to_string(),
    }
}
