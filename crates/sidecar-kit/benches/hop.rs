//! What one API round trip costs on each protocol (issue 33):
//!
//! ```sh
//! cargo bench -p plugreg-sidecar-kit --bench hop -- --out BENCHMARKS.md
//! cargo bench -p plugreg-sidecar-kit --bench hop -- --n 200 --busy 1   # with a CPU hog, never written
//! ```
//!
//! The cluster benchmark's traces put a claim's chain about 0.5 ms a hop slower on HTTP/2 than
//! on HTTP/1.1, outside the API server's own time (its audit timestamps). This bench asks
//! where: one fresh kube-apiserver v1.36.2 with an audit log, and one ConfigMap read (GET) and
//! changed (a merge PATCH of one key) in turn, one request at a time, by four clients:
//!
//! - the kit's [`Transport`] as every sidecar builds it (HTTP/2 by ALPN), on a one-thread
//!   runtime as most sidecars run;
//! - the same on HTTP/1.1 only ([`Transport::new_http1`]);
//! - curl (libcurl over nghttp2 and OpenSSL) with `--http2`, and with `--http1.1`: a client
//!   that is neither hyper nor Go, so that a cost both clients see on one protocol is the API
//!   server's.
//!
//! Each client makes its requests in rounds, in turn with the others (drift and the API
//! server's own background work fall on all four), over one connection it opened and warmed
//! before. Reported for each client and verb: the round trip the client saw (p50, p90), the
//! API server's time for it (audit `requestReceivedTimestamp` to `stageTimestamp` at
//! ResponseComplete), and the difference, request by request: what the request spent outside
//! the API server's handler (the client, TLS, the protocol's framing on both sides, the
//! kernel). `--busy K` runs K threads that only spin beside the run, as the cluster's
//! etcd, controllers and kubelet share its two cores.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use plugreg_sidecar_kit::ratelimit::{Transport, unlimited_client_on};
use plugreg_testpeers::bench::{commit, date, load, write_block};
use plugreg_testpeers::{ApiServer, ApiServerOptions, KubeVersion};
use serde_json::json;

const START: &str = "<!-- bench:hop:start -->";
const END: &str = "<!-- bench:hop:end -->";
const NAMESPACE: &str = "default";
const NAME: &str = "hop";
/// Requests each client makes before its measured ones (connection, TLS, caches).
const WARM: usize = 20;
/// Rounds the measured requests are spread over.
const ROUNDS: usize = 8;

struct Args {
    /// GET + PATCH pairs per client.
    n: usize,
    busy: usize,
    out: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        n: 400,
        busy: 0,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--n" => a.n = it.next().and_then(|v| v.parse().ok()).unwrap_or(a.n),
            "--busy" => a.busy = it.next().and_then(|v| v.parse().ok()).unwrap_or(0),
            "--out" => a.out = it.next(),
            // cargo bench passes --bench.
            _ => {}
        }
    }
    a.n = a.n.max(ROUNDS);
    a
}

/// The four clients.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Client {
    KitH2,
    KitH1,
    CurlH2,
    CurlH1,
}

impl Client {
    const ALL: [Client; 4] = [Client::KitH2, Client::KitH1, Client::CurlH2, Client::CurlH1];

    fn agent(self) -> &'static str {
        match self {
            Client::KitH2 => "hop-kit-h2",
            Client::KitH1 => "hop-kit-h1",
            Client::CurlH2 => "hop-curl-h2",
            Client::CurlH1 => "hop-curl-h1",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Client::KitH2 => "kit, HTTP/2 (as the sidecars)",
            Client::KitH1 => "kit, HTTP/1.1",
            Client::CurlH2 => "curl, HTTP/2",
            Client::CurlH1 => "curl, HTTP/1.1",
        }
    }
}

