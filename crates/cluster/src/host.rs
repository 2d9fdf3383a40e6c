//! What the cluster needs from the host, checked before anything starts, and small helpers
//! around host processes and commands.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::Error;

/// The command that installs the Kubernetes peers and the node runtime.
pub const PEERS_SETUP: &str = "bash interop/build-peers.sh (as root)";
/// The command that installs the image tools, kubectl v1.20.2 and busybox-static.
pub const IMAGES_SETUP: &str = "bash images/setup.sh (as root)";
/// Where `images/setup.sh` puts kubectl and busybox: `$PLUGREG_DEPLOY_TOOLS`, else
/// `$HOME/.cache/plugreg-deploy`.
pub const TOOLS_DIR_ENV: &str = "PLUGREG_DEPLOY_TOOLS";
/// The CNI plugins directory of Debian's `containernetworking-plugins`.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// The tools folder of `images/setup.sh`.
pub fn tools_dir() -> PathBuf {
    match std::env::var_os(TOOLS_DIR_ENV).filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home).join(".cache/plugreg-deploy")
        }
    }
}

/// kubectl v1.20.2 of `images/setup.sh` (its kustomize renders `deploy/`).
pub fn kubectl() -> Result<PathBuf, Error> {
    let path = tools_dir().join("kubectl-v1.20.2");
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::missing(
            format!("kubectl v1.20.2 (looked for {})", path.display()),
            IMAGES_SETUP,
        ))
    }
}

/// Where cargo put this workspace's binaries for the running program: its own directory
/// (`target/<profile>`), or the parent of `deps` for a test executable.
pub fn workspace_bin_dir() -> Result<PathBuf, Error> {
    let exe = std::env::current_exe().map_err(|e| Error::io("finding this program", e))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    Ok(match dir.file_name() {
        Some(name) if name == "deps" => dir.parent().unwrap_or(dir).to_owned(),
        _ => dir.to_owned(),
    })
}

/// `program` on `PATH`.
pub fn on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// Checks what every node needs from the host: root, util-linux's namespace tools, runc, the
/// CNI loopback plugin and cgroups. Each missing piece fails with its name and the set-up
/// command, so a test on an unprepared machine says what to do instead of passing.
pub fn check() -> Result<(), Error> {
    if !rustix::process::geteuid().is_root() {
        return Err(Error::missing(
            "root: the node mounts, creates namespaces and cgroups and runs containers",
            "run the tests (or plugreg-cluster) as root",
        ));
    }
    for (cmd, fix) in [
        ("unshare", "apt-get install util-linux"),
        ("nsenter", "apt-get install util-linux"),
        ("setpriv", "apt-get install util-linux"),
        ("mount", "apt-get install mount"),
        ("runc", PEERS_SETUP),
    ] {
        if on_path(cmd).is_none() {
            return Err(Error::missing(format!("`{cmd}` on PATH"), fix));
        }
    }
    let loopback = Path::new(CNI_BIN_DIR).join("loopback");
    if !loopback.is_file() {
        return Err(Error::missing(
            format!("the CNI loopback plugin ({})", loopback.display()),
            PEERS_SETUP,
        ));
    }
    if cgroup_mounts().is_empty() {
        return Err(Error::missing(
            "a mounted cgroup hierarchy (/proc/self/mountinfo lists none)",
            "mount cgroupfs (v1 or v2) at /sys/fs/cgroup",
        ));
    }
    Ok(())
}

/// The mount points of every cgroup hierarchy (v1 controllers, named ones, the v2 unified
/// one) as this process sees them.
pub fn cgroup_mounts() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split(' ').next()?;
            if fstype != "cgroup" && fstype != "cgroup2" {
                return None;
            }
            left.split(' ').nth(4).map(|m| PathBuf::from(unescape(m)))
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
pub fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let n = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(n);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount points listed in a `mountinfo` file (e.g. `/proc/<pid>/mountinfo`).
pub fn mount_points(mountinfo: &Path) -> Result<Vec<String>, Error> {
    let text = std::fs::read_to_string(mountinfo)
        .map_err(|e| Error::io(format!("reading {}", mountinfo.display()), e))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(unescape))
        .collect())
}

/// A currently free TCP port on 127.0.0.1, never one this process handed out before (two
/// host-network pods of one cluster declaring one port cannot be scheduled together); see
/// [`plugreg_testpeers::free_port`]. The cluster's ports are all allocated this way.
pub fn free_port() -> Result<u16, Error> {
    Ok(plugreg_testpeers::free_port()?)
}

/// The parent process id of `pid`, from `/proc/<pid>/stat`.
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: split after it.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(1)?.parse().ok()
}

/// The processes whose parent is `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| parent_of(*p) == Some(pid))
        .collect()
}

/// Whether process `pid` exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat.get(i + 2..i + 3))
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Sends `signal` to process `pid` (which this crate started); a process already gone is not
/// an error.
pub fn signal(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Runs a command to completion and returns its stdout; a failure carries the command line
/// and the end of its output.
pub fn run(cmd: &mut Command) -> Result<String, Error> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::io(format!("running {cmd:?}"), e))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
    output.push_str(&String::from_utf8_lossy(&out.stderr));
    let start = output.len().saturating_sub(6000);
    let start = (start..output.len())
        .find(|i| output.is_char_boundary(*i))
        .unwrap_or(output.len());
    Err(Error::Command {
        command: format!("{cmd:?}"),
        status: out.status.to_string(),
        output: output[start..].to_owned(),
    })
}

/// The last few KB of a file, or a note that it cannot be read.
pub fn tail_of(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return format!("({} not readable)", path.display());
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(8000)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_mountinfo_fields() {
        assert_eq!(unescape("/a\\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\"), "/end\\");
        assert_eq!(unescape("/x\\134y"), "/x\\y");
    }

    #[test]
    fn never_hands_out_a_port_twice() {
        let ports: Vec<u16> = (0..200).map(|_| free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len());
    }

    #[test]
    fn reads_this_process_and_its_parent() {
        let me = std::process::id();
        assert!(alive(me));
        let parent = parent_of(me).expect("a parent");
        assert!(children_of(parent).contains(&me));
        assert!(!alive(u32::MAX));
    }
}
