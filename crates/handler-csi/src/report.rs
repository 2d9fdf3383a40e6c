//! One line of text for an error and its causes, as a plugin sees it in
//! `RegistrationStatus.error` and an operator in a log line or on a terminal.
//!
//! This crate's errors keep each step's message apart from its cause (`#[source]`), so a log
//! layer can walk the chain. The text sent to a plugin must carry the whole story in one string,
//! the way upstream's wrapped Go errors read: `step: cause: root cause`.

use std::error::Error;
use std::fmt;

/// `e` and its sources joined with `": "`, as [`plugreg_runtime::report::chain`] words them
/// (gRPC statuses as grpc-go does, a cause already shown skipped); with the `kube` feature, a
/// Kubernetes API error reads as the server's message and ends the chain.
pub fn chain(e: &(dyn Error + 'static)) -> String {
    plugreg_runtime::report::chain_with(e, describe)
}

/// This crate's own wording of one level: only Kubernetes API errors.
#[cfg(feature = "kube")]
fn describe(err: &(dyn Error + 'static)) -> Option<(String, bool)> {
    let Some(kube::Error::Api(s)) = err.downcast_ref::<kube::Error>() else {
        return None;
    };
    let text = if s.message.is_empty() {
        format!("API server answered {} {}", s.code, s.reason)
    } else {
        s.message.clone()
    };
    Some((text, true))
}

#[cfg(not(feature = "kube"))]
fn describe(_: &(dyn Error + 'static)) -> Option<(String, bool)> {
    None
}

/// An error whose `Display` is its whole [`chain`]: what a handler hands to the plugin manager,
/// which sends `Display` to the plugin. The typed error stays reachable through
/// [`inner`](Self::inner) (and by downcasting the boxed handler error to `Reported<E>`).
pub struct Reported<E> {
    text: String,
    inner: E,
}

impl<E: Error + 'static> Reported<E> {
    /// Wraps `inner`.
    pub fn new(inner: E) -> Self {
        Self {
            text: chain(&inner),
            inner,
        }
    }
}

impl<E> Reported<E> {
    /// The typed error.
    pub fn inner(&self) -> &E {
        &self.inner
    }

    /// Unwraps the typed error.
    pub fn into_inner(self) -> E {
        self.inner
    }
}

impl<E> fmt::Display for Reported<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl<E: fmt::Debug> fmt::Debug for Reported<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

// No `source()`: the text already holds every cause, and a reporter that walks the chain would
// print each one twice.
impl<E: fmt::Debug> Error for Reported<E> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer step failed")]
    struct Outer(#[source] Middle);

    #[derive(Debug, thiserror::Error)]
    #[error("NodeGetInfo failed")]
    struct Middle(#[source] tonic::Status);

    #[test]
    fn joins_causes_and_formats_grpc_status_like_go() {
        let e = Outer(Middle(tonic::Status::unavailable("driver is sad")));
        assert_eq!(
            chain(&e),
            "outer step failed: NodeGetInfo failed: rpc error: code = Unavailable desc = driver is sad"
        );
        let r = Reported::new(e);
        assert_eq!(r.to_string(), chain(r.inner()));
        assert!(r.source().is_none());
    }

    #[derive(Debug, thiserror::Error)]
    #[error("wrapper: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[test]
    fn skips_a_cause_already_shown() {
        let e = Repeats(std::io::Error::other("boom"));
        assert_eq!(chain(&e), "wrapper: boom");
    }

    #[cfg(feature = "kube")]
    #[test]
    fn a_kube_api_error_reads_as_the_servers_message_and_ends_the_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("failed to patch Node \"n1\"")]
        struct Patch(#[source] kube::Error);

        let status = kube::core::Status {
            code: 409,
            reason: "Conflict".into(),
            message: "the object has been modified".into(),
            ..Default::default()
        };
        let e = Patch(kube::Error::Api(status.clone().boxed()));
        assert_eq!(
            chain(&e),
            "failed to patch Node \"n1\": the object has been modified"
        );
        let quiet = kube::core::Status {
            message: String::new(),
            ..status
        };
        let e = Patch(kube::Error::Api(quiet.boxed()));
        assert_eq!(
            chain(&e),
            "failed to patch Node \"n1\": API server answered 409 Conflict"
        );
    }
}
