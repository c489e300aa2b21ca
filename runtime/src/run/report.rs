//! `parallax report` and `parallax diff`: the plots, page and tables of the run directories
//! `parallax train` writes (read by `crate::run::read`, compared by
//! `parallax_compiler::dsl::compare`).

use crate::run::read::{self, Points, ReadError};
use parallax_compiler::dsl::compare::{self, Written};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use serde_json::{Map, Value};
use std::fmt::Display;
use std::path::{Path, PathBuf};

/// The metrics `diff` prints side by side, in this order.
const DIFF_METRICS: &str =
    "final_train_loss val_loss val_accuracy steps wall_seconds samples_per_sec";

/// Above this many points a training-loss curve is averaged into buckets: the SVG (inlined
/// into the HTML) stays small for long runs, and a mean reads better than raw noise anyway.
const MAX_POINTS: usize = 1500;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("no run folders given")]
    NoRuns,
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{path}: {what}")]
    At { path: String, what: String },
}

fn fail(path: &Path, what: impl Display) -> ReportError {
    ReportError::At {
        path: path.display().to_string(),
        what: what.to_string(),
    }
}

/// One run directory, read.
struct Run {
    dir: PathBuf,
    label: String,
    summary: Map<String, Value>,
    /// `(step, value)` points of the training loss, validation loss and validation accuracy.
    curves: [Points; 3],
}

/// Names runs by their folder; when two folders share a name, by the experiment name and
/// the path as given, and by position as a last resort (the same folder twice).
fn labels(dirs: &[&Path], summaries: &[Map<String, Value>]) -> Vec<String> {
    let folder = |d: &Path| {
        let d = d.canonicalize().unwrap_or_else(|_| d.to_path_buf());
        let name = d.file_name().map(|n| n.to_string_lossy().into_owned());
        name.unwrap_or_else(|| d.display().to_string())
    };
    let folders: Vec<String> = dirs.iter().map(|d| folder(d)).collect();
    let unique = |all: &[String], s: &String| all.iter().filter(|x| *x == s).count() == 1;
    let mut out: Vec<String> = (0..dirs.len())
        .map(|i| match summaries[i].get("name").and_then(Value::as_str) {
            _ if unique(&folders, &folders[i]) => folders[i].clone(),
            Some(name) => format!("{name} ({})", dirs[i].display()),
            None => dirs[i].display().to_string(),
        })
        .collect();
    let named = out.clone();
    for (i, label) in out.iter_mut().enumerate() {
        if !unique(&named, label) {
            *label = format!("{label} [{}]", i + 1);
        }
    }
    out
}

/// A number to about 4 significant digits, without trailing zeros; other values as JSON.
fn fmt_value(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Number(n) if n.is_f64() => fmt_f64(n.as_f64().unwrap_or(f64::NAN)),
        v => v.to_string(),
    }
}

fn fmt_f64(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return x.to_string();
    }
    if x.abs() < 1e-4 {
        return format!("{x:.3e}");
    }
    let decimals = (3 - x.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{x:.decimals$}");
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// Run colours (Tableau 10): distinct, and all legible on white.
const COLORS: [u32; 10] = [
    0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728, 0x9467bd, 0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22,
    0x17becf,
];

fn color(run: usize) -> RGBColor {
    let [_, r, g, b] = COLORS[run % COLORS.len()].to_be_bytes();
    RGBColor(r, g, b)
}

/// One curve of a chart.
struct Series<'a> {
    label: String,
    points: &'a [(f64, f64)],
    style: ShapeStyle,
    /// Marker radius in pixels (0: a plain line).
    marker: u32,
}

/// Averages consecutive points into at most `max` buckets.
fn thin(points: &[(f64, f64)], max: usize) -> Points {
    if points.len() <= max {
        return points.to_vec();
    }
    let chunks = points.chunks(points.len().div_ceil(max));
    let mean = |c: &[(f64, f64)]| {
        let (x, y) = c.iter().fold((0.0, 0.0), |(x, y), p| (x + p.0, y + p.1));
        (x / c.len() as f64, y / c.len() as f64)
    };
    chunks.map(mean).collect()
}

/// The lowest and highest values of the points, widened when they are equal.
fn bounds<'a>(points: impl Iterator<Item = &'a (f64, f64)>) -> Option<(f64, f64)> {
    let (lo, hi) = points.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let pad = |v: f64| v.abs().max(1e-3) * 0.1;
    match (lo.is_finite(), lo < hi) {
        (false, _) => None,
        (true, true) => Some((lo, hi)),
        (true, false) => Some((lo - pad(lo), hi + pad(hi))),
    }
}

