//! `csi-sidecars`' command line (pflag syntax), after KEP-4958's conventions:
//!
//! - `--controllers=provisioner,attacher,resizer,snapshotter,health-monitor`: which controllers
//!   run (any subset, at least one; no default, so that a manifest says what it runs);
//! - the process's flags, unprefixed and only unprefixed ([`PROCESS`]): the driver socket, the
//!   API server, logging, the diagnostics server and leader election (one value for the whole
//!   process: the controllers share one driver connection and one HTTP server, and their
//!   Leases the election's timings);
//! - `--timeout` unprefixed sets every controller's CSI call deadline ([`SHARED`]);
//! - every other flag of a sidecar with its controller's prefix (`--provisioner-worker-threads`,
//!   `--attacher-timeout`, `--resizer-feature-gates`, `--provisioner-kube-api-qps`), with the
//!   sidecar's default and meaning. A prefixed flag wins over the unprefixed one.
//!
//! Each controller's flags are then parsed by its sidecar's own parser, from the process's
//! flags and its own with the prefix taken off: defaults, value syntax, repeated flags and
//! feature gates are exactly the sidecar's. A prefixed flag of a controller that is not in
//! `--controllers` is accepted and reported ([`Parsed::ignored`]), so that a chart can switch a
//! controller off without removing its flags. The removed klog flags and the flags of older
//! upstream releases that the sidecars accept are not accepted here: no manifest predates this
//! binary.

use std::collections::HashMap;
use std::sync::OnceLock;

use plugreg_sidecar_kit::flags::{Command, Flags, Parsed as SidecarParsed, SidecarFlags};
use plugreg_sidecar_kit::goflag::{FlagError, Kind, Spec, Value, flag};
use plugreg_sidecar_kit::gosyntax::SyntaxError;
use plugreg_sidecar_kit::pflag;

/// The flags of the whole process: unprefixed, the same for every controller.
pub const PROCESS: &[&str] = &[
    "csi-address",
    "http-endpoint",
    "kubeconfig",
    "leader-election",
    "leader-election-labels",
    "leader-election-lease-duration",
    "leader-election-namespace",
    "leader-election-renew-deadline",
    "leader-election-retry-period",
    "log-flush-frequency",
    "log-json-info-buffer-size",
    "log-json-split-stream",
    "log-text-info-buffer-size",
    "log-text-split-stream",
    "logging-format",
    "master",
    "metrics-address",
    "metrics-path",
    "v",
    "vmodule",
];

/// Flags given unprefixed for every controller, and prefixed for one.
pub const SHARED: &[&str] = &["timeout"];

/// A controller of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Controller {
    /// external-provisioner's.
    Provisioner,
    /// external-attacher's.
    Attacher,
    /// external-resizer's.
    Resizer,
    /// external-snapshotter's csi-snapshotter.
    Snapshotter,
    /// external-health-monitor's controller.
    HealthMonitor,
}

impl Controller {
    /// Every controller, in the order they start.
    pub const ALL: [Controller; 5] = [
        Controller::Provisioner,
        Controller::Attacher,
        Controller::Resizer,
        Controller::Snapshotter,
        Controller::HealthMonitor,
    ];

