//! The client-side limit of the Kubernetes client (`--kube-api-qps`, `--kube-api-burst`), as
//! client-go's token bucket, shared by two clients with priorities (decision of issue 12).
//!
//! - The bucket holds at most `burst` tokens, starts full and gains `qps` tokens a second;
//!   every request takes one before it is sent, including the first request of a watch (a
//!   watch holds no token once it has started) and each page of a list.
//! - The high-priority client carries what binds claims (PV create, claim updates, PV
//!   patch/delete), the low-priority one events and bookkeeping. A low request waits while
//!   any high request waits for a token; requests of one priority are served in the order
//!   they were made.
//! - As client-go's `rest.RESTClientFor`: `qps == 0` means its default 5 and `burst == 0`
//!   its default 10; `qps < 0` means no limit (requests are still counted).
//! - kube's own retries (429/503/504, inside the client's stack) are not limited or counted
//!   again; client-go throttles each retry. Only the first attempt is seen here.
//!
//! Every client here is kube's client stack built on a [`Transport`], which differs from
//! `ClientBuilder::try_from(Config)` where it matters in two things:
//! - Its sockets have `TCP_NODELAY`, as every TCP connection of a Go program has (client-go's
//!   included). kube 5.0 leaves Nagle's algorithm on (kube-rs #2056): a request written in two
//!   segments then waits for the API server's delayed ACK, 40 ms on Linux. The one-node
//!   cluster's trace (issue 33) saw it whenever a sidecar needed a second connection: the
//!   attacher's second of two concurrent detaches answered 41-45 ms after the first.
//! - It speaks HTTP/2 to an API server that offers it, as client-go does: one connection
//!   carries every request and watch of the clients built on one transport. kube speaks
//!   HTTP/1.1 only, one connection per request in flight and one per watch: `csi-sidecars`
//!   held 23 connections to the API server at 300 claims, each with its TLS state, buffers and
//!   task (about 35 KB each; issue 29).
//!
//! It also leaves out kube's tracing layer (debug spans named `HTTP`, which no sidecar logs)
//! and the expiry of an exec plugin's client certificate (`Client::valid_until`, crate-private
//! in kube, read by no sidecar).
//!
//! [`RateLimiter`] also counts the requests, in total and per verb and resource
//! (`"POST persistentvolumes"`, `"WATCH persistentvolumeclaims"`,
//! `"PUT persistentvolumeclaims/status"`), for the benchmark's requests per volume.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::Client as LegacyClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::retry::RetryPolicy;
use kube::client::{Body, ClientBuilder, DynBody};
use plugreg_runtime::{prom, report};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::util::BoxService;
use tower::{BoxError, Layer, Service, ServiceExt as _};

use crate::flags::{ControllerFlags, kubeconfig_path};
use crate::metrics::{Collector, Families};

/// client-go's `DefaultQPS`, used when the flag is 0.
pub const DEFAULT_QPS: f64 = 5.0;
/// client-go's `DefaultBurst`, used when the flag is 0.
pub const DEFAULT_BURST: u32 = 10;
/// Distinct (verb, resource) keys counted; further ones are counted under [`OTHER_KEY`]
/// (the paths come from our own client, but the bound costs nothing).
pub const MAX_KEYS: usize = 256;
/// The key under which requests beyond [`MAX_KEYS`] distinct keys are counted.
pub const OTHER_KEY: &str = "other";

/// Building the clients failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// kube could not build a client from the configuration (TLS, auth, proxy).
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// Which queue a request waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// What binds claims: waits only for tokens and for earlier high requests.
    High,
    /// Events and bookkeeping: also waits while any high request waits.
    Low,
}

impl Priority {
    fn index(self) -> usize {
        match self {
            Priority::High => 0,
            Priority::Low => 1,
        }
    }
}

/// Builds the two clients of the provisioner from `config`, sharing one bucket of `burst`
/// tokens refilled at `qps` a second (see the module documentation for 0 and negative values)
/// and one connection ([`Transport`]).
/// Returns (high-priority client, low-priority client, the shared limiter). Must be called
/// within a Tokio runtime (kube's client spawns its buffer task).
pub fn clients(
    config: kube::Config,
    qps: f64,
    burst: u32,
) -> Result<(kube::Client, kube::Client, Arc<RateLimiter>), Error> {
    clients_on(&Transport::new(config)?, qps, burst)
}

