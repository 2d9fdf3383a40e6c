//! Where one step of a claim's life spends its time (issue 33): the API server's audit log
//! (one JSON line per answered request, [`plugreg_testpeers::ApiServerOptions::audit`]) read
//! back for the step's window, as a timeline of the requests each component made, in the order
//! the API server received them.
//!
//! Each line of the timeline says when a request arrived (ms after the step began), who made it
//! (the user agent's program: plugreg's sidecars send `csi-provisioner/...` as client-go's do;
//! kube-controller-manager's controllers are told apart by the service account in its agent),
//! what it was, how long the API server took to answer it, and how long after the previous
//! request's answer it arrived: the reaction time of its maker, which is the watch event's
//! delivery, the maker's queue and its own work (a driver call included). A step's floor is the
//! chain of requests each of which needs the previous one's answer: their API time plus the
//! unavoidable part of the reactions.
//!
//! Left out: watches and lists (long-running), Leases (leader election and node heartbeats),
//! Events (not on any step's path), and the benchmark's own requests (no user agent). The one
//! kind of Lease kept is csi-provisioner's volume record (`<lease>-volumes-<n>`, decisions P3):
//! it is written before CreateVolume, so it is on the provisioning steps' path, a round trip
//! upstream does not make (it keeps in-flight volumes in memory only, and can leak them).
//!
//! The driver's own calls come from csi-test-driver's `--call-log` ([`read_calls`]) and join
//! the timeline as the driver's rows: the time before a call is then its caller's reaction
//! without the driver in it. [`summary`] sums each step of every life: plugreg's requests,
//! their API time, the driver time of the calls plugreg's sidecars made, and plugreg's
//! reactions; a step's floor is its time less plugreg's reactions (what plugreg could take out
//! of it at most). The reactions are measured from the previous answer in the window, whoever
//! it was for, so a reaction to an earlier answer counts only from the latest one: they are a
//! lower bound, and they include the watch event's delivery, which is the API server's. The
//! summary also gives how long after the answer of plugreg's last driver call the step ended
//! (a snapshot's readyToUse after CreateSnapshot's answer); the end is when the benchmark's
//! poll (every 10 ms) saw it, so it is late by up to one poll.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::error::Error;

/// One answered request, as the audit log tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// When the API server received it (µs since the epoch).
    pub received: i64,
    /// When it answered (µs since the epoch).
    pub answered: i64,
    /// Who asked ([`actor`]).
    pub actor: String,
    /// `create`, `update`, `patch`, `delete`, `get`, ...
    pub verb: String,
    /// `persistentvolumeclaims`, `pods/status`, ...
    pub resource: String,
    /// The object's name (empty for a create with `generateName`).
    pub name: String,
    /// The HTTP status.
    pub code: u16,
}

/// A step of a life: its name and when it began and ended.
#[derive(Debug, Clone)]
pub struct Window {
    /// What the step is.
    pub step: String,
    /// Which life (0, 1, ...).
    pub life: usize,
    /// When the benchmark started it.
    pub start: SystemTime,
    /// When the benchmark saw it done.
    pub end: SystemTime,
}

/// Reads the audit log at `path`: every complete line that is a `ResponseComplete` event.
pub fn read(path: &Path) -> Result<Vec<Request>, Error> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    Ok(text.lines().filter_map(parse_line).collect())
}

/// One line of the audit log, if it is an answered request.
pub fn parse_line(line: &str) -> Option<Request> {
    let v: Value = serde_json::from_str(line).ok()?;
    if v["stage"] != "ResponseComplete" {
        return None;
    }
    let micros = |field: &str| -> Option<i64> {
        let t: k8s_openapi::jiff::Timestamp = v[field].as_str()?.parse().ok()?;
        Some(t.as_microsecond())
    };
    let object = &v["objectRef"];
    let mut resource = object["resource"].as_str().unwrap_or_default().to_owned();
    if let Some(sub) = object["subresource"].as_str() {
        resource = format!("{resource}/{sub}");
    }
    Some(Request {
        received: micros("requestReceivedTimestamp")?,
        answered: micros("stageTimestamp")?,
        actor: actor(
            v["userAgent"].as_str().unwrap_or_default(),
            v["user"]["username"].as_str().unwrap_or_default(),
        ),
        verb: v["verb"].as_str().unwrap_or_default().to_owned(),
        resource,
        name: object["name"].as_str().unwrap_or_default().to_owned(),
        code: v["responseStatus"]["code"]
            .as_u64()
            .and_then(|c| u16::try_from(c).ok())
            .unwrap_or(0),
    })
}

