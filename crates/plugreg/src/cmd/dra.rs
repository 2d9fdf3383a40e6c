//! `plugreg dra ...`: call a DRA driver on its socket as the kubelet would (D11).
//!
//! * `prepare` / `unprepare`: NodePrepareResources / NodeUnprepareResources through the
//!   manager's own DRA client (`plugreg_handler_dra::DraHandler`), with the kubelet's answer checks;
//! * `health`: the first NodeWatchResources answer (`v1alpha1.DRAResourceHealth`).
//!
//! Output is a table, or `-o json`.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, bail};
use plugreg_handler_dra::DraHandler;
use plugreg_manager::PluginHandler;
use plugreg_proto::dra::health_v1alpha1 as health;
use plugreg_proto::dra::v1;

use crate::output::{Output, table};

/// The `plugreg dra` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DraCommand {
    /// NodePrepareResources for the claims.
    Prepare(Calls),
    /// NodeUnprepareResources for the claims.
    Unprepare(Calls),
    /// Show the driver's device health (first NodeWatchResources answer).
    Health(Target),
}

/// Which driver, how long, how to print.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The driver's DRA socket: a path or unix://PATH.
    #[arg(long, value_name = "SOCKET")]
    pub endpoint: String,
    /// Limit for the call.
    #[arg(long, default_value = "45s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// A prepare or unprepare call.
#[derive(Debug, Clone, clap::Args)]
pub struct Calls {
    #[command(flatten)]
    target: Target,
    /// A claim as NAMESPACE/NAME/UID (repeatable).
    #[arg(long = "claim", required = true, value_parser = parse_claim)]
    claims: Vec<v1::Claim>,
    /// The service to call, as advertised.
    #[arg(long, default_value = "v1.DRAPlugin", value_parser = ["v1.DRAPlugin", "v1beta1.DRAPlugin"])]
    service: String,
}

fn parse_claim(s: &str) -> Result<v1::Claim, String> {
    let parts: Vec<&str> = s.split('/').collect();
    match parts.as_slice() {
        [ns, name, uid] if !ns.is_empty() && !name.is_empty() && !uid.is_empty() => Ok(v1::Claim {
            namespace: (*ns).into(),
            name: (*name).into(),
            uid: (*uid).into(),
        }),
        _ => Err(format!("{s:?} is not NAMESPACE/NAME/UID")),
    }
}

/// The name the CLI registers the endpoint under in its private handler.
const CLI_DRIVER: &str = "plugreg-cli";

/// Runs a `plugreg dra` command.
pub async fn run(cmd: DraCommand, out: &mut impl Write) -> anyhow::Result<()> {
    match cmd {
        DraCommand::Prepare(c) => call(c, true, out).await,
        DraCommand::Unprepare(c) => call(c, false, out).await,
        DraCommand::Health(t) => health_cmd(t, out).await,
    }
}