/// [`clients`] on `transport`'s connection.
pub fn clients_on(
    transport: &Transport,
    qps: f64,
    burst: u32,
) -> Result<(kube::Client, kube::Client, Arc<RateLimiter>), Error> {
    let limiter = Arc::new(RateLimiter::new(qps, burst));
    let high = transport
        .builder()?
        .with_layer(&limiter.layer(Priority::High))
        .build();
    let low = transport
        .builder()?
        .with_layer(&limiter.layer(Priority::Low))
        .build();
    Ok((high, low, limiter))
}

/// A client of its own with its own bucket of `burst` tokens refilled at `qps` a second, and
/// its own connection, for work that must never wait behind the others (leader election, as
/// upstream gives it its own clientset).
pub fn own_client(config: kube::Config, qps: f64, burst: u32) -> Result<kube::Client, Error> {
    own_client_on(&Transport::new(config)?, qps, burst)
}

/// A client with its own bucket of `burst` tokens refilled at `qps` a second, on
/// `transport`'s connection.
pub fn own_client_on(transport: &Transport, qps: f64, burst: u32) -> Result<kube::Client, Error> {
    let limiter = Arc::new(RateLimiter::new(qps, burst));
    Ok(transport
        .builder()?
        .with_layer(&limiter.layer(Priority::High))
        .build())
}

/// A client without a limit of its own, for a caller that takes its tokens from a
/// [`RateLimiter`] itself ([`RateLimiter::acquire`]) so that it can choose or change a
/// request's priority while it waits.
pub fn unlimited_client(config: kube::Config) -> Result<kube::Client, Error> {
    unlimited_client_on(&Transport::new(config)?)
}

/// [`unlimited_client`] on `transport`'s connection.
pub fn unlimited_client_on(transport: &Transport) -> Result<kube::Client, Error> {
    Ok(transport.builder()?.build())
}

/// The service of [`Transport::builder`]'s clients: kube's (`ClientBuilder::try_from(Config)`).
pub type KubeService = BoxService<Request<Body>, Response<Box<DynBody>>, BoxError>;

/// The HTTP client under a [`Transport`]'s Kubernetes clients.
type HttpClient = LegacyClient<TimeoutConnector<hyper_rustls::HttpsConnector<HttpConnector>>, Body>;

/// One connection pool to the API server, for every client built on it: an HTTPS API server
/// that offers HTTP/2 (kube-apiserver does) gets one HTTP/2 connection, which carries every
/// request and watch of those clients as streams of their own, as client-go's transport does;
/// over plain HTTP, or when the server offers HTTP/1.1 only, one connection per request in
/// flight, kept for the next.
///
/// A connection that has received nothing for [`PING_AFTER`] is pinged and closed when the
/// ping is not answered within [`PING_TIMEOUT`] (client-go's `ReadIdleTimeout` and
/// `PingTimeout` for HTTP/2): a dead connection fails its requests and watches, which are then
/// made again on a new one, instead of hanging them all.
///
/// Cloning shares the pool. Each client built on it ([`Transport::builder`]) keeps its own
/// token bucket, authentication and retries above it.
#[derive(Clone)]
pub struct Transport {
    config: kube::Config,
    /// `None` with a proxy: each client is then kube's own (kube's proxy connectors, HTTP/1.1).
    http: Option<HttpClient>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("cluster_url", &self.config.cluster_url)
            .field("proxy", &self.http.is_none())
            .finish_non_exhaustive()
    }
}

/// How long an HTTP/2 connection may receive nothing before it is pinged (client-go's
/// `ReadIdleTimeout`).
pub const PING_AFTER: Duration = Duration::from_secs(30);
/// How long a ping may go unanswered before its connection is closed (client-go's
/// `PingTimeout`).
pub const PING_TIMEOUT: Duration = Duration::from_secs(15);

impl Transport {
    /// The pool for `config`: kube's HTTPS connector with the config's TLS and server name
    /// (offering HTTP/2 and HTTP/1.1), its connect, read and write timeouts, and `TCP_NODELAY`
    /// on its sockets. A config with a proxy gets kube's own builder for each client (kube's
    /// proxy connectors), whose sockets keep Nagle's algorithm on.
    pub fn new(config: kube::Config) -> Result<Self, kube::Error> {
        Self::with_protocols(config, true)
    }

