//! The command-line skeleton every sidecar shares, which each sidecar extends with its own
//! flags ([`SidecarFlags`]):
//!
//! - component-base's logging flags (`-v`, `--vmodule`, `--logging-format`, ...) into
//!   [`LogOptions`];
//! - the klog flags the Kubernetes sidecars removed (`--logtostderr`, `--log-dir`, ...),
//!   accepted and ignored (listed in [`Flags::legacy`] so that `main` can warn) instead of
//!   upstream's exit 2;
//! - `--version`;
//! - the flags and feature gates of older upstream releases that real manifests still pass
//!   ([`compat`]): accepted as today's meaning, or with upstream's old deprecation warning,
//!   listed in [`Flags::outdated`] for `main` to log;
//! - for controller sidecars ([`Command::controller`]), the [`ControllerFlags`]: the API server
//!   (`--kubeconfig`, `--master`), the client-side rate limit (`--kube-api-qps`,
//!   `--kube-api-burst`), leader election (`--leader-election*`) and the diagnostics server
//!   (`--http-endpoint`, `--metrics-address`, `--metrics-path`).
//!
//! The syntax is Go's `flag` ([`Syntax::Go`]) or spf13/pflag ([`Syntax::Pflag`]), as the
//! upstream sidecar uses. The table is sorted by name, as both print it; a sidecar's own
//! [`Spec`] of a skeleton flag's name replaces the skeleton's help text (the value still goes
//! where the skeleton puts it).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use crate::compat::{self, Accepted, Meaning, Upstream};
use crate::goflag::{self, FlagError, Kind, Spec, Value, flag, logging as log_flags};
use crate::gosyntax::{SyntaxError, parse_duration, parse_int};
use crate::logging::LogOptions;
use crate::pflag;

/// Which parser the upstream sidecar uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// Go's `flag`: `-name` or `--name`, parsing stops at the first non-flag argument.
    Go,
    /// spf13/pflag: `--name`, one-letter shorthands, positional arguments anywhere.
    Pflag,
}

/// How a sidecar's command line is made of the skeleton and its own flags.
#[derive(Debug, Clone, Copy)]
pub struct Command {
    /// The parser.
    pub syntax: Syntax,
    /// The help text of every removed klog flag.
    pub legacy_usage: &'static str,
    /// The help text of `--version`.
    pub version_usage: &'static str,
    /// Whether the [`ControllerFlags`] are part of it.
    pub controller: bool,
    /// The upstream sidecar it replaces: which older flags and gates ([`compat`]) it accepts.
    pub upstream: Upstream,
}

/// What a sidecar adds to the skeleton: its own flags and where their values go.
pub trait SidecarFlags: Default {
    /// The sidecar's own flags (in any order). A spec named like a skeleton flag only replaces
    /// that flag's help text.
    fn specs() -> &'static [Spec];

