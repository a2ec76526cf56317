//! A role as a child process: what `dev`, the benches and the test scenarios all start. Its
//! stdout lines are read as they come (a role says where it listens with `<role> listening on
//! ADDR`); its stderr is kept, so that a child that exits when it should not can be named
//! with its last words. See `Mode` for what differs between a role the product starts
//! (passed through to our stderr, stopped cleanly, following its parent) and one a test starts.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// How long a role may take to say it listens.
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a child may take over a clean stop (the ledger finishing its block).
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Set in a child's environment to the pid of the process that started it.
const PARENT_ENV: &str = "KVASIR_PARENT_PID";
/// Stderr kept per `Mode::Product` child: at least its latest 64 KiB, at most twice that.
const KEPT_STDERR: usize = 64 * 1024;

/// Called first thing in every `kvasir-node` process: a role started by `Process` gets
/// SIGTERM when its parent dies (however it dies), so no worker outlives a killed `dev`.
pub fn follow_parent() {
    #[cfg(target_os = "linux")]
    if let Some(parent) = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
    {
        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM);
        // The parent may have died before the line above ran.
        if std::os::unix::process::parent_id() != parent {
            std::process::exit(1);
        }
    }
}

/// This executable's path: what `kvasir-node` starts its roles with.
pub fn current_exe() -> Result<std::path::PathBuf> {
    std::env::current_exe().context("locating this executable")
}

/// Who starts the child, which says where its stderr goes and whether it follows its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A role `kvasir-node` starts (`dev`, benches): its stderr written to ours as it comes,
    /// at warning level unless RUST_LOG says otherwise, its latest 64 KiB kept; dropping its
    /// handle stops it cleanly (SIGTERM, then SIGKILL if it lingers); it stops when its
    /// parent dies (`follow_parent`).
    Product,
    /// A process a test starts: its stderr kept whole, at the role's own log level, for the
    /// test to read and print on failure; dropping its handle kills it (SIGKILL) at once.
    Test,
}

pub struct Process {
    child: std::process::Child,
    lines: Receiver<String>,
    /// The stdout lines read so far.
    seen: Vec<String>,
    /// The latest of what it wrote to stderr.
    stderr: Arc<Mutex<String>>,
    what: String,
    mode: Mode,
}

impl Process {
    /// Runs `exe` with `args`, named in errors by its first argument (its role).
    pub fn start<S: AsRef<OsStr>>(exe: &Path, args: &[S], mode: Mode) -> Result<Process> {
        let mut command = Command::new(exe);
        command.args(args);
        let role = args.first().map_or("child".into(), |a| {
            a.as_ref().to_string_lossy().into_owned()
        });
        Process::spawn(command, &role, mode)
    }

