//! Checks on the sections that later stages execute (data, optimizer, train, devices): every
//! number in range, every combination meaningful. All problems are reported at once.

use super::ast::{Data, Experiment, Loss, Normalize, Optimizer, Schedule, DEVICE_KINDS};
use super::spans::Path;
use super::Source;
use crate::diag::{suggest, Diagnostic};
use crate::path;

struct Checker<'a> {
    src: &'a Source,
    out: Vec<Diagnostic>,
}

impl Checker<'_> {
    fn fail(&mut self, path: Path, msg: impl Into<String>, hint: Option<String>) {
        let d = Diagnostic::new(msg, self.src.span(&path)).hint_opt(hint);
        self.out.push(d);
    }

    fn positive(&mut self, path: Path, what: &str, v: f64) {
        if !(v.is_finite() && v > 0.0) {
            self.fail(
                path,
                format!("{what} must be a positive number, got {v}"),
                None,
            );
        }
    }

    fn unit_interval(&mut self, path: Path, what: &str, v: f64) {
        if !(0.0..1.0).contains(&v) {
            self.fail(path, format!("{what} must be in [0, 1), got {v}"), None);
        }
    }

    fn non_negative(&mut self, path: Path, what: &str, v: f64) {
        if !(v.is_finite() && v >= 0.0) {
            self.fail(path, format!("{what} must be zero or more, got {v}"), None);
        }
    }

    fn count(&mut self, path: Path, what: &str, v: u64) {
        if v == 0 {
            self.fail(path, format!("{what} must be at least 1"), None);
        }
    }
}

pub fn validate(src: &Source) -> Vec<Diagnostic> {
    let mut c = Checker {
        src,
        out: Vec::new(),
    };
    let e: &Experiment = &src.experiment;
    if e.name.trim().is_empty() {
        c.fail(path!["name"], "the experiment needs a name", None);
    }
    loss(&mut c, &e.loss);
    data(&mut c, &e.data);
    optimizer(&mut c, &e.optimizer);

    let t = &e.train;
    c.count(path!["train", "batch_size"], "`batch_size`", t.batch_size);
    match (t.steps, t.epochs) {
        (Some(_), Some(_)) => c.fail(
            path!["train", "epochs"],
            "give `steps` or `epochs`, not both",
            None,
        ),
        (None, None) => c.fail(
            path!["train"],
            "the training budget is missing",
            Some("add `steps: N` or `epochs: N` to `train`".into()),
        ),
        (Some(s), None) => c.count(path!["train", "steps"], "`steps`", s),
        (None, Some(ep)) => c.count(path!["train", "epochs"], "`epochs`", ep),
    }

    let d = &e.devices;
    if d.gpus == 0 || d.gpus > 65536 {
        c.fail(
            path!["devices", "gpus"],
            format!("`gpus` must be between 1 and 65536, got {}", d.gpus),
            None,
        );
    }
    if d.nodes == 0 || !d.gpus.is_multiple_of(d.nodes.max(1)) {
        c.fail(
            path!["devices", "nodes"],
            format!("{} GPUs do not split evenly over {} nodes", d.gpus, d.nodes),
            None,
        );
    }
    if !(d.gradient_bucket_mb >= 0.0 && d.gradient_bucket_mb.is_finite()) {
        c.fail(
            path!["devices", "gradient_bucket_mb"],
            format!(
                "`gradient_bucket_mb` must be a size in MiB, got {}",
                d.gradient_bucket_mb
            ),
            Some("0 all-reduces each gradient on its own".into()),
        );
    }
    if d.micro_shards == 0 || d.micro_shards > 65536 {
        c.fail(
            path!["devices", "micro_shards"],
            format!(
                "`micro_shards` must be between 1 and 65536, got {}",
                d.micro_shards
            ),
            Some("a batch smaller than it splits into one-sample shards".into()),
        );
    }
    if !DEVICE_KINDS.contains(&d.kind.as_str()) {
        c.fail(
            path!["devices", "kind"],
            format!("unknown device kind `{}`", d.kind),
            Some(suggest(
                &d.kind,
                "device kinds",
                DEVICE_KINDS.iter().copied(),
            )),
        );
    }
    c.out
}

fn loss(c: &mut Checker, l: &Loss) {
    if let Loss::CrossEntropy {
        label_smoothing, ..
    } = l
    {
        c.unit_interval(
            path!["loss", "label_smoothing"],
            "`label_smoothing`",
            *label_smoothing,
        );
    }
}