    /// Sets the sidecar's flag `spec` (never a skeleton flag) to `value`; refuses a value with
    /// the reason Go would give.
    fn set(&mut self, spec: &Spec, value: Value<'_>) -> Result<(), SyntaxError>;

    /// The controller block inside the sidecar's options, for a [`Command::controller`]
    /// command.
    fn controller(&mut self) -> Option<&mut ControllerFlags> {
        None
    }
}

/// The whole command line: the sidecar's options and the skeleton's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Flags<O> {
    /// What the sidecar does (its own flags, and the controller block if it has one).
    pub options: O,
    /// How it logs (validated separately: an invalid logging configuration is exit 1, not 2).
    pub logging: LogOptions,
    /// `--version`: print `<argv0> <version>` and exit 0.
    pub version: bool,
    /// Removed klog flags that were given (accepted and ignored), in order, without dashes.
    pub legacy: Vec<String>,
    /// Flags and feature gates of older upstream releases that were given and accepted
    /// ([`compat`]), in order, each with its warning.
    pub outdated: Vec<Accepted>,
    /// Positional arguments (pflag only; Go's `flag` stops at the first one).
    pub positional: Vec<String>,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed<O> {
    /// Run (or print the version, if [`Flags::version`] is set).
    Run(Box<Flags<O>>),
    /// `-h` or `--help`: print the usage and exit 0.
    Help,
}

/// The flags of a sidecar that talks to the API server.
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerFlags {
    /// `--kubeconfig` (the `KUBECONFIG` environment variable wins, see [`kubeconfig_path`]).
    pub kubeconfig: String,
    /// `--master`: the API server URL.
    pub master: String,
    /// `--kube-api-qps`: the client-side rate limit shared by the kube clients.
    pub kube_api_qps: f64,
    /// `--kube-api-burst`.
    pub kube_api_burst: i64,
    /// `--leader-election`: work only while holding the Lease.
    pub leader_election: bool,
    /// `--leader-election-namespace` (empty: `$POD_NAMESPACE`, the service-account namespace,
    /// `default`).
    pub leader_election_namespace: String,
    /// `--leader-election-lease-duration`.
    pub leader_election_lease_duration: Duration,
    /// `--leader-election-renew-deadline`.
    pub leader_election_renew_deadline: Duration,
    /// `--leader-election-retry-period`.
    pub leader_election_retry_period: Duration,
    /// `--leader-election-labels` (`k:v,k2:v2`), labels put on the Lease.
    pub leader_election_labels: BTreeMap<String, String>,
    /// `--http-endpoint`: the diagnostics server address (empty: off).
    pub http_endpoint: String,
    /// `--metrics-address` (deprecated; conflicts with `--http-endpoint`).
    pub metrics_address: String,
    /// `--metrics-path`.
    pub metrics_path: String,
}

impl Default for ControllerFlags {
    fn default() -> Self {
        let secs = Duration::from_secs;
        Self {
            kubeconfig: String::new(),
            master: String::new(),
            kube_api_qps: 5.0,
            kube_api_burst: 10,
            leader_election: false,
            leader_election_namespace: String::new(),
            leader_election_lease_duration: secs(15),
            leader_election_renew_deadline: secs(10),
            leader_election_retry_period: secs(5),
            leader_election_labels: BTreeMap::new(),
            http_endpoint: String::new(),
            metrics_address: String::new(),
            metrics_path: "/metrics".into(),
        }
    }
}

/// The [`ControllerFlags`], with the help texts of a controller sidecar.
const CONTROLLER_SPECS: &[Spec] = &[
    flag(
        "http-endpoint",
        Kind::String,
        "string",
        "",
        "TCP address of the HTTP server for metrics and /healthz/leader-election (example: `:8080`). Empty: off. Only one of `--metrics-address` and `--http-endpoint` can be set.",
    ),
    flag(
        "kube-api-burst",
        Kind::Int,
        "int",
        "10",
        "Burst of the client-side rate limit of the Kubernetes API client.",
    ),
    flag(
        "kube-api-qps",
        Kind::Value,
        "float",
        "5",
        "Queries per second of the client-side rate limit of the Kubernetes API client.",
    ),
    flag(
        "kubeconfig",
        Kind::String,
        "string",
        "",
        "Path to a kubeconfig file (the KUBECONFIG environment variable wins). Without it and --master: in-cluster configuration.",
    ),
    flag(
        "leader-election",
        Kind::Bool,
        "",
        "",
        "Work only while holding a Lease, so that replicas can stand by.",
    ),
    flag(
        "leader-election-labels",
        Kind::Value,
        "map",
        "",
        "Labels of the Lease, as key:value pairs separated by commas.",
    ),
    flag(
        "leader-election-lease-duration",
        Kind::Duration,
        "duration",
        "15s",
        "How long standbys wait before taking over a Lease that is not renewed.",
    ),
    flag(
        "leader-election-namespace",
        Kind::String,
        "string",
        "",
        "Namespace of the Lease (empty: $POD_NAMESPACE, else this pod's namespace, else default).",
    ),
    flag(
        "leader-election-renew-deadline",
        Kind::Duration,
        "duration",
        "10s",
        "How long the leader keeps trying to renew before it gives up.",
    ),
    flag(
        "leader-election-retry-period",
        Kind::Duration,
        "duration",
        "5s",
        "Pause between attempts to acquire or renew the Lease.",
    ),
    flag(
        "master",
        Kind::String,
        "string",
        "",
        "URL of the Kubernetes API server (with or instead of --kubeconfig, out of cluster).",
    ),
    flag(
        "metrics-address",
        Kind::String,
        "string",
        "",
        "(deprecated) TCP address of the metrics server. Only one of `--metrics-address` and `--http-endpoint` can be set.",
    ),
    flag(
        "metrics-path",
        Kind::String,
        "string",
        "/metrics",
        "HTTP path of the Prometheus metrics.",
    ),
];

impl ControllerFlags {
    /// Sets the flag `name` if it is one of the block's; `None` if it is not.
    fn set(&mut self, name: &str, value: Value<'_>) -> Option<Result<(), SyntaxError>> {
        let text = match value {
            Value::Bool(b) => {
                return (name == "leader-election").then(|| {
                    self.leader_election = b;
                    Ok(())
                });
            }
            Value::Text(text) => text,
        };
        let owned = || text.to_owned();
        let result = (|| {
            match name {
                "kubeconfig" => self.kubeconfig = owned(),
                "master" => self.master = owned(),
                "kube-api-qps" => self.kube_api_qps = pflag::parse_float(text)?,
                "kube-api-burst" => self.kube_api_burst = parse_int(text)?,
                "leader-election-namespace" => self.leader_election_namespace = owned(),
                "leader-election-lease-duration" => {
                    self.leader_election_lease_duration = parse_duration(text)?;
                }
                "leader-election-renew-deadline" => {
                    self.leader_election_renew_deadline = parse_duration(text)?;
                }
                "leader-election-retry-period" => {
                    self.leader_election_retry_period = parse_duration(text)?;
                }
                "leader-election-labels" => self.leader_election_labels.extend(parse_labels(text)?),
                "http-endpoint" => self.http_endpoint = owned(),
                "metrics-address" => self.metrics_address = owned(),
                "metrics-path" => self.metrics_path = owned(),
                _ => return Ok(false),
            }
            Ok(true)
        })();
        match result {
            Ok(false) => None,
            Ok(true) => Some(Ok(())),
            Err(e) => Some(Err(e)),
        }
    }

