//! A real kube-apiserver (v1.20.2 or v1.36.2) with its own etcd, on loopback only.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tempfile::TempDir;
use tokio::time::Instant;

use crate::error::Error;
use crate::kubelet::KubeVersion;
use crate::peers::{ETCD, peer};

/// How long [`ApiServer::start`] waits for etcd and for the API server.
const READY_TIMEOUT: Duration = Duration::from_secs(90);
/// How often readiness is polled.
const POLL: Duration = Duration::from_millis(200);
/// How many times start-up is retried when a chosen port was taken meanwhile.
const PORT_ATTEMPTS: usize = 4;
/// How many bytes of a log an error message shows.
const LOG_TAIL_BYTES: u64 = 6000;

/// A running kube-apiserver (v1.20.2 or v1.36.2, see [`start_version`](Self::start_version))
/// backed by its own etcd (3.4, Debian's), both listening on free ports of 127.0.0.1, with a throw-away CA, server certificate,
/// service-account key pair and a static admin token (group
/// `system:masters`), all in a temporary directory.
///
/// Dropping it kills both processes, waits for them and removes the
/// directory. Each instance is independent, so tests may run several in
/// parallel (about 300 MB of memory each).
#[derive(Debug)]
pub struct ApiServer {
    version: KubeVersion,
    /// Kubeconfig files of the node identities, by node name.
    node_kubeconfigs: Vec<(String, PathBuf)>,
    etcd: Option<Child>,
    apiserver: Option<Child>,
    url: String,
    token: String,
    kubeconfig: PathBuf,
    ca_cert: PathBuf,
    pki: Pki,
    log: PathBuf,
    /// The audit log, when [`ApiServerOptions::audit`] asked for one.
    audit_log: Option<PathBuf>,
    // Dropped last (fields drop in declaration order, after Drop::drop).
    dir: TempDir,
}

/// How [`ApiServer::start_with`] sets the API server up.
#[derive(Debug, Clone, Default)]
pub struct ApiServerOptions {
    /// Node names that get a kubelet's identity (user `system:node:<name>`, group
    /// `system:nodes`, a static token; see [`ApiServer::node_kubeconfig`]). When any is given,
    /// authorization is `Node,RBAC` and the NodeRestriction admission is on, as in a kubeadm
    /// cluster.
    pub nodes: Vec<String>,
    /// Write an audit log (JSON lines, level Metadata, stage ResponseComplete only) of every
    /// request: who asked what, when it arrived and when it was answered. For tracing where a
    /// step's time goes ([`ApiServer::audit_log_path`]).
    pub audit: bool,
}

impl ApiServer {
    /// Starts etcd and kube-apiserver v1.20.2; see [`start_version`](Self::start_version).
    pub async fn start() -> Result<ApiServer, Error> {
        Self::start_version(KubeVersion::V1_20_2).await
    }

    /// Starts etcd and kube-apiserver of `version` and waits (at most 90 s)
    /// until `/readyz` answers `ok`, the `default` namespace exists and nodes
    /// can be listed.
    ///
    /// Fails with [`Error::MissingPeer`] if the peers are not built.
    pub async fn start_version(version: KubeVersion) -> Result<ApiServer, Error> {
        Self::start_with(version, &ApiServerOptions::default()).await
    }

