//! The node: containerd and the whole kubelet of one release, in their own mount and PID
//! namespaces, with every path they write in the node's temporary directory.
//!
//! Why namespaces: the kubelet and containerd write to fixed host paths whatever they are
//! told (`/var/log/pods`, `/var/log/containers`, `/run/containerd`, the flexvolume directory),
//! set kernel settings and iptables rules, and the pods they run leave bind mounts behind.
//! A holder process (`unshare --mount --pid --fork`, running `node-init.sh` as PID 1) gives
//! the node a mount namespace in which `/var/lib`, `/var/log` and `/run` are directories of
//! the node's temporary directory, the kernel settings the kubelet wants are files that
//! already say so, and iptables fails; containerd and the kubelet enter it with `nsenter`.
//! So two nodes never collide, the host keeps its files, settings and rules, `/var/lib/kubelet`
//! is where `deploy/` expects it, and tearing down is killing PID 1: the kernel kills every
//! process of the namespace (shims and containers included) and drops every mount in it.
//! Pods' cgroups go under a cgroup root of the node's own (`/plugreg-<node dir>`), removed
//! last.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use plugreg_testpeers::{KubeVersion, peer};
use rustix::process::Signal;
use tempfile::TempDir;
use tokio::time::Instant;

use crate::error::Error;
use crate::host::{self, CNI_BIN_DIR, PEERS_SETUP};

/// The init script run as PID 1 of the node's namespaces.
const NODE_INIT: &str = include_str!("node-init.sh");

/// The kernel settings the kubelet makes sure of at start (its `setupKernelTunables`, the
/// same list in v1.20.2 and v1.36.2). Inside the node they read as these values.
const KUBELET_SYSCTLS: &str = "vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 \
     kernel/panic_on_oops=1 kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000";

/// How long a node process gets to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long containerd gets to answer.
const CONTAINERD_READY: Duration = Duration::from_secs(60);

/// The sandbox (pause) image both containerd configurations name.
pub const SANDBOX_IMAGE: &str = "registry.k8s.io/pause:3.10";
/// The containerd namespace of the CRI plugin.
pub const CRI_NAMESPACE: &str = "k8s.io";

/// What a node is made of.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The Kubernetes release of the kubelet (v1.20.2 runs with containerd 1.6, v1.36.2 with
    /// containerd 2.3.4).
    pub version: KubeVersion,
    /// The Node's name.
    pub name: String,
    /// The kubeconfig the kubelet reaches the API server with.
    pub kubeconfig: PathBuf,
    /// The kubelet's `-v` level.
    pub kubelet_verbosity: u8,
}

/// The containerd release a kubelet release runs with, as peer names.
struct Containerd {
    daemon: &'static str,
    shim: &'static str,
    ctr: &'static str,
}

fn containerd_of(version: KubeVersion) -> Containerd {
    match version {
        // Debian's containerd 1.6 (a v1.20 kubelet speaks CRI v1alpha2, which 1.6 serves).
        KubeVersion::V1_20_2 => Containerd {
            daemon: "containerd-v1.6",
            shim: "containerd-shim-runc-v2-v1.6",
            ctr: "ctr-v1.6",
        },
        // Kubernetes 1.35 was the last release to run containerd 1.x.
        KubeVersion::V1_36_2 => Containerd {
            daemon: "containerd-v2.3.4",
            shim: "containerd-shim-runc-v2-v2.3.4",
            ctr: "ctr-v2.3.4",
        },
    }
}

/// A process running inside the node's namespaces: `nsenter` (our child) and the program it
/// started (its child, by host PID).
#[derive(Debug)]
struct NodeProcess {
    name: &'static str,
    nsenter: Child,
    pid: u32,
    log: PathBuf,
}

