//! `plugreg`: the kubelet-side plugin manager daemon, operator commands and the demo.
//!
//! The binary (`src/main.rs`) calls [`main`]; each subcommand lives in `cmd/` (one module a
//! command), and every command prints through one `output` module. A library so that the
//! crate's own tests can turn on the `demo` feature (a dev-dependency on itself), which the
//! shipped binary leaves out.

mod cmd;
mod logging;
mod output;

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
    Manager(Box<cmd::manager::ManagerArgs>),
    /// List the sockets in a registry directory and what each says about itself.
    List(cmd::sockets::DirArgs),
    /// Show one registration socket in detail.
    Inspect(cmd::sockets::SocketArgs),
    /// Print sockets as they appear and disappear.
    Watch(cmd::sockets::DirArgs),
    /// Exit 0 when a registration socket answers GetInfo in time, 1 otherwise.
    Probe(cmd::sockets::SocketArgs),
    /// Talk to a CSI driver's socket.
    Csi {
        #[command(subcommand)]
        command: cmd::csi::CsiCommand,
    },
    /// Call a device plugin on its socket as the kubelet does.
    Device {
        #[command(subcommand)]
        command: cmd::device::DeviceCommand,
    },
    /// Call a DRA driver's socket as the kubelet would.
    Dra {
        #[command(subcommand)]
        command: cmd::dra::DraCommand,
    },
    /// Show the whole registration flow in a temp dir (no root, no cluster; needs a build with
    /// cargo feature `demo`).
    Demo(cmd::demo::DemoArgs),
}

/// Parses the command line, runs the command and returns the process's exit code.
pub async fn main() -> ExitCode {
    let cli = Cli::parse();
    let quiet = !matches!(cli.command, Command::Manager(_));
    logging::init(cli.verbosity, cli.log_format, quiet);
    let mut stdout = std::io::stdout();
    let result = match cli.command {
        Command::Manager(args) => cmd::manager::run(*args).await,
        Command::List(args) => cmd::sockets::list(args, &mut stdout).await,
        Command::Inspect(args) => cmd::sockets::inspect(args, &mut stdout).await,
        Command::Watch(args) => cmd::sockets::watch(args, &mut stdout).await,
        Command::Probe(args) => match cmd::sockets::probe(args, &mut stdout).await {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Command::Csi { command } => cmd::csi::run(command, &mut stdout)
            .await
            .map_err(anyhow::Error::from),
        Command::Device { command } => cmd::device::run(command, &mut stdout).await,
        Command::Dra { command } => cmd::dra::run(command, &mut stdout).await,
        Command::Demo(args) => cmd::demo::run(args, &mut stdout).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("plugreg: {e:#}");
            ExitCode::FAILURE
        }
    }
}
