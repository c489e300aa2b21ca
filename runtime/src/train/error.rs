//! Why a training run stopped.

use crate::data::DataError;
use crate::exec::ExecError;
use crate::run::weights::WeightsError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Model(String),
    /// The ranks of a job do not agree on what they run.
    #[error("{0}")]
    Ranks(String),
    /// Training step `step` failed: its kernels, or a collective with the other ranks.
    #[error("training step {step}: {source}")]
    Step { step: u64, source: ExecError },
    /// A NaN or an infinity in the loss, a gradient, a parameter or a state after step
    /// `step` (or in the validation loss after epoch `epoch`). The data are checked finite
    /// when loaded, so the model diverged.
    #[error("{}: {what}; the data were checked finite when loaded, so the model diverged: lower the learning rate (now {}) or clip gradients (set `clip_norm`)", at(*.step, *.epoch), number(*.lr))]
    NonFinite {
        step: u64,
        epoch: Option<u64>,
        what: String,
        lr: f32,
    },
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    #[error(transparent)]
    Checkpoint(#[from] crate::run::checkpoint::CheckpointError),
    /// The plan's buffers would not fit in the machine's memory (checked before allocating).
    #[error(transparent)]
    Memory(#[from] crate::exec::host_memory::TooLarge),
    #[error(transparent)]
    RunDir(#[from] crate::run::dir::RunDirError),
    #[error(transparent)]
    Resume(#[from] crate::run::resume::ResumeError),
    /// A resumed run that had already finished: its final weights and summary are written.
    #[error("{dir}: the run finished: its {steps} steps are all done (final.safetensors and summary.json are written); ask for more with --steps N, N > {steps}")]
    Finished { dir: String, steps: u64 },
    /// A signal asked the run to stop: it finished its step and saved where it stood.
    #[error("stopped by {} after step {step} of {total}; its state is in {checkpoint}; continue with `parallax train --resume {dir}`", signal_name(*signal))]
    Interrupted {
        signal: usize,
        step: u64,
        total: u64,
        checkpoint: String,
        dir: String,
    },
}

/// `SIGINT`, `SIGTERM` or the number.
pub fn signal_name(signal: usize) -> String {
    match signal {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// A learning rate as the user would write it: `0.005`, `100`, `1e38`.
fn number(x: f32) -> String {
    if x != 0.0 && !(1e-4..1e6).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// Where a [`TrainError::NonFinite`] was found.
fn at(step: u64, epoch: Option<u64>) -> String {
    match epoch {
        Some(e) => format!("the validation after epoch {e} (step {step})"),
        None => format!("step {step}"),
    }
}

/// What a [`TrainError::NonFinite`] of a training step names: the loss, and the first tensor
/// holding a non-finite value.
pub(super) fn non_finite(loss: f32, tensor: Option<crate::exec::finite::NonFinite>) -> String {
    match (loss.is_finite(), tensor) {
        (true, Some(t)) => format!(
            "{t} went non-finite, which the loss ({}) does not show",
            number(loss)
        ),
        (false, Some(t)) => format!("the loss is {loss}, and {t} went non-finite"),
        (_, None) => format!("the loss is {loss}"),
    }
}