    /// [`Transport::new`] offering HTTP/1.1 only: one connection per request in flight. For
    /// measuring what HTTP/2 costs one request (the kit's `hop` benchmark); sidecars use
    /// [`Transport::new`].
    pub fn new_http1(config: kube::Config) -> Result<Self, kube::Error> {
        Self::with_protocols(config, false)
    }

    fn with_protocols(config: kube::Config, http2: bool) -> Result<Self, kube::Error> {
        if config.proxy_url.is_some() {
            return Ok(Self { config, http: None });
        }
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        let mut connector = TimeoutConnector::new(https_connector(&config, http, http2)?);
        connector.set_connect_timeout(config.connect_timeout);
        connector.set_read_timeout(config.read_timeout);
        connector.set_write_timeout(config.write_timeout);
        connector.set_reset_reader_on_write(config.reset_reader_on_write);
        let client = LegacyClient::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .http2_keep_alive_interval(PING_AFTER)
            .http2_keep_alive_timeout(PING_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .build(connector);
        Ok(Self {
            config,
            http: Some(client),
        })
    }

    /// kube's client stack for the config on this pool (see the module documentation): its
    /// base URI, retries (`default_retry`), authentication and extra headers.
    pub fn builder(&self) -> Result<ClientBuilder<KubeService>, kube::Error> {
        use kube::client::ConfigExt as _;
        let config = &self.config;
        let Some(client) = &self.http else {
            return ClientBuilder::try_from(config.clone());
        };
        let service = tower::ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(
                config
                    .default_retry
                    .then(|| tower::retry::RetryLayer::new(RetryPolicy::server_retry())),
            )
            .option_layer(config.auth_layer()?)
            .layer(config.extra_headers_layer()?)
            .map_err(BoxError::from)
            .service(client.clone())
            .map_response(|r: Response<Incoming>| {
                r.map(|body| Box::new(body.map_err(BoxError::from)) as Box<DynBody>)
            });
        Ok(ClientBuilder::new(
            BoxService::new(service),
            config.default_namespace.clone(),
        ))
    }
}

/// TLS sessions a client keeps for resumption, one per server name: a client talks to one API
/// server (rustls' default keeps 256 and allocates room for them up front, about 15 KB for
/// every client of a process, ten or so in csi-sidecars).
const TLS_SESSIONS: usize = 4;

/// kube's HTTPS connector for `config` over `http`, built as
/// `ConfigExt::rustls_https_connector_with_connector` builds it (kube's TLS config, the
/// config's server name), with a session cache of [`TLS_SESSIONS`], offering HTTP/2 beside
/// HTTP/1.1 by ALPN when `http2` (kube's offers HTTP/1.1 only).
fn https_connector(
    config: &kube::Config,
    http: HttpConnector,
    http2: bool,
) -> Result<hyper_rustls::HttpsConnector<HttpConnector>, kube::Error> {
    use kube::client::ConfigExt as _;
    let mut tls = config.rustls_client_config()?;
    tls.resumption = rustls::client::Resumption::in_memory_sessions(TLS_SESSIONS);
    let mut builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = rustls::pki_types::ServerName::try_from(name.clone()).map_err(|e| {
            kube::Error::RustlsTls(kube::client::RustlsTlsError::InvalidServerName(e))
        })?;
        builder =
            builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let builder = builder.enable_http1();
    Ok(if http2 {
        builder.enable_http2().wrap_connector(http)
    } else {
        builder.wrap_connector(http)
    })
}

/// The REST config from `--master`, `--kubeconfig` (or `KUBECONFIG`) or the in-cluster
/// environment, with upstream's Info lines. QPS and burst are the [`RateLimiter`]'s
/// (`--kube-api-qps`, `--kube-api-burst`), not part of `kube::Config`. The error is what
/// upstream logs after "Failed to create config: ".
pub async fn kube_config(flags: &ControllerFlags) -> Result<kube::Config, String> {
    let mut config = kube_config_of(flags).await?;
    if let Ok(v) = http::HeaderValue::from_str(&user_agent(
        std::env::args_os().next().as_deref(),
        crate::VERSION,
    )) {
        config.headers.push((http::header::USER_AGENT, v));
    }
    Ok(config)
}

/// The User-Agent every request carries, shaped as client-go's default
/// (`<program>/<version> (<os>/<arch>) kubernetes/<commit>`) with plugreg in place of the
/// commit: `csi-provisioner/v0.1.0 (linux/amd64) plugreg`. API server audit logs and metrics
/// then tell the sidecars apart, as they tell upstream's apart.
pub fn user_agent(argv0: Option<&std::ffi::OsStr>, version: &str) -> String {
    let program = argv0
        .and_then(|a| std::path::Path::new(a).file_name())
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty())
        .unwrap_or("plugreg");
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    };
    format!(
        "{program}/{version} ({}/{arch}) plugreg",
        std::env::consts::OS
    )
}