/// Draws the series on shared axes into an SVG string. Generic over the y axis so that
/// losses can use a logarithmic one and accuracy a linear one.
fn chart<Y>(
    (title, y_desc): (&str, &str),
    legend: SeriesLabelPosition,
    x_max: f64,
    y: Y,
    series: &[Series],
) -> Result<String, String>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut svg = String::new();
    let draw = |svg: &mut String| -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = SVGBackend::with_string(svg, (900, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, y)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .x_label_formatter(&|x| fmt_f64(*x))
            .y_label_formatter(&|y| fmt_f64(*y))
            .draw()?;
        for s in series.iter().filter(|s| !s.points.is_empty()) {
            let style = s.style;
            let line = LineSeries::new(s.points.iter().copied(), style).point_size(s.marker);
            chart
                .draw_series(line)?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        }
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw(&mut svg).map_err(|e| e.to_string())?;
    Ok(svg)
}

/// `loss.svg`: each run's training loss per step (thin) and validation loss at each epoch
/// end (thick, with markers), in the run's colour. Logarithmic when every loss is positive:
/// the late part of training, where runs differ, is otherwise squashed near zero.
fn loss_chart(runs: &[Run], x_max: f64) -> Result<String, String> {
    let thinned: Vec<Points> = runs
        .iter()
        .map(|r| thin(&r.curves[0], MAX_POINTS))
        .collect();
    let mut series = Vec::new();
    for (i, (run, loss)) in runs.iter().zip(&thinned).enumerate() {
        series.push(Series {
            label: format!("{} train", run.label),
            points: loss,
            style: color(i).mix(0.5).stroke_width(1),
            marker: 0,
        });
        series.push(Series {
            label: format!("{} validation", run.label),
            points: &run.curves[1],
            style: color(i).stroke_width(3),
            marker: 3,
        });
    }
    let (lo, hi) = bounds(series.iter().flat_map(|s| s.points)).unwrap_or((0.0, 1.0));
    // Losses fall: the upper right is clear of the curves.
    let legend = SeriesLabelPosition::UpperRight;
    if lo > 0.0 {
        let y = (lo * 0.9..hi * 1.1).log_scale();
        chart(("Loss", "loss (log scale)"), legend, x_max, y, &series)
    } else {
        chart(("Loss", "loss"), legend, x_max, lo..hi, &series)
    }
}

/// `accuracy.svg`: validation accuracy per step; `None` when no run measured any.
fn accuracy_chart(runs: &[Run], x_max: f64) -> Option<Result<String, String>> {
    let series: Vec<Series> = (runs.iter().enumerate())
        .map(|(i, run)| Series {
            label: run.label.clone(),
            points: &run.curves[2],
            style: color(i).stroke_width(2),
            marker: 3,
        })
        .collect();
    let (lo, hi) = bounds(series.iter().flat_map(|s| s.points))?;
    let pad = (hi - lo) * 0.05;
    // Accuracy rises: the lower right is clear of the curves.
    let (titles, legend) = (
        ("Validation accuracy", "accuracy"),
        SeriesLabelPosition::LowerRight,
    );
    Some(chart(titles, legend, x_max, lo - pad..hi + pad, &series))
}

