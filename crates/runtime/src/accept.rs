//! What a listener does when `accept()` fails for want of resources.
//!
//! EMFILE, ENFILE, ENOBUFS and ENOMEM pass, but an accept retried at once fails again at once: a
//! listener that retries in a loop burns a core until the shortage ends. Every plugreg listener
//! pauses instead, by [`BACKOFF`] (as Go's `net/http` does).

use std::io;
use std::time::Duration;

use crate::Backoff;

/// The pause after consecutive failed accepts: 5 ms doubling to 1 s.
pub const BACKOFF: Backoff = Backoff::new(Duration::from_millis(5), Duration::from_secs(1));

/// Whether an accept error is a shortage (out of file descriptors or kernel memory), which calls
/// for a pause rather than an immediate retry.
pub fn is_shortage(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc_errno::EMFILE | libc_errno::ENFILE | libc_errno::ENOBUFS | libc_errno::ENOMEM)
    )
}

/// Linux errno values (no libc dependency for four numbers).
mod libc_errno {
    pub const ENOMEM: i32 = 12;
    pub const ENFILE: i32 = 23;
    pub const EMFILE: i32 = 24;
    pub const ENOBUFS: i32 = 105;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortages_are_told_apart_from_other_errors() {
        assert!(is_shortage(&io::Error::from_raw_os_error(24)));
        assert!(is_shortage(&io::Error::from_raw_os_error(23)));
        assert!(!is_shortage(&io::Error::from_raw_os_error(103))); // ECONNABORTED
        assert!(!is_shortage(&io::Error::other("no errno")));
        assert_eq!(BACKOFF.delay(1), Duration::from_millis(5));
        assert_eq!(BACKOFF.delay(20), Duration::from_secs(1));
    }
}