async fn kube_config_of(flags: &ControllerFlags) -> Result<kube::Config, String> {
    let env = std::env::var("KUBECONFIG").ok();
    let (kubeconfig, from_env) = kubeconfig_path(&flags.kubeconfig, env.as_deref());
    if from_env {
        tracing::info!("Found KUBECONFIG environment variable set, using that..");
    }
    let master = &flags.master;
    if master.is_empty() && kubeconfig.is_empty() {
        tracing::info!("Building kube configs for running in cluster...");
        return kube::Config::incluster_env().map_err(|e| report::chain(&e));
    }
    tracing::info!("Either master or kubeconfig specified. building kube config from that..");
    let mut config = if kubeconfig.is_empty() {
        kube::Config::new(parse_master(master)?)
    } else {
        let file =
            kube::config::Kubeconfig::read_from(&kubeconfig).map_err(|e| report::chain(&e))?;
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| report::chain(&e))?
    };
    if !master.is_empty() {
        config.cluster_url = parse_master(master)?;
    }
    // A plain-HTTP API server needs no CA; without one, the TLS set-up would look for the
    // system's roots, which a scratch image does not have, and fail although TLS is never used.
    if config.cluster_url.scheme_str() == Some("http") && config.root_cert.is_none() {
        config.root_cert = Some(Vec::new());
    }
    Ok(config)
}

fn parse_master(master: &str) -> Result<http::Uri, String> {
    master
        .parse()
        .map_err(|e| format!("invalid --master {master:?}: {e}"))
}

/// The shared token bucket with its two queues and the request counters.
#[derive(Debug)]
pub struct RateLimiter {
    /// Tokens per second; `None` when unlimited.
    qps: Option<f64>,
    burst: f64,
    state: Mutex<State>,
    /// Woken whenever the head of a queue or the high queue's emptiness may have changed.
    changed: Notify,
    total: AtomicU64,
}

#[derive(Debug)]
struct State {
    tokens: f64,
    last: Instant,
    next_ticket: u64,
    /// Waiting tickets per priority, oldest first.
    queues: [VecDeque<u64>; 2],
    counts: BTreeMap<String, u64>,
}

impl RateLimiter {
    /// A full bucket of `burst` tokens refilled at `qps` tokens a second (0 → client-go's
    /// defaults 5 and 10; `qps < 0` → unlimited).
    pub fn new(qps: f64, burst: u32) -> Self {
        let qps = if qps == 0.0 { DEFAULT_QPS } else { qps };
        let burst = if burst == 0 { DEFAULT_BURST } else { burst };
        // NaN and negative rates mean no limit, as client-go builds no limiter for qps <= 0
        // after its defaulting.
        let qps = (qps > 0.0 && qps.is_finite()).then_some(qps);
        Self {
            qps,
            burst: f64::from(burst),
            state: Mutex::new(State {
                tokens: f64::from(burst),
                last: Instant::now(),
                next_ticket: 0,
                queues: [VecDeque::new(), VecDeque::new()],
                counts: BTreeMap::new(),
            }),
            changed: Notify::new(),
            total: AtomicU64::new(0),
        }
    }

    /// The tower layer that makes a client's requests wait here with `priority`.
    pub fn layer(self: &Arc<Self>, priority: Priority) -> RateLimitLayer {
        RateLimitLayer {
            limiter: Arc::clone(self),
            priority,
        }
    }

