//! What the benchmark reads about the machine from `/proc`, and the one place it raises the
//! open-file limit. Processes' memory and CPU time come from `plugreg_runtime::procfs`, the one
//! reader every crate uses.

use std::io;
use std::path::Path;

pub use plugreg_runtime::procfs::{cpu_time, memory};

/// The machine the figures were taken on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// CPUs this process may run on.
    pub cpus: usize,
    /// `model name` of the first CPU.
    pub model: String,
    /// Kernel release.
    pub kernel: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
}

/// Describes this machine from `/proc`.
pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(|| "unknown".to_owned(), |(_, m)| m.trim().to_owned());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_owned(), |k| k.trim().to_owned());
    let memory_mib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024);
    Machine {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        model,
        kernel,
        memory_mib,
    }
}

/// The 1, 5 and 15 minute load averages, as `/proc/loadavg` shows them.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// The type of the file system holding `path` (the longest mount point above it in
/// `/proc/self/mounts`), e.g. `ext4` or `tmpfs`.
pub fn fs_type(path: &Path) -> String {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, mount, fs) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(mount)
                .then(|| (mount.len(), fs.to_owned()))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "unknown".to_owned(), |(_, fs)| fs)
}

/// Raises this process's soft open-file limit to at least `want` (up to the hard limit) and
/// returns the new soft limit. Children inherit it.
pub fn raise_nofile(want: u64) -> io::Result<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let current = getrlimit(Resource::Nofile);
    let hard = current.maximum;
    let soft = current.current.unwrap_or(u64::MAX);
    if soft >= want {
        return Ok(soft);
    }
    let target = hard.map_or(want, |h| want.min(h));
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(target),
            maximum: hard,
        },
    )?;
    if target < want {
        return Err(io::Error::other(format!(
            "open-file limit is {target} (hard limit), {want} wanted"
        )));
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describes_the_machine() {
        let m = machine();
        assert!(m.cpus >= 1);
        assert!(!m.kernel.is_empty());
        assert_ne!(fs_type(Path::new("/proc/self")), "unknown");
    }
}
