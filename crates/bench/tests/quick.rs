//! The smoke run end to end: latency in-process, a small burst with the farm and the
//! in-process-child manager as processes, the section spliced into an existing file.

use std::process::Command;

#[test]
fn quick_run_writes_its_section_and_keeps_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("BENCHMARKS.md");
    std::fs::write(&out, "# Benchmarks\n\n## Sidecar\n\nkept\n").unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_plugreg-bench"))
        .args([
            "--quick",
            "--latency-count",
            "5",
            "--warmup",
            "1",
            "--burst",
            "50",
        ])
        .args(["--manager", "in-process-child", "--settle", "200ms"])
        .arg("--work-dirs")
        .arg(tmp.path())
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let md = std::fs::read_to_string(&out).unwrap();
    assert!(
        md.starts_with("# Benchmarks\n\n## Sidecar\n\nkept\n"),
        "{md}"
    );
    assert!(md.contains("<!-- bench:manager:start -->"));
    assert!(md.contains("<!-- bench:manager:end -->"));
    assert!(md.contains("| in-process-child (library) |"), "{md}");
    assert!(md.contains("**registration**"), "{md}");
}
