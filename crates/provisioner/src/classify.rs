//! What a failed provisioning step means for the claim (upstream's `ProvisioningState`,
//! `docs/upstream/upstream-external-provisioner.md` §11): whether anything may still be running in the
//! driver, and whether the scheduler should pick another node.

use std::fmt;

use tonic::Code;

/// The state a failed attempt leaves the claim in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Nothing runs in the background: the driver said no, or the request was never sent.
    /// (The claim is still retried with back-off while it exists.)
    Final,
    /// The driver may still be creating the volume: keep the claim's intent until a final
    /// answer or success, even if the claim is deleted meanwhile.
    Background,
    /// Nothing changed (an error before the call, e.g. a secret or topology lookup): the
    /// previous state stands.
    NoChange,
    /// The selected node cannot take the volume: remove `volume.kubernetes.io/selected-node`
    /// so that the scheduler picks again.
    Reschedule,
}

/// One failed provisioning attempt: the text upstream puts in the `ProvisioningFailed` event,
/// and what it means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProvisionError {
    /// What state the attempt leaves behind.
    pub state: State,
    /// The event and log text (gRPC errors read `rpc error: code = <Code> desc = <msg>`).
    pub message: String,
    /// The driver answered INVALID_ARGUMENT: upstream's "infeasible" slow path (§11.4).
    pub infeasible: bool,
}

impl ProvisionError {
    /// A final error with this text.
    pub fn final_(message: impl Into<String>) -> Self {
        Self::new(State::Final, message)
    }

    /// A no-change error with this text.
    pub fn no_change(message: impl Into<String>) -> Self {
        Self::new(State::NoChange, message)
    }

    /// An error in `state` with this text.
    pub fn new(state: State, message: impl Into<String>) -> Self {
        Self {
            state,
            message: message.into(),
            infeasible: false,
        }
    }

    /// Prefixes the message (`"<context>: <message>"`), keeping the state.
    pub fn context(mut self, context: &str) -> Self {
        self.message = format!("{context}: {}", self.message);
        self
    }

    /// Classifies a failed CreateVolume (§11.1). `reschedule_possible` is true when topology
    /// is supported and the claim has a selected node.
    /// A failure of the transport rather than an answer of the driver (see [`from_transport`])
    /// is in the background: the request may have reached the driver.
    pub fn from_create_volume(status: &tonic::Status, reschedule_possible: bool) -> Self {
        let state = if from_transport(status) {
            State::Background
        } else {
            create_volume_state(status.code(), reschedule_possible)
        };
        Self {
            state,
            message: plugreg_runtime::report::grpc(status),
            infeasible: status.code() == Code::InvalidArgument,
        }
    }
}

impl fmt::Display for ProvisionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ProvisionError {}

/// The state of a CreateVolume error code (§11.1): RESOURCE_EXHAUSTED reschedules when it can;
/// CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE and ABORTED may still be running in the driver;
/// every other code is final. Transport failures arrive as UNAVAILABLE or UNKNOWN from tonic
/// and upstream treats non-gRPC errors as background: tonic's UNKNOWN without a status from the
/// server is covered by the caller passing [`State::Background`] directly.
pub fn create_volume_state(code: Code, reschedule_possible: bool) -> State {
    match code {
        Code::ResourceExhausted if reschedule_possible => State::Reschedule,
        Code::ResourceExhausted => State::Final,
        Code::Cancelled | Code::DeadlineExceeded | Code::Unavailable | Code::Aborted => {
            State::Background
        }
        _ => State::Final,
    }
}

/// Whether `status` was made on this side of the connection (a reset connection, a stream
/// without a gRPC status, a reply over the message cap) instead of being the driver's answer:
/// then the driver may have received, and carried out, the request. tonic keeps the transport's
/// error as the status's source; the statuses it makes itself without one are recognised by
/// their texts.
pub fn from_transport(status: &tonic::Status) -> bool {
    const LOCAL: [&str; 4] = [
        "Error, decoded message length too large",
        "grpc-status header missing",
        "missing grpc-status",
        "transport error",
    ];
    std::error::Error::source(status).is_some()
        || LOCAL.iter().any(|t| status.message().contains(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_volume_codes_map_to_upstreams_states() {
        let bg = [
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::Unavailable,
            Code::Aborted,
        ];
        for c in bg {
            assert_eq!(create_volume_state(c, true), State::Background, "{c:?}");
        }
        assert_eq!(
            create_volume_state(Code::ResourceExhausted, true),
            State::Reschedule
        );
        assert_eq!(
            create_volume_state(Code::ResourceExhausted, false),
            State::Final
        );
        for c in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::OutOfRange,
            Code::FailedPrecondition,
            Code::Unimplemented,
            Code::Internal,
        ] {
            assert_eq!(create_volume_state(c, true), State::Final, "{c:?}");
        }
    }

    #[test]
    fn transport_failures_are_background() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
        let reset = tonic::Status::from_error(Box::new(io));
        assert_eq!(reset.code(), Code::Unknown);
        assert_eq!(
            ProvisionError::from_create_volume(&reset, false).state,
            State::Background
        );
        let too_large = tonic::Status::out_of_range(
            "Error, decoded message length too large: found 5000000 bytes, the limit is: 4194304 bytes",
        );
        assert_eq!(
            ProvisionError::from_create_volume(&too_large, false).state,
            State::Background
        );
        let truncated =
            tonic::Status::unknown("grpc-status header missing, mapped from HTTP status code 200");
        assert_eq!(
            ProvisionError::from_create_volume(&truncated, true).state,
            State::Background
        );
        // The driver's own UNKNOWN and OUT_OF_RANGE stay final.
        for s in [
            tonic::Status::unknown("disk on fire"),
            tonic::Status::out_of_range("too big"),
        ] {
            assert_eq!(
                ProvisionError::from_create_volume(&s, false).state,
                State::Final
            );
        }
    }

    #[test]
    fn invalid_argument_is_infeasible_and_reads_like_grpc_go() {
        let e =
            ProvisionError::from_create_volume(&tonic::Status::invalid_argument("bad size"), false);
        assert!(e.infeasible);
        assert_eq!(e.state, State::Final);
        assert!(
            e.message
                .starts_with("rpc error: code = InvalidArgument desc = bad size")
        );
    }
}
