//! `plugreg-cluster`: a one-node Kubernetes cluster with a CSI driver deployed from an overlay
//! of `deploy/`, for driver authors. `scripts/cluster.sh` builds it and runs `up`.
//!
//! `up` builds the images (pause, busybox, plugreg's sidecars, the test driver) from the
//! binaries beside this one, starts the cluster, imports those and `--image` archives, applies
//! each `--overlay` (default `deploy/test`), prints how to reach the cluster and waits for
//! Ctrl-C or SIGTERM, then tears everything down.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use plugreg_cluster::{Cluster, ClusterOptions, ImageFile, ImageSet, host};
use plugreg_testpeers::KubeVersion;

/// A real one-node Kubernetes cluster (etcd, kube-apiserver, kube-controller-manager,
/// kube-scheduler, containerd, runc, the kubelet) on loopback, with a CSI driver from an
/// overlay of deploy/. Needs root, `interop/build-peers.sh` and `images/setup.sh`.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Bring the cluster up, print KUBECONFIG, wait for Ctrl-C or SIGTERM, tear it down.
    Up(Up),
    /// Measure start-up and a volume's life on each release; write BENCHMARKS.md's section.
    Bench(Bench),
}

#[derive(Debug, clap::Args)]
struct Bench {
    /// Releases to measure (repeatable) [default: v1.20.2 and v1.36.2].
    #[arg(long = "kube-version", value_parser = parse_version)]
    versions: Vec<KubeVersion>,
    /// Clusters started per release.
    #[arg(long, default_value_t = 3)]
    starts: usize,
    /// Volume lives per release.
    #[arg(long, default_value_t = 10)]
    runs: usize,
    /// Whole claim lives on v1.36.2 (snapshot, restore, clone, expansion, clean-up).
    #[arg(long, default_value_t = 5)]
    lives: usize,
    /// Trace the last claim life's steps through the API server's audit log (who made which
    /// request when); the timeline goes into the section.
    #[arg(long)]
    trace: bool,
    /// The Markdown file to write the section into (printed to stdout otherwise).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Where the binaries of plugreg's images are [default: this program's directory].
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct Up {
    /// Kubernetes release: v1.36.2 (containerd 2.3.4) or v1.20.2 (containerd 1.6).
    #[arg(long = "kube-version", default_value = "v1.36.2", value_parser = parse_version)]
    version: KubeVersion,
    /// A kustomization to apply (an overlay of deploy/; repeatable) [default: deploy/test].
    #[arg(long = "overlay", value_name = "DIR")]
    overlays: Vec<PathBuf>,
    /// An image archive (OCI or `docker save`) to import: `FILE` keeps the names it carries,
    /// `NAME=FILE` puts its tag on repository NAME (repeatable).
    #[arg(long = "image", value_name = "[NAME=]FILE", value_parser = parse_image)]
    images: Vec<ImageFile>,
    /// Where the binaries of plugreg's images are [default: this program's directory].
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// The kubelet's -v.
    #[arg(long, default_value_t = 2)]
    kubelet_v: u8,
}

fn parse_version(s: &str) -> Result<KubeVersion, String> {
    KubeVersion::ALL
        .into_iter()
        .find(|v| v.as_str() == s || v.as_str().trim_start_matches('v') == s)
        .ok_or_else(|| format!("unknown release {s:?} (v1.20.2 or v1.36.2)"))
}

fn parse_image(s: &str) -> Result<ImageFile, String> {
    let (base_name, file) = match s.split_once('=') {
        Some((name, file)) => (Some(name.to_owned()), file),
        None => (None, s),
    };
    let archive = PathBuf::from(file);
    if !archive.is_file() {
        return Err(format!("{file}: no such file"));
    }
    Ok(ImageFile { archive, base_name })
}

/// The repository this program was built from (the images' scripts, deploy/).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `--bin-dir`, else this program's directory.
fn bin_dir(given: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match given {
        Some(d) => Ok(d),
        None => Ok(host::workspace_bin_dir()?),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Cmd::Up(up) => run_up(up).await,
        Cmd::Bench(bench) => run_bench(bench).await,
    }
}

/// The output of a command, trimmed ("?" when it fails).
fn output_of(cmd: &mut std::process::Command) -> String {
    cmd.output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "?".to_owned())
}