fn data(c: &mut Checker, d: &Data) {
    for (f, v) in d.files() {
        if v.trim().is_empty() {
            c.fail(path!["data", f], format!("`{f}` needs a file path"), None);
        }
    }
    let validation = match d {
        Data::Digits { validation }
        | Data::Idx { validation, .. }
        | Data::Csv { validation, .. }
        | Data::Npy { validation, .. } => *validation,
        Data::Tokens {
            validation_windows, ..
        } => {
            c.count(
                path!["data", "validation_windows"],
                "`validation_windows`",
                *validation_windows,
            );
            0.0
        }
        Data::ImageFolder {
            validation,
            validation_split,
            resize,
            normalize,
            ..
        } => {
            image_folder(
                c,
                validation.is_some(),
                *validation_split,
                *resize,
                normalize,
            );
            validation_split.unwrap_or(0.0)
        }
        Data::Blobs {
            samples,
            classes,
            features,
            std,
            validation,
        } => {
            c.count(path!["data", "samples"], "`samples`", *samples);
            c.count(path!["data", "features"], "`features`", *features);
            if *classes < 2 {
                c.fail(
                    path!["data", "classes"],
                    "`classes` must be at least 2",
                    None,
                );
            }
            c.positive(path!["data", "std"], "`std`", *std);
            *validation
        }
        Data::Sequence {
            length,
            vocab,
            samples,
            validation,
            ..
        } => {
            c.count(path!["data", "length"], "`length`", *length);
            c.count(path!["data", "samples"], "`samples`", *samples);
            if *vocab < 2 {
                c.fail(path!["data", "vocab"], "`vocab` must be at least 2", None);
            }
            *validation
        }
        Data::Synthetic {
            samples,
            validation,
        } => {
            c.count(path!["data", "samples"], "`samples`", *samples);
            *validation
        }
    };
    let field = match d {
        Data::ImageFolder { .. } => "validation_split",
        _ => "validation",
    };
    c.unit_interval(path!["data", field], "the validation fraction", validation);
}

fn image_folder(
    c: &mut Checker,
    folder: bool,
    split: Option<f64>,
    resize: Option<u64>,
    normalize: &Option<Normalize>,
) {
    if folder && split.is_some() {
        c.fail(
            path!["data", "validation_split"],
            "give a `validation` folder or a `validation_split` of `train`, not both",
            None,
        );
    }
    if let Some(r) = resize {
        c.count(path!["data", "resize"], "`resize`", r);
    }
    let Some(n) = normalize else { return };
    if n.mean.len() != n.std.len() || n.mean.is_empty() {
        c.fail(
            path!["data", "normalize"],
            format!(
                "`normalize` needs one mean and one std per channel, got {} and {}",
                n.mean.len(),
                n.std.len()
            ),
            None,
        );
    }
    for (i, s) in n.std.iter().enumerate() {
        c.positive(path!["data", "normalize", "std", i], "a `std`", *s);
    }
    for (i, m) in n.mean.iter().enumerate() {
        if !m.is_finite() {
            c.fail(
                path!["data", "normalize", "mean", i],
                format!("a `mean` must be finite, got {m}"),
                None,
            );
        }
    }
}

fn optimizer(c: &mut Checker, o: &Optimizer) {
    let p = |f: &str| path!["optimizer", f];
    match o {
        Optimizer::Sgd {
            momentum, nesterov, ..
        } => {
            c.unit_interval(p("momentum"), "`momentum`", *momentum);
            if *nesterov && *momentum == 0.0 {
                c.fail(
                    p("nesterov"),
                    "Nesterov momentum needs `momentum` above 0",
                    Some("set e.g. `momentum: 0.9`".into()),
                );
            }
        }
        Optimizer::Adam { betas, eps, .. } | Optimizer::AdamW { betas, eps, .. } => {
            c.unit_interval(p("betas"), "beta1", betas.0);
            c.unit_interval(p("betas"), "beta2", betas.1);
            c.positive(p("eps"), "`eps`", *eps);
        }
    }
    let lr = &o.lr();
    c.positive(p("lr"), "the learning rate `lr`", *lr);
    c.non_negative(p("weight_decay"), "`weight_decay`", o.weight_decay());
    if let Some(clip) = o.clip_norm() {
        c.positive(p("clip_norm"), "`clip_norm`", clip);
    }
    let s = |f: &str| path!["optimizer", "schedule", f];
    match o.schedule() {
        Schedule::Constant | Schedule::Warmup { .. } => {}
        Schedule::Step { every, gamma } => {
            c.count(s("every"), "`every`", *every);
            c.positive(s("gamma"), "`gamma`", *gamma);
        }
        Schedule::Cosine { min_lr, .. } => {
            c.non_negative(s("min_lr"), "`min_lr`", *min_lr);
            // Only against a valid `lr`: a bad one is reported already.
            if *lr > 0.0 && min_lr > lr {
                c.fail(
                    s("min_lr"),
                    format!("`min_lr` {min_lr} is above `lr` {lr}"),
                    None,
                );
            }
        }
        Schedule::Linear { end_lr, .. } => c.non_negative(s("end_lr"), "`end_lr`", *end_lr),
    }
}
