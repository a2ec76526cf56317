//! The public edge under a stranger's load, over real processes: what a peer on the internet
//! can do to the gateway must not stop it.

use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use kvasir_api::{Client, ClientError};
use kvasir_tests::bin;
use kvasir_tests::swarm::Proc;

/// With its open-file limit at 64, the gateway is sent 200 idle TCP connections: it runs out
/// of descriptors, keeps accepting once they close, and serves the next client.
#[test]
fn running_out_of_file_descriptors_does_not_stop_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    let mut command = Command::new("prlimit");
    command
        .arg("--nofile=64:64")
        .arg(bin("kvasir-node"))
        .args(["gateway", "--listen", "127.0.0.1:0", "--self-signed"])
        .arg("--cert-out")
        .arg(&cert)
        .args(["--hub", "127.0.0.1:9"]);
    let mut gateway = Proc::spawn(command);
    let addr = gateway.listening("gateway");
    let idle: Vec<TcpStream> = (0..200)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    assert!(idle.len() > 64, "only {} connections were made", idle.len());
    std::thread::sleep(Duration::from_millis(500));
    drop(idle);
    std::thread::sleep(Duration::from_millis(500));
    // Still serving: the REST side answers (404: this gateway relays no ledger).
    let client =
        Client::with_ca(&format!("https://localhost:{}", port(&addr)), Some(&cert)).unwrap();
    match client.head() {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!(
            "the gateway stopped serving: {other:?}\n{}",
            gateway.stderr()
        ),
    }
    assert!(
        gateway.stderr().contains("accepting a connection"),
        "the accept errors were not logged: {}",
        gateway.stderr()
    );
}

fn port(addr: &str) -> &str {
    addr.rsplit(':').next().unwrap_or_default()
}
