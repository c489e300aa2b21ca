//! The run directory and everything in it: `dir` the folder itself (refusals, the lock, stale
//! temporaries), `atomic` files written whole or not at all, `record` the typed `run.json`,
//! `checkpoint` and `resume` checkpoints and what a continuation may take, `weights`
//! safetensors, `tensorboard` the event files, `read` reading `summary.json` and
//! `metrics.jsonl` back, `report` the `report` page and `diff` table of run folders.

pub mod atomic;
pub mod checkpoint;
pub mod dir;
pub mod read;
pub mod record;
pub mod report;
pub mod resume;
pub mod tensorboard;
pub mod weights;
