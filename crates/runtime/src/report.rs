//! One line of text for an error and its causes: what a plugin reads in
//! `RegistrationStatus.error`, an operator in a log line or on a terminal.
//!
//! plugreg's errors keep each step's message apart from its cause (`#[source]`). A text sent to a
//! plugin must carry the whole story in one string, the way upstream's wrapped Go errors read:
//! `step: cause: root cause`, with gRPC statuses worded as grpc-go words them.

use std::error::Error;

/// A gRPC status worded as grpc-go words it: `rpc error: code = Unavailable desc = ...`.
pub fn grpc(status: &tonic::Status) -> String {
    format!(
        "rpc error: code = {} desc = {}",
        go_code(status.code()),
        status.message()
    )
}

/// A gRPC code's name as grpc-go spells it (`OK`, `Canceled`, `InvalidArgument`, ...); tonic's
/// `Debug` differs for two of them (`Ok`, `Cancelled`).
pub fn go_code(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// `e` and its sources joined with `": "`: a [`tonic::Status`] reads as [`grpc`] and ends the
/// chain; a cause whose text the previous level already ends with (thiserror's `"...: {0}"`) is
/// skipped.
pub fn chain(e: &(dyn Error + 'static)) -> String {
    chain_with(e, |_| None)
}

/// [`chain`], where `describe` may word a level itself: `Some((text, last))` uses `text` for that
/// level and, when `last`, stops there (its own sources add nothing).
pub fn chain_with(
    e: &(dyn Error + 'static),
    describe: impl Fn(&(dyn Error + 'static)) -> Option<(String, bool)>,
) -> String {
    let mut out = String::new();
    let mut next: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(err) = next {
        let (text, last) =
            describe(err).unwrap_or_else(|| match err.downcast_ref::<tonic::Status>() {
                Some(s) => (grpc(s), true),
                None => (err.to_string(), false),
            });
        if !out.ends_with(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        if last {
            break;
        }
        next = err.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Step(&'static str, Option<Box<dyn Error + 'static>>);
    impl std::fmt::Display for Step {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl Error for Step {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref()
        }
    }

    #[test]
    fn joins_causes_and_words_grpc_like_go() {
        let status = tonic::Status::unavailable("driver is sad");
        let e = Step("NodeGetInfo failed", Some(Box::new(status)));
        let e = Step("register", Some(Box::new(e)));
        assert_eq!(
            chain(&e),
            "register: NodeGetInfo failed: rpc error: code = Unavailable desc = driver is sad"
        );
    }

    #[test]
    fn a_cause_already_in_the_text_is_not_repeated() {
        let inner = Step("connection refused", None);
        let e = Step("dial failed: connection refused", Some(Box::new(inner)));
        assert_eq!(chain(&e), "dial failed: connection refused");
    }

    #[test]
    fn a_custom_description_can_end_the_chain() {
        let e = Step("outer", Some(Box::new(Step("noisy inner", None))));
        let text = chain_with(&e, |err| {
            (err.to_string() == "outer").then(|| ("OUTER".to_string(), true))
        });
        assert_eq!(text, "OUTER");
    }
}
