//! `train`'s progress on stderr: a bar on a terminal, else the log's (`train::say::Log`).

use indicatif::{ProgressBar, ProgressStyle};
use parallax_runtime::train::{say, Event};

/// The run's progress on stderr: a bar on a terminal, else the log's lines; rank 0 speaks
/// for a job.
pub(crate) struct Progress {
    pub log: say::Log,
    pub lead: bool,
    pub terminal: bool,
    pub bar: Option<ProgressBar>,
}

impl Progress {
    pub(crate) fn on_event(&mut self, e: &Event) {
        // The job's other ranks train silently.
        if !self.lead {
            return;
        }
        let line = self.log.line(e);
        match (e, &self.bar) {
            (Event::Start { total_steps, .. }, _) => {
                errln!("{}", line.unwrap_or_default());
                if self.terminal {
                    let b = ProgressBar::new(*total_steps);
                    let style = "{bar:30} {pos}/{len} steps  {msg}  eta {eta}";
                    b.set_style(ProgressStyle::with_template(style).expect("a valid template"));
                    self.bar = Some(b);
                }
            }
            (
                Event::Step {
                    step,
                    loss,
                    samples_per_sec,
                    ..
                },
                Some(b),
            ) => {
                b.set_position(*step);
                b.set_message(format!("loss {loss:.4}  {samples_per_sec:.0} samples/s"));
            }
            (_, Some(b)) => line.into_iter().for_each(|l| b.println(l)),
            (_, None) => line.into_iter().for_each(|l| errln!("{l}")),
        }
    }
}