    /// [`start_version`](Self::start_version) with `options`.
    pub async fn start_with(
        version: KubeVersion,
        options: &ApiServerOptions,
    ) -> Result<ApiServer, Error> {
        let etcd_bin = peer(ETCD)?;
        let apiserver_bin = peer(version.apiserver_peer())?;
        let dir = tempfile::Builder::new()
            .prefix("plugreg-apiserver-")
            .tempdir()
            .map_err(|e| Error::io("creating the API server's temp dir", e))?;
        let d = dir.path().to_path_buf();
        let pki = make_pki(&d)?;
        let token = new_token();
        let token_file = d.join("tokens.csv");
        let mut tokens = format!("{token},plugreg-admin,plugreg-admin-uid,\"system:masters\"\n");
        let mut node_tokens = Vec::new();
        for node in &options.nodes {
            let t = new_token();
            tokens.push_str(&format!(
                "{t},system:node:{node},plugreg-node-{node},\"system:nodes\"\n"
            ));
            node_tokens.push((node.clone(), t));
        }
        write_file(&token_file, &tokens)?;

        let etcd_log = d.join("etcd.log");
        let etcd = start_etcd(&etcd_bin, &d, &etcd_log).await?;
        let mut server = ApiServer {
            version,
            node_kubeconfigs: node_tokens
                .iter()
                .map(|(n, _)| (n.clone(), d.join(format!("kubeconfig-node-{n}"))))
                .collect(),
            etcd: Some(etcd.child),
            apiserver: None,
            url: String::new(),
            token,
            kubeconfig: d.join("kubeconfig"),
            ca_cert: pki.ca_cert.clone(),
            pki,
            log: d.join("kube-apiserver.log"),
            audit_log: options.audit.then(|| d.join("audit.log")),
            dir,
        };
        let mut audit_args = Vec::new();
        if let Some(path) = &server.audit_log {
            let policy = d.join("audit-policy.yaml");
            write_file(
                &policy,
                "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived, ResponseStarted]\nrules:\n- level: Metadata\n",
            )?;
            audit_args = vec![
                format!("--audit-policy-file={}", policy.display()),
                format!("--audit-log-path={}", path.display()),
                "--audit-log-format=json".to_owned(),
                "--audit-log-mode=blocking".to_owned(),
            ];
        }

        let mut last_err = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port()?;
            let log = File::create(&server.log)
                .map_err(|e| Error::io("creating kube-apiserver.log", e))?;
            let log2 = log
                .try_clone()
                .map_err(|e| Error::io("cloning a log handle", e))?;
            let child = Command::new(&apiserver_bin)
                .args(apiserver_args(
                    version,
                    &d,
                    &server.pki,
                    &token_file,
                    etcd.client_port,
                    port,
                    !options.nodes.is_empty(),
                ))
                .args(&audit_args)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2)
                .spawn()
                .map_err(|e| Error::io(format!("spawning {}", apiserver_bin.display()), e))?;
            server.apiserver = Some(child);
            server.url = format!("https://127.0.0.1:{port}");
            server.write_kubeconfig(&server.kubeconfig, "plugreg-admin", &server.token)?;
            for ((node, token), (_, path)) in node_tokens.iter().zip(&server.node_kubeconfigs) {
                server.write_kubeconfig(path, &format!("system:node:{node}"), token)?;
            }
            match server.wait_ready().await {
                Ok(()) => return Ok(server),
                Err(e) => {
                    let log = tail_of(&server.log);
                    if let Some(mut c) = server.apiserver.take() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    if !log.contains("address already in use") {
                        return Err(e);
                    }
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| Error::NotReady {
            peer: version.apiserver_peer().to_owned(),
            reason: "no free port".to_owned(),
            log: String::new(),
        }))
    }

    /// The API server of `version` that the tests of this process running now share: the
    /// first caller starts it (see [`start_version`](Self::start_version)), later callers get
    /// the same one while any holder keeps its `Arc`, and it stops when the last is dropped.
    /// Sharing saves a start (~5 s) and ~300 MB per test; tests that share one must use
    /// their own object names (e.g. their own Node).
    pub async fn shared(version: KubeVersion) -> Result<Arc<ApiServer>, Error> {
        type Slot = tokio::sync::Mutex<Weak<ApiServer>>;
        static SLOTS: OnceLock<Vec<(KubeVersion, Slot)>> = OnceLock::new();
        let slots = SLOTS.get_or_init(|| {
            KubeVersion::ALL
                .iter()
                .map(|v| (*v, tokio::sync::Mutex::new(Weak::new())))
                .collect()
        });
        let (_, slot) = slots
            .iter()
            .find(|(v, _)| *v == version)
            .expect("KubeVersion::ALL lists every version");
        // Held while starting, so that concurrent callers wait for this one server.
        let mut slot = slot.lock().await;
        if let Some(s) = slot.upgrade() {
            return Ok(s);
        }
        let s = Arc::new(Self::start_version(version).await?);
        *slot = Arc::downgrade(&s);
        Ok(s)
    }

    /// The audit log (JSON lines), when it was asked for ([`ApiServerOptions::audit`]).
    pub fn audit_log_path(&self) -> Option<&Path> {
        self.audit_log.as_deref()
    }

    /// The release of this API server.
    pub fn version(&self) -> KubeVersion {
        self.version
    }

    /// The API server's URL, `https://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The bearer token of a `system:masters` user.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// A kubeconfig file (usable with `kubectl --kubeconfig`) for the admin
    /// user.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// A kubeconfig file of the kubelet identity of `node` (user `system:node:<node>`, group
    /// `system:nodes`), if it was asked for in [`ApiServerOptions::nodes`].
    pub fn node_kubeconfig(&self, node: &str) -> Option<&Path> {
        self.node_kubeconfigs
            .iter()
            .find(|(n, _)| n == node)
            .map(|(_, p)| p.as_path())
    }

    /// A client with the kubelet identity of `node` (see [`node_kubeconfig`](Self::node_kubeconfig)).
    pub async fn node_client(&self, node: &str) -> Result<kube::Client, Error> {
        let path = self.node_kubeconfig(node).ok_or_else(|| {
            Error::io(
                format!("no identity for node {node:?}"),
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )
        })?;
        client_from(path).await
    }

    /// The PEM file of the CA that signed the server certificate.
    pub fn ca_cert_path(&self) -> &Path {
        &self.ca_cert
    }

    /// The process ids of kube-apiserver and etcd, while they run.
    pub fn pids(&self) -> Vec<u32> {
        [&self.apiserver, &self.etcd]
            .into_iter()
            .flatten()
            .map(Child::id)
            .collect()
    }

    /// The port of [`url`](Self::url) on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_default()
    }

    /// The PEM file of the private key that signs service-account tokens (what
    /// kube-controller-manager's `--service-account-private-key-file` needs to issue the token
    /// secrets that v1.20 pods mount).
    pub fn service_account_key_path(&self) -> &Path {
        &self.pki.sa_key
    }

    /// The temporary directory holding certificates, logs and etcd's data.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The serving certificate (for IP 127.0.0.1, signed by the CA) and its key; other
    /// loopback servers of the same test may serve with them.
    pub(crate) fn serving_cert(&self) -> (&Path, &Path) {
        (&self.pki.server_cert, &self.pki.server_key)
    }

    /// The end of kube-apiserver's log.
    pub fn log_tail(&self) -> String {
        tail_of(&self.log)
    }

    /// A client for the admin user, built from [`kubeconfig_path`](Self::kubeconfig_path).
    pub async fn client(&self) -> Result<kube::Client, Error> {
        client_from(&self.kubeconfig).await
    }

    /// Writes to `path` a kubeconfig that authenticates as ServiceAccount `ns/account` (which
    /// must exist) with a fresh token of it (TokenRequest, one hour): a sidecar started with it
    /// has exactly the rights RBAC gives that account.
    pub async fn service_account_kubeconfig(
        &self,
        ns: &str,
        account: &str,
        path: &Path,
    ) -> Result<(), Error> {
        use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
        use k8s_openapi::api::core::v1::ServiceAccount;
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(3600),
                bound_object_ref: None,
            },
            ..Default::default()
        };
        let status = kube::Api::<ServiceAccount>::namespaced(self.client().await?, ns)
            .create_token_request(account, &kube::api::PostParams::default(), &request)
            .await?
            .status
            .ok_or_else(|| Error::Unsupported("a TokenRequest answered without a token".into()))?;
        self.write_kubeconfig(
            path,
            &format!("system:serviceaccount:{ns}:{account}"),
            &status.token,
        )
    }

    fn write_kubeconfig(&self, path: &Path, user: &str, token: &str) -> Result<(), Error> {
        let kc = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{
                "name": "plugreg-test",
                "cluster": {
                    "server": self.url,
                    "certificate-authority": self.ca_cert,
                },
            }],
            "users": [{ "name": user, "user": { "token": token } }],
            "contexts": [{
                "name": "plugreg-test",
                "context": { "cluster": "plugreg-test", "user": user },
            }],
            "current-context": "plugreg-test",
        });
        write_file(path, &format!("{kc:#}\n"))
    }

    async fn wait_ready(&mut self) -> Result<(), Error> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let client = self.client().await?;
        loop {
            if let Some(c) = self.apiserver.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                return Err(self.not_ready(format!("kube-apiserver exited ({st})")));
            }
            if let Some(c) = self.etcd.as_mut()
                && let Ok(Some(st)) = c.try_wait()
            {
                return Err(Error::NotReady {
                    peer: ETCD.to_owned(),
                    reason: format!("etcd exited ({st})"),
                    log: tail_of(&self.dir.path().join("etcd.log")),
                });
            }
            let last = match tokio::time::timeout(Duration::from_secs(10), probe(&client)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => e,
                Err(_) => "probe timed out".to_owned(),
            };
            if Instant::now() >= deadline {
                return Err(self.not_ready(format!(
                    "not ready within {READY_TIMEOUT:?}; last probe: {last}"
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn not_ready(&self, reason: String) -> Error {
        Error::NotReady {
            peer: self.version.apiserver_peer().to_owned(),
            reason,
            log: tail_of(&self.log),
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for child in [self.apiserver.take(), self.etcd.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

async fn client_from(kubeconfig: &Path) -> Result<kube::Client, Error> {
    let kc = Kubeconfig::read_from(kubeconfig)?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(30));
    Ok(kube::Client::try_from(config)?)
}

/// One readiness probe: `/readyz` is `ok`, the `default` namespace exists,
/// nodes can be listed.
async fn probe(client: &kube::Client) -> Result<(), String> {
    let req = kube::core::Request::new("")
        .get("readyz", &Default::default())
        .map_err(|e| e.to_string())?;
    let body = client
        .request_text(req)
        .await
        .map_err(|e| format!("/readyz: {e}"))?;
    if body.trim() != "ok" {
        return Err(format!("/readyz: {body}"));
    }
    Api::<Namespace>::all(client.clone())
        .get("default")
        .await
        .map_err(|e| format!("get namespace default: {e}"))?;
    Api::<Node>::all(client.clone())
        .list(&ListParams::default().limit(1))
        .await
        .map_err(|e| format!("list nodes: {e}"))?;
    Ok(())
}

struct Etcd {
    child: Child,
    client_port: u16,
}

/// Starts etcd on two free ports and waits for its `/health`; retries with
/// new ports when one was taken meanwhile.
async fn start_etcd(bin: &Path, dir: &Path, log_path: &Path) -> Result<Etcd, Error> {
    let mut last = String::new();
    for attempt in 0..PORT_ATTEMPTS {
        let client_port = free_port()?;
        let peer_port = free_port()?;
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let data = dir.join(format!("etcd-data-{attempt}"));
        let log = File::create(log_path).map_err(|e| Error::io("creating etcd.log", e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| Error::io("cloning a log handle", e))?;
        let mut child = Command::new(bin)
            .arg("--name=default")
            .arg(format!("--data-dir={}", data.display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=default={peer_url}"))
            .env_remove("ETCD_NAME")
            .env_remove("ETCD_DATA_DIR")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .spawn()
            .map_err(|e| Error::io(format!("spawning {}", bin.display()), e))?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                last = format!("etcd exited ({st})");
                break;
            }
            if etcd_healthy(client_port) {
                return Ok(Etcd { child, client_port });
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::NotReady {
                    peer: ETCD.to_owned(),
                    reason: format!("/health not ok within {READY_TIMEOUT:?}"),
                    log: tail_of(log_path),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !tail_of(log_path).contains("address already in use") {
            break;
        }
    }
    Err(Error::NotReady {
        peer: ETCD.to_owned(),
        reason: last,
        log: tail_of(log_path),
    })
}

/// etcd's `GET /health` answers 200 with `"health":"true"`.
fn etcd_healthy(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    plain_get(addr, "/health")
        .is_some_and(|(status, body)| status == 200 && body.contains("\"health\":\"true\""))
}

/// A blocking but short (loopback, 1 s timeouts) plain HTTP/1.0 `GET path`: the status and the
/// body, or `None` if nothing answered.
pub(crate) fn plain_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .ok()?;
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let status = head
        .strip_prefix("HTTP/1.")
        .and_then(|r| r.get(2..5))
        .and_then(|c| c.parse().ok())?;
    Some((status, body.to_owned()))
}

fn apiserver_args(
    version: KubeVersion,
    dir: &Path,
    pki: &Pki,
    token_file: &Path,
    etcd_port: u16,
    port: u16,
    node_restriction: bool,
) -> Vec<String> {
    let mut args = vec![
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        "--bind-address=127.0.0.1".to_owned(),
        "--advertise-address=127.0.0.1".to_owned(),
        format!("--secure-port={port}"),
        format!("--tls-cert-file={}", pki.server_cert.display()),
        format!("--tls-private-key-file={}", pki.server_key.display()),
        format!("--client-ca-file={}", pki.ca_cert.display()),
        format!("--token-auth-file={}", token_file.display()),
        "--authorization-mode=RBAC".to_owned(),
        format!("--service-account-key-file={}", pki.sa_pub.display()),
        format!(
            "--service-account-signing-key-file={}",
            pki.sa_key.display()
        ),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
        "--service-cluster-ip-range=10.0.0.0/24".to_owned(),
        format!("--cert-dir={}", dir.join("cert-dir").display()),
        "--endpoint-reconciler-type=none".to_owned(),
        "--profiling=false".to_owned(),
        // As kubeadm and kind set it: CSI node plugins run privileged.
        "--allow-privileged=true".to_owned(),
    ];
    if node_restriction {
        for a in args
            .iter_mut()
            .filter(|a| *a == "--authorization-mode=RBAC")
        {
            *a = "--authorization-mode=Node,RBAC".to_owned();
        }
        args.push("--enable-admission-plugins=NodeRestriction".to_owned());
    }
    // 1.20 still has an insecure HTTP port unless told not to; 1.24 removed the flag.
    if version == KubeVersion::V1_20_2 {
        args.push("--insecure-port=0".to_owned());
    }
    args
}

/// A currently free TCP port on 127.0.0.1 (bound to port 0 and released), never one this
/// process handed out before. Another process may still take it before it is used; callers
/// retry on collision.
///
/// The memory matters: the kernel may give a released port back to the next bind, and two
/// peers (or two host-network pods of one cluster, which the scheduler then refuses to place
/// together: "didn't have free ports for the requested pod ports") would get the same port.
pub fn free_port() -> Result<u16, Error> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    for _ in 0..1000 {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .map_err(|e| Error::io("binding 127.0.0.1:0 to find a free port", e))?;
        let port = l
            .local_addr()
            .map_err(|e| Error::io("reading a bound port", e))?
            .port();
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if given.insert(port) {
            return Ok(port);
        }
    }
    Err(Error::io(
        "finding a free port on 127.0.0.1 not handed out before",
        std::io::Error::from(std::io::ErrorKind::AddrInUse),
    ))
}

#[derive(Debug)]
struct Pki {
    ca_cert: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    sa_key: PathBuf,
    sa_pub: PathBuf,
}

/// Makes a CA, a server certificate for 127.0.0.1 and a service-account key
/// pair with the `openssl` command.
fn make_pki(dir: &Path) -> Result<Pki, Error> {
    let p = |n: &str| dir.join(n);
    let s = |n: &str| p(n).display().to_string();
    let ec = [
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
    ];
    openssl(&[&ec[..], &["-out", &s("ca.key")]].concat())?;
    openssl(&[
        "req",
        "-x509",
        "-new",
        "-key",
        &s("ca.key"),
        "-sha256",
        "-days",
        "3650",
        "-subj",
        "/CN=plugreg-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-out",
        &s("ca.crt"),
    ])?;
    openssl(&[&ec[..], &["-out", &s("server.key")]].concat())?;
    openssl(&[
        "req",
        "-new",
        "-key",
        &s("server.key"),
        "-subj",
        "/CN=kube-apiserver",
        "-out",
        &s("server.csr"),
    ])?;
    write_file(
        &p("server.ext"),
        "basicConstraints=critical,CA:FALSE\n\
         keyUsage=critical,digitalSignature,keyEncipherment\n\
         extendedKeyUsage=serverAuth\n\
         subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        &s("server.csr"),
        "-CA",
        &s("ca.crt"),
        "-CAkey",
        &s("ca.key"),
        "-CAcreateserial",
        "-days",
        "3650",
        "-sha256",
        "-extfile",
        &s("server.ext"),
        "-out",
        &s("server.crt"),
    ])?;
    openssl(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        &s("sa.key"),
    ])?;
    openssl(&["pkey", "-in", &s("sa.key"), "-pubout", "-out", &s("sa.pub")])?;
    Ok(Pki {
        ca_cert: p("ca.crt"),
        server_cert: p("server.crt"),
        server_key: p("server.key"),
        sa_key: p("sa.key"),
        sa_pub: p("sa.pub"),
    })
}

fn openssl(args: &[&str]) -> Result<(), Error> {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::io("running openssl (is it installed?)", e))?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Command {
        command: format!("openssl {}", args.join(" ")),
        status: out.status.to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

pub(crate) fn write_file(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// A token unique enough for a throw-away loopback server.
fn new_token() -> String {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut h = RandomState::new().build_hasher();
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    let a = h.finish();
    let mut h = RandomState::new().build_hasher();
    h.write_u64(a);
    format!("plugreg-{a:016x}{:016x}", h.finish())
}

/// The last few KB of a log file, or a note that it cannot be read.
pub(crate) fn tail_of(path: &Path) -> String {
    use std::io::{Seek, SeekFrom};
    let Ok(mut f) = File::open(path) else {
        return format!("({} not readable)", path.display());
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}
