//! The sidecars' diagnostics: a small HTTP/1 server with the bounds a network endpoint needs and
//! one shared health check in flight ([`http`]), and the metrics registry with
//! `csi_sidecar_operations_seconds`, the work-queue, leader and process metrics, and a sidecar's
//! own families through a [`metrics::Collector`] ([`metrics`]).
//!
//! It is not the endpoints themselves: which paths a sidecar serves (`/metrics`,
//! `/healthz/leader-election`) and what they check is `plugreg-sidecar-kit`'s `diagnostics`.
//! It needs no Kubernetes client.

pub mod http;
pub mod metrics;