    /// The name in `--controllers`, the prefix of its flags and the `controller` label.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Provisioner => "provisioner",
            Controller::Attacher => "attacher",
            Controller::Resizer => "resizer",
            Controller::Snapshotter => "snapshotter",
            Controller::HealthMonitor => "health-monitor",
        }
    }

    fn command(self) -> &'static Command {
        match self {
            Controller::Provisioner => &plugreg_provisioner::flags::COMMAND,
            Controller::Attacher => &plugreg_attacher::flags::COMMAND,
            Controller::Resizer => &plugreg_resizer::flags::COMMAND,
            Controller::Snapshotter => &plugreg_snapshotter::flags::COMMAND,
            Controller::HealthMonitor => &plugreg_health_monitor::flags::COMMAND,
        }
    }

    fn specs(self) -> Vec<Spec> {
        let c = self.command();
        match self {
            Controller::Provisioner => c.specs::<plugreg_provisioner::flags::Options>(),
            Controller::Attacher => c.specs::<plugreg_attacher::flags::Options>(),
            Controller::Resizer => c.specs::<plugreg_resizer::flags::Options>(),
            Controller::Snapshotter => c.specs::<plugreg_snapshotter::flags::Options>(),
            Controller::HealthMonitor => c.specs::<plugreg_health_monitor::flags::Options>(),
        }
    }

    /// Parses `args` (unprefixed) with the sidecar's own parser; `Ok(())` when it takes them.
    fn check(self, args: &[String]) -> Result<(), FlagError> {
        let c = self.command();
        match self {
            Controller::Provisioner => c
                .parse::<plugreg_provisioner::flags::Options, _>(args)
                .map(drop),
            Controller::Attacher => c
                .parse::<plugreg_attacher::flags::Options, _>(args)
                .map(drop),
            Controller::Resizer => c
                .parse::<plugreg_resizer::flags::Options, _>(args)
                .map(drop),
            Controller::Snapshotter => c
                .parse::<plugreg_snapshotter::flags::Options, _>(args)
                .map(drop),
            Controller::HealthMonitor => c
                .parse::<plugreg_health_monitor::flags::Options, _>(args)
                .map(drop),
        }
    }

    fn by_name(name: &str) -> Option<Controller> {
        Controller::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Where a flag of the table goes.
#[derive(Debug, Clone, Copy)]
enum Route {
    /// `--controllers`.
    Controllers,
    /// `--version`.
    Version,
    /// A [`PROCESS`] or [`SHARED`] flag: to every controller, under this name.
    Everyone(&'static str),
    /// A prefixed flag: to one controller, under the sidecar's name.
    One(Controller, &'static str),
}

/// The table and the routes, built once (the prefixed names live as long as the process).
struct Table {
    specs: Vec<Spec>,
    routes: HashMap<&'static str, Route>,
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut specs = vec![
            flag(
                "controllers",
                Kind::String,
                "string",
                "",
                "The controllers to run, comma-separated: any of provisioner, attacher, resizer, snapshotter, health-monitor. Required.",
            ),
            flag(
                "version",
                Kind::Bool,
                "",
                "",
                "Show version and exit.",
            ),
        ];
        let mut routes = HashMap::from([
            ("controllers", Route::Controllers),
            ("version", Route::Version),
        ]);
        for controller in Controller::ALL {
            for spec in controller.specs() {
                if spec.legacy || spec.name == "version" {
                    continue;
                }
                let everyone = PROCESS.contains(&spec.name) || SHARED.contains(&spec.name);
                if everyone && !routes.contains_key(spec.name) {
                    routes.insert(spec.name, Route::Everyone(spec.name));
                    specs.push(spec);
                }
                if PROCESS.contains(&spec.name) {
                    continue;
                }
                let name: &'static str =
                    Box::leak(format!("{}-{}", controller.name(), spec.name).into_boxed_str());
                routes.insert(name, Route::One(controller, spec.name));
                specs.push(Spec { name, ..spec });
            }
        }
        specs.sort_unstable_by_key(|s| s.name);
        Table { specs, routes }
    })
}

/// The usage text for the program `argv0`.
pub fn usage(argv0: &str) -> String {
    pflag::usage(argv0, &table().specs)
}

/// Every flag's name (without dashes), sorted.
#[cfg(test)]
fn names() -> impl Iterator<Item = &'static str> {
    table().specs.iter().map(|s| s.name)
}

