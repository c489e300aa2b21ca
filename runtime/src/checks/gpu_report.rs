//! What `gpu-check` says: its progress and its verdict as lines, for the standard output
//! (`INTERP`, `LOCKSTEP`, `PROFILE` and the script's `ROW` lines) or the error stream (the
//! rest). The CLI only prints them.

use super::{Conformance, InterpreterRow, Progress};
use std::collections::BTreeMap;

/// A line and where it goes.
pub enum Line {
    Out(String),
    Err(String),
}

/// The check's report for the experiment `name`, built as the check goes.
#[derive(Default)]
pub struct Report {
    name: String,
    precision: &'static str,
    /// Per kernel family: kernels, kernels bit-equal to the interpreter, largest ulp apart,
    /// largest difference over the tensor's largest magnitude.
    families: BTreeMap<&'static str, (usize, usize, u64, f64)>,
}

impl Report {
    pub fn new(name: &str, precision: &'static str) -> Report {
        Report {
            name: name.to_string(),
            precision,
            ..Report::default()
        }
    }

    /// What one event of the check says, if anything.
    pub fn progress(&mut self, p: Progress) -> Option<Line> {
        let (name, prec) = (&self.name, self.precision);
        Some(match p {
            Progress::Interpreter(r) => return self.interpreter(r),
            Progress::Started {
                kernels,
                target,
                batch,
            } => Line::Err(format!(
                "{name}: {kernels} kernels, PTX for {target}, {prec}, batch {batch}"
            )),
            Progress::Step {
                step,
                cpu_loss,
                gpu_loss,
                difference: d,
            } => Line::Err(format!(
                "step {step}: loss cpu {cpu_loss:.7} cuda {gpu_loss:.7} (relative difference {d:.2e})"
            )),
            Progress::Mismatch(m) => Line::Out(format!(
                "LOCKSTEP kernel {} ({:?}: {}) step {} `{}` in `{}`: relative difference {:.2e}; first values cpu {:?} cuda {:?}",
                m.kernel,
                m.kind,
                m.ops.join(" -> "),
                m.step,
                m.op,
                m.layer,
                m.difference,
                m.cpu,
                m.gpu,
            )),
        })
    }

    /// Counts the kernel in its family; a line only for a kernel that differs.
    fn interpreter(&mut self, r: InterpreterRow) -> Option<Line> {
        let f = self.families.entry(r.family).or_default();
        let equal = r.differing == 0 && r.failed.is_none();
        f.0 += 1;
        f.1 += usize::from(equal);
        f.2 = f.2.max(r.max_ulp);
        f.3 = f.3.max(r.max_scaled);
        if equal {
            return None;
        }
        Some(Line::Out(format!(
            "INTERP kernel {} ({}: {}) {}/{} values differ from the interpreter's in bits, largest {} ulp, {:.1e} of the largest value{}{}",
            r.kernel,
            r.family,
            r.ops.join(" -> "),
            r.differing,
            r.elements,
            r.max_ulp,
            r.max_scaled,
            r.worst.map_or(String::new(), |(s, e, g, i)| format!(
                " (step {s} element {e}: GPU {g:e}, interpreter {i:e})"
            )),
            r.failed.map_or(String::new(), |m| format!("; interpreter: {m}"))
        )))
    }

    /// The verdict: the families, the profile, cuBLASLt's and CUDA graphs' notes, the
    /// differences and the script's `ROW` line.
    pub fn finish(&self, c: &Conformance) -> Vec<Line> {
        let (name, prec) = (&self.name, self.precision);
        let mut lines = Vec::new();
        for (family, (kernels, equal, ulp, scaled)) in &self.families {
            lines.push(Line::Out(format!("INTERP {family}: {equal} of {kernels} kernels bit-equal to the interpreter; largest {ulp} ulp apart, {scaled:.1e} of the largest value")));
        }
        if let Some(p) = &c.profile {
            let all = p.total_ms;
            lines.push(Line::Out(format!(
                "PROFILE {name}: {all:.2} ms in launches (one step, events around each launch)"
            )));
            for (label, ms, n) in p.kinds.iter().take(25) {
                let label: String = label.chars().take(70).collect();
                let share = 100.0 * ms / all.max(1e-9);
                lines.push(Line::Out(format!(
                    "PROFILE {ms:9.3} ms {share:5.1}% {n:5}x  {label}"
                )));
            }
        }
        if let Some((plans, fallbacks, refused)) = &c.cublaslt {
            lines.push(Line::Err(format!(
                "{name}: cuBLASLt ran {plans} GEMM shape(s); {fallbacks} went to cuBLAS"
            )));
            for r in refused {
                lines.push(Line::Err(format!("{name}: cuBLASLt refused {r}")));
            }
        }
        if let Some(graphs) = &c.cuda_graphs {
            lines.push(Line::Err(format!("{name}: CUDA graphs: {graphs}")));
        }
        let (worst, worst_d) = &c.worst_tensor;
        lines.push(Line::Err(format!(
            "{name}: largest relative difference of losses {:.2e}; parameters {:.2e} (whole vector, L2; largest per tensor {worst_d:.2e} in `{worst}`); tolerance {:.0e}",
            c.loss_difference, c.parameter_difference, c.tolerance
        )));
        let share = c
            .peak_percent
            .map_or("?".to_string(), |s| format!("{s:.1}%"));
        let (ld, pd) = match c.steps {
            0 => ("-".to_string(), "-".to_string()),
            _ => (
                format!("{:.2e}", c.loss_difference),
                format!("{:.2e}", c.parameter_difference),
            ),
        };
        // One machine-readable row for the script's table.
        lines.push(Line::Out(format!(
            "ROW|{name}|{prec}|{ld}|{pd}|{}|{:.3}|{:.2}|{share}",
            if c.ok() { "ok" } else { "FAIL" },
            c.median_step_ms,
            c.tflops
        )));
        lines
    }
}
