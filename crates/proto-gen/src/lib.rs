//! plugreg-proto's Rust code is generated once and checked in (`crates/proto/src/gen`), so that
//! building plugreg never compiles a protobuf compiler. This crate holds the generator:
//!
//! * `cargo run -p plugreg-proto-gen` rewrites `crates/proto/src/gen` from `crates/proto/proto`;
//! * its test (`tests/current.rs`, part of `cargo test --workspace`) generates into a temp dir
//!   and fails when the checked-in code differs, naming the files and the command above.
//!
//! protox compiles the `.proto` files in Rust (no system `protoc`), tonic-prost-build turns the
//! descriptors into messages, clients and servers.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The `.proto` files, relative to [`proto_dir`] (which is also the import root).
pub const PROTO_FILES: [&str; 8] = [
    "pluginregistration.proto",
    "example_v1beta1.proto",
    "deviceplugin_v1beta1.proto",
    "example_v1beta2.proto",
    "csi.proto",
    "dra_v1.proto",
    "dra_v1beta1.proto",
    "dra_health_v1alpha1.proto",
];

/// Why generating or comparing failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `.proto` file does not compile.
    #[error("failed to compile the .proto files in {dir:?}")]
    Compile {
        /// The import root.
        dir: PathBuf,
        /// Why.
        #[source]
        source: Box<protox::Error>,
    },
    /// Code generation failed.
    #[error("failed to generate Rust code into {dir:?}")]
    Generate {
        /// The output directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Reading or writing a generated file failed.
    #[error("failed to access {path:?}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// `crates/proto/proto`: the `.proto` files.
pub fn proto_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/proto")
}

/// `crates/proto/src/gen`: the checked-in generated code.
pub fn gen_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/src/gen")
}

/// Generates the Rust code of [`PROTO_FILES`] into `out` (one `<package>.rs` per proto package).
pub fn generate(out: &Path) -> Result<(), Error> {
    let dir = proto_dir();
    let fds = protox::compile(PROTO_FILES, [&dir]).map_err(|source| Error::Compile {
        dir: dir.clone(),
        source: Box::new(source),
    })?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // prost's codec with small per-call buffers (plugreg-proto's `codec` module).
        .codec_path("crate::codec::ProstCodec")
        .out_dir(out)
        .compile_fds(fds)
        .map_err(|source| Error::Generate {
            dir: out.to_owned(),
            source,
        })
}

/// The `.rs` files in `dir`, by name.
fn rust_files(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>, Error> {
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { path, source }
    };
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into();
            files.insert(name, fs::read(&path).map_err(io_err(&path))?);
        }
    }
    Ok(files)
}

/// How the `.rs` files in `checked_in` differ from those in `fresh`: one entry per file that
/// is missing, extra or changed (empty: identical).
pub fn differences(checked_in: &Path, fresh: &Path) -> Result<Vec<String>, Error> {
    let old = rust_files(checked_in)?;
    let new = rust_files(fresh)?;
    let mut diffs = Vec::new();
    for (name, content) in &new {
        match old.get(name) {
            None => diffs.push(format!("{name} is missing")),
            Some(c) if c != content => diffs.push(format!("{name} differs")),
            Some(_) => {}
        }
    }
    diffs.extend(
        old.keys()
            .filter(|n| !new.contains_key(*n))
            .map(|n| format!("{n} is no longer generated")),
    );
    Ok(diffs)
}

/// Regenerates [`gen_dir`]: generates into a temp dir, then replaces the directory's `.rs`
/// files (a package that went away loses its file). Returns what changed.
pub fn regenerate() -> Result<Vec<String>, Error> {
    let target = gen_dir();
    let tmp = tempfile::tempdir().map_err(|source| Error::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    generate(tmp.path())?;
    fs::create_dir_all(&target).map_err(|source| Error::Io {
        path: target.clone(),
        source,
    })?;
    let changed = differences(&target, tmp.path())?;
    for name in rust_files(&target)?.keys() {
        let path = target.join(name);
        fs::remove_file(&path).map_err(|source| Error::Io { path, source })?;
    }
    for (name, content) in rust_files(tmp.path())? {
        let path = target.join(name);
        fs::write(&path, content).map_err(|source| Error::Io { path, source })?;
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_missing_extra_and_changed_files() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for (dir, name, text) in [
            (&a, "same.rs", "x"),
            (&b, "same.rs", "x"),
            (&a, "changed.rs", "old"),
            (&b, "changed.rs", "new"),
            (&a, "gone.rs", "x"),
            (&b, "new.rs", "x"),
            (&a, "notes.txt", "ignored"),
        ] {
            fs::write(dir.path().join(name), text).unwrap();
        }
        assert_eq!(
            differences(a.path(), b.path()).unwrap(),
            [
                "changed.rs differs",
                "new.rs is missing",
                "gone.rs is no longer generated"
            ]
        );
        assert!(differences(b.path(), b.path()).unwrap().is_empty());
    }
}
