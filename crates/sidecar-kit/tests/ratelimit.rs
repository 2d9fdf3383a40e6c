//! The shared client-side rate limit through a real kube-apiserver: every request is counted
//! under its verb and resource, a watch counts once, and a low-priority request made while
//! high-priority ones wait is sent after them.

use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use plugreg_sidecar_kit::ratelimit::{self, RateLimiter};
use plugreg_testpeers::{ApiServer, KubeVersion};

async fn config(api: &ApiServer) -> kube::Config {
    let kc = Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap()
}

/// Polls `cond` until it holds (or fails after 30 s).
async fn until(what: &str, limiter: &RateLimiter, cond: impl Fn(&RateLimiter) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cond(limiter) {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn every_request_is_counted_and_a_watch_once() {
    let api = ApiServer::shared(KubeVersion::V1_36_2).await.unwrap();
    // No limit, so the test waits for nothing but the server.
    let (high, low, limiter) = ratelimit::clients(config(&api).await, -1.0, 10).unwrap();
    let ns_high: Api<Namespace> = Api::all(high);
    let ns_low: Api<Namespace> = Api::all(low);
    for _ in 0..5 {
        ns_high.get("default").await.unwrap();
    }
    let list = ns_low.list(&ListParams::default()).await.unwrap();
    let rv = list.metadata.resource_version.unwrap();
    // Nothing changes: the watch ends at its server-side timeout after one request.
    let mut watch = ns_low
        .watch(&WatchParams::default().timeout(1), &rv)
        .await
        .unwrap()
        .boxed();
    while let Some(event) = watch.next().await {
        let event = event.unwrap();
        assert!(
            !matches!(event, kube::core::WatchEvent::Error(_)),
            "{event:?}"
        );
    }
    ns_high.get("kube-system").await.unwrap();

    let by_kind = limiter.requests_by_kind();
    assert_eq!(by_kind.get("GET namespaces"), Some(&6), "{by_kind:?}");
    assert_eq!(by_kind.get("LIST namespaces"), Some(&1), "{by_kind:?}");
    assert_eq!(by_kind.get("WATCH namespaces"), Some(&1), "{by_kind:?}");
    assert_eq!(limiter.requests(), 8, "{by_kind:?}");
}

#[tokio::test]
async fn a_low_request_made_while_high_ones_wait_is_sent_after_them() {
    let api = ApiServer::shared(KubeVersion::V1_36_2).await.unwrap();
    // Two tokens a second, bucket of 2: the test runs for about 3 s.
    let (high, low, limiter) = ratelimit::clients(config(&api).await, 2.0, 2).unwrap();
    let ns_high: Api<Namespace> = Api::all(high);
    let ns_low: Api<Namespace> = Api::all(low);
    for _ in 0..2 {
        ns_high.get("default").await.unwrap();
    }
    // The bucket is empty: these four wait, in the high queue.
    let highs: Vec<_> = (0..4)
        .map(|_| {
            let ns = ns_high.clone();
            tokio::spawn(async move { ns.get("default").await.map(|_| ()) })
        })
        .collect();
    until("four high requests queued", &limiter, |l| {
        l.waiting() == (4, 0)
    })
    .await;
    ns_low.get("kube-system").await.unwrap();
    // When the low request's answer is back, all high ones had been let through before it.
    let by_kind = limiter.requests_by_kind();
    assert_eq!(by_kind.get("GET namespaces"), Some(&7), "{by_kind:?}");
    assert_eq!(limiter.waiting(), (0, 0));
    for h in highs {
        h.await.unwrap().unwrap();
    }
    assert_eq!(limiter.requests(), 7);
}
