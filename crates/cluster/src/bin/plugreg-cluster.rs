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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Args {
        command: Cmd::Up(up),
    } = Args::parse();
    let exe = std::env::current_exe().context("finding this program")?;
    let bin_dir = match up.bin_dir {
        Some(d) => d,
        None => exe.parent().context("this program's directory")?.to_owned(),
    };
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