/// What one client saw of its requests, in order: the verb and the round trip in µs.
type Seen = Vec<(&'static str, f64)>;

fn patch_body(i: usize) -> serde_json::Value {
    json!({"data": {"i": i.to_string()}})
}

/// The ConfigMap's key `i` set to `i` (a merge PATCH).
async fn patch(api: &Api<ConfigMap>, i: usize) {
    api.patch(NAME, &PatchParams::default(), &Patch::Merge(patch_body(i)))
        .await
        .expect("PATCH");
}

async fn kit_round(api: &Api<ConfigMap>, pairs: usize, seen: &mut Seen, counter: &mut usize) {
    for _ in 0..pairs {
        let t = Instant::now();
        api.get(NAME).await.expect("GET");
        seen.push(("get", t.elapsed().as_secs_f64() * 1e6));
        *counter += 1;
        let t = Instant::now();
        patch(api, *counter).await;
        seen.push(("patch", t.elapsed().as_secs_f64() * 1e6));
    }
}

/// `pairs` PATCHes, each followed by its watch event on `api`'s own connection(s), as a
/// sidecar sees its own write come back: the time from sending the PATCH to the event's
/// arrival (µs; a task of its own reads the watch and stamps each event as it comes).
async fn watch_round(api: &Api<ConfigMap>, pairs: usize, seen: &mut Vec<f64>, counter: &mut usize) {
    use futures::StreamExt as _;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let current = api.get(NAME).await.expect("GET");
    let rv = current.metadata.resource_version.unwrap_or_default();
    let stream = api
        .watch(
            &kube::api::WatchParams::default().fields(&format!("metadata.name={NAME}")),
            &rv,
        )
        .await
        .expect("WATCH");
    let reader = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            if let Ok(kube::api::WatchEvent::Modified(cm)) = ev {
                let i = cm
                    .data
                    .and_then(|d| d.get("i").and_then(|i| i.parse::<usize>().ok()))
                    .unwrap_or_default();
                if tx.send((i, Instant::now())).is_err() {
                    return;
                }
            }
        }
    });
    for _ in 0..pairs {
        *counter += 1;
        let t = Instant::now();
        patch(api, *counter).await;
        loop {
            let (i, at) = rx.recv().await.expect("watch event");
            if i == *counter {
                seen.push(at.duration_since(t).as_secs_f64() * 1e6);
                break;
            }
        }
    }
    reader.abort();
}

/// One curl process making `pairs` GET + PATCH pairs over one connection; returns each
/// transfer's `time_total` in µs (the first `warm` pairs' included).
fn curl_round(server: &ApiServer, client: Client, pairs: usize, counter: &mut usize) -> Vec<f64> {
    let url = format!(
        "{}/api/v1/namespaces/{NAMESPACE}/configmaps/{NAME}",
        server.url()
    );
    let proto = if client == Client::CurlH2 {
        "http2"
    } else {
        "http1.1"
    };
    let common = format!(
        "{proto}\ncacert = \"{}\"\nheader = \"Authorization: Bearer {}\"\nuser-agent = \"{}\"\noutput = \"/dev/null\"\nsilent\nshow-error\nfail\nwrite-out = \"%{{time_total}}\\n\"\n",
        server.ca_cert_path().display(),
        server.token(),
        client.agent()
    );
    let mut config = String::new();
    for i in 0..pairs {
        if i > 0 {
            config.push_str("next\n");
        }
        config.push_str(&common);
        config.push_str(&format!("url = \"{url}\"\nnext\n"));
        *counter += 1;
        config.push_str(&common);
        config.push_str(&format!(
            "url = \"{url}\"\nrequest = \"PATCH\"\nheader = \"Content-Type: application/merge-patch+json\"\ndata = \"{}\"\n",
            patch_body(*counter).to_string().replace('"', "\\\"")
        ));
    }
    let mut file = tempfile::NamedTempFile::new().expect("curl config");
    file.write_all(config.as_bytes()).expect("curl config");
    let out = Command::new("curl")
        .arg("--config")
        .arg(file.path())
        .output()
        .expect("curl: is it installed?");
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().parse::<f64>().expect("time_total") * 1e6)
        .collect()
}

/// Microseconds since the epoch of an audit timestamp (RFC 3339), parsed as the cluster
/// trace parses the same fields (`crates/cluster/src/trace.rs`).
fn micros(ts: &str) -> i64 {
    ts.parse::<k8s_openapi::jiff::Timestamp>()
        .expect("an RFC 3339 audit timestamp")
        .as_microsecond()
}