/// Who answers the driver's calls in a timeline.
pub const DRIVER: &str = "driver";

/// The programs of plugreg's controller sidecars, as their user agents name them.
pub const SIDECARS: &[&str] = &[
    "csi-provisioner",
    "csi-attacher",
    "csi-resizer",
    "csi-snapshotter",
    "csi-sidecars",
    "csi-external-health-monitor-controller",
];

/// Reads csi-test-driver's call log at `path` (`<start µs> <end µs> <method>` lines) as
/// requests answered by [`DRIVER`] (verb `call`, the method as resource, no HTTP status).
/// The calls made on a timer are left out, being on no step's path ([`TIMED`]). No file: no
/// calls (a driver without `--call-log`).
pub fn read_calls(path: &Path) -> Result<Vec<Request>, Error> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text.lines().filter_map(parse_call).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
    }
}

/// Driver calls made on a timer, not in answer to an object: livenessprobe's Probe every few
/// seconds, the health monitor's ControllerGetVolume or ListVolumes each `--monitor-interval`,
/// the attacher's ListVolumes each `--reconcile-sync`.
pub const TIMED: &[&str] = &["Probe", "ControllerGetVolume", "ListVolumes"];

/// One line of csi-test-driver's call log, unless it is a [`TIMED`] call.
pub fn parse_call(line: &str) -> Option<Request> {
    let mut fields = line.split(' ');
    let received = fields.next()?.parse().ok()?;
    let answered = fields.next()?.parse().ok()?;
    let method = fields.next()?;
    if fields.next().is_some() || TIMED.contains(&method) {
        return None;
    }
    Some(Request {
        received,
        answered,
        actor: DRIVER.to_owned(),
        verb: "call".to_owned(),
        resource: method.to_owned(),
        name: String::new(),
        code: 0,
    })
}

/// Whether plugreg made `r`: a request of one of its sidecars, or a driver call that is not
/// the kubelet's (the Node service's).
fn plugreg_made(r: &Request) -> bool {
    if r.actor == DRIVER {
        return !r.resource.starts_with("Node");
    }
    SIDECARS.contains(&r.actor.as_str())
}

/// Who made a request: the program of its user agent (`csi-provisioner/v0.1.0 (linux/amd64)
/// plugreg` -> `csi-provisioner`); kube-controller-manager's controllers by the service account
/// client-go appends to its agent (`kcm:persistent-volume-binder`); no agent: the user.
pub fn actor(user_agent: &str, username: &str) -> String {
    let program = user_agent.split('/').next().unwrap_or_default().trim();
    if program.is_empty() {
        return format!("user {username}");
    }
    if program == "kube-controller-manager" {
        let controller = user_agent.rsplit(':').next().unwrap_or_default();
        return format!("kcm:{controller}");
    }
    program.to_owned()
}

fn micros_of(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The requests of `window` that a step's chain is made of (see the module documentation).
pub fn in_window<'a>(requests: &'a [Request], window: &Window) -> Vec<&'a Request> {
    let (start, end) = (micros_of(window.start), micros_of(window.end));
    let mut out: Vec<&Request> = requests
        .iter()
        .filter(|r| r.received >= start && r.received <= end)
        .filter(|r| !matches!(r.verb.as_str(), "watch" | "list"))
        .filter(|r| !r.resource.starts_with("leases") || is_volume_record(r))
        .filter(|r| !r.resource.starts_with("events"))
        .filter(|r| !r.actor.starts_with("user "))
        .collect();
    out.sort_by_key(|r| r.received);
    out
}

/// Whether `r` is a write of csi-provisioner's volume record (a Lease named
/// `<lease>-volumes-<n>`; see the module documentation).
fn is_volume_record(r: &Request) -> bool {
    r.resource == "leases" && r.name.contains("-volumes-") && SIDECARS.contains(&r.actor.as_str())
}

