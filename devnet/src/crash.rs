//! SIGKILL at random instants, the harness of the stores' crash tests (the ledger's, the
//! consensus proposals' and the hub registry's). The child is the test binary itself, started
//! on one of its ignored tests with a data directory in its environment; it writes to its
//! store as fast as it can and prints a line after each write it made durable, until it is
//! killed. The test then reopens the store and checks that every durable write is there.
//!
//! `KVASIR_CRASH_ITERATIONS` sets the number of kills and `KVASIR_CRASH_SEED` replays a
//! run's instants. A store that fails to reopen is kept, and its files listed (`listing`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Set in the child's environment to the directory of its store.
const CHILD_DIR: &str = "KVASIR_CRASH_CHILD_DIR";

/// The store directory, in the child; `None` when the ignored child test is run by itself.
pub fn child_dir() -> Option<PathBuf> {
    std::env::var_os(CHILD_DIR).map(PathBuf::from)
}

/// A run of kills, with its own seeded instants.
pub struct Kills {
    pub iterations: usize,
    pub seed: u64,
    rng: StdRng,
    /// Kills that landed after the child's first durable write: a run with too few of them
    /// only ever killed start-up.
    pub after_writes: usize,
}

/// When the child is killed.
#[derive(Debug, Clone, Copy)]
enum KillAt {
    /// This long after it starts: often while it opens its store.
    AfterStart(Duration),
    /// This long after its first durable write: inside its write loop.
    AfterFirstWrite(Duration),
}

impl Kills {
    /// `KVASIR_CRASH_ITERATIONS` kills (`default` without it), at the instants of
    /// `KVASIR_CRASH_SEED` (a random seed without it, printed so that it can be replayed).
    pub fn from_env(store: &str, default: usize) -> Kills {
        let iterations = std::env::var("KVASIR_CRASH_ITERATIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default);
        let seed = std::env::var("KVASIR_CRASH_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(rand::random);
        eprintln!("crash test of the {store}: {iterations} kills, KVASIR_CRASH_SEED={seed}");
        Kills {
            iterations,
            seed,
            rng: StdRng::seed_from_u64(seed),
            after_writes: 0,
        }
    }

    /// Starts this test binary's ignored test `child` on the store in `dir`, kills it with
    /// SIGKILL at the next random instant and returns the lines it printed (the writes it
    /// made durable, in order).
    pub fn kill_child(&mut self, child: &str, dir: &Path) -> Vec<String> {
        let kill_at = if self.rng.gen_bool(0.5) {
            KillAt::AfterStart(Duration::from_micros(self.rng.gen_range(0..150_000)))
        } else {
            KillAt::AfterFirstWrite(Duration::from_micros(self.rng.gen_range(0..40_000)))
        };
        let exe = std::env::current_exe().expect("the test binary's path");
        let mut process = Command::new(exe)
            .args([
                child,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the child");
        let stdout = process.stdout.take().expect("the child's stdout");
        let (sender, receiver) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // The test harness's own lines ("running 1 test") are not writes.
                if let Some(write) = line.strip_prefix("durable ") {
                    let _ = sender.send(write.to_string());
                }
            }
        });
        let mut lines = Vec::new();
        match kill_at {
            KillAt::AfterStart(delay) => std::thread::sleep(delay),
            KillAt::AfterFirstWrite(delay) => {
                lines.extend(receiver.recv_timeout(Duration::from_secs(30)).ok());
                std::thread::sleep(delay);
            }
        }
        process.kill().expect("SIGKILL");
        let status = process.wait().expect("the killed child");
        let _ = reader.join();
        // A child that failed on its own (a write refused, a panic) proves nothing either.
        #[cfg(unix)]
        let killed = std::os::unix::process::ExitStatusExt::signal(&status) == Some(9);
        #[cfg(not(unix))]
        let killed = !status.success();
        assert!(
            killed,
            "the child must have been killed, not have exited: {status}"
        );
        lines.extend(receiver.try_iter());
        if !lines.is_empty() {
            self.after_writes += 1;
        }
        lines
    }

    /// Fails a run whose kills mostly landed before the child wrote anything.
    pub fn assert_enough_after_writes(&self) {
        assert!(
            self.after_writes * 2 >= self.iterations,
            "only {} of {} kills landed after a write, too few to prove anything",
            self.after_writes,
            self.iterations
        );
    }
}

/// What a child prints after each write it made durable (read by `Kills::kill_child`).
pub fn report_durable(write: std::fmt::Arguments) {
    println!("durable {write}");
}

/// The files of the store at `store` with their sizes, for the message of a store that
/// failed to reopen (whose test keeps its directory), so that its cause can be read.
pub fn listing(store: &Path) -> String {
    let files: Vec<String> = std::fs::read_dir(store)
        .into_iter()
        .flatten()
        .flatten()
        .map(|f| {
            let size = f.metadata().map_or(0, |m| m.len());
            format!("{} ({size} bytes)", f.file_name().to_string_lossy())
        })
        .collect();
    format!(
        "the store is kept in {} and holds {files:?}",
        store.display()
    )
}