/// The API server's time for each request of each of our clients, in order (µs), with its verb.
fn server_times(audit: &std::path::Path) -> BTreeMap<String, Vec<(String, f64)>> {
    let text = std::fs::read_to_string(audit).expect("audit log");
    let mut by_agent: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    for line in text.lines() {
        let Ok(ev) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let agent = ev["userAgent"].as_str().unwrap_or_default();
        if !agent.starts_with("hop-") || ev["objectRef"]["name"] != NAME {
            continue;
        }
        let (Some(received), Some(done)) = (
            ev["requestReceivedTimestamp"].as_str(),
            ev["stageTimestamp"].as_str(),
        ) else {
            continue;
        };
        by_agent.entry(agent.to_owned()).or_default().push((
            ev["verb"].as_str().unwrap_or_default().to_owned(),
            (micros(done) - micros(received)) as f64,
        ));
    }
    by_agent
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

/// Spins until told to stop.
fn hog(stop: Arc<AtomicBool>) {
    let mut x = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..10_000 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
}

fn main() {
    let a = args();
    let started = Instant::now();
    let load_at_start = load();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let server = runtime
        .block_on(ApiServer::start_with(
            KubeVersion::V1_36_2,
            &ApiServerOptions {
                audit: true,
                ..ApiServerOptions::default()
            },
        ))
        .expect("kube-apiserver v1.36.2 (are the peers built?)");
    let audit = server.audit_log_path().expect("audit log").to_path_buf();

    let stop = Arc::new(AtomicBool::new(false));
    let hogs: Vec<_> = (0..a.busy)
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || hog(stop))
        })
        .collect();

    let per_round = a.n / ROUNDS;
    let mut seen: BTreeMap<Client, Seen> = BTreeMap::new();
    let mut events: BTreeMap<Client, Vec<f64>> = BTreeMap::new();
    runtime.block_on(async {
        let admin = server.client().await.expect("client");
        let cms: Api<ConfigMap> = Api::namespaced(admin, NAMESPACE);
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(NAME.into());
        cms.create(&PostParams::default(), &cm)
            .await
            .expect("ConfigMap");

        let kit = |client: Client, agent: &'static str| {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(server.kubeconfig_path()).expect("kubeconfig");
            async move {
                let mut config = kube::Config::from_custom_kubeconfig(
                    kubeconfig,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await
                .expect("config");
                config.headers.push((
                    http::header::USER_AGENT,
                    http::HeaderValue::from_static(agent),
                ));
                let transport = if client == Client::KitH2 {
                    Transport::new(config)
                } else {
                    Transport::new_http1(config)
                }
                .expect("transport");
                let api: Api<ConfigMap> =
                    Api::namespaced(unlimited_client_on(&transport).expect("client"), NAMESPACE);
                api
            }
        };
        let h2 = kit(Client::KitH2, Client::KitH2.agent()).await;
        let h1 = kit(Client::KitH1, Client::KitH1.agent()).await;
        // The watch rounds' clients, apart from the audit log's pairs.
        let w2 = kit(Client::KitH2, "watch-kit-h2").await;
        let w1 = kit(Client::KitH1, "watch-kit-h1").await;
        let mut counter = 0;
        let mut warm = Vec::new();
        kit_round(&h2, WARM, &mut warm, &mut counter).await;
        kit_round(&h1, WARM, &mut warm, &mut counter).await;
        for _ in 0..ROUNDS {
            for (client, api) in [(Client::KitH2, &w2), (Client::KitH1, &w1)] {
                watch_round(
                    api,
                    per_round,
                    events.entry(client).or_default(),
                    &mut counter,
                )
                .await;
            }
            for client in Client::ALL {
                let s = seen.entry(client).or_default();
                match client {
                    Client::KitH2 => kit_round(&h2, per_round, s, &mut counter).await,
                    Client::KitH1 => kit_round(&h1, per_round, s, &mut counter).await,
                    Client::CurlH2 | Client::CurlH1 => {
                        // Each curl process warms its own connection first.
                        let times = curl_round(&server, client, WARM + per_round, &mut counter);
                        for (i, t) in times.into_iter().enumerate() {
                            let verb = if i % 2 == 0 { "get" } else { "patch" };
                            s.push((verb, t));
                        }
                    }
                }
            }
        }
    });
    stop.store(true, Ordering::Relaxed);
    for h in hogs {
        let _ = h.join();
    }

    // The audit log is written before each answer (blocking mode): it is complete.
    let mut servers = server_times(&audit);
    let mut rows = String::new();
    let mut outside_p50: BTreeMap<(Client, &str), f64> = BTreeMap::new();
    for client in Client::ALL {
        let mut server_seq = servers.remove(client.agent()).unwrap_or_default();
        // Drop the warm-ups from the API server's list as from the client's.
        match client {
            Client::KitH2 | Client::KitH1 => {
                server_seq.drain(..(2 * WARM).min(server_seq.len()));
            }
            Client::CurlH2 | Client::CurlH1 => {}
        }
        let client_seq = seen.remove(&client).unwrap_or_default();
        assert_eq!(
            client_seq.len(),
            server_seq.len(),
            "{}: the audit log has every request",
            client.agent()
        );
        // curl's warm-ups: the first 2 * WARM of each round.
        let keep: Vec<bool> = match client {
            Client::KitH2 | Client::KitH1 => vec![true; client_seq.len()],
            Client::CurlH2 | Client::CurlH1 => (0..client_seq.len())
                .map(|i| i % (2 * (WARM + per_round)) >= 2 * WARM)
                .collect(),
        };
        for verb in ["get", "patch"] {
            let mut rtt = Vec::new();
            let mut srv = Vec::new();
            let mut outside = Vec::new();
            for (i, ((v, t), (sv, st))) in client_seq.iter().zip(&server_seq).enumerate() {
                assert_eq!(v, sv, "{}: requests in order", client.agent());
                if !keep[i] || *v != verb {
                    continue;
                }
                rtt.push(*t);
                srv.push(*st);
                outside.push(t - st);
            }
            let n = rtt.len();
            let out50 = percentile(&mut outside, 0.5);
            outside_p50.insert((client, verb), out50);
            rows.push_str(&format!(
                "| {} | {} | {n} | {:.0} / {:.0} | {:.0} | **{:.0}** |\n",
                client.label(),
                verb.to_uppercase(),
                percentile(&mut rtt, 0.5),
                percentile(&mut rtt, 0.9),
                percentile(&mut srv, 0.5),
                out50,
            ));
        }
    }
    let mut watch_rows = String::new();
    for (client, mut v) in events {
        watch_rows.push_str(&format!(
            "| {} | {} | {:.0} / {:.0} |\n",
            client.label(),
            v.len(),
            percentile(&mut v, 0.5),
            percentile(&mut v, 0.9),
        ));
    }
    let diff = |a: Client, b: Client, verb: &str| outside_p50[&(a, verb)] - outside_p50[&(b, verb)];
    let summary = format!(
        "HTTP/2 minus HTTP/1.1, outside the API server's handler (medians): the kit {:+.0} µs a GET and {:+.0} µs a PATCH; curl {:+.0} µs a GET and {:+.0} µs a PATCH.",
        diff(Client::KitH2, Client::KitH1, "get"),
        diff(Client::KitH2, Client::KitH1, "patch"),
        diff(Client::CurlH2, Client::CurlH1, "get"),
        diff(Client::CurlH2, Client::CurlH1, "patch"),
    );
    let block = format!(
        "{START}\n#### One API round trip on each protocol ({}, commit {}; `cargo bench -p plugreg-sidecar-kit --bench hop`)\n\n\
         kube-apiserver v1.36.2 (audit log, blocking), one ConfigMap read and patched in turn, one request at a \
         time, {} GET + PATCH pairs per client in {ROUNDS} rounds taken in turn, {} spinning thread(s) beside; load at \
         start {load_at_start}; {:.0} s in all. Times in µs.\n\n\
         | client | verb | requests | round trip p50 / p90 | API server p50 | outside the API server p50 |\n\
         |---|---|---|---|---|---|\n{rows}\n{summary}\n\n\
         A PATCH and its own watch event on the same client (a sidecar's write coming back), the watch opened on \
         the client's transport as a sidecar's cache opens it (on HTTP/2 the same connection): from sending the \
         PATCH to the event's arrival, µs.\n\n\
         | client | events | PATCH sent -> its event p50 / p90 |\n|---|---|---|\n{watch_rows}{END}\n",
        date(),
        commit(),
        per_round * ROUNDS,
        a.busy,
        started.elapsed().as_secs_f64(),
    );
    println!("{block}");
    if let Some(out) = &a.out {
        if a.busy == 0 {
            write_block(out, START, END, &block);
        } else {
            eprintln!("--busy runs are not written to {out}");
        }
    }
}