    /// Checks what upstream accepts but fails on later with a Go panic: leader-election
    /// timings client-go refuses at election start. Here they are a clear error at start
    /// (`main` exits 1). Without `--leader-election` the timings do not matter.
    pub fn validate(&self) -> Result<(), String> {
        if !self.leader_election {
            return Ok(());
        }
        let (lease, renew, retry) = (
            self.leader_election_lease_duration,
            self.leader_election_renew_deadline,
            self.leader_election_retry_period,
        );
        if lease.is_zero() || renew.is_zero() || retry.is_zero() {
            return Err(
                "--leader-election-lease-duration, --leader-election-renew-deadline and --leader-election-retry-period must be greater than zero".into(),
            );
        }
        if lease <= renew {
            return Err(format!(
                "--leader-election-lease-duration ({lease:?}) must be greater than --leader-election-renew-deadline ({renew:?})"
            ));
        }
        // client-go's JitterFactor.
        if renew.as_secs_f64() <= retry.as_secs_f64() * 1.2 {
            return Err(format!(
                "--leader-election-renew-deadline ({renew:?}) must be greater than 1.2 x --leader-election-retry-period ({retry:?})"
            ));
        }
        Ok(())
    }

    /// The diagnostics server's address: `--http-endpoint`, else `--metrics-address` (empty:
    /// no server), or upstream's refusal when both are set (exit 1).
    pub fn http_address(&self) -> Result<&str, &'static str> {
        match (self.http_endpoint.as_str(), self.metrics_address.as_str()) {
            (endpoint, address) if !endpoint.is_empty() && !address.is_empty() => {
                Err("only one of `--metrics-address` and `--http-endpoint` can be set.")
            }
            ("", address) => Ok(address),
            (endpoint, _) => Ok(endpoint),
        }
    }

    /// Whether `/healthz/leader-election` is served: with `--leader-election` and an address
    /// from `--http-endpoint` (not the deprecated `--metrics-address`), as upstream.
    pub fn serves_leader_health(&self) -> bool {
        self.leader_election && !self.http_endpoint.is_empty()
    }

    /// The client-side rate limit as the limiter takes it: (qps, burst), a negative burst
    /// counting as 0 (client-go's default).
    pub fn rate_limit(&self) -> (f64, u32) {
        (
            self.kube_api_qps,
            u32::try_from(self.kube_api_burst.max(0)).unwrap_or(u32::MAX),
        )
    }
}

/// `--leader-election-labels`: `key:value` items separated by commas (empty: none); an item
/// without exactly one `:` is refused.
pub fn parse_labels(value: &str) -> Result<BTreeMap<String, String>, SyntaxError> {
    let mut labels = BTreeMap::new();
    if value.is_empty() {
        return Ok(labels);
    }
    for item in value.split(',') {
        match item.split_once(':') {
            Some((k, v)) if !v.contains(':') => {
                labels.insert(k.to_owned(), v.to_owned());
            }
            _ => {
                return Err(SyntaxError::Other(format!(
                    "{item:?} is not a label of the form key:value"
                )));
            }
        }
    }
    Ok(labels)
}