/// A running node. Dropping it kills everything in it (see the module documentation).
#[derive(Debug)]
pub struct Node {
    config: NodeConfig,
    holder: Option<Child>,
    init_pid: u32,
    containerd: Option<NodeProcess>,
    kubelet: Option<NodeProcess>,
    kubelet_starts: u32,
    kubelet_port: u16,
    kubelet_healthz_port: u16,
    cgroup_name: String,
    cgroups: Vec<PathBuf>,
    // Dropped last (fields drop in declaration order, after Drop::drop); taken by Drop when
    // the directory is to be kept.
    dir: Option<TempDir>,
}

impl Node {
    /// Creates the node's namespaces and starts containerd in them (the kubelet starts with
    /// [`start_kubelet`](Self::start_kubelet), once the images it needs are imported).
    pub async fn start(config: NodeConfig) -> Result<Node, Error> {
        host::check()?;
        check_peers(config.version)?;
        // Short: unix socket paths under it must stay within 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("plugreg-node-")
            .tempdir()
            .map_err(|e| Error::io("creating the node's temp dir", e))?;
        let cgroup_name = format!(
            "plugreg-{}",
            dir.path().file_name().unwrap_or_default().to_string_lossy()
        );
        let mut node = Node {
            config,
            holder: None,
            init_pid: 0,
            containerd: None,
            kubelet: None,
            kubelet_starts: 0,
            kubelet_port: host::free_port()?,
            kubelet_healthz_port: host::free_port()?,
            cgroup_name,
            cgroups: Vec::new(),
            dir: Some(dir),
        };
        node.make_cgroups()?;
        node.start_holder()?;
        node.start_containerd().await?;
        Ok(node)
    }