    /// Requests let through so far (both clients).
    pub fn requests(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Requests let through so far per verb and resource, e.g. `"POST persistentvolumes"`,
    /// `"LIST storageclasses"`, `"WATCH persistentvolumeclaims"`, `"PATCH events"`.
    pub fn requests_by_kind(&self) -> BTreeMap<String, u64> {
        self.lock().counts.clone()
    }

    /// Requests waiting for a token now, (high, low).
    pub fn waiting(&self) -> (usize, usize) {
        let s = self.lock();
        (s.queues[0].len(), s.queues[1].len())
    }

    /// Waits for a token with `priority`, then counts one request of `key`. Cancel-safe:
    /// dropping the future leaves the queue.
    pub async fn acquire(self: &Arc<Self>, priority: Priority, key: &str) {
        self.enqueue(priority).wait(key).await;
    }

    /// Takes a place in the queue of `priority` now; the place is kept until the ticket is
    /// waited on and served, or dropped. The order of `enqueue` calls is the order of service.
    pub fn enqueue(self: &Arc<Self>, priority: Priority) -> Ticket {
        let mut s = self.lock();
        let id = s.next_ticket;
        s.next_ticket += 1;
        s.queues[priority.index()].push_back(id);
        Ticket {
            limiter: Arc::clone(self),
            priority,
            id,
            served: false,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent between statements; a panic elsewhere cannot break it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The waiting time until a token is available for the head of `priority`'s queue, or
    /// takes it (`Ok`) when that ticket is `id`, it may go, and a token is there.
    fn try_take(&self, s: &mut State, priority: Priority, id: u64) -> Result<(), Option<Duration>> {
        let is_head = s.queues[priority.index()].front() == Some(&id);
        let blocked_by_high = priority == Priority::Low && !s.queues[0].is_empty();
        if !is_head || blocked_by_high {
            return Err(None);
        }
        let Some(qps) = self.qps else {
            return Ok(());
        };
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(s.last).as_secs_f64();
        s.tokens = (s.tokens + elapsed * qps).min(self.burst);
        s.last = now;
        if s.tokens >= 1.0 {
            s.tokens -= 1.0;
            Ok(())
        } else {
            // At least a millisecond, so rounding cannot spin.
            let wait = ((1.0 - s.tokens) / qps).max(0.001);
            Err(Some(Duration::from_secs_f64(wait.min(86_400.0))))
        }
    }

    fn count(&self, s: &mut State, key: &str) {
        self.total.fetch_add(1, Ordering::Relaxed);
        let key = if s.counts.contains_key(key) || s.counts.len() < MAX_KEYS {
            key
        } else {
            OTHER_KEY
        };
        match s.counts.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                s.counts.insert(key.to_owned(), 1);
            }
        }
    }
}

/// A place in a queue of the [`RateLimiter`].
#[derive(Debug)]
pub struct Ticket {
    limiter: Arc<RateLimiter>,
    priority: Priority,
    id: u64,
    served: bool,
}

impl Ticket {
    /// Waits until this ticket's turn and a token, then counts one request of `key`.
    pub async fn wait(mut self, key: &str) {
        let limiter = Arc::clone(&self.limiter);
        loop {
            // Registered before the check, so that a change after it is not missed
            // (`notify_waiters` reaches every `Notified` created before the call).
            let changed = limiter.changed.notified();
            let outcome = {
                let mut s = limiter.lock();
                let r = limiter.try_take(&mut s, self.priority, self.id);
                if r.is_ok() {
                    s.queues[self.priority.index()].pop_front();
                    limiter.count(&mut s, key);
                }
                r
            };
            match outcome {
                Ok(()) => {
                    self.served = true;
                    limiter.changed.notify_waiters();
                    return;
                }
                Err(None) => changed.await,
                Err(Some(wait)) => {
                    // Only the head sleeps; it is woken early when a high request arrives
                    // ahead of a low head (it then waits for the high queue to drain).
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = changed => {}
                    }
                }
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.served {
            return;
        }
        let mut s = self.limiter.lock();
        let q = &mut s.queues[self.priority.index()];
        if let Some(i) = q.iter().position(|&t| t == self.id) {
            q.remove(i);
        }
        drop(s);
        self.limiter.changed.notify_waiters();
    }
}

/// The verb and resource of an API request for the counters: `"GET pods"` for one object,
/// `"LIST pods"`, `"WATCH pods"`, `"PUT persistentvolumeclaims/status"`; the HTTP method and
/// path for anything else (discovery: `"GET /api"`, `"GET /apis/storage.k8s.io/v1"`).
pub fn request_key(method: &http::Method, uri: &http::Uri) -> String {
    let path = uri.path();
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segs.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => &[][..],
    };
    let rest = match rest {
        ["namespaces", _ns, r, tail @ ..] => {
            let mut v = vec![*r];
            v.extend_from_slice(tail);
            v
        }
        r => r.to_vec(),
    };
    let Some((resource, tail)) = rest.split_first() else {
        // Bounded, whatever the path (it is ASCII in an `http::Uri`; `get` also guards the rest).
        let p = path.get(..100).unwrap_or(path);
        return format!("{method} {p}");
    };
    let watch = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let verb = match (method.as_str(), tail.is_empty()) {
        ("GET", _) if watch => "WATCH",
        ("GET", true) => "LIST",
        ("DELETE", true) => "DELETECOLLECTION",
        (m, _) => m,
    };
    match tail.get(1) {
        Some(sub) => format!("{verb} {resource}/{sub}"),
        None => format!("{verb} {resource}"),
    }
}

/// The [`Layer`] of one priority.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    limiter: Arc<RateLimiter>,
    priority: Priority,
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimited<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimited {
            inner: Arc::new(tokio::sync::Mutex::new(inner)),
            limiter: Arc::clone(&self.limiter),
            priority: self.priority,
        }
    }
}

