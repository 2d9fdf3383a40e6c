//! The one reader of `/proc` about processes and mounts: a process's memory and CPU time, and
//! the mount points below a directory. Benchmarks read the figures they write from here, and
//! the commands that clean up mounts read `mountinfo` here.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A field of `/proc/<pid>/status` given in kB (`VmRSS`, `VmHWM`, ...; a trailing `:` is
/// allowed), in KiB. `pid` may be `"self"`.
pub fn status_kib(pid: &str, field: &str) -> io::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    field_kib(&status, pid, field)
}

/// `field` of the status text `status` of process `pid`, in KiB.
fn field_kib(status: &str, pid: &str, field: &str) -> io::Result<u64> {
    let field = field.trim_end_matches(':');
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| io::Error::other(format!("no {field} in /proc/{pid}/status")))
}

/// Memory of a process, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    /// Resident set size now (`VmRSS`), KiB.
    pub rss_kib: u64,
    /// Peak resident set size so far (`VmHWM`), KiB.
    pub hwm_kib: u64,
    /// Of the RSS, anonymous memory (`RssAnon`: heap, stacks), KiB.
    pub anon_kib: u64,
    /// Of the RSS, file-backed pages (`RssFile`: mostly the executable's code as it is run),
    /// KiB.
    pub file_kib: u64,
}

/// Reads the memory of process `pid` (`"self"` works too), from one read of its status: the
/// kernel computes the fields of one read from the same counters (so `VmHWM >= VmRSS`), where
/// separate reads may see the RSS move in between (the counters are per CPU and read
/// approximately).
pub fn memory(pid: &str) -> io::Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(Memory {
        rss_kib: field_kib(&status, pid, "VmRSS")?,
        hwm_kib: field_kib(&status, pid, "VmHWM")?,
        anon_kib: field_kib(&status, pid, "RssAnon")?,
        file_kib: field_kib(&status, pid, "RssFile")?,
    })
}

/// User plus system CPU time of process `pid` and every thread it ever had (`/proc/<pid>/stat`,
/// in USER_HZ = 100 ticks per second on every Linux ABI).
pub fn cpu_time(pid: &str) -> io::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces; the fields after it are space-separated.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| io::Error::other("malformed stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ")": state is field 3, utime field 14, stime field 15 (1-based, man proc(5)).
    let ticks = |i: usize| -> io::Result<u64> {
        fields
            .get(i - 3)
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| io::Error::other("malformed stat"))
    };
    Ok(Duration::from_millis((ticks(14)? + ticks(15)?) * 10))
}

/// The mount points at or below `dir` in this process's mount namespace
/// (`/proc/self/mountinfo`, field 5, with the kernel's `\040` for a space); none when it cannot
/// be read.
pub fn mount_points_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_cpu() {
        let m = memory("self").unwrap();
        assert!(m.rss_kib > 0 && m.hwm_kib >= m.rss_kib);
        // Another read may see other counters (see `memory`): only that it reads.
        assert!(status_kib("self", "VmHWM:").unwrap() > 0);
        assert!(status_kib("self", "VmNope").is_err());
        cpu_time("self").unwrap();
    }

    #[test]
    fn the_root_is_a_mount_point() {
        assert!(mount_points_under(Path::new("/")).contains(&PathBuf::from("/")));
        assert!(mount_points_under(Path::new("/no/such/dir")).is_empty());
    }
}
