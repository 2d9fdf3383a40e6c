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
//! Events (not on any step's path), and the benchmark's own requests (no user agent).

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
        .filter(|r| !r.resource.starts_with("leases") && !r.resource.starts_with("events"))
        .filter(|r| !r.actor.starts_with("user "))
        .collect();
    out.sort_by_key(|r| r.received);
    out
}

fn ms(micros: i64) -> String {
    format!("{:.1}", micros as f64 / 1000.0)
}

/// The timeline of each window, as Markdown: one table per step, then who made how many
/// requests and how long they waited in all.
pub fn markdown(requests: &[Request], windows: &[Window]) -> String {
    let mut o = String::new();
    for w in windows {
        let list = in_window(requests, w);
        let start = micros_of(w.start);
        let took = w.end.duration_since(w.start).unwrap_or(Duration::ZERO);
        o.push_str(&format!(
            "#### {} ({:.0} ms, {} requests)\n\n| at ms | who | request | API ms | after the previous answer, ms |\n|---|---|---|---|---|\n",
            w.step,
            took.as_secs_f64() * 1000.0,
            list.len()
        ));
        let mut previous: Option<i64> = None;
        let mut by_actor: BTreeMap<&str, (usize, i64, i64)> = BTreeMap::new();
        for r in &list {
            let gap = previous.map(|p| r.received - p);
            let name = if r.name.is_empty() {
                String::new()
            } else {
                format!(" {}", r.name)
            };
            o.push_str(&format!(
                "| {} | {} | {} {}{} ({}) | {} | {} |\n",
                ms(r.received - start),
                r.actor,
                r.verb,
                r.resource,
                name,
                r.code,
                ms(r.answered - r.received),
                gap.map(ms).unwrap_or_default()
            ));
            let e = by_actor.entry(r.actor.as_str()).or_default();
            e.0 += 1;
            e.1 += r.answered - r.received;
            e.2 += gap.unwrap_or(0).max(0);
            previous = Some(previous.map_or(r.answered, |p| p.max(r.answered)));
        }
        o.push_str("\nBy whom: ");
        let parts: Vec<String> = by_actor
            .iter()
            .map(|(a, (n, api, gap))| {
                format!(
                    "{a} {n} request(s), {} ms at the API server, {} ms before them",
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
        let mut bench = r.clone();
        bench.actor = "user plugreg-admin".into();
        let all = vec![r.clone(), lease, bench, early.clone()];
        let w = Window {
            step: "snapshot".into(),
            start: UNIX_EPOCH + Duration::from_micros(early.received as u64 - 1000),
            end: UNIX_EPOCH + Duration::from_micros(r.received as u64 + 1000),
        };
        let got = in_window(&all, &w);
        assert_eq!(got, vec![&early, &r]);
        let md = markdown(&all, &[w]);
        assert!(md.contains("| 1.0 | snapshot-controller |"), "{md}");
        // The second request came 46.5 ms after the first one's answer.
        assert!(md.contains("| 46.5 |"), "{md}");
    }
}
