//! The binary, as a user runs it: see the tests in crates/devicemanager and crates/plugreg.