/// The whole command line, parsed: each selected controller's flags as its sidecar parses
/// them.
#[derive(Debug, Default)]
pub struct Parsed {
    /// `--controllers`, in start order, each once.
    pub controllers: Vec<Controller>,
    /// `--version`.
    pub version: bool,
    /// Prefixed flags of controllers not in `--controllers`, as given.
    pub ignored: Vec<String>,
    /// The provisioner's flags, when it runs.
    pub provisioner: Option<Flags<plugreg_provisioner::flags::Options>>,
    /// The attacher's flags, when it runs.
    pub attacher: Option<Flags<plugreg_attacher::flags::Options>>,
    /// The resizer's flags, when it runs.
    pub resizer: Option<Flags<plugreg_resizer::flags::Options>>,
    /// The snapshotter's flags, when it runs.
    pub snapshotter: Option<Flags<plugreg_snapshotter::flags::Options>>,
    /// The health monitor's flags, when it runs.
    pub health_monitor: Option<Flags<plugreg_health_monitor::flags::Options>>,
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Outcome {
    /// Run (or print the version).
    Run(Box<Parsed>),
    /// `-h` or `--help`.
    Help,
}

/// `--name=value` as a sidecar's parser takes it.
fn arg(name: &str, value: Value<'_>) -> String {
    match value {
        Value::Bool(b) => format!("--{name}={b}"),
        Value::Text(t) => format!("--{name}={t}"),
    }
}

/// The reason inside a sidecar parser's refusal, for pflag to word it again under the prefixed
/// name.
fn reason(e: FlagError) -> SyntaxError {
    let text = e.0;
    let reason = text
        .split_once(" flag: ")
        .map(|(_, r)| r)
        .or_else(|| text.split_once(": ").map(|(_, r)| r))
        .unwrap_or(&text);
    if reason.ends_with("invalid syntax") {
        SyntaxError::Parse
    } else if reason.ends_with("value out of range") {
        SyntaxError::Range
    } else {
        SyntaxError::Other(reason.to_owned())
    }
}

/// Parses the arguments after the program name.
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Outcome, FlagError> {
    let table = table();
    let mut controllers: Option<Vec<Controller>> = None;
    let mut version = false;
    let mut everyone: Vec<String> = Vec::new();
    let mut own: Vec<(Controller, String)> = Vec::new();
    let set = |spec: &Spec, value: Value<'_>| -> Result<(), SyntaxError> {
        match table.routes.get(spec.name) {
            Some(Route::Controllers) => {
                let Value::Text(text) = value else {
                    return Err(SyntaxError::Parse);
                };
                let mut list = Vec::new();
                for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    let c = Controller::by_name(name).ok_or_else(|| {
                        SyntaxError::Other(format!(
                            "unknown controller {name:?} (known: provisioner, attacher, resizer, snapshotter, health-monitor)"
                        ))
                    })?;
                    if !list.contains(&c) {
                        list.push(c);
                    }
                }
                list.sort();
                controllers = Some(list);
            }
            Some(Route::Version) => {
                version = matches!(value, Value::Bool(true));
            }
            Some(Route::Everyone(name)) => {
                let a = arg(name, value);
                // Checked by a sidecar that has the flag (all of them have these).
                Controller::Provisioner
                    .check(std::slice::from_ref(&a))
                    .map_err(reason)?;
                everyone.push(a);
            }
            Some(Route::One(controller, name)) => {
                let a = arg(name, value);
                controller.check(std::slice::from_ref(&a)).map_err(reason)?;
                own.push((*controller, a));
            }
            None => unreachable!("--{} is in the table without a route", spec.name),
        }
        Ok(())
    };
    let positional = match pflag::parse(&table.specs, args, set)? {
        pflag::Outcome::Help => return Ok(Outcome::Help),
        pflag::Outcome::Run(positional) => positional,
    };
    if let Some(p) = positional.first() {
        return Err(FlagError(format!("unexpected argument: {p:?}")));
    }
    let mut parsed = Parsed {
        version,
        ..Parsed::default()
    };
    if version {
        return Ok(Outcome::Run(Box::new(parsed)));
    }
    let controllers = match controllers {
        Some(c) if !c.is_empty() => c,
        _ => {
            return Err(FlagError(
                "--controllers is required: a comma-separated list of provisioner, attacher, resizer, snapshotter, health-monitor".to_owned(),
            ));
        }
    };
    for (c, a) in &own {
        if !controllers.contains(c) {
            parsed
                .ignored
                .push(format!("--{}-{}", c.name(), a.trim_start_matches("--")));
        }
    }
    for &c in &controllers {
        let mut args = everyone.clone();
        args.extend(own.iter().filter(|(o, _)| *o == c).map(|(_, a)| a.clone()));
        let wrong = |e: FlagError| FlagError(format!("{} flags: {}", c.name(), e.0));
        match c {
            Controller::Provisioner => parsed.provisioner = Some(sidecar(c, &args).map_err(wrong)?),
            Controller::Attacher => parsed.attacher = Some(sidecar(c, &args).map_err(wrong)?),
            Controller::Resizer => parsed.resizer = Some(sidecar(c, &args).map_err(wrong)?),
            Controller::Snapshotter => parsed.snapshotter = Some(sidecar(c, &args).map_err(wrong)?),
            Controller::HealthMonitor => {
                parsed.health_monitor = Some(sidecar(c, &args).map_err(wrong)?);
            }
        }
    }
    parsed.controllers = controllers;
    Ok(Outcome::Run(Box::new(parsed)))
}