    /// The node's temporary directory (logs, configuration, and what the node sees as
    /// `/var/lib`, `/var/log` and `/run`).
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().map_or(Path::new("/"), TempDir::path)
    }

    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The release of the kubelet.
    pub fn version(&self) -> KubeVersion {
        self.config.version
    }

    /// Where a path of the node (as the kubelet and the pods' hostPath volumes see it) is on
    /// the host: `/var/lib/...`, `/var/log/...` and `/run/...` are in the node's directory,
    /// anything else is the host's own path.
    pub fn host_path(&self, node_path: impl AsRef<Path>) -> PathBuf {
        let p = node_path.as_ref();
        for (inside, outside) in [
            ("/var/lib", "var-lib"),
            ("/var/log", "var-log"),
            ("/run", "run"),
        ] {
            if let Ok(rest) = p.strip_prefix(inside) {
                return self.dir().join(outside).join(rest);
            }
        }
        p.to_owned()
    }

    /// The kubelet's log (every start appended, each after a `--- kubelet start N ---` line).
    pub fn kubelet_log(&self) -> PathBuf {
        self.dir().join("kubelet.log")
    }

    /// containerd's log.
    pub fn containerd_log(&self) -> PathBuf {
        self.dir().join("containerd.log")
    }

    /// The kubelet's log as text.
    pub fn kubelet_log_text(&self) -> String {
        std::fs::read_to_string(self.kubelet_log()).unwrap_or_default()
    }

    /// containerd's unix socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir().join("containerd.sock")
    }

    /// The host PID of the node's PID 1 (every node process is in its namespaces).
    pub fn init_pid(&self) -> u32 {
        self.init_pid
    }

    /// The host PID of the running kubelet.
    pub fn kubelet_pid(&self) -> Option<u32> {
        self.kubelet.as_ref().map(|k| k.pid)
    }

    /// The host PID of containerd.
    pub fn containerd_pid(&self) -> Option<u32> {
        self.containerd.as_ref().map(|c| c.pid)
    }

    /// The kubelet's ports on 127.0.0.1: its API and its `/healthz`.
    pub fn kubelet_ports(&self) -> (u16, u16) {
        (self.kubelet_port, self.kubelet_healthz_port)
    }

    /// The node's cgroup root (the kubelet's `cgroupRoot`), e.g. `/plugreg-plugreg-node-AbC123`.
    pub fn cgroup_root(&self) -> String {
        format!("/{}", self.cgroup_name)
    }

    /// Every mount point in the node's mount namespace (where the kubelet and the CSI driver
    /// mount volumes), as the node sees them.
    pub fn mounts(&self) -> Result<Vec<String>, Error> {
        host::mount_points(&PathBuf::from(format!("/proc/{}/mountinfo", self.init_pid)))
    }

    /// Every process of the node (host PIDs): containerd, the kubelet, the shims and every
    /// container's processes.
    pub fn processes(&self) -> Vec<u32> {
        let Ok(mine) = std::fs::read_link(format!("/proc/{}/ns/pid", self.init_pid)) else {
            return Vec::new();
        };
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                // Members of the node's PID namespace or of one nested in it (containers):
                // their NSpid line lists a PID for the node's namespace too.
                std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|ns| ns == mine)
                    || in_nested_namespace(*pid, self.init_pid)
            })
            .collect()
    }

    /// The processes of a container (host PIDs), by its CRI id (`containerd://<id>` in a pod's
    /// status, with or without the scheme): those whose cgroup path names it.
    pub fn container_processes(&self, container_id: &str) -> Vec<u32> {
        let id = container_id.rsplit("://").next().unwrap_or(container_id);
        if id.is_empty() {
            return Vec::new();
        }
        self.processes()
            .into_iter()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| {
                    c.lines()
                        .any(|l| l.ends_with(id) || l.contains(&format!("/{id}/")))
                })
            })
            .collect()
    }

    /// Imports an image archive (OCI or Docker) into the CRI's image store, named `base_name`
    /// plus the archive's own tag when given (`ctr images import --base-name`).
    pub fn import_image(&self, archive: &Path, base_name: Option<&str>) -> Result<(), Error> {
        let ctr = peer(containerd_of(self.config.version).ctr)?;
        let mut cmd = Command::new(ctr);
        cmd.arg("--address").arg(self.containerd_socket()).args([
            "-n",
            CRI_NAMESPACE,
            "images",
            "import",
        ]);
        if let Some(name) = base_name {
            cmd.arg("--base-name").arg(name);
        }
        cmd.arg(archive);
        host::run(&mut cmd).map(drop)
    }

    /// The images in the CRI's store (`ctr images ls -q`).
    pub fn images(&self) -> Result<Vec<String>, Error> {
        let ctr = peer(containerd_of(self.config.version).ctr)?;
        let out = host::run(
            Command::new(ctr)
                .arg("--address")
                .arg(self.containerd_socket())
                .args(["-n", CRI_NAMESPACE, "images", "ls", "-q"]),
        )?;
        Ok(out.lines().map(str::to_owned).collect())
    }

    /// Starts the kubelet (again, after [`stop_kubelet`](Self::stop_kubelet)), appending to
    /// its log. Whether it got the Node Ready is for the caller to watch in the API.
    pub fn start_kubelet(&mut self) -> Result<(), Error> {
        if self.kubelet.is_some() {
            return Ok(());
        }
        let version = self.config.version;
        let config = self.dir().join("kubelet.yaml");
        write(&config, &self.kubelet_config())?;
        let mut args = vec![
            format!("--kubeconfig={}", self.config.kubeconfig.display()),
            format!("--config={}", config.display()),
            "--root-dir=/var/lib/kubelet".to_owned(),
            format!("--hostname-override={}", self.config.name),
            // The kubelet does not report a loopback address as the Node's (it logs "nodeIP
            // can't be loopback address"), but with it set it picks no other: the Node has no
            // address, and nothing reaches out for one.
            "--node-ip=127.0.0.1".to_owned(),
            format!("--v={}", self.config.kubelet_verbosity),
        ];
        if version == KubeVersion::V1_20_2 {
            // v1.20's configuration file has no runtime endpoint yet.
            args.push("--container-runtime=remote".to_owned());
            args.push(format!(
                "--container-runtime-endpoint=unix://{}",
                self.containerd_socket().display()
            ));
        }
        self.kubelet_starts += 1;
        let log = self.kubelet_log();
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| Error::io(format!("opening {}", log.display()), e))?;
        let _ = writeln!(f, "--- kubelet start {} ---", self.kubelet_starts);
        let kubelet = peer(version.kubelet_peer())?;
        let home = self.dir().join("home");
        std::fs::create_dir_all(&home).map_err(|e| Error::io("creating the node's home", e))?;
        let env = vec![
            ("PATH".to_owned(), system_path()),
            ("HOME".to_owned(), home.display().to_string()),
            // v1.20's in-tree ECR credential provider asks the EC2 metadata service
            // (169.254.169.254) for credentials at start: not here.
            ("AWS_EC2_METADATA_DISABLED".to_owned(), "true".to_owned()),
        ];
        self.kubelet = Some(self.spawn_inside("kubelet", &kubelet, &args, &env, &log)?);
        Ok(())
    }

    /// Stops the kubelet (SIGTERM, then SIGKILL after 10 s), as `systemctl restart kubelet`
    /// does; the pods keep running.
    pub async fn stop_kubelet(&mut self) -> Result<(), Error> {
        if let Some(k) = self.kubelet.take() {
            stop(k).await?;
        }
        Ok(())
    }

    /// Whether the kubelet is still running (it exits on fatal errors).
    pub fn kubelet_running(&mut self) -> bool {
        match self.kubelet.as_mut() {
            Some(k) => matches!(k.nsenter.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// After the kubelet exited because one of its ports was taken meanwhile (they are picked
    /// free, then bound a little later): new ports. Whether that was the reason.
    pub fn repick_kubelet_ports(&mut self) -> Result<bool, Error> {
        let tail = host::tail_of(&self.kubelet_log());
        let tail = tail.rsplit("--- kubelet start").next().unwrap_or_default();
        if !tail.contains("address already in use") {
            return Ok(false);
        }
        if let Some(mut k) = self.kubelet.take() {
            let _ = k.nsenter.wait();
        }
        self.kubelet_port = host::free_port()?;
        self.kubelet_healthz_port = host::free_port()?;
        Ok(true)
    }

    /// An error describing the kubelet's state, with the end of its log.
    pub fn kubelet_error(&self, reason: impl Into<String>) -> Error {
        Error::Node {
            process: "kubelet".to_owned(),
            reason: reason.into(),
            log: self.kubelet_log(),
            tail: host::tail_of(&self.kubelet_log()),
        }
    }

    /// Stops the kubelet, then kills everything in the node (containerd, its shims, every
    /// container) by killing its PID 1, which also drops every mount the node made, and
    /// removes the node's cgroups. The pods should be gone first (the cluster deletes them):
    /// this works either way.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        self.stop_kubelet().await?;
        if let Some(c) = self.containerd.take() {
            stop(c).await?;
        }
        self.kill_all();
        Ok(())
    }

    fn kill_all(&mut self) {
        if self.init_pid != 0 {
            host::signal(self.init_pid, Signal::KILL);
        }
        for mut p in [self.kubelet.take(), self.containerd.take()]
            .into_iter()
            .flatten()
        {
            host::signal(p.pid, Signal::KILL);
            let _ = p.nsenter.wait();
        }
        if let Some(mut h) = self.holder.take() {
            let _ = h.kill();
            let _ = h.wait();
        }
        self.remove_cgroups();
    }

    /// A directory named after the node in every cgroup hierarchy: the kubelet's
    /// `cgroupRoot`, under which it puts every pod.
    fn make_cgroups(&mut self) -> Result<(), Error> {
        for mount in host::cgroup_mounts() {
            let dir = mount.join(&self.cgroup_name);
            match std::fs::create_dir(&dir) {
                Ok(()) => self.cgroups.push(dir),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                // A read-only or restricted hierarchy: the kubelet names the one it needs.
                Err(_) => {}
            }
        }
        if self.cgroups.is_empty() {
            return Err(Error::missing(
                format!(
                    "a writable cgroup hierarchy (could not create {} in any)",
                    self.cgroup_name
                ),
                "run as root with cgroupfs mounted read-write at /sys/fs/cgroup",
            ));
        }
        Ok(())
    }

    /// Removes the node's cgroups, deepest first; their processes are dead by now (a few
    /// retries while the kernel finishes with them).
    fn remove_cgroups(&mut self) {
        for root in std::mem::take(&mut self.cgroups) {
            for _ in 0..50 {
                if remove_tree(&root) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    fn start_holder(&mut self) -> Result<(), Error> {
        let log = self.dir().join("node-init.log");
        let stderr = File::create(&log).map_err(|e| Error::io("creating node-init.log", e))?;
        let mut holder = Command::new("setpriv")
            // If this process dies without dropping the node, the holder goes too, and with
            // it (--kill-child) PID 1 and every process of the node.
            .args(["--pdeathsig", "KILL", "--"])
            .args(["unshare", "--mount", "--pid", "--fork", "--kill-child"])
            .args(["--propagation", "slave", "--"])
            .args(["bash", "-c", NODE_INIT])
            .env_clear()
            .env("PATH", system_path())
            .env("NODE_ROOT", self.dir())
            .env("SYSCTLS", KUBELET_SYSCTLS)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| Error::io("starting the node's namespaces (setpriv unshare)", e))?;
        let stdout = holder.stdout.take();
        self.holder = Some(holder);
        if !wait_ready_line(stdout) {
            let status = self
                .holder
                .as_mut()
                .and_then(|h| h.try_wait().ok().flatten())
                .map_or_else(|| "still running".to_owned(), |s| s.to_string());
            return Err(Error::Node {
                process: "node-init (unshare --mount --pid)".to_owned(),
                reason: format!(
                    "did not set the node's namespaces up ({status}); can this host create \
                     mount and PID namespaces?"
                ),
                log: log.clone(),
                tail: host::tail_of(&log),
            });
        }
        let holder_pid = self.holder.as_ref().map_or(0, Child::id);
        self.init_pid = host::children_of(holder_pid)
            .into_iter()
            .next()
            .ok_or_else(|| Error::Node {
                process: "node-init".to_owned(),
                reason: "has no PID 1 child".to_owned(),
                log: log.clone(),
                tail: host::tail_of(&log),
            })?;
        Ok(())
    }

    async fn start_containerd(&mut self) -> Result<(), Error> {
        let runtime = containerd_of(self.config.version);
        let cni = self.dir().join("cni");
        std::fs::create_dir_all(&cni).map_err(|e| Error::io("creating the CNI dir", e))?;
        // Loopback only: a pod network gets no address (and no route anywhere); the pods use
        // the host's network, which is what every test pod and the deploy/ overlay ask for.
        write(
            &cni.join("10-lo.conflist"),
            r#"{"cniVersion": "1.0.0", "name": "lo-only", "plugins": [{"type": "loopback"}]}"#,
        )?;
        // containerd runs `containerd-shim-runc-v2` from PATH.
        let shims = self.dir().join("shims");
        std::fs::create_dir_all(&shims).map_err(|e| Error::io("creating the shim dir", e))?;
        let shim = peer(runtime.shim)?;
        std::os::unix::fs::symlink(&shim, shims.join("containerd-shim-runc-v2"))
            .map_err(|e| Error::io("linking the shim", e))?;
        let config = self.dir().join("containerd.toml");
        write(&config, &self.containerd_config())?;
        let daemon = peer(runtime.daemon)?;
        let args = vec![
            "--config".to_owned(),
            config.display().to_string(),
            "--address".to_owned(),
            self.containerd_socket().display().to_string(),
        ];
        let env = vec![(
            "PATH".to_owned(),
            format!("{}:{}", shims.display(), system_path()),
        )];
        let log = self.containerd_log();
        self.containerd = Some(self.spawn_inside("containerd", &daemon, &args, &env, &log)?);
        // Ready when it answers a client.
        let ctr = peer(runtime.ctr)?;
        let deadline = Instant::now() + CONTAINERD_READY;
        loop {
            let answered = host::run(
                Command::new(&ctr)
                    .arg("--address")
                    .arg(self.containerd_socket())
                    .arg("version"),
            );
            match answered {
                Ok(_) => return Ok(()),
                Err(e) => {
                    let exited = self
                        .containerd
                        .as_mut()
                        .is_some_and(|c| !matches!(c.nsenter.try_wait(), Ok(None)));
                    if exited || Instant::now() >= deadline {
                        return Err(Error::Node {
                            process: "containerd".to_owned(),
                            reason: if exited {
                                "exited".to_owned()
                            } else {
                                format!("did not answer within {CONTAINERD_READY:?}: {e}")
                            },
                            log: log.clone(),
                            tail: host::tail_of(&log),
                        });
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Runs `program` in the node's namespaces: `nsenter` into PID 1's mount and PID
    /// namespaces, `setpriv --pdeathsig TERM` so that the program ends if `nsenter` is killed.
    fn spawn_inside(
        &self,
        name: &'static str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: &Path,
    ) -> Result<NodeProcess, Error> {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| Error::io(format!("opening {}", log.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| Error::io("cloning a log handle", e))?;
        let mut nsenter = Command::new("nsenter")
            .arg(format!("--target={}", self.init_pid))
            .args(["--mount", "--pid", "--"])
            .args(["setpriv", "--pdeathsig", "TERM", "--"])
            .arg(program)
            .args(args)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| Error::io(format!("starting {name} (nsenter)"), e))?;
        // nsenter forks into the PID namespace: the program is its child.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let pid = loop {
            if let Some(pid) = host::children_of(nsenter.id()).into_iter().next() {
                break pid;
            }
            if !matches!(nsenter.try_wait(), Ok(None)) || std::time::Instant::now() >= deadline {
                let _ = nsenter.kill();
                let _ = nsenter.wait();
                return Err(Error::Node {
                    process: name.to_owned(),
                    reason: "did not start in the node's namespaces".to_owned(),
                    log: log.to_owned(),
                    tail: host::tail_of(log),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Ok(NodeProcess {
            name,
            nsenter,
            pid,
            log: log.to_owned(),
        })
    }

    fn containerd_config(&self) -> String {
        let root = self.dir().display().to_string();
        let sandbox = SANDBOX_IMAGE;
        match self.config.version {
            KubeVersion::V1_20_2 => format!(
                r#"version = 2
root = "{root}/containerd/root"
state = "{root}/containerd/state"
[grpc]
  address = "{root}/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox}"
  # The kubelet gives the sandbox oom_score_adj -998, which needs CAP_SYS_RESOURCE.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{root}/cni"
"#
            ),
            KubeVersion::V1_36_2 => format!(
                r#"version = 4
root = "{root}/containerd/root"
state = "{root}/containerd/state"
[grpc]
  address = "{root}/containerd.sock"
[plugins.'io.containerd.internal.v1.opt']
  path = '{root}/containerd/opt'
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{sandbox}'
[plugins.'io.containerd.cri.v1.runtime']
  # The kubelet gives the sandbox oom_score_adj -998, which needs CAP_SYS_RESOURCE.
  restrict_oom_score_adj = true
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['{CNI_BIN_DIR}']
  conf_dir = '{root}/cni'
"#
            ),
        }
    }

    fn kubelet_config(&self) -> String {
        let mut config = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 without systemd; pods under the node's own cgroup root.
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: {cgroup_root}
enforceNodeAllocatable: []
failSwapOn: false
authentication: {{anonymous: {{enabled: true}}, webhook: {{enabled: false}}}}
authorization: {{mode: AlwaysAllow}}
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
resolvConf: ""
# Inside the node's /var/lib (the default, /usr/libexec/kubernetes/..., is the host's).
volumePluginDir: /var/lib/kubelet/volumeplugins
# The images come from files and cannot be pulled again: never collect them, and a full
# host disk must not evict the test's pods.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%"}}
# v1.20's kubelet reports the Node Ready at its second status update: 2 s after the first,
# not 10.
nodeStatusUpdateFrequency: 2s
"#,
            cgroup_root = self.cgroup_root(),
            port = self.kubelet_port,
            healthz = self.kubelet_healthz_port,
        );
        if self.config.version == KubeVersion::V1_36_2 {
            config.push_str(&format!(
                "failCgroupV1: false\ncontainerRuntimeEndpoint: unix://{}\n",
                self.containerd_socket().display()
            ));
        }
        config
    }
}

/// Set (to anything) to keep every node's directory (logs, configuration, pod logs) after
/// tear-down, for a post-mortem; its path is printed.
pub const KEEP_ENV: &str = "PLUGREG_CLUSTER_KEEP";

impl Drop for Node {
    fn drop(&mut self) {
        self.kill_all();
        if std::env::var_os(KEEP_ENV).is_some()
            && let Some(dir) = self.dir.take()
        {
            eprintln!(
                "{KEEP_ENV}: kept the node's directory {}",
                dir.keep().display()
            );
        }
    }
}

/// Whether the node's peers of `version` are built: the kubelet and its containerd.
pub fn check_peers(version: KubeVersion) -> Result<(), Error> {
    let runtime = containerd_of(version);
    for name in [
        version.kubelet_peer(),
        runtime.daemon,
        runtime.shim,
        runtime.ctr,
    ] {
        peer(name).map_err(|e| Error::missing(e.to_string(), PEERS_SETUP))?;
    }
    Ok(())
}

/// The PATH the node's daemons get.
fn system_path() -> String {
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned()
}

/// Whether `pid` lives in a PID namespace nested in the one `init` is PID 1 of: its
/// `NSpid` line lists more levels than init's, and its PID at init's level is known.
fn in_nested_namespace(pid: u32, init: u32) -> bool {
    let levels = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/status"))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .map(|l| l.split_whitespace().count())
    };
    match (levels(pid), levels(init)) {
        (Some(p), Some(i)) => p > i && is_descendant(pid, init),
        _ => false,
    }
}

/// Whether `pid` descends from `ancestor` (through parent links).
fn is_descendant(mut pid: u32, ancestor: u32) -> bool {
    for _ in 0..64 {
        match host::parent_of(pid) {
            Some(p) if p == ancestor => return true,
            Some(0) | None => return false,
            Some(p) => pid = p,
        }
    }
    false
}

/// Reads the holder's stdout until its `ready` line (or its end, or 30 s).
fn wait_ready_line(stdout: Option<ChildStdout>) -> bool {
    let Some(stdout) = stdout else {
        return false;
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let ready = lines.any(|l| l.is_ok_and(|l| l.trim() == "ready"));
        let _ = tx.send(ready);
        // Keep reading so the holder never blocks on a full pipe.
        for _ in lines {}
    });
    rx.recv_timeout(Duration::from_secs(30)).unwrap_or(false)
}

/// SIGTERM, a grace period, then SIGKILL; waits for `nsenter` (which exits with the program).
async fn stop(mut p: NodeProcess) -> Result<(), Error> {
    host::signal(p.pid, Signal::TERM);
    let deadline = Instant::now() + STOP_GRACE;
    loop {
        if !matches!(p.nsenter.try_wait(), Ok(None)) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            host::signal(p.pid, Signal::KILL);
            let _ = p.nsenter.wait();
            // The log says why it needed the kill; not an error for the caller.
            let _ = writeln!(
                OpenOptions::new()
                    .append(true)
                    .open(&p.log)
                    .map_err(|e| Error::io("opening a log", e))?,
                "--- {} killed after {STOP_GRACE:?} ---",
                p.name
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `rmdir` of `root` and every directory under it, deepest first; whether all are gone.
fn remove_tree(root: &Path) -> bool {
    if !root.exists() {
        return true;
    }
    let mut dirs = Vec::new();
    let mut stack = vec![root.to_owned()];
    while let Some(d) = stack.pop() {
        if let Ok(entries) = std::fs::read_dir(&d) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(e.path());
                }
            }
        }
        dirs.push(d);
    }
    // Parents were pushed before their children.
    for d in dirs.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
    !root.exists()
}

fn write(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}
