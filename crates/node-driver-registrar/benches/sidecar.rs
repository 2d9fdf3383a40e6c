//! Sidecar benchmark: `cargo bench -p plugreg-node-driver-registrar --bench sidecar`.
//!
//! Runs the release binary against the in-process CSI test driver and plugreg's plugin manager
//! (the kubelet side, in-process, with a handler that accepts every CSI driver) and measures:
//! - start -> registration socket listening, and GetPluginInfo answered -> socket listening (R5);
//! - start -> registered (the manager's `Registered` event, i.e. Notify(true) sent);
//! - steady RSS (VmRSS) after 3 s idle and after 200 /healthz checks and 200 /metrics
//!   scrapes, after bursts of 64 concurrent /healthz (and how many GetInfo self-calls those
//!   made: concurrent callers share one check), and peak RSS (VmHWM), from /proc/<pid>/status.
//!
//! Prints a Markdown report on stdout.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use plugreg_csi_test_driver::{DriverConfig, Method, start};
use plugreg_manager::{
    HandlerError, HandlerRegistry, ManagerConfig, ManagerEvent, PluginHandler, PluginManager,
    async_trait,
};
use tokio_util::sync::CancellationToken;

/// The binary under test: this build's, or `PLUGREG_SIDECAR_BIN` (to compare another build).
fn bin() -> String {
    std::env::var("PLUGREG_SIDECAR_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_csi-node-driver-registrar").to_owned())
}
const DRIVER: &str = "bench.csi.plugreg.io";
const RUNS: usize = 30;
const BURST: usize = 64;
const BURSTS: usize = 5;

struct Accept;

#[async_trait]
impl PluginHandler for Accept {
    async fn validate(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
        Ok(())
    }
    async fn register(&self, _: &str, _: &str, _: &[String]) -> Result<(), HandlerError> {
        Ok(())
    }
    async fn deregister(&self, _: &str, _: &str) {}
}

/// A kB field of `/proc/<pid>/status` (0 once the process is gone).
fn status_kib(pid: u32, field: &str) -> u64 {
    plugreg_runtime::procfs::status_kib(&pid.to_string(), field).unwrap_or(0)
}