/// One sidecar's flags from its share of the arguments.
fn sidecar<O: SidecarFlags>(c: Controller, args: &[String]) -> Result<Flags<O>, FlagError> {
    match c.command().parse::<O, _>(args)? {
        SidecarParsed::Run(flags) => Ok(*flags),
        SidecarParsed::Help => Err(FlagError("help asked inside a controller's flags".into())),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn run(args: &[&str]) -> Parsed {
        match parse(args).unwrap() {
            Outcome::Run(p) => *p,
            Outcome::Help => panic!("help"),
        }
    }

    fn error(args: &[&str]) -> String {
        parse(args).unwrap_err().0
    }

    #[test]
    fn each_controller_gets_the_process_flags_and_its_own_with_its_defaults() {
        let p = run(&[
            "--controllers=attacher,provisioner",
            "--csi-address=/run/csi.sock",
            "--leader-election",
            "--provisioner-worker-threads=7",
            "--attacher-timeout=30s",
            "--provisioner-extra-create-metadata",
            "--v=4",
        ]);
        assert_eq!(
            p.controllers,
            [Controller::Provisioner, Controller::Attacher]
        );
        let prov = p.provisioner.unwrap().options;
        let att = p.attacher.unwrap();
        assert_eq!(prov.csi_address, "/run/csi.sock");
        assert_eq!(att.options.csi_address, "/run/csi.sock");
        assert!(prov.controller.leader_election && att.options.controller.leader_election);
        assert_eq!(prov.worker_threads, 7);
        assert!(prov.extra_create_metadata);
        assert_eq!(att.options.timeout, Duration::from_secs(30));
        assert_eq!(att.logging.verbosity, 4);
        // The sidecars' defaults where nothing was said.
        let defaults = match plugreg_provisioner::flags::parse::<&str>(&[]).unwrap() {
            SidecarParsed::Run(f) => f.options,
            SidecarParsed::Help => unreachable!(),
        };
        assert_eq!(prov.timeout, defaults.timeout);
        assert_eq!(
            prov.controller.kube_api_qps,
            defaults.controller.kube_api_qps
        );
        assert!(p.resizer.is_none() && p.snapshotter.is_none());
    }

    #[test]
    fn a_prefixed_flag_wins_over_the_shared_one_whatever_the_order() {
        let p = run(&[
            "--resizer-timeout=3m",
            "--controllers=resizer,snapshotter",
            "--timeout=20s",
        ]);
        assert_eq!(p.resizer.unwrap().options.timeout, Duration::from_secs(180));
        assert_eq!(
            p.snapshotter.unwrap().options.timeout,
            Duration::from_secs(20)
        );
    }

    #[test]
    fn each_controller_keeps_its_own_token_bucket_flags() {
        let p = run(&[
            "--controllers=provisioner,attacher",
            "--provisioner-kube-api-qps=100",
            "--provisioner-kube-api-burst=200",
        ]);
        let prov = p.provisioner.unwrap().options.controller;
        let att = p.attacher.unwrap().options.controller;
        assert_eq!(prov.rate_limit(), (100.0, 200));
        assert_ne!(att.rate_limit(), (100.0, 200));
    }

    #[test]
    fn the_refusals_name_the_flag_as_given() {
        assert!(error(&[]).contains("--controllers is required"));
        assert!(error(&["--controllers="]).contains("--controllers is required"));
        assert_eq!(
            error(&["--controllers=provisioner,health"]),
            "invalid argument \"provisioner,health\" for \"--controllers\" flag: unknown controller \"health\" (known: provisioner, attacher, resizer, snapshotter, health-monitor)"
        );
        assert_eq!(
            error(&["--controllers=attacher", "--attacher-timeout=ten"]),
            "invalid argument \"ten\" for \"--attacher-timeout\" flag: time: invalid duration \"ten\""
        );
        assert_eq!(
            error(&[
                "--controllers=provisioner",
                "--provisioner-worker-threads=many"
            ]),
            "invalid argument \"many\" for \"--provisioner-worker-threads\" flag: strconv.ParseUint: parsing \"many\": invalid syntax"
        );
        assert_eq!(
            error(&["--controllers=attacher", "--worker-threads=3"]),
            "unknown flag: --worker-threads"
        );
        assert_eq!(
            error(&["--controllers=attacher", "--attacher-csi-address=/x"]),
            "unknown flag: --attacher-csi-address"
        );
        assert!(error(&["--controllers=attacher", "extra"]).contains("unexpected argument"));
    }

    #[test]
    fn flags_of_controllers_that_do_not_run_are_reported_not_refused() {
        let p = run(&[
            "--controllers=provisioner",
            "--snapshotter-worker-threads=3",
        ]);
        assert_eq!(p.ignored, ["--snapshotter-worker-threads=3"]);
        assert!(p.snapshotter.is_none());
    }

    #[test]
    fn every_flag_of_every_sidecar_has_its_place() {
        let names: Vec<&str> = names().collect();
        for c in Controller::ALL {
            for spec in c.specs() {
                if spec.legacy || spec.name == "version" {
                    continue;
                }
                let prefixed = format!("{}-{}", c.name(), spec.name);
                let placed = if PROCESS.contains(&spec.name) {
                    names.contains(&spec.name) && !names.contains(&prefixed.as_str())
                } else {
                    names.contains(&prefixed.as_str())
                };
                assert!(placed, "--{} of the {}", spec.name, c.name());
            }
        }
        assert!(names.contains(&"timeout") && names.contains(&"controllers"));
        assert!(!names.contains(&"logtostderr"), "no removed klog flags");
        assert!(usage("csi-sidecars").contains("--provisioner-extra-create-metadata"));
    }

    #[test]
    fn the_health_monitor_takes_its_prefixed_flags_and_the_shared_timeout() {
        let p = run(&[
            "--controllers=health-monitor,attacher",
            "--timeout=5s",
            "--health-monitor-worker-threads=3",
            "--health-monitor-list-volumes-interval=1m",
            "--health-monitor-enable-node-watcher",
        ]);
        assert_eq!(
            p.controllers,
            [Controller::Attacher, Controller::HealthMonitor]
        );
        let hm = p.health_monitor.unwrap().options;
        assert_eq!(hm.worker_threads, 3);
        assert_eq!(hm.timeout, Duration::from_secs(5));
        assert_eq!(hm.list_volumes_interval, Duration::from_secs(60));
        assert!(hm.enable_node_watcher);
        assert_eq!(
            error(&[
                "--controllers=health-monitor",
                "--health-monitor-monitor-interval=often"
            ]),
            "invalid argument \"often\" for \"--health-monitor-monitor-interval\" flag: time: invalid duration \"often\""
        );
    }

    #[test]
    fn help_and_version() {
        assert!(matches!(parse(&["--help"]).unwrap(), Outcome::Help));
        assert!(run(&["--version"]).version);
    }
}
