//! Helpers for the cross-crate scenarios in `tests/tests/`: they run the real
//! `kvasir-node` and `kvasir-wallet` binaries as separate processes.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Path of a workspace binary, built (once per test process) in the same profile as the
/// running test, so a scenario never runs a stale binary.
pub fn bin(name: &str) -> PathBuf {
    static PROFILE_DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = PROFILE_DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        // target/<profile>/deps/<test> -> target/<profile>
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target dir")
            .to_path_buf();
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .args([
                "build",
                "--quiet",
                "-p",
                "kvasir-node",
                "-p",
                "kvasir-wallet",
            ])
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
        // What cargo set for this test's package: build scripts that watch these (ring
        // watches CARGO_PKG_NAME and CARGO_MANIFEST_DIR) would otherwise see them changed
        // from a plain `cargo build` and rebuild half the tree, here and at the next build.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            let set_by_cargo = [
                "CARGO_PKG_",
                "CARGO_MANIFEST_",
                "CARGO_CRATE_",
                "CARGO_BIN_",
            ]
            .iter()
            .any(|prefix| name.starts_with(prefix))
                || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"].contains(&&*name);
            if set_by_cargo {
                cargo.env_remove(&*name);
            }
        }
        if release {
            cargo.arg("--release");
        }
        let status = cargo.status().expect("running cargo build");
        assert!(status.success(), "building the binaries failed");
        profile_dir
    });
    dir.join(name)
}

/// A fresh chain from the built-in template (`genesis init`) in `chain`.
pub fn genesis_init(chain: &Path) {
    genesis_init_with(chain, &[]);
}

/// As `genesis_init`, with `extra` arguments (`--model M`, `--template T`...).
pub fn genesis_init_with(chain: &Path, extra: &[&str]) {
    let mut args = vec!["genesis", "init", "--out", path_str(chain)];
    args.extend_from_slice(extra);
    let init = run("kvasir-node", &args);
    assert!(init.status.success(), "{}", stderr(&init));
}

/// Runs a workspace binary to completion and returns its output.
pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(bin(name))
        .args(args)
        .output()
        .expect("starting binary")
}

/// A temporary path as the `&str` a command line takes.
pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

pub mod network;
pub mod proxy;
pub mod swarm;
pub mod wallet;
