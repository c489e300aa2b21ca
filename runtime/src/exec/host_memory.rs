//! The host's memory, checked before a CPU run allocates anything: what the plan's buffers
//! need at its batch (every simulated device's, added up: they share this machine) against
//! what the machine has available. Refusing with the plan's table beats an allocator abort
//! halfway through, or the kernel killing the process.

use crate::exec::grid::Grid;
use parallax_compiler::plan::bytes;
use parallax_compiler::shards::{device_bytes, grid_bytes};
use parallax_compiler::Plan;

/// A plan that does not fit in the machine's memory: what it needs, what there is, the plan's
/// memory table, and what to change.
#[derive(Debug, thiserror::Error)]
#[error("{table}\n  = hint: {hint}")]
pub struct TooLarge {
    pub table: String,
    pub hint: String,
}

/// Refuses `plan`, run by one executor or by the simulated devices of `grid`, when the
/// machine's available memory cannot hold what they would allocate. Nothing is checked
/// where the available memory cannot be read.
pub fn check(plan: &Plan, grid: Option<Grid>) -> Result<(), TooLarge> {
    let needed = needed_bytes(plan, grid);
    let Some(available) = available_bytes().filter(|&m| needed > m) else {
        return Ok(());
    };
    let devices = grid.map_or(1, |g| g.devices());
    Err(TooLarge {
        table: refusal(plan, needed, available, devices),
        hint: if devices > 1 {
            "lower `train.batch_size`, or simulate fewer devices (`--gpus`)"
        } else {
            "lower `train.batch_size`, or make the model smaller"
        }
        .to_string(),
    })
}

/// What the host executors for `plan` allocate: one executor for the whole batch, or the
/// simulated devices of `grid`.
pub fn needed_bytes(plan: &Plan, grid: Option<Grid>) -> u64 {
    match grid {
        None => device_bytes(plan, 1, None),
        Some(g) => grid_bytes(plan, g.dp as u32, g.tp as u32)
            .into_iter()
            .fold(0u64, u64::saturating_add),
    }
}

/// A whole file's bytes, refused (as an out-of-memory I/O error naming both sizes) when the
/// file is larger than the memory the machine has available, rather than aborting halfway.
pub fn read_whole(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let len = std::fs::metadata(path)?.len();
    if let Some(available) = available_bytes().filter(|&a| len > a) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!(
                "the file is {}, more than the {} of memory this machine has available",
                bytes(len),
                bytes(available)
            ),
        ));
    }
    std::fs::read(path)
}

/// Bytes the machine can still give this process: the least of Linux's `MemAvailable`, what
/// is left under the process's address-space limit (`ulimit -v`) and under its cgroup's
/// memory limit (a container's). `None` where none can be read, and then nothing is checked.
pub fn available_bytes() -> Option<u64> {
    [meminfo(), address_space_left(), cgroup_left()]
        .into_iter()
        .flatten()
        .min()
}

/// The number after `key` on its line of `text`, times `unit`.
fn field(text: &str, key: &str, unit: u64) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let n: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(n.saturating_mul(unit))
}

fn meminfo() -> Option<u64> {
    field(
        &std::fs::read_to_string("/proc/meminfo").ok()?,
        "MemAvailable:",
        1024,
    )
}

fn address_space_left() -> Option<u64> {
    let limit = field(
        &std::fs::read_to_string("/proc/self/limits").ok()?,
        "Max address space",
        1,
    )?;
    let used = field(
        &std::fs::read_to_string("/proc/self/status").ok()?,
        "VmSize:",
        1024,
    )?;
    Some(limit.saturating_sub(used))
}

fn cgroup_left() -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?;
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// The refusal's text: what is needed, what is there, the plan's memory table.
fn refusal(plan: &Plan, needed: u64, available: u64, devices: usize) -> String {
    let m = &plan.memory;
    let mut text = format!(
        "`{}` needs {} of memory{} at a batch of {}, but this machine has {} available",
        plan.name,
        bytes(needed),
        if devices > 1 {
            format!(" for its {devices} simulated devices")
        } else {
            String::new()
        },
        plan.sharding.map_or(plan.batch_size, |s| s.global_batch),
        bytes(available)
    );
    text += &match plan.sharding {
        Some(_) => format!(
            "\n  the plan of one micro-shard ({} samples):",
            plan.batch_size
        ),
        None => "\n  the plan:".to_string(),
    };
    for (what, b) in [
        ("parameters", m.parameter_bytes),
        ("optimizer state", m.optimizer_state_bytes),
        ("running statistics", m.statistics_bytes),
        ("inputs", m.input_bytes),
        (
            "activations at the peak",
            m.peak_bytes.saturating_sub(m.dedicated_bytes()),
        ),
        ("total at the peak", m.peak_bytes),
    ] {
        text += &format!("\n  {what:<24} {:>12}", bytes(b));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_reports_its_memory() {
        let b = available_bytes().expect("/proc/meminfo has MemAvailable");
        assert!(b > 1 << 20, "{b}");
        assert!(b <= meminfo().unwrap());
    }

    #[test]
    fn fields_are_read_with_their_units() {
        let limits = "Max cpu time              unlimited            unlimited            seconds\nMax address space         8192000000           8192000000           bytes\n";
        assert_eq!(field(limits, "Max address space", 1), Some(8_192_000_000));
        assert_eq!(field(limits, "Max cpu time", 1), None);
        assert_eq!(
            field("VmSize:\t  1024 kB\n", "VmSize:", 1024),
            Some(1 << 20)
        );
    }
}
