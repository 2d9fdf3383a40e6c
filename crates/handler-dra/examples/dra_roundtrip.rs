//! Benchmark: DRA NodePrepareResources + NodeUnprepareResources round trips through the
//! manager's DRA client (`DraHandler`) against a plugreg-dra driver on a real Unix socket.
//!
//! `cargo run --release -p plugreg-handler-dra --example dra_roundtrip -- [ROUNDS]` prints p50, p99
//! and max in microseconds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use plugreg_dra::{Claim, Driver, DriverError, PrepareResult, async_trait};
use plugreg_handler_api::PluginHandler;
use plugreg_handler_dra::DraHandler;

/// Answers one device per claim.
struct Driver1;

#[async_trait]
impl Driver for Driver1 {
    async fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, PrepareResult>, DriverError> {
        Ok(claims
            .into_iter()
            .map(|c| {
                let d = plugreg_dra::Device {
                    request_names: vec![],
                    pool_name: "pool".into(),
                    device_name: "dev-0".into(),
                    cdi_device_ids: vec![format!("example.com/dev={}", c.uid)],
                    share_id: None,
                };
                (c.uid, Ok(vec![d]))
            })
            .collect())
    }

    async fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> Result<HashMap<String, Result<(), String>>, DriverError> {
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::main]
async fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5000);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = plugreg_dra::Config::new("bench.example.com");
    cfg.registry_dir = dir.path().join("registry");
    cfg.plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&cfg.registry_dir).unwrap();
    std::fs::create_dir_all(&cfg.plugin_dir).unwrap();
    let token = tokio_util::sync::CancellationToken::new();
    let p = plugreg_dra::start(Arc::new(Driver1), cfg, token.clone())
        .await
        .unwrap();
    let ep = p.plugin_socket().display().to_string();
    let h = DraHandler::new();
    h.register("bench.example.com", &ep, &["v1.DRAPlugin".into()])
        .await
        .unwrap();
    let claim = |i: usize| Claim {
        namespace: "ns".into(),
        uid: format!("uid-{i}"),
        name: format!("c-{i}"),
    };
    // Warm-up: the connection and the first calls.
    for i in 0..100 {
        h.prepare("bench.example.com", vec![claim(i)])
            .await
            .unwrap();
        h.unprepare("bench.example.com", vec![claim(i)])
            .await
            .unwrap();
    }
    let mut t = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let start = Instant::now();
        let r = h
            .prepare("bench.example.com", vec![claim(i)])
            .await
            .unwrap();
        assert_eq!(r.claims.len(), 1);
        h.unprepare("bench.example.com", vec![claim(i)])
            .await
            .unwrap();
        t.push(start.elapsed());
    }
    t.sort();
    println!(
        "dra prepare+unprepare round trip: rounds={rounds} p50={}us p99={}us max={}us",
        pct(&t, 0.50).as_micros(),
        pct(&t, 0.99).as_micros(),
        t[t.len() - 1].as_micros()
    );
    token.cancel();
}