/// The service made by [`RateLimitLayer`]: takes a place in the queue when called (so the
/// order of calls is the order of service), waits for a token, then sends.
#[derive(Debug)]
pub struct RateLimited<S> {
    // The inner stack (kube's boxed service) is not `Clone`; the lock is held only for its
    // readiness and `call`, not while the response comes.
    inner: Arc<tokio::sync::Mutex<S>>,
    limiter: Arc<RateLimiter>,
    priority: Priority,
}

impl<S, B> Service<Request<Body>> for RateLimited<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        let key = request_key(req.method(), req.uri());
        // The place in the queue is taken now, in call order (kube's buffer calls in the
        // order the requests were made); dropping the future gives it up.
        let ticket = self.limiter.enqueue(self.priority);
        Box::pin(async move {
            ticket.wait(&key).await;
            let fut = {
                let mut svc = inner.lock().await;
                svc.ready().await.map_err(Into::into)?;
                svc.call(req)
            };
            fut.await.map_err(Into::into)
        })
    }
}

/// `plugreg_kube_requests_total{verb,resource}`: the requests counted so far, for the
/// registry ([`Metrics::register`](crate::metrics::Metrics::register)).
impl Collector for RateLimiter {
    fn collect(&self, families: &mut Families) {
        requests(self, None, families);
    }
}

/// One controller's bucket among several in one process (`csi-sidecars`): its
/// `plugreg_kube_requests_total` series carry the label `controller`.
#[derive(Debug)]
pub struct ControllerRequests {
    /// The controller's bucket.
    pub limiter: Arc<RateLimiter>,
    /// The `controller` label's value.
    pub controller: String,
}

impl Collector for ControllerRequests {
    fn collect(&self, families: &mut Families) {
        requests(&self.limiter, Some(&self.controller), families);
    }
}

