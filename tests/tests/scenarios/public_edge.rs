//! The public edge under a stranger's load, over real processes: what a peer on the internet
//! can do to the gateway must not stop it.

use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use kvasir_api::{Client, ClientError};
use kvasir_devnet::{Mode, Process};
use kvasir_tests::bin;
use kvasir_tests::swarm::lone_gateway;

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
    let mut gateway = Process::spawn(command, "gateway", Mode::Test).unwrap();
    let addr = gateway.listening("gateway").unwrap().to_string();
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

/// A gateway relaying to a ledger that does not answer, or is not there, answers within its
/// timeout with the API's own error, and tells the public nothing about its insides.
#[test]
fn a_silent_or_missing_ledger_gets_a_json_error_in_time_without_internal_text() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    // Accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap();
    // Nothing listens here.
    let missing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let missing_addr = missing.local_addr().unwrap();
    drop(missing);
    for (ledger, status, kind) in [
        (silent_addr, 504, "ledger_timeout"),
        (missing_addr, 502, "ledger_unreachable"),
    ] {
        let ledger_url = format!("http://{ledger}");
        let (_gateway, addr) = lone_gateway(
            &cert,
            &["--ledger", &ledger_url, "--ledger-timeout-ms", "500"],
        );
        let url = format!("https://localhost:{}", port(&addr));
        let client = Client::with_ca(&url, Some(&cert)).unwrap();
        let start = std::time::Instant::now();
        match client.head() {
            Err(ClientError::Api {
                status: got,
                error,
                message,
            }) => {
                assert_eq!((got, error.as_str()), (status, kind), "{message}");
                for secret in [
                    "127.0.0.1",
                    "refused",
                    "os error",
                    &ledger.port().to_string(),
                ] {
                    assert!(!message.contains(secret), "{message:?} tells {secret:?}");
                }
            }
            other => panic!("expected {status} {kind}: {other:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }
    drop(silent);
}

fn port(addr: &str) -> &str {
    addr.rsplit(':').next().unwrap_or_default()
}

/// A POST that promises 1000 bytes of body and sends one a second is answered 408 (the API's
/// JSON error) within the gateway's body deadline, and the gateway serves others meanwhile.
#[test]
fn a_trickled_request_body_gets_a_408_in_time_and_others_are_served_meanwhile() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::ServerName;
    use tokio_rustls::TlsConnector;

    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    let (gateway, addr) = lone_gateway(&cert, &[]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let start = std::time::Instant::now();
    let trickled = runtime.spawn({
        let (addr, cert) = (addr.clone(), cert.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let tls = TlsConnector::from(kvasir_wire::tls::client(Some(&cert)).unwrap());
            let name = ServerName::try_from("localhost").unwrap();
            let (mut reader, mut writer) = tokio::io::split(tls.connect(name, tcp).await.unwrap());
            writer
                .write_all(b"POST /txs HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
                .await
                .unwrap();
            let trickle = tokio::spawn(async move {
                while writer.write_all(b" ").await.is_ok() && writer.flush().await.is_ok() {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            });
            let mut answer = Vec::new();
            let read = tokio::time::timeout(
                Duration::from_secs(20),
                reader.read_to_end(&mut answer),
            )
            .await;
            trickle.abort();
            (read.is_ok(), String::from_utf8_lossy(&answer).into_owned())
        }
    });
    // Meanwhile another client is served at once (404: this gateway relays no ledger).
    std::thread::sleep(Duration::from_secs(2));
    let client =
        Client::with_ca(&format!("https://localhost:{}", port(&addr)), Some(&cert)).unwrap();
    let asked = std::time::Instant::now();
    match client.head() {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => panic!("the gateway stopped serving: {other:?}"),
    }
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    let (ended, answer) = runtime.block_on(trickled).unwrap();
    let took = start.elapsed();
    assert!(
        ended,
        "the connection was still open after {took:?}: {answer:?}\n{}",
        gateway.stderr()
    );
    assert!(took < Duration::from_secs(13), "took {took:?}");
    if !answer.is_empty() {
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        let error: kvasir_api::ErrorBody =
            serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert_eq!(error.error, "request_timeout", "{answer}");
    }
}