/// Each request of a window's chain with how long after the latest earlier answer it came
/// (none for the first): its maker's reaction, as the timeline and [`summary`] count it.
fn with_gaps<'a>(list: &[&'a Request]) -> Vec<(&'a Request, Option<i64>)> {
    let mut previous: Option<i64> = None;
    list.iter()
        .map(|&r| {
            let gap = previous.map(|p| r.received - p);
            previous = Some(previous.map_or(r.answered, |p| p.max(r.answered)));
            (r, gap)
        })
        .collect()
}

fn ms(micros: i64) -> String {
    format!("{:.1}", micros as f64 / 1000.0)
}

/// The timeline of each window, as Markdown: one table per step, then who made how many
/// requests and how long they waited in all; only the last life's windows.
pub fn markdown(requests: &[Request], windows: &[Window]) -> String {
    let mut o = String::new();
    let last = windows.iter().map(|w| w.life).max();
    for w in windows.iter().filter(|w| Some(w.life) == last) {
        let list = in_window(requests, w);
        let start = micros_of(w.start);
        let took = w.end.duration_since(w.start).unwrap_or(Duration::ZERO);
        o.push_str(&format!(
            "#### {} ({:.0} ms, {} requests and driver calls)\n\n| at ms | who | request or driver call | API (driver) ms | after the previous answer, ms |\n|---|---|---|---|---|\n",
            w.step,
            took.as_secs_f64() * 1000.0,
            list.len()
        ));
        let mut by_actor: BTreeMap<&str, (usize, i64, i64)> = BTreeMap::new();
        for (r, gap) in with_gaps(&list) {
            let name = if r.name.is_empty() {
                String::new()
            } else {
                format!(" {}", r.name)
            };
            let what = if r.actor == DRIVER {
                r.resource.clone()
            } else {
                format!("{} {}{} ({})", r.verb, r.resource, name, r.code)
            };
            o.push_str(&format!(
                "| {} | {} | {} | {} | {} |\n",
                ms(r.received - start),
                r.actor,
                what,
                ms(r.answered - r.received),
                gap.map(ms).unwrap_or_default()
            ));
            let e = by_actor.entry(r.actor.as_str()).or_default();
            e.0 += 1;
            e.1 += r.answered - r.received;
            e.2 += gap.unwrap_or(0).max(0);
        }
        o.push_str("\nBy whom: ");
        let parts: Vec<String> = by_actor
            .iter()
            .map(|(a, (n, api, gap))| {
                format!(
                    "{a} {n} request(s) or call(s), {} ms at the API server (the driver), {} ms before them",
                    ms(*api),
                    ms(*gap)
                )
            })
            .collect();
        o.push_str(&parts.join("; "));
        o.push_str(".\n\n");
    }
    o
}

/// plugreg's share of one step of one life ([`summary`]), in µs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Share {
    step: i64,
    requests: usize,
    api: i64,
    driver: i64,
    reactions: i64,
    /// From the answer of the last driver call plugreg made in the step to the step's end
    /// (none without a call): for a snapshot, readyToUse after CreateSnapshot's answer.
    after_call: Option<i64>,
}

impl Share {
    fn of(requests: &[Request], w: &Window) -> Share {
        let mut share = Share {
            step: micros_of(w.end) - micros_of(w.start),
            ..Share::default()
        };
        for (r, gap) in with_gaps(&in_window(requests, w)) {
            if plugreg_made(r) {
                share.reactions += gap.unwrap_or(0).max(0);
                if r.actor == DRIVER {
                    share.driver += r.answered - r.received;
                    share.after_call = Some(micros_of(w.end) - r.answered);
                } else {
                    share.requests += 1;
                    share.api += r.answered - r.received;
                }
            }
        }
        share
    }

    /// The step's time over its floor: the step less plugreg's reactions.
    fn step_ratio(&self) -> f64 {
        self.step as f64 / (self.step - self.reactions).max(1) as f64
    }

