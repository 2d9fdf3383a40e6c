//! Property tests (arbtest) of the checks that untrusted input meets first. The same
//! properties run for longer as libFuzzer targets in `fuzz/`.

use arbtest::arbitrary;
use plugreg_manager::info_check;

#[path = "props/plugininfo.rs"]
mod plugininfo;

#[test]
fn plugininfo_checks_accept_exactly_the_acceptable_replies() {
    arbtest::arbtest(plugininfo::check).budget_ms(500);
}
