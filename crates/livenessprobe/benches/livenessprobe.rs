//! livenessprobe benchmark: `cargo bench -p plugreg-livenessprobe --bench livenessprobe`.
//!
//! Runs the release binary against the in-process CSI test driver (healthy, on a real Unix
//! socket) and measures:
//! - `/healthz` round trip (a new TCP connection, one HTTP/1.1 request, a fresh dial of the
//!   driver and its Probe) over 1,000 sequential requests: p50, p90, p99, max;
//! - RSS (VmRSS) right after start, after 3 s idle, after the 1,000 requests, after bursts of 64
//!   concurrent `/healthz` (and how many Probe calls those made: concurrent callers share one),
//!   and the peak (VmHWM), from /proc/<pid>/status.
//!
//! `PLUGREG_LIVENESSPROBE_BIN=/path/to/livenessprobe` measures another build (the Go sidecar
//! takes the same flags). Prints a Markdown report on stdout.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use plugreg_csi_test_driver::{DriverConfig, Method, start};

const REQUESTS: usize = 1000;
const BURST: usize = 64;
const BURSTS: usize = 5;

fn bin() -> String {
    std::env::var("PLUGREG_LIVENESSPROBE_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_livenessprobe").to_owned())
}

/// A kB field of `/proc/<pid>/status` (0 once the process is gone).
fn status_kib(pid: u32, field: &str) -> u64 {
    plugreg_runtime::procfs::status_kib(&pid.to_string(), field).unwrap_or(0)
}

fn healthz(addr: SocketAddr) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

/// A free loopback port (bound and released; the sidecar binds it right after).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let driver = start(
        DriverConfig {
            name: "bench.csi.plugreg.io".into(),
            ..DriverConfig::default()
        },
        &socket,
    )
    .await
    .unwrap();
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut child = Command::new(bin())
        .arg(format!("--csi-address={}", socket.display()))
        .arg(format!("--http-endpoint=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the sidecar did not listen");
        std::thread::sleep(Duration::from_millis(5));
    }
    let after_start = status_kib(pid, "VmRSS:");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = status_kib(pid, "VmRSS:");

    let mut times = Vec::with_capacity(REQUESTS);
    for _ in 0..REQUESTS {
        let t = Instant::now();
        let code = tokio::task::spawn_blocking(move || healthz(addr))
            .await
            .unwrap();
        times.push(t.elapsed());
        assert_eq!(code, 200);
    }
    times.sort();
    let loaded = status_kib(pid, "VmRSS:");

    let before = driver.calls().count(Method::Probe);
    for _ in 0..BURSTS {
        let burst: Vec<_> = (0..BURST)
            .map(|_| tokio::task::spawn_blocking(move || healthz(addr)))
            .collect();
        for b in burst {
            assert_eq!(b.await.unwrap(), 200);
        }
    }
    let burst_probes = driver.calls().count(Method::Probe) - before;
    let after_burst = status_kib(pid, "VmRSS:");
    let peak = status_kib(pid, "VmHWM:");

    println!("### livenessprobe\n");
    println!("| `/healthz` round trip ({REQUESTS} sequential) | p50 | p90 | p99 | max |");
    println!("|---|---|---|---|---|");
    println!(
        "| connect + request + dial driver + Probe + answer | {} | {} | {} | {} |",
        ms(percentile(&times, 0.5)),
        ms(percentile(&times, 0.9)),
        ms(percentile(&times, 0.99)),
        ms(*times.last().unwrap())
    );
    println!();
    println!("| memory (KiB) | value |");
    println!("|---|---|");
    println!("| VmRSS right after listening | {after_start} |");
    println!("| VmRSS after 3 s idle | {idle} |");
    println!("| VmRSS after {REQUESTS} /healthz | {loaded} |");
    println!("| VmRSS after {BURSTS} bursts of {BURST} concurrent /healthz | {after_burst} |");
    println!("| VmHWM (peak RSS) | {peak} |");
    println!();
    println!(
        "{BURSTS} bursts of {BURST} concurrent /healthz made {burst_probes} Probe calls (concurrent callers share one)."
    );
    let _ = child.kill();
    let _ = child.wait();
    driver.stop().await.unwrap();
}