async fn call(c: Calls, prepare: bool, out: &mut impl Write) -> anyhow::Result<()> {
    let method = if prepare {
        "NodePrepareResources"
    } else {
        "NodeUnprepareResources"
    };
    let handler = DraHandler::with_timeouts(c.target.timeout, Duration::from_secs(5));
    handler
        .register(
            CLI_DRIVER,
            &c.target.endpoint,
            std::slice::from_ref(&c.service),
        )
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // (uid, name, error, devices)
    let mut rows: Vec<(String, String, String, Vec<v1::Device>)> = Vec::new();
    let answered: Vec<(String, String, Vec<v1::Device>)> = if prepare {
        let r = handler
            .prepare(CLI_DRIVER, c.claims.clone())
            .await
            .map_err(|s| anyhow::anyhow!("{method}: {}", plugreg_runtime::report::grpc(&s)))?;
        r.claims
            .into_iter()
            .map(|(k, v)| (k, v.error, v.devices))
            .collect()
    } else {
        let r = handler
            .unprepare(CLI_DRIVER, c.claims.clone())
            .await
            .map_err(|s| anyhow::anyhow!("{method}: {}", plugreg_runtime::report::grpc(&s)))?;
        r.claims
            .into_iter()
            .map(|(k, v)| (k, v.error, Vec::new()))
            .collect()
    };
    handler.deregister(CLI_DRIVER, &c.target.endpoint).await;
    let mut problems = Vec::new();
    for (uid, error, devices) in answered {
        let Some(claim) = c.claims.iter().find(|cl| cl.uid == uid) else {
            problems.push(format!(
                "{method} returned result for unknown claim UID {uid}"
            ));
            continue;
        };
        if !error.is_empty() {
            problems.push(format!(
                "{method} failed for ResourceClaim {}: {error}",
                claim.name
            ));
        }
        rows.push((uid, claim.name.clone(), error, devices));
    }
    let skipped = c
        .claims
        .iter()
        .filter(|cl| !rows.iter().any(|r| r.0 == cl.uid))
        .count();
    if skipped > 0 {
        problems.push(format!("{method} skipped {skipped} ResourceClaims"));
    }
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    match c.target.output {
        Output::Json => {
            let claims: Vec<_> = rows
                .iter()
                .map(|(uid, name, error, devices)| {
                    serde_json::json!({
                        "uid": uid, "name": name, "error": error,
                        "devices": devices.iter().map(|d| serde_json::json!({
                            "pool": d.pool_name, "device": d.device_name,
                            "requests": d.request_names, "cdi_device_ids": d.cdi_device_ids,
                            "share_id": d.share_id,
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect();
            let v = serde_json::json!({"method": method, "service": c.service, "claims": claims, "errors": problems});
            crate::output::json(out, &v)?;
        }
        Output::Table => {
            let mut lines = vec![[
                "CLAIM".to_owned(),
                "UID".into(),
                "POOL".into(),
                "DEVICE".into(),
                "CDI".into(),
                "ERROR".into(),
            ]];
            for (uid, name, error, devices) in &rows {
                if devices.is_empty() {
                    lines.push([
                        name.clone(),
                        uid.clone(),
                        "-".into(),
                        "-".into(),
                        "-".into(),
                        error.clone(),
                    ]);
                }
                for d in devices {
                    lines.push([
                        name.clone(),
                        uid.clone(),
                        d.pool_name.clone(),
                        d.device_name.clone(),
                        d.cdi_device_ids.join(","),
                        error.clone(),
                    ]);
                }
            }
            table(out, &lines)?;
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

async fn health_cmd(t: Target, out: &mut impl Write) -> anyhow::Result<()> {
    let path = plugreg_transport::parse_address(&t.endpoint)?;
    let answer = tokio::time::timeout(t.timeout, async {
        let conn = plugreg_transport::connect_direct(&path, t.timeout)
            .await
            .with_context(|| format!("cannot connect to {}", path.display()))?;
        let mut client = plugreg_transport::client!(
            health::dra_resource_health_client::DraResourceHealthClient,
            conn
        );
        let mut stream = client
            .node_watch_resources(health::NodeWatchResourcesRequest {})
            .await
            .map_err(|s| {
                anyhow::anyhow!("NodeWatchResources: {}", plugreg_runtime::report::grpc(&s))
            })?
            .into_inner();
        stream
            .message()
            .await
            .map_err(|s| {
                anyhow::anyhow!("NodeWatchResources: {}", plugreg_runtime::report::grpc(&s))
            })?
            .context("NodeWatchResources ended without an answer")
    })
    .await
    .map_err(|_| anyhow::anyhow!("NodeWatchResources: no answer within {:?}", t.timeout))??;
    let name = |h: i32| match health::HealthStatus::try_from(h) {
        Ok(health::HealthStatus::Healthy) => "Healthy",
        Ok(health::HealthStatus::Unhealthy) => "Unhealthy",
        _ => "Unknown",
    };
    match t.output {
        Output::Json => {
            let devices: Vec<_> = answer
                .devices
                .iter()
                .map(|d| {
                    let id = d.device.clone().unwrap_or_default();
                    serde_json::json!({
                        "pool": id.pool_name, "device": id.device_name, "health": name(d.health),
                        "last_updated_time": d.last_updated_time,
                        "health_check_timeout_seconds": d.health_check_timeout_seconds,
                        "message": d.message,
                    })
                })
                .collect();
            crate::output::json(out, &serde_json::json!({ "devices": devices }))?;
        }
        Output::Table => {
            let mut lines = vec![[
                "POOL".to_owned(),
                "DEVICE".into(),
                "HEALTH".into(),
                "MESSAGE".into(),
            ]];
            for d in &answer.devices {
                let id = d.device.clone().unwrap_or_default();
                lines.push([
                    id.pool_name,
                    id.device_name,
                    name(d.health).into(),
                    d.message.clone(),
                ]);
            }
            table(out, &lines)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_namespace_name_uid() {
        let c = parse_claim("ns/name/uid").unwrap();
        assert_eq!(
            (c.namespace.as_str(), c.name.as_str(), c.uid.as_str()),
            ("ns", "name", "uid")
        );
        assert_eq!(
            parse_claim("ns/name").unwrap_err(),
            "\"ns/name\" is not NAMESPACE/NAME/UID"
        );
        assert!(parse_claim("ns//uid").is_err());
        assert!(parse_claim("a/b/c/d").is_err());
    }
}
