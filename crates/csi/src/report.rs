//! One line of text for an error and its causes, as a plugin sees it in
//! `RegistrationStatus.error` and an operator in a log line or on a terminal.
//!
//! This crate's errors keep each step's message apart from its cause (`#[source]`), so a log
//! layer can walk the chain. The text sent to a plugin must carry the whole story in one string,
//! the way upstream's wrapped Go errors read: `step: cause: root cause`.

use std::error::Error;
use std::fmt;

/// `e` and its sources joined with `": "`. gRPC statuses read like Go's
/// (`rpc error: code = Unavailable desc = ...`), Kubernetes API errors as the server's message,
/// and a cause whose text the previous level already ends with is skipped.
pub fn chain(e: &(dyn Error + 'static)) -> String {
    let mut out = String::new();
    let mut next: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(err) = next {
        let (text, stop) = describe(err);
        // thiserror's `"...: {0}"` style already ends with its cause's text.
        if !out.ends_with(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        if stop {
            break;
        }
        next = err.source();
    }
    out
}

/// One level's text, and whether its own sources add nothing worth showing.
fn describe(err: &(dyn Error + 'static)) -> (String, bool) {
    if let Some(s) = err.downcast_ref::<tonic::Status>() {
        return (
            format!("rpc error: code = {:?} desc = {}", s.code(), s.message()),
            true,
        );
    }
    #[cfg(feature = "kube")]
    if let Some(kube::Error::Api(s)) = err.downcast_ref::<kube::Error>() {
        let text = if s.message.is_empty() {
            format!("API server answered {} {}", s.code, s.reason)
        } else {
            s.message.clone()
        };
        return (text, true);
    }
    (err.to_string(), false)
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
}