/// The `--feature-gates` syntax (component-base's `mapStringBool`): comma-separated
/// `Name=bool` pairs, spaces around each part trimmed. A malformed pair or a non-boolean value
/// is a flag error; whether the names exist is the sidecar's to check (an unknown name is
/// upstream's `klog.Fatal`, exit 255).
pub fn parse_gate_list(value: &str) -> Result<BTreeMap<String, bool>, SyntaxError> {
    let mut gates = BTreeMap::new();
    for pair in value.split(',') {
        if pair.is_empty() {
            continue;
        }
        let Some((k, v)) = pair.split_once('=') else {
            return Err(SyntaxError::Other(
                "malformed pair, expect string=bool".into(),
            ));
        };
        let (k, v) = (k.trim(), v.trim());
        let b = crate::gosyntax::parse_bool(v).map_err(|_| {
            SyntaxError::Other(format!(
                "invalid value of {k}: {v}, err: strconv.ParseBool: parsing {v:?}: invalid syntax"
            ))
        })?;
        gates.insert(k.to_owned(), b);
    }
    Ok(gates)
}

/// Gate names of `k8s.io/apiserver`'s default mutable gate (which a sidecar's own gates are
/// added to), as of recent releases: a sidecar accepts and ignores them. A name missing here is
/// refused like any unknown gate.
pub const APISERVER_GATES: &[&str] = &[
    "APIListChunking",
    "APIPriorityAndFairness",
    "APIResponseCompression",
    "APIServerIdentity",
    "APIServerTracing",
    "APIServingWithRoutine",
    "AdmissionWebhookMatchConditions",
    "AggregatedDiscoveryEndpoint",
    "AllowParsingUserUIDFromCertAuth",
    "AllowUnsafeMalformedObjectDeletion",
    "AnonymousAuthConfigurableEndpoints",
    "AuthorizeWithSelectors",
    "BtreeWatchCache",
    "CBORServingAndStorage",
    "ConcurrentWatchObjectDecode",
    "ConsistentListFromCache",
    "CoordinatedLeaderElection",
    "CustomResourceFieldSelectors",
    "DeclarativeValidation",
    "DeclarativeValidationTakeover",
    "DetectCacheInconsistency",
    "ExternalServiceAccountTokenSigner",
    "InPlacePodVerticalScaling",
    "KMSv1",
    "KMSv2",
    "KMSv2KDF",
    "ListFromCacheSnapshot",
    "MutatingAdmissionPolicy",
    "OpenAPIEnums",
    "RemoteRequestHeaderUID",
    "RemainingItemCount",
    "ResilientWatchCacheInitialization",
    "RetryGenerateName",
    "SeparateCacheWatchRPC",
    "SizeBasedListCostEstimate",
    "StorageVersionAPI",
    "StorageVersionHash",
    "StrictCostEnforcementForVAP",
    "StrictCostEnforcementForWebhooks",
    "StructuredAuthenticationConfiguration",
    "StructuredAuthenticationConfigurationEgressSelector",
    "StructuredAuthorizationConfiguration",
    "TokenRequestServiceAccountUIDValidation",
    "UnauthenticatedHTTP2DOSMitigation",
    "ValidatingAdmissionPolicy",
    "WatchCacheInitializationPostStartHook",
    "WatchFromStorageWithoutResourceVersion",
    "WatchList",
];

/// A `--feature-gates` name the sidecar does not know (upstream then exits, each sidecar with
/// its own line and code).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unrecognized feature gate: {0}")]
pub struct UnknownGate(pub String);

/// For a `--feature-gates` name none of the sidecar's own gates is: the apiserver's gates
/// ([`APISERVER_GATES`]), `AllAlpha` and `AllBeta` are accepted and pushed to `ignored` (they
/// have no effect on a sidecar); any other name is refused.
pub fn other_gate(name: &str, ignored: &mut Vec<String>) -> Result<(), UnknownGate> {
    if name == "AllAlpha" || name == "AllBeta" || APISERVER_GATES.contains(&name) {
        ignored.push(name.to_owned());
        Ok(())
    } else {
        Err(UnknownGate(name.to_owned()))
    }
}

