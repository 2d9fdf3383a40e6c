//! What the manager tells the outside world: one [`PluginRecord`] per known socket, and a
//! stream of [`ManagerEvent`]s.

use std::path::PathBuf;
use std::time::SystemTime;

use serde::{Serialize, Serializer};

use crate::operation::Step;

/// Where a socket stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PluginState {
    /// Seen, waiting for a free operation slot.
    Pending,
    /// A registration attempt is running.
    Registering,
    /// Registered with its handler; the plugin was told so.
    Registered,
    /// The last attempt failed; the next one waits for the back-off.
    BackingOff,
    /// Deregistration is running.
    Deregistering,
    /// The socket file is there but its plugin is dead (D5); it registers again once the
    /// socket is re-created.
    Failed,
}

impl PluginState {
    /// Every state.
    pub const ALL: [PluginState; 6] = [
        PluginState::Pending,
        PluginState::Registering,
        PluginState::Registered,
        PluginState::BackingOff,
        PluginState::Deregistering,
        PluginState::Failed,
    ];

    /// The label used in logs, metrics and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            PluginState::Pending => "pending",
            PluginState::Registering => "registering",
            PluginState::Registered => "registered",
            PluginState::BackingOff => "backing_off",
            PluginState::Deregistering => "deregistering",
            PluginState::Failed => "failed",
        }
    }
}

/// One socket as the manager knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PluginRecord {
    /// The registration socket.
    pub socket: PathBuf,
    /// Plugin type, once GetInfo answered.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// Plugin name, once GetInfo answered.
    pub name: String,
    /// Endpoint handed to the handler.
    pub endpoint: String,
    /// Advertised versions.
    pub versions: Vec<String>,
    /// Where it stands.
    pub state: PluginState,
    /// Whether the socket is in the desired state.
    pub desired: bool,
    /// The last failure, if the latest attempt failed.
    pub last_error: Option<String>,
    /// The step that failed.
    pub failed_step: Option<Step>,
    /// Failed attempts in a row.
    pub failures: u32,
    /// Since when it is registered (RFC 3339, nanoseconds).
    #[serde(serialize_with = "rfc3339")]
    pub registered_at: Option<SystemTime>,
}

fn rfc3339<S: Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.collect_str(&humantime::format_rfc3339_nanos(*t)),
        None => s.serialize_none(),
    }
}

/// Something that happened to a socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagerEvent {
    /// Registered and notified.
    Registered {
        /// The registration socket.
        socket: PathBuf,
        /// Plugin type.
        plugin_type: String,
        /// Plugin name.
        name: String,
        /// Endpoint handed to the handler.
        endpoint: String,
    },
    /// Deregistered (the handler forgot it).
    Deregistered {
        /// The registration socket.
        socket: PathBuf,
        /// Plugin type.
        plugin_type: String,
        /// Plugin name.
        name: String,
        /// Endpoint handed to the handler.
        endpoint: String,
    },
    /// A registration attempt failed.
    Failed {
        /// The registration socket.
        socket: PathBuf,
        /// Which step failed.
        step: Step,
        /// Upstream-style message.
        error: String,
    },
}
