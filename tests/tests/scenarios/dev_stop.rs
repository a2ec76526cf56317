//! `kvasir-node dev --serve` stops every process it started: cleanly on Ctrl-C (SIGINT) or
//! SIGTERM, and even when it is itself SIGKILLed (each child follows its parent).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvasir_devnet::Process;
use kvasir_tests::start;
use kvasir_tests::swarm::{alive, children};
use nix::sys::signal::Signal;

/// `dev --serve` on the tiny model, up and serving; the process and the pids it started.
fn serving(data: &Path) -> (Process, Vec<u32>) {
    let mut dev = start(
        "kvasir-node",
        &[
            "dev",
            "--serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--preset",
            "tiny",
            "--tokens",
            "4",
        ],
    );
    dev.line_within("the swarm is running", Duration::from_secs(300))
        .unwrap();
    let started = children(dev.pid());
    // Ledger, hub, gateway and two workers (the backbone generated once and has exited).
    assert_eq!(started.len(), 5, "{started:?}\n{}", dev.stderr());
    (dev, started)
}

fn all_gone_within(pids: &[u32], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while pids.iter().any(|p| alive(*p)) {
        let left: Vec<&u32> = pids.iter().filter(|p| alive(**p)).collect();
        assert!(Instant::now() < deadline, "still running: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn ctrl_c_and_sigterm_stop_every_child_and_leave_a_verified_chain() {
    let dir = tempfile::tempdir().unwrap();
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        let (dev, started) = serving(dir.path());
        dev.signal(signal).unwrap();
        let out = dev.finish(Duration::from_secs(120)).unwrap();
        assert!(out.contains("stopping the swarm"), "{out}");
        assert!(out.contains("chain re-verified from genesis"), "{out}");
        all_gone_within(&started, Duration::from_secs(5));
    }
}

#[test]
fn children_stop_when_dev_is_killed_outright() {
    let dir = tempfile::tempdir().unwrap();
    let (mut dev, started) = serving(dir.path());
    dev.kill();
    all_gone_within(&started, Duration::from_secs(30));
}

#[test]
fn a_child_that_dies_stops_dev_with_its_name_and_every_other_child() {
    let dir = tempfile::tempdir().unwrap();
    let (dev, started) = serving(dir.path());
    // The gateway is the only child listening on a TLS port of its own: find it by its
    // command line.
    let gateway = *started
        .iter()
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|b| *b == 0).any(|arg| arg == b"gateway"))
        })
        .expect("a gateway child");
    let status = Command::new("kill")
        .args(["-KILL", &gateway.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    let (code, stderr) = dev.wait_for_exit(Duration::from_secs(60)).unwrap();
    assert_ne!(code, Some(0), "dev must fail when a child dies: {stderr}");
    assert!(
        stderr.contains(&format!("the gateway (pid {gateway}) exited")),
        "{stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    all_gone_within(&started, Duration::from_secs(30));
}
