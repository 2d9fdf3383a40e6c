//! The real binary against the in-process CSI test driver and a minimal kubelet client:
//! start-up, failure paths, the registration socket's life, HTTP.
//!
//! Multi-threaded runtimes: the test body blocks on the child's log lines while the driver
//! keeps serving on the worker threads.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use plugreg_csi_test_driver::{Code, DriverConfig, Failure, Fault, Method, start};
use rustix::process::Signal;

const SECS10: Duration = Duration::from_secs(10);

async fn driver(dir: &Path, config: DriverConfig) -> plugreg_csi_test_driver::RunningDriver {
    start(
        DriverConfig {
            name: DRIVER.into(),
            ..config
        },
        &dir.join("csi.sock"),
    )
    .await
    .unwrap()
}

fn dirs() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let csi = tmp.path().join("csi.sock");
    let reg = tmp.path().join("registry");
    std::fs::create_dir(&reg).unwrap();
    (tmp, csi, reg)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_answers_get_info_and_removes_its_socket_on_sigterm() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let mut args = args(&csi, &reg);
    args.push("--http-endpoint=127.0.0.1:0".into());
    let mut p = Proc::spawn(&args);
    let socket = reg_socket(&reg);

    p.wait_for_line("\"Registration Server started\"", SECS10);
    assert!(is_socket(&socket));
    let log = p.log();
    for line in [
        "\"Calling CSI driver to discover driver name\"",
        &format!("\"CSI driver name\" csiDriverName=\"{DRIVER}\""),
        &format!(
            "\"Starting Registration Server\" socketPath=\"{}\"",
            socket.display()
        ),
    ] {
        assert!(log.contains(line), "missing {line:?} in\n{log}");
    }
    let mode = std::fs::metadata(&socket).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o700);

    let info = get_info(&socket).await;
    assert_eq!(info.r#type, "CSIPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(info.endpoint, KUBELET_PATH);
    assert_eq!(info.supported_versions, ["1.0.0"]);
    p.wait_for_line("\"Received GetInfo call\"", SECS10);

    let http = p.http_address(SECS10);
    let metric = |body: &str, name: &str| -> String {
        body.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing in\n{body}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .to_owned()
    };
    let (code, body) = http_get(http, "/metrics", SECS10);
    assert_eq!(code, 200);
    assert_eq!(
        metric(
            &body,
            "csi_node_driver_registrar_registered{driver_name=\"csi.test.plugreg.io\"}"
        ),
        "0"
    );
    notify(&socket, true, "").await;
    p.wait_for_line("\"Received NotifyRegistrationStatus call\"", SECS10);
    let (_, body) = http_get(http, "/metrics", SECS10);
    assert_eq!(
        metric(
            &body,
            "csi_node_driver_registrar_registered{driver_name=\"csi.test.plugreg.io\"}"
        ),
        "1"
    );
    assert_eq!(
        metric(
            &body,
            "csi_node_driver_registrar_notifications_total{driver_name=\"csi.test.plugreg.io\",result=\"accepted\"}"
        ),
        "1"
    );
    assert_eq!(http_get(http, "/healthz", SECS10), (200, "ok".into()));
    assert_eq!(http_get(http, "/nope", SECS10).0, 404);
    // The sidecar asked the driver once and never again.
    assert_eq!(drv.calls().get_plugin_info(), 1);

    p.signal(Signal::TERM);
    assert_eq!(p.exit_code(SECS10), 0, "{}", p.log());
    assert!(!socket.exists(), "SIGTERM removes the socket");
    assert!(entries(&reg).is_empty());
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_a_driver_that_appears_after_3s() {
    let (tmp, csi, reg) = dirs();
    let p = Proc::spawn(&args(&csi, &reg));
    p.wait_for_line("\"Attempting to open a gRPC connection\"", SECS10);
    let late = Instant::now() + Duration::from_secs(3);
    tokio::time::sleep_until(late.into()).await;
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    p.wait_for_line("\"Registration Server started\"", SECS10);
    let waited = p.started.elapsed();
    assert!(waited >= Duration::from_secs(3), "{waited:?}");
    assert!(is_socket(&reg_socket(&reg)));
    assert_eq!(get_info(&reg_socket(&reg)).await.name, DRIVER);
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gives_up_with_exit_1_when_the_driver_never_appears() {
    let (_tmp, csi, reg) = dirs();
    let mut args = args(&csi, &reg);
    args.push("--csi-connect-window=1s".into());
    let mut p = Proc::spawn(&args);
    assert_eq!(p.exit_code(SECS10), 1);
    let took = p.started.elapsed();
    assert!(took >= Duration::from_secs(1), "{took:?}");
    assert!(
        p.log()
            .contains("\"Error connecting to CSI driver\" err=\"context deadline exceeded\"")
    );
    assert!(entries(&reg).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_a_slow_get_plugin_info_within_the_window() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(
        tmp.path(),
        DriverConfig {
            get_plugin_info: Fault {
                delay: Some(Duration::from_secs(2)),
                delay_first: Some(2),
                ..Fault::default()
            },
            ..DriverConfig::default()
        },
    )
    .await;
    let mut args = args(&csi, &reg);
    args.push("--timeout=300ms".into());
    let p = Proc::spawn(&args);
    let retry = p.wait_for_line("\"GetPluginInfo failed, retrying\"", SECS10);
    assert!(retry.contains("DeadlineExceeded"), "{retry}");
    p.wait_for_line("\"Registration Server started\"", SECS10);
    assert_eq!(
        drv.calls().get_plugin_info(),
        3,
        "two slow calls, then one that answered"
    );
    assert_eq!(get_info(&reg_socket(&reg)).await.name, DRIVER);
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_plugin_info_errors_are_retried_then_give_up_at_the_window() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(
        tmp.path(),
        DriverConfig {
            get_plugin_info: Fault {
                error: Some(Failure::new(Code::Internal, "not ready")),
                ..Fault::default()
            },
            ..DriverConfig::default()
        },
    )
    .await;
    let mut args = args(&csi, &reg);
    args.push("--csi-connect-window=1s".into());
    let mut p = Proc::spawn(&args);
    assert_eq!(p.exit_code(SECS10), 1);
    let log = p.log();
    assert!(
        log.contains(
            "\"Error retreiving CSI driver name\" err=\"rpc error: code = Internal desc = not ready\""
        ),
        "{log}"
    );
    assert!(drv.calls().get_plugin_info() >= 3, "retried");
    assert!(entries(&reg).is_empty());
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_driver_name_exits_1() {
    let (tmp, csi, reg) = dirs();
    let drv = start(
        DriverConfig {
            name: String::new(),
            ..DriverConfig::default()
        },
        &tmp.path().join("csi.sock"),
    )
    .await
    .unwrap();
    let mut p = Proc::spawn(&args(&csi, &reg));
    assert_eq!(p.exit_code(SECS10), 1);
    assert!(
        p.log()
            .contains("\"Error retreiving CSI driver name\" err=\"driver name is empty\"")
    );
    assert_eq!(drv.calls().count(Method::GetPluginInfo), 1, "not retried");
    assert!(entries(&reg).is_empty());
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_driver_names_exit_1_and_create_nothing() {
    for name in ["../escape", "a/b", "a..b", "x\0y", "-dash", &"n".repeat(64)] {
        let (tmp, csi, reg) = dirs();
        let drv = start(
            DriverConfig {
                name: name.to_owned(),
                ..DriverConfig::default()
            },
            &csi,
        )
        .await
        .unwrap();
        let before = entries(tmp.path());
        let mut p = Proc::spawn(&args(&csi, &reg));
        assert_eq!(p.exit_code(SECS10), 1, "{name:?}: {}", p.log());
        assert!(p.log().contains("invalid CSI driver name"), "{}", p.log());
        assert!(entries(&reg).is_empty(), "{name:?}");
        assert_eq!(
            entries(tmp.path()),
            before,
            "{name:?}: nothing created outside"
        );
        drv.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regular_file_at_the_socket_path_exits_1_and_stays_untouched() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let socket = reg_socket(&reg);
    std::fs::write(&socket, b"precious").unwrap();
    let mut p = Proc::spawn(&args(&csi, &reg));
    assert_eq!(p.exit_code(SECS10), 1);
    assert!(p.log().contains("but it's not a socket"), "{}", p.log());
    assert_eq!(std::fs::read(&socket).unwrap(), b"precious");
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_socket_is_replaced() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let socket = reg_socket(&reg);
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let p = Proc::spawn(&args(&csi, &reg));
    p.wait_for_line("\"Registration Server started\"", SECS10);
    assert_eq!(get_info(&socket).await.name, DRIVER);
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_removes_the_socket_and_exits_1() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let mut p = Proc::spawn(&args(&csi, &reg));
    p.wait_for_line("\"Registration Server started\"", SECS10);
    let socket = reg_socket(&reg);
    notify(&socket, false, "driverNodeID must not be empty").await;
    assert_eq!(p.exit_code(SECS10), 1);
    assert!(p.log().contains(
        "\"Registration process failed with error, restarting registration container\" err=\"driverNodeID must not be empty\""
    ));
    assert!(
        !socket.exists(),
        "the socket is removed on this exit path too"
    );
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_removes_the_socket_and_exits_0() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let mut p = Proc::spawn(&args(&csi, &reg));
    p.wait_for_line("\"Registration Server started\"", SECS10);
    p.signal(Signal::INT);
    assert_eq!(p.exit_code(SECS10), 0);
    assert!(!reg_socket(&reg).exists());
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_socket_is_re_created() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let p = Proc::spawn(&args(&csi, &reg));
    p.wait_for_line("\"Registration Server started\"", SECS10);
    let socket = reg_socket(&reg);
    std::fs::remove_file(&socket).unwrap();
    p.wait_for_nth("\"Registration Server started\"", 2, SECS10);
    wait_until(SECS10, "the socket to come back", || is_socket(&socket));
    assert_eq!(get_info(&socket).await.name, DRIVER);
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_served_on_the_deprecated_health_port() {
    // --health-port binds every interface; pick a free port first.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let mut args = args(&csi, &reg);
    args.push(format!("--health-port={port}"));
    let p = Proc::spawn(&args);
    let line = p.wait_for_line("\"Starting HTTP server\"", SECS10);
    assert!(line.contains(&format!("endpoint=\":{port}\"")), "{line}");
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert_eq!(http_get(addr, "/healthz", SECS10), (200, "ok".into()));
    drv.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_never_hangs_when_the_socket_is_taken_over() {
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let mut args = args(&csi, &reg);
    args.extend([
        "--http-endpoint=127.0.0.1:0".into(),
        "--timeout=500ms".into(),
    ]);
    let p = Proc::spawn(&args);
    let http = p.http_address(SECS10);
    let socket = reg_socket(&reg);
    // A listener that never accepts takes the path over: the check sees it and answers within
    // --timeout plus slack.
    std::fs::remove_file(&socket).unwrap();
    let hijacker = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let t = Instant::now();
    let (code, body) = http_get(http, "/healthz", SECS10);
    let took = t.elapsed();
    assert!(matches!(code, 200 | 404 | 500), "{code} {body}");
    assert!(took < Duration::from_millis(900), "{took:?}: {code} {body}");
    // The hijacker listens, so it counts as another live instance and is left alone (R3);
    // once it is gone (its socket file stays, dead), the sidecar takes its path back.
    p.wait_for_line("replaced by another live instance", SECS10);
    assert!(is_socket(&socket));
    drop(hijacker);
    p.wait_for_nth("\"Registration Server started\"", 2, SECS10);
    wait_until(SECS10, "a healthy check", || {
        http_get(http, "/healthz", SECS10).0 == 200
    });
    drv.stop().await.unwrap();
}

/// CPU time the process `pid` has used so far (from /proc/<pid>/schedstat).
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).unwrap();
    Duration::from_nanos(stat.split_whitespace().next().unwrap().parse().unwrap())
}

/// The file descriptors `pid` has open.
fn open_fds(pid: u32) -> std::collections::BTreeSet<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// The lowest file descriptor number `pid` does not use, once its descriptor table has been
/// the same for 100 ms (connections of the last request close a moment after the answer):
/// with RLIMIT_NOFILE set to it, the process cannot open another descriptor.
fn lowest_free_fd(pid: u32) -> u64 {
    let mut used = open_fds(pid);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = open_fds(pid);
        if now == used {
            break;
        }
        used = now;
    }
    (0..).find(|n| !used.contains(n)).unwrap()
}

/// The soft and hard RLIMIT_NOFILE of `pid`, from /proc/<pid>/limits.
fn nofile_limits(pid: u32) -> rustix::process::Rlimit {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let mut values = line["Max open files".len()..]
        .split_whitespace()
        .map(|v| v.parse::<u64>().ok());
    rustix::process::Rlimit {
        current: values.next().unwrap(),
        maximum: values.next().unwrap(),
    }
}

/// Out of file descriptors (a real EMFILE: the child's RLIMIT_NOFILE is lowered with
/// prlimit), the HTTP server backs off instead of retrying accept() in a busy loop, and
/// serves the waiting client once descriptors are available again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_server_does_not_spin_when_out_of_file_descriptors() {
    use rustix::process::{Pid, Resource, Rlimit, prlimit};
    use std::io::{Read, Write};
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let mut args = args(&csi, &reg);
    args.push("--http-endpoint=127.0.0.1:0".into());
    let p = Proc::spawn(&args);
    let http = p.http_address(SECS10);
    wait_until(SECS10, "a healthy check", || {
        http_get(http, "/healthz", SECS10).0 == 200
    });

    let pid = Pid::from_raw(p.pid() as i32).unwrap();
    let old = nofile_limits(p.pid());
    // The kernel completes the handshake (backlog); accept() in the sidecar fails with EMFILE.
    // A descriptor the sidecar was just closing (the last probe's connection) can leave a hole
    // below the limit that one accept still fits in: then look again and lower the limit anew.
    let mut attempts = 0;
    let mut client = loop {
        attempts += 1;
        assert!(attempts <= 10, "could not exhaust the descriptors");
        let lowered = Rlimit {
            current: Some(lowest_free_fd(p.pid())),
            maximum: old.maximum,
        };
        prlimit(Some(pid), Resource::Nofile, lowered).unwrap();
        let mut client = std::net::TcpStream::connect(http).unwrap();
        client
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(1)))
            .unwrap();
        match client.read(&mut [0u8; 1]) {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break client;
            }
            _ => continue, // it was served: there was a hole
        }
    };
    p.wait_for_line("HTTP accept failed; retrying", SECS10);
    let window = Duration::from_secs(2);
    let (cpu0, t0) = (cpu_time(p.pid()), Instant::now());
    std::thread::sleep(window);
    let used = cpu_time(p.pid()) - cpu0;
    let share = used.as_secs_f64() / t0.elapsed().as_secs_f64();
    eprintln!("CPU while out of descriptors: {used:?} in {window:?}");
    assert!(
        share < 0.03,
        "the sidecar used {used:?} of CPU in {window:?} while out of descriptors: it spins"
    );

    prlimit(Some(pid), Resource::Nofile, old).unwrap();
    client.set_read_timeout(Some(SECS10)).unwrap();
    let mut response = String::new();
    client.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
    drv.stop().await.unwrap();
}

/// Issue 17, finding 1: 1,000 clients that connect and send nothing or only part of a request
/// head (slow-loris) do not keep `/healthz` from answering. (Before: 16 connections were served
/// at once, each idle one for up to 5 s, and the rest waited in a 128-deep backlog: the probe
/// was not even connected.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_behind_1000_idle_and_slow_loris_clients() {
    use std::io::Write;
    let soft = {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let limit = getrlimit(Resource::Nofile);
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        let _ = setrlimit(Resource::Nofile, raised);
        getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
    };
    assert!(
        soft >= 1200,
        "this test holds 1,000 connections open; RLIMIT_NOFILE allows {soft}"
    );
    let (tmp, csi, reg) = dirs();
    let drv = driver(tmp.path(), DriverConfig::default()).await;
    let mut args = args(&csi, &reg);
    args.push("--http-endpoint=127.0.0.1:0".into());
    let p = Proc::spawn(&args);
    let http = p.http_address(SECS10);
    wait_until(SECS10, "a healthy check", || {
        http_get(http, "/healthz", SECS10).0 == 200
    });
    let crowd: Vec<std::net::TcpStream> = (0..1000)
        .map(|i| {
            let mut s = std::net::TcpStream::connect_timeout(&http, SECS10).unwrap();
            if i % 2 == 1 {
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: ")
                    .unwrap();
            }
            s
        })
        .collect();
    let (code, body) = http_get(http, "/healthz", SECS10);
    assert_eq!((code, body.as_str()), (200, "ok"));
    drop(crowd);
    drv.stop().await.unwrap();
}