/// Defines a sidecar flag module's `names`, `usage` and `parse` for its options type, over the
/// [`Command`] named `COMMAND` in that module.
#[macro_export]
macro_rules! command_functions {
    ($options:ty) => {
        /// The name of every flag (without dashes), sorted, removed klog flags included.
        pub fn names() -> impl Iterator<Item = &'static str> {
            COMMAND.names::<$options>()
        }

        /// The usage text the upstream parser would print for these flags, for the program
        /// `argv0`.
        pub fn usage(argv0: &str) -> String {
            COMMAND.usage::<$options>(argv0)
        }

        /// Parses the arguments after the program name.
        pub fn parse<S: AsRef<str>>(
            args: &[S],
        ) -> Result<$crate::flags::Parsed<$options>, $crate::goflag::FlagError> {
            COMMAND.parse(args)
        }
    };
}

/// The kubeconfig path to use: the `KUBECONFIG` environment variable when set and non-empty
/// (upstream logs "Found KUBECONFIG environment variable set, using that.."), else the flag.
/// The boolean says whether the variable was used.
pub fn kubeconfig_path(flag: &str, env: Option<&str>) -> (String, bool) {
    match env {
        Some(v) if !v.is_empty() => (v.to_owned(), true),
        _ => (flag.to_owned(), false),
    }
}

impl Command {
    /// Every flag, sorted by name as Go and pflag print them.
    pub fn specs<O: SidecarFlags>(&self) -> Vec<Spec> {
        let own = O::specs();
        let mut specs: Vec<Spec> = Vec::with_capacity(own.len() + 32);
        let (v_type, backtrace_type, threshold_type) = match self.syntax {
            // pflag shows the Go flag's value type.
            Syntax::Pflag => ("Level", "traceLocation", "severity"),
            Syntax::Go => ("value", "value", "value"),
        };
        for &(name, kind, type_name) in goflag::LEGACY_KLOG {
            let type_name = match name {
                "log-backtrace-at" => backtrace_type,
                "stderrthreshold" => threshold_type,
                _ => type_name,
            };
            specs.push(goflag::legacy(name, kind, type_name, self.legacy_usage));
        }
        specs.extend([
            log_flags::LOG_FLUSH_FREQUENCY,
            log_flags::LOG_JSON_INFO_BUFFER_SIZE,
            log_flags::LOG_JSON_SPLIT_STREAM,
            log_flags::LOG_TEXT_INFO_BUFFER_SIZE,
            log_flags::LOG_TEXT_SPLIT_STREAM,
            log_flags::LOGGING_FORMAT,
            Spec {
                type_name: v_type,
                ..log_flags::V
            },
            log_flags::VMODULE,
            flag("version", Kind::Bool, "", "", self.version_usage),
        ]);
        if self.controller {
            specs.extend_from_slice(CONTROLLER_SPECS);
        }
        for spec in own {
            match specs.iter_mut().find(|s| s.name == spec.name) {
                Some(known) => known.usage = spec.usage,
                None => specs.push(*spec),
            }
        }
        specs.sort_unstable_by_key(|s| s.name);
        specs
    }

    /// The name of every flag (without dashes), sorted, removed klog flags included.
    pub fn names<O: SidecarFlags>(&self) -> impl Iterator<Item = &'static str> {
        self.specs::<O>().into_iter().map(|s| s.name)
    }

    /// Whether `name` is a boolean flag (one that takes a value only as `--name=value`).
    pub fn is_bool<O: SidecarFlags>(&self, name: &str) -> bool {
        self.specs::<O>()
            .iter()
            .any(|s| s.name == name && s.kind == Kind::Bool)
    }

    /// The usage text for the program `argv0`, as the sidecar's parser prints it.
    pub fn usage<O: SidecarFlags>(&self, argv0: &str) -> String {
        let specs = self.specs::<O>();
        match self.syntax {
            Syntax::Go => goflag::usage(argv0, &specs),
            Syntax::Pflag => pflag::usage(argv0, &specs),
        }
    }

    /// Parses the arguments after the program name.
    pub fn parse<O: SidecarFlags, S: AsRef<str>>(
        &self,
        args: &[S],
    ) -> Result<Parsed<O>, FlagError> {
        let mut specs = self.specs::<O>();
        let old: Vec<&compat::OldFlag> = compat::old_flags(self.upstream, &specs).collect();
        // Parsed, never printed: the usage is today's.
        specs.extend(old.iter().map(|o| o.spec));
        let mut flags = Flags::<O>::default();
        let (controller, upstream) = (self.controller, self.upstream);
        let known = &specs;
        let set = |spec: &Spec, value: Value<'_>| {
            if let Some(o) = old.iter().find(|o| o.spec.name == spec.name) {
                return flags.set_old(o, value, known, controller, upstream);
            }
            if let (Value::Text(text), true) = (value, spec.name == "feature-gates")
                && let Some((rest, accepted)) = compat::take_graduated(upstream, text)
            {
                flags.set(spec, Value::Text(&rest), controller)?;
                flags.outdated.extend(accepted);
                return Ok(());
            }
            flags.set(spec, value, controller)?;
            if spec.legacy {
                flags.legacy.push(spec.name.to_owned());
            }
            Ok(())
        };
        let help = match self.syntax {
            Syntax::Go => goflag::parse(&specs, args, set)? == goflag::Outcome::Help,
            Syntax::Pflag => match pflag::parse(&specs, args, set)? {
                pflag::Outcome::Help => true,
                pflag::Outcome::Run(positional) => {
                    flags.positional = positional;
                    false
                }
            },
        };
        Ok(if help {
            Parsed::Help
        } else {
            Parsed::Run(Box::new(flags))
        })
    }
}