fn escape(s: &str) -> String {
    (s.replace('&', "&amp;").replace('<', "&lt;"))
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The order of `train`'s summary fields (`serde_json` reads objects sorted by key).
const SUMMARY_ORDER: &str = "name steps epochs final_train_loss val_loss val_accuracy \
    samples_per_sec step_time_ms_median data_wait_seconds data_wait_share data_samples_read wall_seconds parameters seed backend run_id resumed_from";

/// The summaries side by side: one row per field (the known ones first, in `train`'s order,
/// then any others by name), one column per run.
fn summary_table(runs: &[Run]) -> String {
    let row = |head: &str, tag: &str, cells: Vec<String>| {
        let cells: String = (cells.iter())
            .map(|c| format!("<{tag}>{}</{tag}>", escape(c)))
            .collect();
        format!("<tr><th>{}</th>{cells}</tr>\n", escape(head))
    };
    let mut html = String::from("<table class=\"summary\">\n");
    html += &row("", "th", runs.iter().map(|r| r.label.clone()).collect());
    let folders = runs.iter().map(|r| r.dir.display().to_string());
    html += &row("folder", "td", folders.collect());
    let rank = |k: &str| SUMMARY_ORDER.split(' ').position(|o| o == k);
    let mut keys: Vec<&String> = runs.iter().flat_map(|r| r.summary.keys()).collect();
    keys.sort_by_key(|k| (rank(k).unwrap_or(usize::MAX), *k));
    keys.dedup();
    for key in keys {
        let cell = |r: &Run| fmt_value(r.summary.get(key).unwrap_or(&Value::Null));
        html += &row(key, "td", runs.iter().map(cell).collect());
    }
    html + "</table>\n"
}

const STYLE: &str = "body{font-family:sans-serif;margin:2em;color:#222}\
table.summary{border-collapse:collapse}\
.summary td,.summary th{border:1px solid #ccc;padding:4px 10px;text-align:right}\
.summary th{background:#f4f4f4}.summary tr>th:first-child{text-align:left}\
svg{display:block;max-width:100%;height:auto;margin:1em 0}";

/// Writes `loss.svg`, `accuracy.svg` (for runs with an accuracy) and `report.html` (the
/// summaries side by side and the plots inlined) for `runs` into `out` (default: the first
/// run's folder); returns the files written.
pub fn report(runs: &[PathBuf], out: Option<&Path>) -> Result<Vec<PathBuf>, ReportError> {
    let Some(first) = runs.first() else {
        return Err(ReportError::NoRuns);
    };
    let summaries = (runs.iter().map(|d| read::summary(d))).collect::<Result<Vec<_>, _>>()?;
    let dirs: Vec<&Path> = runs.iter().map(PathBuf::as_path).collect();
    let labels = labels(&dirs, &summaries);
    let mut loaded = Vec::new();
    for ((dir, summary), label) in runs.iter().zip(summaries).zip(labels) {
        let (dir, curves) = (dir.clone(), read::curves(dir)?);
        loaded.push(Run {
            dir,
            label,
            summary,
            curves,
        });
    }
    let out = out.unwrap_or(first);
    if out.exists() && !out.is_dir() {
        return Err(fail(out, "not a folder"));
    }
    std::fs::create_dir_all(out).map_err(|e| fail(out, e))?;

    // One x axis for both plots: the last step of any run.
    let x_max =
        (loaded.iter().flat_map(|r| r.curves.iter().flatten())).fold(1.0, |m, p| p.0.max(m));
    let failed = |e: String| fail(out, format_args!("drawing the plots: {e}"));
    let mut plots = vec![(
        "loss.svg",
        "Loss",
        loss_chart(&loaded, x_max).map_err(failed)?,
    )];
    if let Some(svg) = accuracy_chart(&loaded, x_max) {
        plots.push(("accuracy.svg", "Validation accuracy", svg.map_err(failed)?));
    }

    let names: Vec<String> = loaded.iter().map(|r| escape(&r.label)).collect();
    let mut html = format!(
        "<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n\
         <title>Parallax report: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n\
         <h1>Parallax report</h1>\n<h2>Summaries</h2>\n{}",
        names.join(", "),
        summary_table(&loaded)
    );
    let mut written = Vec::new();
    for (file, title, svg) in &plots {
        let path = out.join(file);
        std::fs::write(&path, svg).map_err(|e| fail(&path, e))?;
        written.push(path);
        // The plots are inlined too, so that the page is one self-contained file.
        html += &format!("<h2>{title}</h2>\n{svg}\n");
    }
    let path = out.join("report.html");
    std::fs::write(&path, html + "</body>\n</html>\n").map_err(|e| fail(&path, e))?;
    written.push(path);
    Ok(written)
}

/// What differs between two runs: their experiments' changes, then their summaries' metrics
/// side by side.
pub fn diff(a: &Path, b: &Path) -> Result<String, ReportError> {
    // Summaries first: they also check that each folder exists, which names the folder
    // rather than a file in it when a path is wrong.
    let summaries = [read::summary(a)?, read::summary(b)?];
    let (path_a, path_b) = (a.join("experiment.ron"), b.join("experiment.ron"));
    let (text_a, text_b) = (read::read(&path_a)?, read::read(&path_b)?);
    let exp_a = Written::scan(&text_a).map_err(|e| fail(&path_a, e))?;
    let exp_b = Written::scan(&text_b).map_err(|e| fail(&path_b, e))?;
    let changes = compare::changes(&exp_a, &exp_b);
    let mut lines: Vec<String> = changes.iter().map(ToString::to_string).collect();
    if lines.is_empty() {
        lines.push("experiments are identical".into());
    }

    let names = labels(&[a, b], &summaries);
    let mut rows = vec![[String::new(), names[0].clone(), names[1].clone()]];
    for key in DIFF_METRICS.split(' ') {
        let cell = |s: &Map<String, Value>| fmt_value(s.get(key).unwrap_or(&Value::Null));
        rows.push([key.into(), cell(&summaries[0]), cell(&summaries[1])]);
    }
    let width = |c: usize| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0);
    let (w0, w1) = (width(0), width(1));
    let mut text = lines.join("\n") + "\n\n";
    for [key, va, vb] in &rows {
        text += format!("{key:<w0$}  {va:<w1$}  {vb}").trim_end();
        text += "\n";
    }
    Ok(text)
}