fn http_get(addr: SocketAddr, path: &str) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// The sidecar's count of GetInfo calls, from /metrics.
fn get_info_calls(addr: SocketAddr) -> u64 {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r.lines()
        .find(|l| l.starts_with("csi_node_driver_registrar_get_info_calls_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

struct Sample {
    listening: Duration,
    answered_to_listening: Duration,
    registered: Duration,
}

async fn one_run(dir: &Path, keep: bool) -> (Sample, Option<std::process::Child>, SocketAddr) {
    let csi = dir.join("csi.sock");
    let registry = dir.join("registry");
    let driver = start(
        DriverConfig {
            name: DRIVER.into(),
            ..DriverConfig::default()
        },
        &csi,
    )
    .await
    .unwrap();
    let mut calls = driver.calls().subscribe();
    let token = CancellationToken::new();
    let manager = PluginManager::start(
        ManagerConfig::new(&registry),
        HandlerRegistry::new().with("CSIPlugin", Arc::new(Accept)),
        token.clone(),
    )
    .await
    .unwrap();
    let mut events = manager.subscribe();
    let socket = registry.join(format!("{DRIVER}-reg.sock"));
    let http_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();

    let t0 = Instant::now();
    let mut child = Command::new(bin())
        .arg(format!("--csi-address={}", csi.display()))
        .arg(format!("--plugin-registration-path={}", registry.display()))
        .arg("--kubelet-registration-path=/var/lib/kubelet/plugins/bench/csi.sock")
        .arg(format!("--http-endpoint=127.0.0.1:{http_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The driver answers at once, so "call arrived" is "answered" within microseconds.
    let answered = loop {
        let call = calls.recv().await.unwrap();
        if call.method == Method::GetPluginInfo {
            break Instant::now();
        }
    };
    while plugreg_transport::path_kind(&socket).ok() != Some(plugreg_transport::PathKind::Socket) {
        std::thread::sleep(Duration::from_micros(50));
    }
    let listening = Instant::now();
    let registered = loop {
        match events.recv().await.unwrap() {
            ManagerEvent::Registered { name, .. } if name == DRIVER => break Instant::now(),
            _ => {}
        }
    };
    let sample = Sample {
        listening: listening - t0,
        answered_to_listening: listening.saturating_duration_since(answered),
        registered: registered - t0,
    };
    let addr: SocketAddr = format!("127.0.0.1:{http_port}").parse().unwrap();
    if keep {
        // The driver and manager must outlive this function for the RSS phase.
        std::mem::forget(driver);
        std::mem::forget(manager);
        std::mem::forget(token);
        return (sample, Some(child), addr);
    }
    let _ = child.kill();
    let _ = child.wait();
    token.cancel();
    manager.stopped().await;
    driver.stop().await.unwrap();
    (sample, None, addr)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; nothing else is accepted.
    let mut samples = Vec::new();
    for _ in 0..RUNS {
        let dir = tempfile::tempdir().unwrap();
        samples.push(one_run(dir.path(), false).await.0);
    }
    let dir = tempfile::tempdir().unwrap();
    let (_, child, http) = one_run(dir.path(), true).await;
    let mut child = child.unwrap();
    let pid = child.id();
    let after_start = (status_kib(pid, "VmRSS:"), status_kib(pid, "VmHWM:"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = status_kib(pid, "VmRSS:");
    let t = Instant::now();
    let healthz = tokio::task::spawn_blocking(move || {
        for _ in 0..200 {
            assert_eq!(http_get(http, "/healthz"), 200);
        }
        for _ in 0..200 {
            assert_eq!(http_get(http, "/metrics"), 200);
        }
    });
    healthz.await.unwrap();
    let per_check = t.elapsed() / 400;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let loaded = status_kib(pid, "VmRSS:");
    // Bursts of concurrent probes: they share one check in flight (and 16 connections are
    // answered at once, the rest wait for one of those workers).
    let get_info_before = get_info_calls(http);
    let burst = tokio::task::spawn_blocking(move || {
        for _ in 0..BURSTS {
            let threads: Vec<_> = (0..BURST)
                .map(|_| std::thread::spawn(move || http_get(http, "/healthz")))
                .collect();
            for t in threads {
                assert_eq!(t.join().unwrap(), 200);
            }
        }
    });
    burst.await.unwrap();
    let burst_get_info = get_info_calls(http) - get_info_before;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after_burst = status_kib(pid, "VmRSS:");
    let peak = status_kib(pid, "VmHWM:");
    let anon = status_kib(pid, "RssAnon:");
    let file = status_kib(pid, "RssFile:");
    let _ = child.kill();
    let _ = child.wait();

    let col = |f: fn(&Sample) -> Duration| {
        let mut v: Vec<Duration> = samples.iter().map(f).collect();
        v.sort();
        format!(
            "{} | {} | {} | {}",
            ms(percentile(&v, 0.5)),
            ms(percentile(&v, 0.9)),
            ms(percentile(&v, 0.99)),
            ms(*v.last().unwrap())
        )
    };
    let bin = bin();
    let size = std::fs::metadata(&bin).map(|m| m.len()).unwrap_or(0);
    println!("### csi-node-driver-registrar ({RUNS} runs)\n");
    println!("| measure | p50 | p90 | p99 | max |");
    println!("|---|---|---|---|---|");
    println!(
        "| process start -> registration socket listening | {} |",
        col(|s| s.listening)
    );
    println!(
        "| GetPluginInfo answered -> socket listening | {} |",
        col(|s| s.answered_to_listening)
    );
    println!(
        "| process start -> registered with plugreg's manager | {} |",
        col(|s| s.registered)
    );
    println!();
    println!("| memory (KiB) | value |");
    println!("|---|---|");
    println!("| VmRSS right after registration | {} |", after_start.0);
    println!("| VmRSS after 3 s idle | {idle} |");
    println!("| VmRSS after 200 /healthz + 200 /metrics | {loaded} |");
    println!("| VmRSS after {BURSTS} bursts of {BURST} concurrent /healthz | {after_burst} |");
    println!("| VmHWM (peak RSS) | {peak} |");
    println!("| of the final VmRSS: RssAnon (private heap, stacks) | {anon} |");
    println!("| of the final VmRSS: RssFile (binary and libc pages, shared) | {file} |");
    println!();
    println!(
        "Mean /healthz or /metrics round trip (sequential, incl. TCP connect): {}",
        ms(per_check)
    );
    println!(
        "GetInfo self-calls for {} concurrent /healthz ({BURSTS} bursts of {BURST}): {burst_get_info}",
        BURSTS * BURST
    );
    println!("Binary size: {:.2} MiB ({bin})", size as f64 / 1048576.0);
}