async fn run_bench(bench: Bench) -> anyhow::Result<()> {
    use std::process::Command;
    let bin_dir = bin_dir(bench.bin_dir)?;
    let repo = repo();
    let versions = if bench.versions.is_empty() {
        KubeVersion::ALL.to_vec()
    } else {
        bench.versions
    };
    for v in &versions {
        plugreg_cluster::check(*v)?;
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_default();
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.trim().trim_end_matches(" kB").parse().ok())
        .unwrap_or(0);
    let mut commit =
        output_of(
            Command::new("git")
                .arg("-C")
                .arg(&repo)
                .args(["rev-parse", "--short", "HEAD"]),
        );
    if !output_of(Command::new("git").arg("-C").arg(&repo).args([
        "status",
        "--porcelain",
        "--untracked-files=no",
    ]))
    .is_empty()
    {
        commit.push_str("-dirty");
    }
    let info = plugreg_cluster::bench::RunInfo {
        date: output_of(Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])),
        commit,
        machine: format!(
            "{} CPUs, {model}, Linux {}, {:.1} GiB RAM",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            output_of(Command::new("uname").arg("-r")),
            mem_kib as f64 / 1024.0 / 1024.0
        ),
        load: std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        // As run: scripts/cluster.sh passes its arguments through.
        command: std::iter::once("scripts/cluster.sh bench".to_owned())
            .chain(std::env::args().skip(2))
            .collect::<Vec<_>>()
            .join(" "),
    };
    eprintln!("building the images from {} ...", bin_dir.display());
    let images = ImageSet::build(&repo, &bin_dir, &bin_dir.join("cluster-images"))?;
    let options = plugreg_cluster::bench::BenchOptions {
        versions,
        starts: bench.starts,
        runs: bench.runs,
        lives: bench.lives,
        images,
        overlay: repo.join("deploy/test"),
        trace: bench.trace,
    };
    let figures = plugreg_cluster::bench::run(&options).await?;
    let section = plugreg_cluster::bench::markdown(&info, &figures);
    match bench.out {
        Some(path) => {
            plugreg_cluster::bench::write_into(&path, &section)?;
            eprintln!("wrote {}", path.display());
        }
        None => print!("{section}"),
    }
    Ok(())
}

async fn run_up(up: Up) -> anyhow::Result<()> {
    let bin_dir = bin_dir(up.bin_dir)?;
    let repo = repo();
    let overlays = if up.overlays.is_empty() {
        vec![repo.join("deploy/test")]
    } else {
        up.overlays
    };
    for o in &overlays {
        if !o.join("kustomization.yaml").is_file() {
            bail!("{}: no kustomization.yaml", o.display());
        }
    }
    plugreg_cluster::check(up.version)?;
    // From here on Ctrl-C and SIGTERM tear down whatever is up.
    let mut signals = plugreg_runtime::signal::Signals::new().context("SIGTERM/SIGINT handlers")?;

    eprintln!("building the images from {} ...", bin_dir.display());
    let images = ImageSet::build(&repo, &bin_dir, &bin_dir.join("cluster-images"))?;
    let mut files = images.files.clone();
    files.extend(up.images);
    eprintln!("starting a {} cluster ...", up.version);
    let mut options = ClusterOptions::new(up.version, files);
    options.kubelet_verbosity = up.kubelet_v;
    let cluster = tokio::select! {
        cluster = Cluster::start(options) => cluster?,
        _ = signals.shutdown() => bail!("interrupted while starting (what had started is stopped)"),
    };
    for o in &overlays {
        let (objects, changes) = cluster
            .deploy(o)
            .await
            .with_context(|| format!("applying {}", o.display()))?;
        eprintln!(
            "applied {} ({} objects); the loopback rules changed:",
            o.display(),
            objects.len()
        );
        for c in changes {
            eprintln!("  {c}");
        }
    }
    let node = cluster.node();
    println!(
        "cluster {} up in {:.1} s",
        cluster.version(),
        cluster.started_in().as_secs_f64()
    );
    println!("export KUBECONFIG={}", cluster.kubeconfig().display());
    println!("kubectl:    {}", host::kubectl()?.display());
    println!(
        "node:       {} (kubelet.log, containerd.log; pod logs in var-log/pods; the node's /var/lib is var-lib)",
        node.dir().display()
    );
    println!(
        "pods must use hostNetwork: true (the node has no pod network); Ctrl-C tears everything down"
    );

    signals.shutdown().await;
    eprintln!("tearing down ...");
    cluster.shutdown().await?;
    eprintln!("done");
    Ok(())
}
