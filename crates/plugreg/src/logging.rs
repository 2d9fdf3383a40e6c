//! Logging set-up shared by every subcommand: klog-like `-v` levels, text or JSON.

use clap::ValueEnum;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Maps klog's `-v` onto a tracing filter (0-1 info, 2-4 debug, 5+ trace); `RUST_LOG`
/// overrides it.
pub fn init(verbosity: u8, format: LogFormat, quiet: bool) {
    let level = match verbosity {
        _ if quiet && verbosity == 0 => "error",
        0..=1 => "info",
        2..=4 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "{level},h2=warn,hyper=warn,tower=warn,kube=warn,rustls=warn"
        ))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
    }
}