fn requests(limiter: &RateLimiter, controller: Option<&str>, families: &mut Families) {
    let kube = limiter.requests_by_kind();
    families.samples(
        "plugreg_kube_requests_total",
        "Requests sent to the Kubernetes API server (both clients), by verb and resource.",
        "counter",
        kube.iter().map(|(k, n)| {
            let (verb, resource) = k.split_once(' ').unwrap_or((k.as_str(), ""));
            let labels = match controller {
                Some(c) => {
                    prom::labels(&[("controller", c), ("resource", resource), ("verb", verb)])
                }
                None => prom::labels(&[("resource", resource), ("verb", verb)]),
            };
            (labels, *n as f64)
        }),
    );
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_user_agent_names_the_program_as_client_go_does() {
        let ua = user_agent(Some(std::ffi::OsStr::new("/bin/csi-provisioner")), "v0.1.0");
        assert!(ua.starts_with("csi-provisioner/v0.1.0 (linux/"), "{ua}");
        assert!(ua.ends_with(") plugreg"), "{ua}");
        assert!(user_agent(None, "v1").starts_with("plugreg/v1 ("));
        assert!(http::HeaderValue::from_str(&ua).is_ok());
    }

    use super::*;

    /// The connector takes the config's server name as kube's does, and refuses one that is
    /// no server name as kube does.
    #[test]
    fn the_https_connector_takes_the_configs_server_name() {
        let mut config = kube::Config::new("https://127.0.0.1:6443".parse().expect("uri"));
        assert!(https_connector(&config, HttpConnector::new(), true).is_ok());
        config.tls_server_name = Some("kubernetes.default.svc".into());
        assert!(https_connector(&config, HttpConnector::new(), true).is_ok());
        config.tls_server_name = Some("not a name".into());
        assert!(matches!(
            https_connector(&config, HttpConnector::new(), true),
            Err(kube::Error::RustlsTls(_))
        ));
    }

    fn spawn_acquire(
        limiter: &Arc<RateLimiter>,
        priority: Priority,
        tag: &'static str,
        done: &tokio::sync::mpsc::UnboundedSender<(&'static str, Duration)>,
        start: Instant,
    ) -> tokio::task::JoinHandle<()> {
        // The ticket is taken before the task runs: the order of these calls is the order of
        // service.
        let ticket = limiter.enqueue(priority);
        let done = done.clone();
        tokio::spawn(async move {
            ticket.wait(tag).await;
            let _ = done.send((tag, start.elapsed()));
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_bucket_of_burst_then_one_token_every_one_over_qps() {
        let limiter = Arc::new(RateLimiter::new(5.0, 10));
        let start = Instant::now();
        let mut at = Vec::new();
        for _ in 0..20 {
            limiter.acquire(Priority::High, "GET x").await;
            at.push(start.elapsed());
        }
        for t in &at[..10] {
            assert_eq!(*t, Duration::ZERO);
        }
        for (i, t) in at[10..].iter().enumerate() {
            let want = 0.2 * (i + 1) as f64;
            assert!(
                (t.as_secs_f64() - want).abs() < 0.002,
                "request {} at {t:?}, want {want}s",
                i + 10
            );
        }
        assert_eq!(limiter.requests(), 20);
        assert_eq!(limiter.requests_by_kind()["GET x"], 20);
    }

    #[tokio::test(start_paused = true)]
    async fn the_bucket_refills_while_idle_but_not_beyond_burst() {
        let limiter = Arc::new(RateLimiter::new(1.0, 3));
        for _ in 0..3 {
            limiter.acquire(Priority::Low, "k").await;
        }
        tokio::time::sleep(Duration::from_secs(100)).await;
        let start = Instant::now();
        for _ in 0..3 {
            limiter.acquire(Priority::Low, "k").await;
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        limiter.acquire(Priority::Low, "k").await;
        assert!((start.elapsed().as_secs_f64() - 1.0).abs() < 0.002);
    }

    #[tokio::test(start_paused = true)]
    async fn a_low_request_waits_while_high_ones_wait_even_if_it_came_first() {
        let limiter = Arc::new(RateLimiter::new(1.0, 1));
        limiter.acquire(Priority::High, "first").await; // empties the bucket
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let start = Instant::now();
        let mut tasks = vec![spawn_acquire(&limiter, Priority::Low, "low1", &tx, start)];
        for tag in ["high1", "high2", "high3"] {
            tasks.push(spawn_acquire(&limiter, Priority::High, tag, &tx, start));
        }
        tasks.push(spawn_acquire(&limiter, Priority::Low, "low2", &tx, start));
        assert_eq!(limiter.waiting(), (3, 2));
        for t in tasks {
            t.await.unwrap();
        }
        drop(tx);
        let mut order = Vec::new();
        while let Some((tag, at)) = rx.recv().await {
            order.push((tag, at.as_secs_f64().round() as u64));
        }
        assert_eq!(
            order,
            [
                ("high1", 1),
                ("high2", 2),
                ("high3", 3),
                ("low1", 4),
                ("low2", 5)
            ]
        );
        assert_eq!(limiter.waiting(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn requests_of_one_priority_are_served_in_order() {
        let limiter = Arc::new(RateLimiter::new(10.0, 2));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let start = Instant::now();
        let tags = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let tasks: Vec<_> = tags
            .iter()
            .map(|t| spawn_acquire(&limiter, Priority::Low, t, &tx, start))
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        drop(tx);
        let mut order = Vec::new();
        while let Some((tag, _)) = rx.recv().await {
            order.push(tag);
        }
        assert_eq!(order, tags);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_waiter_gives_up_its_place() {
        let limiter = Arc::new(RateLimiter::new(1.0, 1));
        limiter.acquire(Priority::High, "k").await;
        let high = limiter.enqueue(Priority::High);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let low = spawn_acquire(&limiter, Priority::Low, "low", &tx, Instant::now());
        // The low request would wait for the high one forever if its ticket stayed queued.
        drop(high);
        low.await.unwrap();
        assert_eq!(rx.recv().await.unwrap().0, "low");
        assert_eq!(limiter.waiting(), (0, 0));
        assert_eq!(limiter.requests(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn negative_qps_means_no_limit_and_zero_means_client_gos_defaults() {
        let unlimited = Arc::new(RateLimiter::new(-1.0, 1));
        let start = Instant::now();
        for _ in 0..1000 {
            unlimited.acquire(Priority::Low, "k").await;
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(unlimited.requests(), 1000);

        let defaults = Arc::new(RateLimiter::new(0.0, 0));
        for _ in 0..11 {
            defaults.acquire(Priority::High, "k").await;
        }
        assert!((start.elapsed().as_secs_f64() - 0.2).abs() < 0.002);
    }

    #[tokio::test]
    async fn distinct_keys_are_bounded() {
        let limiter = Arc::new(RateLimiter::new(-1.0, 1));
        for i in 0..MAX_KEYS + 10 {
            limiter.acquire(Priority::Low, &format!("k{i}")).await;
        }
        let by_kind = limiter.requests_by_kind();
        assert_eq!(by_kind.len(), MAX_KEYS + 1);
        assert_eq!(by_kind[OTHER_KEY], 10);
        assert_eq!(by_kind.values().sum::<u64>(), limiter.requests());
    }

    #[test]
    fn request_keys_name_the_verb_and_the_resource() {
        let key = |m: &str, u: &str| request_key(&m.parse().unwrap(), &u.parse().unwrap());
        assert_eq!(
            key("POST", "/api/v1/persistentvolumes?"),
            "POST persistentvolumes"
        );
        assert_eq!(
            key("GET", "/api/v1/persistentvolumes/pv-1"),
            "GET persistentvolumes"
        );
        assert_eq!(
            key(
                "GET",
                "/api/v1/persistentvolumes?watch=true&resourceVersion=5"
            ),
            "WATCH persistentvolumes"
        );
        assert_eq!(
            key(
                "GET",
                "/api/v1/namespaces/ns/persistentvolumeclaims?limit=500"
            ),
            "LIST persistentvolumeclaims"
        );
        assert_eq!(
            key(
                "PUT",
                "/api/v1/namespaces/ns/persistentvolumeclaims/c/status"
            ),
            "PUT persistentvolumeclaims/status"
        );
        assert_eq!(
            key("PATCH", "/api/v1/namespaces/default/events/e.1"),
            "PATCH events"
        );
        assert_eq!(
            key("GET", "/apis/storage.k8s.io/v1/storageclasses"),
            "LIST storageclasses"
        );
        assert_eq!(
            key(
                "PUT",
                "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/l"
            ),
            "PUT leases"
        );
        assert_eq!(
            key("GET", "/api/v1/namespaces/kube-system"),
            "GET namespaces"
        );
        assert_eq!(key("GET", "/api/v1/namespaces"), "LIST namespaces");
        assert_eq!(key("GET", "/version"), "GET /version");
        let long = format!("/{}", "a".repeat(300));
        assert_eq!(key("GET", &long), format!("GET {}", &long[..100]));
        assert_eq!(
            key("GET", "/apis/storage.k8s.io/v1"),
            "GET /apis/storage.k8s.io/v1"
        );
    }
}