impl<O: SidecarFlags> Flags<O> {
    /// Applies a flag of an older release ([`compat`]) as what it means today, and records the
    /// warning. `known` is the parse table (today's flags among them).
    fn set_old(
        &mut self,
        old: &compat::OldFlag,
        value: Value<'_>,
        known: &[Spec],
        controller: bool,
        upstream: Upstream,
    ) -> Result<(), SyntaxError> {
        // `compat::old_flags` took only flags whose successor is in the table.
        let today = |name: &str| {
            goflag::lookup(known, name).unwrap_or_else(|| {
                unreachable!(
                    "--{} leads to --{name}, which the table lacks",
                    old.spec.name
                )
            })
        };
        let shown = match value {
            Value::Bool(b) => b.to_string(),
            Value::Text(text) => text.to_owned(),
        };
        match old.meaning {
            Meaning::Successor(name) => self.set(today(name), value, controller)?,
            Meaning::Gate(gate) => {
                let Value::Bool(b) = value else {
                    unreachable!("--{} is a boolean", old.spec.name)
                };
                let pair = format!("{gate}={b}");
                self.set(today("feature-gates"), Value::Text(&pair), controller)?;
            }
            Meaning::Gone => {
                if let Value::Text(text) = value {
                    goflag::check_syntax(old.spec.kind, text)?;
                }
            }
            Meaning::LeaseOnly => compat::check_lease_type(&shown).map_err(SyntaxError::Other)?,
        }
        self.outdated.push(old.accepted(upstream.project(), &shown));
        Ok(())
    }

    /// Routes one flag: logging, `--version`, a removed klog flag, the controller block, else
    /// the sidecar's own.
    fn set(&mut self, spec: &Spec, value: Value<'_>, controller: bool) -> Result<(), SyntaxError> {
        match value {
            Value::Bool(b) if self.logging.set_bool(spec.name, b) => return Ok(()),
            Value::Bool(b) if spec.name == "version" => {
                self.version = b;
                return Ok(());
            }
            Value::Text(text) => {
                if let Some(result) = self.logging.set_value(spec.name, text) {
                    return result;
                }
            }
            Value::Bool(_) => {}
        }
        if spec.legacy {
            // Check the syntax Go checked, ignore the value.
            return match value {
                Value::Bool(_) => Ok(()),
                Value::Text(text) => goflag::check_syntax(spec.kind, text),
            };
        }
        if controller
            && let Some(block) = self.options.controller()
            && let Some(result) = block.set(spec.name, value)
        {
            return result;
        }
        self.options.set(spec, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, Clone, PartialEq)]
    struct Own {
        controller: ControllerFlags,
        timeout: Duration,
        csi_address: String,
        gates: BTreeMap<String, bool>,
    }

