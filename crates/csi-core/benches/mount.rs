//! The mount benchmark: `plugreg csi mount` + `plugreg csi unmount` round trips (each command a
//! process, as an operator runs them) against the `csi-test-driver` process, which stages and
//! publishes with real bind mounts when run as root; and the same sequence through the node
//! client library on one connection, to show what the processes cost. Prints p50/p99/max and,
//! with `--out FILE`, replaces this benchmark's block in FILE (BENCHMARKS.md).
//!
//! ```text
//! cargo build --release -p plugreg -p plugreg-csi-test-driver && \
//!   cargo bench -p plugreg-csi-core --bench mount -- --out BENCHMARKS.md
//! ```

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use plugreg_csi_core::client::Retry;
use plugreg_csi_core::{KubeletLayout, NodeClient, VolumeSpec};

const START: &str = "<!-- bench:csi-mount:start -->";
const END: &str = "<!-- bench:csi-mount:end -->";

struct Args {
    out: Option<PathBuf>,
    count: usize,
    warmup: usize,
}

fn args() -> Args {
    let mut a = Args {
        out: None,
        count: 200,
        warmup: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            // `cargo bench` runs in the package's directory: a relative path is the workspace's.
            "--out" => {
                a.out = it
                    .next()
                    .map(|p| Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(p))
            }
            "--count" => a.count = it.next().and_then(|n| n.parse().ok()).unwrap_or(a.count),
            "--warmup" => a.warmup = it.next().and_then(|n| n.parse().ok()).unwrap_or(a.warmup),
            // `cargo bench` passes --bench; anything else is not ours either.
            _ => {}
        }
    }
    a
}

/// `target/<profile>`, where cargo put this bench's executable (in `deps/`).
fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} is missing: cargo build --release -p plugreg -p plugreg-csi-test-driver",
        bin.display()
    );
    bin
}

struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let _ = self.0.wait();
    }
}

