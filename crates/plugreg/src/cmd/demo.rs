//! `plugreg demo`: the whole registration story in a temp dir, with no root and no cluster.
//!
//! The demo links the plugin side into the daemon (the example plugins, the CSI test driver,
//! the node-driver-registrar), so it is built only with cargo feature `demo`; the shipped
//! binary and images leave it out and say how to get it.

#[cfg(feature = "demo")]
mod device;
#[cfg(feature = "demo")]
mod dra;
#[cfg(feature = "demo")]
mod flow;
#[cfg(feature = "demo")]
mod sidecar;

/// What a build without the demo answers `plugreg demo` with.
#[cfg_attr(feature = "demo", allow(dead_code))]
pub const NOT_BUILT: &str = "this plugreg is built without the demo (cargo feature `demo`), so that the shipped binary carries no test plugins; run it from a checkout with `cargo run -p plugreg --features demo -- demo`";

/// Flags of `plugreg demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Keep the temp dir (and print where it is) instead of removing it.
    #[arg(long)]
    pub keep: bool,
}

/// Runs the demo, printing to `out`; without feature `demo`, fails with [`NOT_BUILT`].
pub async fn run(args: DemoArgs, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    #[cfg(feature = "demo")]
    return flow::run(args, out).await;
    #[cfg(not(feature = "demo"))]
    {
        let _ = (args, out);
        anyhow::bail!(NOT_BUILT)
    }
}