    impl SidecarFlags for Own {
        fn specs() -> &'static [Spec] {
            const OWN: &[Spec] = &[
                flag("timeout", Kind::Duration, "duration", "10s", "Deadline."),
                flag("csi-address", Kind::String, "string", "", "Socket."),
                flag("feature-gates", Kind::Value, "mapStringBool", "", "Gates."),
                flag(
                    "metrics-path",
                    Kind::String,
                    "string",
                    "/metrics",
                    "Own text.",
                ),
            ];
            OWN
        }
        fn set(&mut self, spec: &Spec, value: Value<'_>) -> Result<(), SyntaxError> {
            match (spec.name, value) {
                ("timeout", Value::Text(t)) => self.timeout = parse_duration(t)?,
                ("csi-address", Value::Text(t)) => self.csi_address = t.to_owned(),
                ("feature-gates", Value::Text(t)) => self.gates.extend(parse_gate_list(t)?),
                other => unreachable!("{other:?}"),
            }
            Ok(())
        }
        fn controller(&mut self) -> Option<&mut ControllerFlags> {
            Some(&mut self.controller)
        }
    }

    const PFLAG: Command = Command {
        syntax: Syntax::Pflag,
        legacy_usage: "Removed.",
        version_usage: "Print the version and exit.",
        controller: true,
        upstream: Upstream::Provisioner,
    };
    const GO: Command = Command {
        syntax: Syntax::Go,
        controller: false,
        ..PFLAG
    };

    fn run(command: &Command, args: &[&str]) -> Flags<Own> {
        match command.parse::<Own, _>(args) {
            Ok(Parsed::Run(f)) => *f,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    #[test]
    fn the_table_is_sorted_unique_and_takes_the_sidecars_texts() {
        let specs = PFLAG.specs::<Own>();
        let names: Vec<_> = specs.iter().map(|s| s.name).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(names, sorted);
        let path = specs.iter().find(|s| s.name == "metrics-path").unwrap();
        assert_eq!(path.usage, "Own text.");
        let go = GO.specs::<Own>();
        assert!(!go.iter().any(|s| s.name == "kube-api-qps"));
        // Without the block, the sidecar's spec of that name is its own flag.
        assert!(go.iter().any(|s| s.name == "metrics-path"));
        let text = PFLAG.usage::<Own>("x");
        assert!(text.contains("  -v, --v Level"), "{text}");
        assert!(text.contains("--log-backtrace-at traceLocation"), "{text}");
        assert!(GO.usage::<Own>("x").contains("  -v value\n"));
    }

    #[test]
    fn values_go_where_they_belong() {
        let f = run(
            &PFLAG,
            &[
                "--timeout=1m",
                "--csi-address=/s",
                "--leader-election",
                "--leader-election-labels=a:b",
                "--kube-api-qps=2.5",
                "--kube-api-burst=7",
                "--metrics-path=/m",
                "--logtostderr",
                "--version",
                "-v=3",
                "extra",
            ],
        );
        let o = &f.options;
        assert_eq!(o.timeout, Duration::from_secs(60));
        assert_eq!(o.csi_address, "/s");
        assert!(o.controller.leader_election);
        assert_eq!(o.controller.leader_election_labels.len(), 1);
        assert_eq!(o.controller.rate_limit(), (2.5, 7));
        assert_eq!(o.controller.metrics_path, "/m");
        assert_eq!(f.legacy, ["logtostderr"]);
        assert!(f.version);
        assert_eq!(f.logging.verbosity, 3);
        assert_eq!(f.positional, ["extra"]);
        let f = run(&GO, &["-timeout", "2s", "stop", "--timeout=3s"]);
        assert_eq!(f.options.timeout, Duration::from_secs(2));
        assert!(f.positional.is_empty());
        assert_eq!(
            GO.parse::<Own, _>(&["--kube-api-qps=1"]).unwrap_err().0,
            "flag provided but not defined: -kube-api-qps"
        );
    }

    #[test]
    fn the_controller_block_checks_its_rules() {
        let mut c = ControllerFlags::default();
        assert_eq!(c.http_address(), Ok(""));
        c.metrics_address = ":1".into();
        assert_eq!(c.http_address(), Ok(":1"));
        assert!(!c.serves_leader_health());
        c.http_endpoint = ":2".into();
        assert!(c.http_address().is_err());
        c.metrics_address.clear();
        assert_eq!(c.http_address(), Ok(":2"));
        c.leader_election = true;
        assert!(c.serves_leader_health());
        assert!(c.validate().is_ok());
        c.kube_api_burst = -1;
        assert_eq!(c.rate_limit().1, 0);
    }

    #[test]
    fn an_old_flag_whose_meaning_survives_is_its_successor_with_a_warning() {
        // external-provisioner v1.x's --enable-leader-election, in pflag syntax.
        let f = run(&PFLAG, &["--enable-leader-election", "--csi-address=/s"]);
        assert!(f.options.controller.leader_election);
        assert_eq!(f.outdated.len(), 1);
        assert_eq!(f.outdated[0].given, "enable-leader-election=true");
        assert!(
            f.outdated[0]
                .warning
                .contains("taken as --leader-election=true"),
            "{}",
            f.outdated[0].warning
        );
        // external-resizer v0.x's --csiTimeout, in Go syntax with one dash.
        let resizer = Command {
            upstream: Upstream::Resizer,
            ..GO
        };
        let f = run(&resizer, &["-csiTimeout=30s"]);
        assert_eq!(f.options.timeout, Duration::from_secs(30));
        assert_eq!(f.outdated[0].given, "csiTimeout=30s");
        // Its value is checked as today's flag checks it.
        assert!(
            resizer
                .parse::<Own, _>(&["--csiTimeout=30"])
                .unwrap_err()
                .0
                .contains("-csiTimeout")
        );
        // Another sidecar never had it.
        assert_eq!(
            GO.parse::<Own, _>(&["--csiTimeout=30s"]).unwrap_err().0,
            "flag provided but not defined: -csiTimeout"
        );
    }

    #[test]
    fn an_old_flag_that_became_a_gate_sets_the_gate() {
        let snapshotter = Command {
            upstream: Upstream::Snapshotter,
            ..GO
        };
        let f = run(
            &snapshotter,
            &[
                "--enable-volume-group-snapshots=false",
                "--feature-gates=ReleaseLeaderElectionOnExit=true",
            ],
        );
        assert_eq!(f.options.gates.get("CSIVolumeGroupSnapshot"), Some(&false));
        assert_eq!(f.options.gates.len(), 2);
        let f = run(&snapshotter, &["-enable-volume-group-snapshots"]);
        assert_eq!(f.options.gates.get("CSIVolumeGroupSnapshot"), Some(&true));
        assert!(
            snapshotter
                .parse::<Own, _>(&["--enable-volume-group-snapshots=maybe"])
                .is_err()
        );
    }

    #[test]
    fn an_old_flag_whose_effect_is_gone_gets_upstreams_old_warning() {
        let snapshotter = Command {
            upstream: Upstream::Snapshotter,
            ..GO
        };
        let f = run(
            &snapshotter,
            &["--connection-timeout=15s", "--csi-address=/s"],
        );
        assert_eq!(f.options.csi_address, "/s");
        assert_eq!(
            f.outdated[0].warning,
            "Warning: option connection-timeout=\"15s\" is deprecated and has no effect"
        );
        // The old type is still checked.
        assert!(
            snapshotter
                .parse::<Own, _>(&["--connection-timeout=soon"])
                .is_err()
        );
        let f = run(&PFLAG, &["--provisioner=ch.cloudscale.csi"]);
        assert_eq!(f.outdated[0].given, "provisioner=ch.cloudscale.csi");
        let f = run(&PFLAG, &["--leader-election-type=leases"]);
        assert!(!f.options.controller.leader_election);
        assert!(f.outdated[0].warning.contains("uses a Lease, as asked"));
        assert!(
            PFLAG
                .parse::<Own, _>(&["--leader-election-type=etcd"])
                .unwrap_err()
                .0
                .contains("unknown leader election type: etcd")
        );
    }

    #[test]
    fn a_graduated_gate_is_accepted_at_its_value_and_refused_at_the_other() {
        let f = run(
            &PFLAG,
            &["--feature-gates=Topology=true,HonorPVReclaimPolicy=true"],
        );
        // Taken out: the sidecar sees only the gates it knows.
        assert_eq!(f.options.gates.len(), 1);
        assert_eq!(f.options.gates.get("Topology"), Some(&true));
        assert_eq!(f.outdated.len(), 1);
        assert_eq!(f.outdated[0].given, "HonorPVReclaimPolicy=true");
        assert!(
            f.outdated[0]
                .warning
                .contains("removed from external-provisioner")
        );
        // The other value stays for the sidecar to refuse as upstream does.
        let f = run(&PFLAG, &["--feature-gates=HonorPVReclaimPolicy=false"]);
        assert_eq!(f.options.gates.get("HonorPVReclaimPolicy"), Some(&false));
        assert!(f.outdated.is_empty());
        // Only the sidecar that had it.
        let attacher = Command {
            upstream: Upstream::Attacher,
            ..GO
        };
        let f = run(&attacher, &["--feature-gates=HonorPVReclaimPolicy=true"]);
        assert!(f.outdated.is_empty() && f.options.gates.len() == 1);
    }

    #[test]
    fn old_flags_are_parsed_but_never_listed() {
        let usage = PFLAG.usage::<Own>("x");
        for name in [
            "enable-leader-election",
            "provisioner",
            "connection-timeout",
        ] {
            assert!(!usage.contains(name), "{name}");
            assert!(!PFLAG.names::<Own>().any(|n| n == name), "{name}");
        }
    }
}
