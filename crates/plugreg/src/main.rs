//! `plugreg`: the kubelet-side plugin manager daemon, operator commands and the demo.

mod csi;
mod daemon;
#[cfg(feature = "demo")]
mod demo;
mod device;
mod device_cmd;
#[cfg(feature = "demo")]
mod device_demo;
mod dra;
#[cfg(feature = "panicking-handler")]
mod fault;
mod logging;
mod ops;
#[cfg(feature = "demo")]
mod sidecar;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Kubelet plugin registration, both sides, in Rust.
#[derive(Debug, Parser)]
#[command(name = "plugreg", version, about)]
struct Cli {
    /// Log verbosity, klog style: 0-1 info, 2-4 debug, 5+ trace.
    #[arg(short = 'v', long = "v", global = true, default_value_t = 0)]
    verbosity: u8,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the plugin manager daemon (the kubelet side).
    Manager(Box<daemon::ManagerArgs>),
    /// List the sockets in a registry directory and what each says about itself.
    List(ops::DirArgs),
    /// Show one registration socket in detail.
    Inspect(ops::SocketArgs),
    /// Print sockets as they appear and disappear.
    Watch(ops::DirArgs),
    /// Exit 0 when a registration socket answers GetInfo in time, 1 otherwise.
    Probe(ops::SocketArgs),
    /// Talk to a CSI driver's socket.
    Csi {
        #[command(subcommand)]
        command: csi::CsiCommand,
    },
    /// Call a device plugin on its socket as the kubelet does.
    Device {
        #[command(subcommand)]
        command: device_cmd::DeviceCommand,
    },
    /// Call a DRA driver's socket as the kubelet would.
    Dra {
        #[command(subcommand)]
        command: dra::DraCommand,
    },
    /// Show the whole registration flow in a temp dir (no root, no cluster).
    #[cfg(feature = "demo")]
    Demo(demo::DemoArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let quiet = !matches!(cli.command, Command::Manager(_));
    logging::init(cli.verbosity, cli.log_format, quiet);
    let mut stdout = std::io::stdout();
    let result = match cli.command {
        Command::Manager(args) => daemon::run(*args).await,
        Command::List(args) => ops::list(args, &mut stdout).await,
        Command::Inspect(args) => ops::inspect(args, &mut stdout).await,
        Command::Watch(args) => ops::watch(args, &mut stdout).await,
        Command::Probe(args) => match ops::probe(args, &mut stdout).await {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Command::Csi { command } => csi::run(command, &mut stdout)
            .await
            .map_err(anyhow::Error::from),
        Command::Device { command } => device_cmd::run(command, &mut stdout).await,
        Command::Dra { command } => dra::run(command, &mut stdout).await,
        #[cfg(feature = "demo")]
        Command::Demo(args) => demo::run(args, &mut stdout).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("plugreg: {e:#}");
            ExitCode::FAILURE
        }
    }
}