    /// Starts `command` (its output piped to this handle), named `role` in errors.
    pub fn spawn(mut command: Command, role: &str, mode: Mode) -> Result<Process> {
        if mode == Mode::Product && std::env::var_os("RUST_LOG").is_none() {
            // What is echoed is what goes wrong: the consensus network warns of every
            // connection a stopping peer closes, and errs on every gossip a lone validator
            // has no peer for (see main's DEFAULT_LOG).
            command.env(
                "RUST_LOG",
                "warn,arc_malachitebft_discovery=error,arc_malachitebft_network=off,libp2p_gossipsub=error",
            );
        }
        if mode == Mode::Product {
            command.env(PARENT_ENV, std::process::id().to_string());
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the {role}"))?;
        let (tx, lines) = channel();
        let stdout = child.stdout.take().context("child stdout")?;
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let kept = Arc::new(Mutex::new(String::new()));
        let sink = kept.clone();
        let pipe = child.stderr.take().context("child stderr")?;
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if mode == Mode::Product {
                    eprintln!("{line}");
                }
                let mut all = sink.lock().unwrap_or_else(|p| p.into_inner());
                all.push_str(&line);
                all.push('\n');
                if mode == Mode::Product && all.len() > 2 * KEPT_STDERR {
                    let mut cut = all.len() - KEPT_STDERR;
                    while !all.is_char_boundary(cut) {
                        cut += 1;
                    }
                    all.drain(..cut);
                }
            }
        });
        let what = format!("the {role} (pid {})", child.id());
        Ok(Process {
            child,
            lines,
            seen: Vec::new(),
            stderr: kept,
            what,
            mode,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it wrote to stderr (the latest 64 KiB of it, for `Mode::Product`).
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Its last stderr line, quoted, or "nothing".
    fn last_words(&self) -> String {
        match self.stderr().lines().last() {
            Some(line) => format!("{line:?}"),
            None => "nothing".into(),
        }
    }

    /// If it has exited: which child, how, and the last thing it logged.
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok().flatten()?;
        Some(format!(
            "{} exited ({status}); its last message: {}",
            self.what,
            self.last_words()
        ))
    }

    /// The rest of the next stdout line (after those already returned) that starts with
    /// `prefix`; an error naming what it printed if none comes within `timeout`.
    pub fn line_within(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        self.next_line(prefix, timeout, false)
    }

    /// As `line_within`, for as long as the child goes on printing: an error only once
    /// `START_TIMEOUT` passes without a line (a worker loading a large slice prints as it
    /// goes).
    pub fn line(&mut self, prefix: &str) -> Result<String> {
        self.next_line(prefix, START_TIMEOUT, true)
    }

    /// `timeout` from now, or from each line that comes (`each_line`).
    fn next_line(&mut self, prefix: &str, timeout: Duration, each_line: bool) -> Result<String> {
        let mut deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        let rest = rest.trim().to_string();
                        self.seen.push(line);
                        return Ok(rest);
                    }
                    self.seen.push(line);
                    if each_line {
                        deadline = Instant::now() + timeout;
                    }
                }
                // What a product's child wrote is on our stderr already.
                Err(_) if self.mode == Mode::Product => bail!(
                    "{} did not print {prefix:?} (see its messages above)",
                    self.what
                ),
                Err(_) => bail!(
                    "{} did not print {prefix:?} within {timeout:?}; its stdout {:?}; its stderr:\n{}",
                    self.what,
                    self.seen,
                    self.stderr()
                ),
            }
        }
    }

    /// The address of its `<role> listening on ADDR` line.
    pub fn listening(&mut self, role: &str) -> Result<SocketAddr> {
        let addr = self.line(&format!("{role} listening on "))?;
        addr.parse()
            .with_context(|| format!("{role} printed a bad address {addr:?}"))
    }

    /// Sends it `signal`.
    #[cfg(unix)]
    pub fn signal(&self, signal: nix::sys::signal::Signal) -> Result<()> {
        let pid = i32::try_from(self.pid()).context("a pid over i32")?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
            .with_context(|| format!("signalling {}", self.what))
    }

    /// Stops it at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for it to exit, however it ends: its exit code (none if a signal ended it) and
    /// what it wrote to stderr.
    pub fn wait_for_exit(mut self, timeout: Duration) -> Result<(Option<i32>, String)> {
        let status = self.wait(timeout)?;
        Ok((status.code(), self.stderr()))
    }

    /// Waits for it to exit: all it wrote to stdout, or an error naming what it printed if
    /// it fails or outlasts `timeout`.
    pub fn finish(mut self, timeout: Duration) -> Result<String> {
        let status = self.wait(timeout)?;
        let mut out: Vec<String> = std::mem::take(&mut self.seen);
        out.extend(self.lines.try_iter());
        if !status.success() {
            bail!("{} exited {status}: {out:?}\n{}", self.what, self.stderr());
        }
        Ok(out.join("\n"))
    }

    fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().context("waiting")? {
                // Let the reader threads drain what is left.
                std::thread::sleep(Duration::from_millis(50));
                return Ok(status);
            }
            if Instant::now() > deadline {
                return Err(anyhow!(
                    "{} still runs after {timeout:?} (hung?)\n{}",
                    self.what,
                    self.stderr()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // Reaped already (see `exited`): its pid may belong to another process by now.
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        #[cfg(unix)]
        if self.mode == Mode::Product && self.signal(nix::sys::signal::Signal::SIGTERM).is_ok() {
            let deadline = Instant::now() + STOP_TIMEOUT;
            while Instant::now() < deadline {
                if matches!(self.child.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Process {
        Process::start(Path::new("sh"), &["-c", script], Mode::Test).unwrap()
    }

    #[test]
    fn reads_lines_keeps_stderr_and_names_a_child_that_exits() {
        let mut child =
            sh("echo noise; echo 'hub listening on 127.0.0.1:7'; echo oops >&2; exit 3");
        assert_eq!(
            child.listening("hub").unwrap(),
            "127.0.0.1:7".parse().unwrap()
        );
        let error = child
            .line_within("never", Duration::from_secs(5))
            .unwrap_err();
        assert!(error.to_string().contains("noise"), "{error}");
        std::thread::sleep(Duration::from_millis(200));
        let exited = child.exited().unwrap();
        assert!(exited.contains("\"oops\""), "{exited}");
        let (code, stderr) = sh("echo bye >&2; exit 4")
            .wait_for_exit(Duration::from_secs(5))
            .unwrap();
        assert_eq!((code, stderr.as_str()), (Some(4), "bye\n"));
        assert!(sh("exit 1").finish(Duration::from_secs(5)).is_err());
        assert_eq!(
            sh("echo a; echo b").finish(Duration::from_secs(5)).unwrap(),
            "a\nb"
        );
    }

    #[test]
    fn a_dropped_child_is_stopped() {
        for mode in [Mode::Test, Mode::Product] {
            let child = Process::start(Path::new("sh"), &["-c", "sleep 60"], mode).unwrap();
            let pid = child.pid();
            drop(child);
            assert!(!Path::new(&format!("/proc/{pid}")).exists(), "{mode:?}");
        }
    }

    #[test]
    fn a_product_child_is_waited_for_while_it_prints() {
        let mut child = Process::start(
            Path::new("sh"),
            &["-c", "echo a; sleep 1; echo b; sleep 1; echo done"],
            Mode::Product,
        )
        .unwrap();
        // Each line within 1.5 s, the whole longer than that.
        assert_eq!(
            child
                .next_line("done", Duration::from_millis(1500), true)
                .unwrap(),
            ""
        );
        let mut child = Process::start(Path::new("sh"), &["-c", "sleep 5"], Mode::Product).unwrap();
        let error = child
            .line_within("x", Duration::from_millis(100))
            .unwrap_err();
        assert!(
            error.to_string().contains("see its messages above"),
            "{error}"
        );
    }
}