fn start_driver(dir: &Path) -> (Driver, String) {
    let socket = dir.join("csi.sock");
    let mut child = Command::new(bin("csi-test-driver"))
        .arg("--socket")
        .arg(&socket)
        .args([
            "--volume",
            "vol-1",
            "--node-capability",
            "STAGE_UNSTAGE_VOLUME",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("csi-test-driver starts");
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains("\"listening\"") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(15))
        .expect("the driver listens");
    (Driver(child), socket.display().to_string())
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

struct Series {
    name: &'static str,
    samples: Vec<Duration>,
}

impl Series {
    fn row(&self) -> String {
        let mut s = self.samples.clone();
        s.sort();
        format!(
            "| {} | {} | {} | {} | {} |",
            self.name,
            s.len(),
            ms(pct(&s, 0.5)),
            ms(pct(&s, 0.99)),
            ms(*s.last().expect("samples"))
        )
    }
}

fn cli(op: &str, endpoint: &str, root: &Path) -> Duration {
    let t = Instant::now();
    let out = Command::new(bin("plugreg"))
        .args([
            "csi",
            op,
            "--endpoint",
            endpoint,
            "--volume-id",
            "vol-1",
            "-o",
            "json",
        ])
        .arg("--kubelet-root")
        .arg(root)
        .output()
        .expect("plugreg runs");
    let took = t.elapsed();
    assert!(out.status.success(), "plugreg csi {op}: {out:?}");
    took
}

fn main() {
    let a = args();
    let dir = tempfile::Builder::new()
        .prefix("plugreg-mount-bench-")
        .tempdir_in("/tmp")
        .expect("temp dir");
    let root = dir.path().join("kubelet");
    let (driver, endpoint) = start_driver(dir.path());
    let mounts = rustix::process::geteuid().is_root();

    let mut mount = Series {
        name: "`plugreg csi mount` (process: stage + publish)",
        samples: Vec::new(),
    };
    let mut unmount = Series {
        name: "`plugreg csi unmount` (process: unpublish + unstage)",
        samples: Vec::new(),
    };
    let mut round = Series {
        name: "mount + unmount round trip (2 processes)",
        samples: Vec::new(),
    };
    for i in 0..a.warmup + a.count {
        let m = cli("mount", &endpoint, &root);
        let u = cli("unmount", &endpoint, &root);
        if i >= a.warmup {
            mount.samples.push(m);
            unmount.samples.push(u);
            round.samples.push(m + u);
        }
    }

    // The same sequence through the library, one connection: what the calls and mounts cost.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut lib = Series {
        name: "library round trip (NodeClient::mount + unmount, one connection)",
        samples: Vec::new(),
    };
    rt.block_on(async {
        let c = NodeClient::connect(
            &endpoint,
            Duration::from_secs(5),
            NodeClient::TIMEOUT,
            Retry::ONCE,
        )
        .await
        .expect("connect");
        let spec = VolumeSpec::new("vol-1");
        let paths = c
            .paths(
                &KubeletLayout::new(&root),
                "csi.plugreg.test",
                &spec,
                "plugreg",
                "vol-1",
            )
            .expect("paths");
        for i in 0..a.warmup + a.count {
            let t = Instant::now();
            c.mount(&spec, &paths).await.expect("mount");
            c.unmount("vol-1", &paths).await.expect("unmount");
            if i >= a.warmup {
                lib.samples.push(t.elapsed());
            }
        }
    });
    drop(driver);

    // The kernel's share: the same two bind mounts and two unmounts, as syscalls alone.
    let mut sys = Series {
        name: "syscalls alone: 2 bind mounts + 2 unmounts",
        samples: Vec::new(),
    };
    if mounts {
        let (src, mid, dst) = (
            dir.path().join("s"),
            dir.path().join("m"),
            dir.path().join("d"),
        );
        for p in [&src, &mid, &dst] {
            std::fs::create_dir_all(p).expect("dir");
        }
        let flags = rustix::mount::UnmountFlags::empty();
        for i in 0..a.warmup + a.count {
            let t = Instant::now();
            rustix::mount::mount_bind(&src, &mid).expect("bind");
            rustix::mount::mount_bind(&mid, &dst).expect("bind");
            rustix::mount::unmount(&dst, flags).expect("unmount");
            rustix::mount::unmount(&mid, flags).expect("unmount");
            if i >= a.warmup {
                sys.samples.push(t.elapsed());
            }
        }
    }

    let date = std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let block = format!(
        "{START}\n## CSI node: `plugreg csi mount` + `unmount` round trip (issue 11)\n\n\
         {date}, {} samples after {} warm-up rounds, against the `csi-test-driver` process \
         (STAGE_UNSTAGE_VOLUME; {}), kubelet layout under /tmp; load average {load}. Each \
         command is a fresh `plugreg` process (dial, NodeGetCapabilities, GetPluginInfo for \
         the staging path, then the calls).\n\n\
         ```sh\ncargo build --release -p plugreg -p plugreg-csi-test-driver && \\\n  \
         cargo bench -p plugreg-csi-core --bench mount -- --out BENCHMARKS.md\n```\n\n\
         | what | n | p50 | p99 | max |\n|---|---|---|---|---|\n{}\n{}\n{}\n{}\n{}\n\n\
         The library round trip is 4 RPCs on one connection plus the driver's 2 bind mounts and \
         2 unmounts; the last row shows how much of it the kernel takes. A command as a \
         process adds the rest: the process start, the dial and 2 more RPCs (NodeGetCapabilities, GetPluginInfo).\n{END}",
        a.count,
        a.warmup,
        if mounts {
            "real bind mounts, run as root"
        } else {
            "plain directories: not root"
        },
        mount.row(),
        unmount.row(),
        round.row(),
        lib.row(),
        if mounts {
            sys.row()
        } else {
            "| syscalls alone | - | not root | | |".to_owned()
        },
    );
    println!("{block}");
    if let Some(out) = a.out {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let new = match (text.find(START), text.find(END)) {
            (Some(s), Some(e)) if e > s => {
                format!("{}{block}{}", &text[..s], &text[e + END.len()..])
            }
            _ => format!("{}\n{block}\n", text.trim_end()),
        };
        std::fs::write(&out, new).expect("write the report");
        eprintln!("wrote {}", out.display());
    }
}