    /// plugreg's part (reactions, API time, driver time) over its floor (API and driver time).
    fn own_ratio(&self) -> f64 {
        let floor = self.api + self.driver;
        (floor + self.reactions) as f64 / floor.max(1) as f64
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Each step over every life, as Markdown: the medians of the step's time, of plugreg's
/// requests, their API time, the driver time of plugreg's calls and plugreg's reactions, and
/// two ratios (see the module documentation): the step over its floor (the step less plugreg's
/// reactions), and plugreg's part over its own floor (its API and driver time).
pub fn summary(requests: &[Request], windows: &[Window]) -> String {
    let mut steps: Vec<&str> = Vec::new();
    for w in windows {
        if !steps.contains(&w.step.as_str()) {
            steps.push(&w.step);
        }
    }
    let mut o = String::from(
        "#### Every life's steps: plugreg's share (medians over the lives)\n\n\
         | step | lives | step | plugreg's requests | their API time | its driver calls' time | \
         plugreg's reactions | step / (step - reactions) | plugreg's part / (its API + driver time) | \
         end after plugreg's last driver answer: median (max) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for step in steps {
        let shares: Vec<Share> = windows
            .iter()
            .filter(|w| w.step == step)
            .map(|w| Share::of(requests, w))
            .collect();
        let m = |f: &dyn Fn(&Share) -> f64| median(shares.iter().map(f).collect());
        let after: Vec<f64> = shares
            .iter()
            .filter_map(|s| s.after_call)
            .map(|a| a as f64 / 1000.0)
            .collect();
        let after = match after.iter().copied().reduce(f64::max) {
            Some(max) => format!("{:.1} ms ({max:.1} ms)", median(after)),
            None => "no call".to_owned(),
        };
        o.push_str(&format!(
            "| {step} | {} | {:.1} ms | {} | {:.1} ms | {:.1} ms | {:.1} ms | {:.3}x | {:.2}x | {after} |\n",
            shares.len(),
            m(&|s| s.step as f64 / 1000.0),
            m(&|s| s.requests as f64),
            m(&|s| s.api as f64 / 1000.0),
            m(&|s| s.driver as f64 / 1000.0),
            m(&|s| s.reactions as f64 / 1000.0),
            m(&|s| s.step_ratio()),
            m(&|s| s.own_ratio()),
        ));
    }
    o.push('\n');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = r#"{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a","stage":"ResponseComplete","requestURI":"/apis/snapshot.storage.k8s.io/v1/volumesnapshotcontents/snapcontent-1/status","verb":"patch","user":{"username":"system:serviceaccount:plugreg-csi-test:csi-controller"},"userAgent":"csi-snapshotter/v0.1.0 (linux/amd64) plugreg","objectRef":{"resource":"volumesnapshotcontents","name":"snapcontent-1","apiGroup":"snapshot.storage.k8s.io","apiVersion":"v1","subresource":"status"},"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-29T01:50:01.100000Z","stageTimestamp":"2026-11-29T01:50:01.103500Z"}"#;

    #[test]
    fn an_audit_line_reads_as_a_request() {
        let r = parse_line(LINE).unwrap();
        assert_eq!(r.actor, "csi-snapshotter");
        assert_eq!(r.verb, "patch");
        assert_eq!(r.resource, "volumesnapshotcontents/status");
        assert_eq!(r.name, "snapcontent-1");
        assert_eq!(r.code, 200);
        assert_eq!(r.answered - r.received, 3500);
        assert!(parse_line(&LINE.replace("ResponseComplete", "RequestReceived")).is_none());
        assert!(parse_line("not json").is_none());
    }

    #[test]
    fn actors_are_programs_and_controllers() {
        assert_eq!(
            actor(
                "kube-controller-manager/v1.36.2 (linux/amd64) kubernetes/abc/system:serviceaccount:kube-system:persistent-volume-binder",
                "system:kube-controller-manager"
            ),
            "kcm:persistent-volume-binder"
        );
        assert_eq!(
            actor(
                "kubelet/v1.36.2 (linux/amd64) kubernetes/abc",
                "system:node:n"
            ),
            "kubelet"
        );
        assert_eq!(actor("", "plugreg-admin"), "user plugreg-admin");
    }

    #[test]
    fn a_window_keeps_the_chain_in_order() {
        let r = parse_line(LINE).unwrap();
        let mut early = r.clone();
        early.received -= 50_000;
        early.answered -= 50_000;
        early.actor = "snapshot-controller".into();
        let mut lease = r.clone();
        lease.resource = "leases".into();
        let mut record = r.clone();
        record.resource = "leases".into();
        record.actor = "csi-provisioner".into();
        record.name = "csi-plugreg-test-volumes-0".into();
        record.received += 10;
        let mut bench = r.clone();
        bench.actor = "user plugreg-admin".into();
        let all = vec![r.clone(), lease, record.clone(), bench, early.clone()];
        let w = Window {
            step: "snapshot".into(),
            life: 0,
            start: UNIX_EPOCH + Duration::from_micros(early.received as u64 - 1000),
            end: UNIX_EPOCH + Duration::from_micros(r.received as u64 + 1000),
        };
        let got = in_window(&all, &w);
        // Leader election's Lease goes, the provisioner's volume record stays.
        assert_eq!(got, vec![&early, &r, &record]);
        let md = markdown(&all, &[w]);
        assert!(md.contains("| 1.0 | snapshot-controller |"), "{md}");
        // The second request came 46.5 ms after the first one's answer.
        assert!(md.contains("| 46.5 |"), "{md}");
    }

    #[test]
    fn a_call_log_line_reads_as_the_drivers_request() {
        let r = parse_call("1700000000000100 1700000000002600 CreateSnapshot").unwrap();
        assert_eq!(r.actor, DRIVER);
        assert_eq!(r.resource, "CreateSnapshot");
        assert_eq!(r.answered - r.received, 2500);
        assert!(plugreg_made(&r));
        let node = parse_call("1 2 NodeStageVolume").unwrap();
        assert!(!plugreg_made(&node), "the kubelet's call");
        assert!(parse_call("1 2 Probe").is_none());
        assert!(
            parse_call("1 2 ControllerGetVolume").is_none(),
            "the health monitor's"
        );
        assert!(parse_call("1 2").is_none());
        assert!(parse_call("1 2 CreateVolume extra").is_none());
        assert!(parse_call("x 2 CreateVolume").is_none());
        let missing = read_calls(Path::new("/nonexistent/plugreg/calls.log")).unwrap();
        assert!(missing.is_empty());
    }

    #[test]
    fn the_summary_counts_plugregs_reactions_without_the_driver() {
        let at = |ms: i64| 1_700_000_000_000_000 + ms * 1000;
        let req = |actor: &str, verb: &str, from: i64, to: i64| Request {
            received: at(from),
            answered: at(to),
            actor: actor.into(),
            verb: verb.into(),
            resource: "volumesnapshotcontents".into(),
            name: "c".into(),
            code: 200,
        };
        let mut call = req(DRIVER, "call", 5, 15);
        call.resource = "CreateSnapshot".into();
        let mut node = req(DRIVER, "call", 40, 50);
        node.resource = "NodeStageVolume".into();
        let requests = vec![
            req("snapshot-controller", "create", 1, 3),
            call,
            req("csi-snapshotter", "patch", 16, 20),
            node,
        ];
        let window = |life| Window {
            step: "snapshot".into(),
            life,
            start: UNIX_EPOCH + Duration::from_micros(at(0) as u64),
            end: UNIX_EPOCH + Duration::from_micros(at(100) as u64),
        };
        let share = Share::of(&requests, &window(0));
        // Reactions: 2 ms before the call (after the content's create), 1 ms after it.
        assert_eq!(
            share,
            Share {
                step: 100_000,
                requests: 1,
                api: 4000,
                driver: 10_000,
                reactions: 3000,
                after_call: Some(85_000),
            }
        );
        assert!((share.step_ratio() - 100.0 / 97.0).abs() < 1e-9);
        assert!((share.own_ratio() - 17.0 / 14.0).abs() < 1e-9);
        let md = summary(&requests, &[window(0), window(1)]);
        assert!(
            md.contains(
                "| snapshot | 2 | 100.0 ms | 1 | 4.0 ms | 10.0 ms | 3.0 ms | 1.031x | 1.21x | 85.0 ms (85.0 ms) |"
            ),
            "{md}"
        );
        // The timeline writes the last life only, the driver's rows by method.
        let timeline = markdown(&requests, &[window(0), window(1)]);
        assert_eq!(timeline.matches("#### snapshot").count(), 1, "{timeline}");
        assert!(
            timeline.contains("| driver | CreateSnapshot | 10.0 | 2.0 |"),
            "{timeline}"
        );
        assert_eq!(median(vec![3.0, 1.0, 2.0, 10.0]), 2.5);
    }
}
