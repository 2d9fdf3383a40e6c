//! Property tests (arbtest): livenessprobe's command line and its HTTP handler never panic on
//! any input. The command line is built from the flag table, Go-syntax values and raw bytes;
//! the HTTP input is arbitrary bytes on one connection to the real handler (the driver socket
//! does not exist, so `/healthz` answers 500 once the short probe timeout runs out).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use plugreg_livenessprobe::flags::{self, FlagError};
use plugreg_livenessprobe::metrics::Metrics;
use plugreg_livenessprobe::{Prober, health_handler};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const VALUES: &[&str] = &[
    "",
    "0",
    "1",
    "-1",
    "true",
    "T",
    "0x1F",
    "1s",
    "-1.5h",
    "500ms",
    "9808",
    ":9808",
    "unix:///x",
    "5Mi",
    "a=1",
    "=",
    "--",
    "-v",
    "json",
    "µs",
];

fn args_from(data: &[u8]) -> Vec<String> {
    let names: Vec<&str> = flags::names().collect();
    let mut args = Vec::new();
    let mut bytes = data.iter().copied();
    while let Some(op) = bytes.next() {
        let pick = |b: Option<u8>, n: usize| usize::from(b.unwrap_or(0)) % n;
        args.push(match op % 6 {
            0..=2 => {
                let dashes = ["-", "--", "---", ""][pick(bytes.next(), 4)];
                let name = names[pick(bytes.next(), names.len())];
                if op % 2 == 0 {
                    format!("{dashes}{name}")
                } else {
                    format!(
                        "{dashes}{name}={}",
                        VALUES[pick(bytes.next(), VALUES.len())]
                    )
                }
            }
            3 => VALUES[pick(bytes.next(), VALUES.len())].to_owned(),
            _ => {
                let len = pick(bytes.next(), 17);
                let raw: Vec<u8> = bytes.by_ref().take(len).collect();
                String::from_utf8_lossy(&raw).into_owned()
            }
        });
    }
    args
}

#[test]
fn any_command_line_parses_or_fails_in_go_words() {
    arbtest::arbtest(|u| {
        let data: Vec<u8> = u.arbitrary()?;
        let args = args_from(&data);
        let parsed = flags::parse(&args);
        if let Err(FlagError(m)) = &parsed {
            assert!(
                [
                    "flag provided but not defined: -",
                    "bad flag syntax: ",
                    "flag needs an argument: -",
                    "invalid value ",
                    "invalid boolean value ",
                ]
                .iter()
                .any(|p| m.starts_with(p)),
                "{args:?}: {m}"
            );
        }
        assert_eq!(flags::parse(&args), parsed, "deterministic");
        if let Ok(flags::Parsed::Run(f)) = parsed {
            let _ = f.logging.validate();
            let _ = plugreg_livenessprobe::check_conflicts(&f.options);
            let _ = plugreg_livenessprobe::socket_path(&f.options.csi_address);
        }
        Ok(())
    })
    .budget_ms(1_000);
}

struct Fixture {
    runtime: tokio::runtime::Runtime,
    prober: Arc<Prober>,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| Fixture {
        runtime: tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
        prober: Prober::new(
            "/nonexistent/plugreg-props/csi.sock".into(),
            "csi.example.com".into(),
            Duration::from_millis(20),
            Metrics::new(),
        ),
    })
}

/// Sends `request` on one in-memory connection; returns what came back (bounded).
fn exchange(request: &[u8]) -> Vec<u8> {
    let f = fixture();
    let handler = health_handler(f.prober.clone(), Some("/metrics".into()));
    f.runtime.block_on(async move {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(plugreg_sidecar_kit::http::serve_connection(
            server,
            handler,
            Duration::from_millis(20),
        ));
        let _ = client.write_all(request).await;
        let _ = client.shutdown().await;
        let mut out = Vec::new();
        let mut bounded = (&mut client).take(256 * 1024);
        let read = bounded.read_to_end(&mut out);
        // The connection's own limit (head timeout + handler + write slack) ends it at worst.
        tokio::time::timeout(Duration::from_secs(30), read)
            .await
            .expect("the connection ends within its limit")
            .unwrap();
        served.await.unwrap();
        out
    })
}

#[test]
fn the_http_handler_answers_or_closes_on_any_bytes() {
    arbtest::arbtest(|u| {
        let data: Vec<u8> = u.arbitrary()?;
        let out = exchange(&data);
        assert!(out.is_empty() || out.starts_with(b"HTTP/1."), "{out:?}");
        assert!(out.len() < 64 * 1024);
        Ok(())
    })
    .budget_ms(1_000);
    let ok = exchange(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    let text = String::from_utf8_lossy(&ok);
    assert!(text.starts_with("HTTP/1.1 500"), "{text}");
    assert!(
        text.ends_with("\r\n\r\ncontext deadline exceeded"),
        "{text}"
    );
    let metrics = exchange(b"GET /metrics HTTP/1.1\r\n\r\n");
    assert!(String::from_utf8_lossy(&metrics).contains("process_start_time_seconds"));
}
