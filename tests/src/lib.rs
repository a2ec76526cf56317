//! Helpers for the scenarios in `tests/tests/scenarios/`: they run the real `kvasir-node` and
//! `kvasir-wallet` binaries as separate processes, started through `kvasir_devnet`'s launcher.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

use kvasir_devnet::{Mode, Process};

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

/// Starts workspace binary `name` with `args`, its stderr kept for failure messages.
pub fn start<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S]) -> Process {
    Process::start(&bin(name), args, Mode::Test).expect("starting a process")
}

/// The `preset` checkpoint (`model synth --preset`), synthesized once per test process and
/// shared read-only by every scenario that asks for it: under
/// `target/<profile>/scenario-models/<pid>`, so that no run uses an older synthesis nor
/// another run's. The first call also removes what processes no longer running left there.
pub fn model(preset: &str) -> PathBuf {
    static MODELS: Mutex<Option<std::collections::HashMap<String, PathBuf>>> = Mutex::new(None);
    let mut models = MODELS.lock().unwrap_or_else(|p| p.into_inner());
    let models = models.get_or_insert_with(|| {
        let parent = models_dir().parent().map(Path::to_path_buf);
        for entry in parent
            .iter()
            .flat_map(std::fs::read_dir)
            .flatten()
            .flatten()
        {
            let name = entry.file_name();
            let pid = name.to_str().and_then(|n| n.parse::<u32>().ok());
            if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        std::collections::HashMap::new()
    });
    if let Some(path) = models.get(preset) {
        return path.clone();
    }
    let path = models_dir().join(preset);
    let synth = run(
        "kvasir-node",
        &[
            "model",
            "synth",
            "--out",
            path_str(&path),
            "--preset",
            preset,
        ],
    );
    assert!(synth.status.success(), "{}", stderr(&synth));
    models.insert(preset.to_string(), path.clone());
    path
}

/// This test run's shared files (see `model`): checkpoints, and the HOME of `command`.
fn models_dir() -> PathBuf {
    bin("kvasir-node")
        .parent()
        .expect("the profile directory")
        .join("scenario-models")
        .join(std::process::id().to_string())
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
    command(name).args(args).output().expect("starting binary")
}

/// A workspace binary to run, with its own HOME for this test run: the wallet remembers the
/// chain of every node URL it used under it (beside its default key file), and a test must
/// neither read what the user's wallet remembers nor leave anything there.
pub fn command(name: &str) -> Command {
    let home = models_dir().join("home");
    let _ = std::fs::create_dir_all(&home);
    let mut command = Command::new(bin(name));
    command.env("HOME", home);
    command
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
pub mod pay;
pub mod proxy;
pub mod swarm;
pub mod wallet;
