//! A swarm of real `kvasir-node` processes on loopback: hub, gateway (TLS, self-signed),
//! workers and backbone runs, each a child process killed when its handle drops.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvasir_api::generation::GenerationReport;
use kvasir_api::registry::ReceiptListing;
use kvasir_ledger::Keypair;
use kvasir_node::link::{connect, Connected, Dialed, Identity};
use kvasir_node::wire::Role;
use tokio_rustls::rustls::ClientConfig;

use crate::network::Network;
use crate::{bin, genesis_init_with, path_str, run, stderr, stdout};

/// A running process; SIGKILLed on drop.
pub struct Proc {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
    errors: Arc<Mutex<String>>,
}

impl Proc {
    pub fn start<S: AsRef<std::ffi::OsStr>>(name: &str, args: &[S]) -> Proc {
        let mut command = Command::new(bin(name));
        command.args(args);
        Proc::spawn(command)
    }

    /// Starts `command` (its output piped to this handle).
    pub fn spawn(mut command: Command) -> Proc {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting a process");
        let (tx, lines) = channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let errors = Arc::new(Mutex::new(String::new()));
        let sink = errors.clone();
        let stderr = child.stderr.take().expect("piped stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut all = sink.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        Proc {
            child,
            lines,
            seen: Vec::new(),
            errors,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote to stderr so far (for failure messages).
    pub fn stderr(&self) -> String {
        self.errors.lock().unwrap().clone()
    }

    /// The rest of the next stdout line (after those already returned) that starts with
    /// `prefix`; panics after `timeout`.
    pub fn line(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.trim().to_string();
                    }
                }
                Err(_) => panic!(
                    "no line starting {prefix:?} within {timeout:?}; stdout {:?}; stderr:\n{}",
                    self.seen,
                    self.stderr()
                ),
            }
        }
    }

    /// The address from a `... listening on ADDR` line.
    pub fn listening(&mut self, role: &str) -> String {
        self.line(&format!("{role} listening on "), Duration::from_secs(60))
    }

    /// Sends `signal` (e.g. "INT") with the system's `kill`.
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args(["-s", signal, &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(sent.success(), "kill -s {signal} failed");
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for exit, however it ends; its exit code and everything it wrote to stderr.
    pub fn wait_for_exit(mut self, timeout: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting") {
                // Let the reader thread drain what is left.
                std::thread::sleep(Duration::from_millis(50));
                return (status.code(), self.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "still running after {timeout:?} (hung?)\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for exit; all stdout, or a panic naming what it printed if it fails or hangs.
    pub fn finish(mut self, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting") {
                // Let the reader thread drain what is left.
                std::thread::sleep(Duration::from_millis(50));
                let mut out: Vec<String> = std::mem::take(&mut self.seen);
                out.extend(self.lines.try_iter());
                assert!(
                    status.success(),
                    "exit {status}: {out:?}\n{}",
                    self.stderr()
                );
                return out.join("\n");
            }
            if Instant::now() > deadline {
                panic!("still running after {timeout:?} (hung?)\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The pids whose parent is `pid` (from /proc).
pub fn children(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if process_stat(child).is_some_and(|(_, parent)| parent == pid) {
            found.push(child);
        }
    }
    found
}

/// Whether `pid` is a live process (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    process_stat(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// State letter and parent pid from /proc/PID/stat (the name field may hold spaces).
fn process_stat(pid: u32) -> Option<(char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.next()?.parse().ok()?))
}

/// `GET path` on a plain HTTP endpoint; the body.
pub fn http_get(addr: &str, path: &str) -> String {
    http(addr, "GET", path, "").1
}

/// One HTTP/1.1 request; the status code and the body.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connecting");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    match response.split_once("\r\n\r\n") {
        Some((_, body)) => (status, body.to_string()),
        None => panic!("not an HTTP response: {response:?}"),
    }
}

/// As `http`, over TLS trusting the certificate in `cert` (a self-signed gateway's).
pub fn https(addr: &str, cert: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let response = HttpsCall::send(addr, cert, method, path, body).rest();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    match response.split_once("\r\n\r\n") {
        Some((_, body)) => (status, body.to_string()),
        None => panic!("not an HTTP response: {response:?}"),
    }
}

/// A request sent over TLS (trusting the certificate in `cert`), its answer read as far as
/// the test says: a client can stop reading mid-stream, or hang up by dropping it.
pub struct HttpsCall {
    runtime: tokio::runtime::Runtime,
    stream: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
}

impl HttpsCall {
    pub fn send(addr: &str, cert: &Path, method: &str, path: &str, body: &str) -> HttpsCall {
        use tokio::io::AsyncWriteExt;
        use tokio_rustls::rustls::pki_types::ServerName;
        use tokio_rustls::TlsConnector;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let stream = runtime.block_on(async {
            let tcp = tokio::net::TcpStream::connect(addr).await.expect("connecting");
            let tls = TlsConnector::from(kvasir_node::tls::client(Some(cert)).unwrap());
            let name = ServerName::try_from("localhost").unwrap();
            let mut stream = tls.connect(name, tcp).await.expect("a TLS handshake");
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            stream
        });
        HttpsCall { runtime, stream }
    }

    /// What arrived up to and including the first `needle`; panics if the answer ends first.
    pub fn read_until(&mut self, needle: &str) -> String {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        let mut buffer = [0; 4096];
        while !String::from_utf8_lossy(&got).contains(needle) {
            let n = self
                .runtime
                .block_on(self.stream.read(&mut buffer))
                .unwrap_or(0);
            assert!(
                n > 0,
                "the answer ended before {needle:?}: {}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buffer[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    /// The rest of the answer, to the connection's end.
    pub fn rest(mut self) -> String {
        use tokio::io::AsyncReadExt;
        let mut response = Vec::new();
        // A peer closing without TLS close_notify still delivered what it sent.
        let _ = self
            .runtime
            .block_on(self.stream.read_to_end(&mut response));
        String::from_utf8_lossy(&response).into_owned()
    }
}

/// Sockets in LISTEN state owned by process `pid` (Linux `/proc`).
pub fn listening_sockets(pid: u32) -> usize {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|t| {
                    let t = t.to_string_lossy().into_owned();
                    Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .collect()
        })
        .unwrap_or_default();
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|l| {
                    let fields: Vec<&str> = l.split_whitespace().collect();
                    (fields.get(3) == Some(&"0A")).then(|| fields.get(9).map(|s| s.to_string()))?
                })
                .collect::<Vec<_>>()
        })
        .filter(|inode| inodes.contains(inode))
        .count()
}

/// Hub, gateway and workers over a synthetic checkpoint and a fresh chain.
pub struct Swarm {
    pub dir: tempfile::TempDir,
    pub model: PathBuf,
    pub hub: Option<Proc>,
    pub gateway: Proc,
    pub workers: Vec<Proc>,
    pub hub_addr: String,
    pub registry_addr: String,
    pub gateway_addr: String,
    pub ledger: Option<Proc>,
    /// The ledger's REST API: comma-separated URLs over a network of validators.
    pub ledger_url: Option<String>,
    /// The validators and full nodes, in a swarm started over them.
    pub network: Option<Network>,
    backbone_key: PathBuf,
    /// Arguments added to the hub's command line, also when it is restarted.
    hub_extra: Vec<String>,
}

impl Swarm {
    pub fn start(preset: &str) -> Swarm {
        Swarm::start_with(preset, false)
    }

    /// With `crediting`, also a ledger, and the gateway credits the hub's receipts to it.
    pub fn start_with(preset: &str, crediting: bool) -> Swarm {
        Swarm::start_with_hub_args(preset, crediting, &[])
    }

    /// As `start_with`, the hub also given `hub_extra` (e.g. `--idle-timeout-ms 1000`).
    pub fn start_with_hub_args(preset: &str, crediting: bool, hub_extra: &[&str]) -> Swarm {
        Swarm::start_on(preset, crediting, hub_extra, None, None)
    }

    /// A crediting swarm whose chain keeps credits pending for `blocks` (the template's
    /// challenge window otherwise, ten seconds of blocks): for tests that must see a
    /// conviction cancel a session's pay however slowly the machine runs.
    pub fn start_with_challenge_window(preset: &str, blocks: u64) -> Swarm {
        Swarm::start_on(preset, true, &[], Some(blocks), None)
    }

    /// A crediting swarm whose chain is run by `validators` validators, and whose hub,
    /// gateway and backbone talk to its `full_nodes` full nodes (failing over between them).
    pub fn start_over_validators(preset: &str, validators: usize, full_nodes: usize) -> Swarm {
        Swarm::start_on(preset, true, &[], None, Some((validators, full_nodes)))
    }

    fn start_on(
        preset: &str,
        crediting: bool,
        hub_extra: &[&str],
        challenge_window: Option<u64>,
        validators: Option<(usize, usize)>,
    ) -> Swarm {
        let mut hub_extra: Vec<String> = hub_extra.iter().map(|a| a.to_string()).collect();
        let dir = tempfile::tempdir().unwrap();
        let model = synth_model(dir.path(), preset);
        let chain = dir.path().join("chain");
        // A crediting swarm's chain pins its model, so that evidence can be judged.
        let mut init_extra = vec![];
        if crediting {
            init_extra.extend(["--model", path_str(&model)]);
        }
        let template = dir.path().join("template.json");
        if let Some(blocks) = challenge_window {
            let mut json: serde_json::Value =
                serde_json::from_str(include_str!("../../genesis/template.json")).unwrap();
            json["params"]["challenge_window"] = blocks.into();
            // Unbonding must outlast the window.
            json["params"]["unbonding_blocks"] = (blocks + 10).into();
            std::fs::write(&template, json.to_string()).unwrap();
            init_extra.extend(["--template", path_str(&template)]);
        }
        let (ledger, ledger_url, network) = match (crediting, validators) {
            (true, Some((validators, full_nodes))) => {
                let network = Network::start_in(
                    dir.path(),
                    validators,
                    full_nodes,
                    &init_extra,
                    &["--model", path_str(&model)],
                );
                let urls: Vec<String> = (validators..validators + full_nodes)
                    .map(|node| network.url(node))
                    .collect();
                (None, Some(urls.join(",")), Some(network))
            }
            (true, None) => {
                genesis_init_with(&chain, &init_extra);
                let data = dir.path().join("ledger");
                let (ledger, addr) = start_ledger_on(&chain, &data, "127.0.0.1:0", Some(&model));
                (Some(ledger), Some(format!("http://{addr}")), None)
            }
            (false, _) => {
                genesis_init_with(&chain, &init_extra);
                (None, None, None)
            }
        };
        if let Some(url) = &ledger_url {
            // The hub admits only bonded workers, as the ledger says.
            hub_extra.extend(["--ledger".to_string(), url.clone()]);
        }
        let backbone_key = dir.path().join("backbone.key");
        let backbone = new_key(&backbone_key);
        let mut hub = Proc::start(
            "kvasir-node",
            &Swarm::hub_args(
                dir.path(),
                "127.0.0.1:0",
                "127.0.0.1:0",
                &backbone,
                &hub_extra,
            ),
        );
        let hub_addr = hub.listening("hub");
        let registry_addr = hub.listening("hub registry");
        let gateway_args = Swarm::gateway_args(
            dir.path(),
            "127.0.0.1:0",
            &hub_addr,
            &registry_addr,
            ledger_url.as_deref(),
        );
        let mut gateway = Proc::start("kvasir-node", &gateway_args);
        let gateway_addr = gateway.listening("gateway");
        Swarm {
            dir,
            model,
            hub: Some(hub),
            gateway,
            workers: Vec::new(),
            hub_addr,
            registry_addr,
            gateway_addr,
            ledger,
            ledger_url,
            network,
            backbone_key,
            hub_extra,
        }
    }

    fn hub_args(
        dir: &Path,
        listen: &str,
        registry: &str,
        backbone: &str,
        extra: &[String],
    ) -> Vec<String> {
        let chain = dir.join("chain");
        let mut args = [
            "hub",
            "--listen",
            listen,
            "--registry-listen",
            registry,
            "--key",
            path_str(&chain.join("keys/hub.key")),
            "--genesis",
            path_str(&chain.join("genesis.json")),
            "--backbone",
            backbone,
            "--data-dir",
            path_str(&dir.join("hub-data")),
        ]
        .map(String::from)
        .to_vec();
        args.extend_from_slice(extra);
        args
    }

    fn gateway_args(
        dir: &Path,
        listen: &str,
        hub: &str,
        registry: &str,
        ledger: Option<&str>,
    ) -> Vec<String> {
        let cert = dir.join("gateway-cert.pem");
        let mut args = vec![
            "gateway",
            "--listen",
            listen,
            "--self-signed",
            "--cert-out",
            path_str(&cert),
            "--hub",
            hub,
        ];
        let registry_url = format!("http://{registry}");
        let key = dir.join("chain/keys/gateway.key");
        if let Some(ledger_url) = ledger {
            args.extend([
                "--ledger",
                ledger_url,
                "--registry",
                &registry_url,
                "--key",
                path_str(&key),
                "--credit-interval-ms",
                "100",
            ]);
        }
        args.into_iter().map(String::from).collect()
    }

    /// Kills the gateway and starts it again on the same address, with at most `files` open
    /// files (`prlimit`) and `extra` arguments.
    pub fn restart_gateway_limited(&mut self, files: u64, extra: &[&str]) {
        self.gateway.kill();
        let mut command = Command::new("prlimit");
        command
            .arg(format!("--nofile={files}:{files}"))
            .arg(bin("kvasir-node"))
            .args(Swarm::gateway_args(
                self.dir.path(),
                &self.gateway_addr,
                &self.hub_addr,
                &self.registry_addr,
                self.ledger_url.as_deref(),
            ))
            .args(extra);
        self.gateway = Proc::spawn(command);
        self.gateway.listening("gateway");
    }

    /// Kills the gateway (SIGKILL) and starts it again on the same address.
    pub fn restart_gateway(&mut self) {
        self.restart_gateway_with(&[]);
    }

    /// As `restart_gateway`, the gateway also given `extra` (e.g. `--backbone URL`).
    pub fn restart_gateway_with(&mut self, extra: &[&str]) {
        self.gateway.kill();
        let mut args = Swarm::gateway_args(
            self.dir.path(),
            &self.gateway_addr,
            &self.hub_addr,
            &self.registry_addr,
            self.ledger_url.as_deref(),
        );
        args.extend(extra.iter().map(|a| a.to_string()));
        self.gateway = Proc::start("kvasir-node", &args);
        self.gateway.listening("gateway");
    }

    /// Starts the hub again on its old addresses and data dir (after a kill).
    pub fn restart_hub(&mut self) {
        let backbone = stdout(&run(
            "kvasir-wallet",
            &["address", "--keyfile", path_str(&self.backbone_key)],
        ));
        let args = Swarm::hub_args(
            self.dir.path(),
            &self.hub_addr,
            &self.registry_addr,
            backbone.trim(),
            &self.hub_extra,
        );
        let mut hub = Proc::start("kvasir-node", &args);
        hub.listening("hub");
        hub.listening("hub registry");
        self.hub = Some(hub);
    }

    /// Kills the hub (SIGKILL) and starts it again on its addresses and data dir.
    pub fn kill_and_restart_hub(&mut self) {
        if let Some(mut hub) = self.hub.take() {
            hub.kill();
        }
        self.restart_hub();
    }

    /// Kills the ledger (SIGKILL) and starts it again on its address and data dir.
    pub fn restart_ledger(&mut self) {
        let url = self.ledger_url.clone().expect("a swarm with one ledger");
        let addr = url.strip_prefix("http://").expect("an http URL");
        if let Some(mut ledger) = self.ledger.take() {
            ledger.kill();
        }
        let chain = self.dir.path().join("chain");
        let data = self.dir.path().join("ledger");
        let (ledger, _) = start_ledger_on(&chain, &data, addr, Some(&self.model));
        self.ledger = Some(ledger);
    }

    pub fn cert(&self) -> PathBuf {
        self.dir.path().join("gateway-cert.pem")
    }

    pub fn gateway_url(&self) -> String {
        format!(
            "wss://localhost:{}/swarm",
            self.gateway_addr.rsplit(':').next().unwrap_or_default()
        )
    }

    /// Starts a worker holding `experts`; returns its index once its session is open.
    pub fn add_worker(&mut self, experts: &str) -> usize {
        self.add_worker_with(experts, &[])
    }

    /// As `add_worker`, the worker also given `extra` arguments.
    pub fn add_worker_with(&mut self, experts: &str, extra: &[&str]) -> usize {
        let key = self.worker_key(self.workers.len());
        new_key(&key);
        if let Some(ledger) = &self.ledger_url {
            self.bond(ledger, &key);
        }
        let (url, cert) = (self.gateway_url(), self.cert());
        let mut args = vec![
            "worker",
            "--gateway",
            &url,
            "--keyfile",
            path_str(&key),
            "--model",
            path_str(&self.model),
            "--experts",
            experts,
            "--ca",
            path_str(&cert),
        ];
        args.extend_from_slice(extra);
        let mut worker = Proc::start("kvasir-node", &args);
        worker.line("worker session ", Duration::from_secs(60));
        self.workers.push(worker);
        self.workers.len() - 1
    }

    /// Funds the worker key in `keyfile` from the faucet and bonds the chain's `min_bond`
    /// with it, as a worker operator does before serving (the hub admits only bonded keys):
    /// the same steps `kvasir-node dev` takes.
    pub fn bond(&self, ledger: &str, keyfile: &Path) {
        let client = kvasir_api::Client::new(ledger);
        let faucet = kvasir_keyfile::open(&self.dir.path().join("chain/keys/faucet.key")).unwrap();
        let worker = kvasir_keyfile::open(keyfile).unwrap();
        kvasir_node::dev::launch::bond_workers(&client, &faucet, &[&worker]).unwrap();
    }

    /// Starts a backbone generating greedily with `remote` experts dispatched.
    pub fn start_backbone(&self, remote: &str, prompt: &str, tokens: usize) -> Proc {
        let tokens = tokens.to_string();
        self.backbone_process(&[remote, "--prompt", prompt, "--tokens", &tokens, "--json"])
    }

    /// The backbone's key file (the hub's `--backbone`).
    pub fn backbone_key(&self) -> &Path {
        &self.backbone_key
    }

    /// The key file of worker `index` (as `add_worker` returned it).
    pub fn worker_key(&self, index: usize) -> PathBuf {
        self.dir.path().join(format!("worker{index}.key"))
    }

    /// Starts a backbone serving HTTP on a free port; the process and its address.
    pub fn serve_backbone(&self, remote: &str) -> (Proc, String) {
        self.serve_backbone_with(remote, &[])
    }

    /// As `serve_backbone`, the backbone also given `extra` (e.g. `--order 3`).
    pub fn serve_backbone_with(&self, remote: &str, extra: &[&str]) -> (Proc, String) {
        let mut args = vec![remote, "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut backbone = self.backbone_process(&args);
        let addr = backbone.listening("backbone");
        (backbone, addr)
    }

    /// `backbone --remote <args...>` with this swarm's model, hub and key.
    fn backbone_process(&self, remote_and_more: &[&str]) -> Proc {
        let mut args: Vec<String> = [
            "backbone",
            "--model",
            path_str(&self.model),
            "--hub",
            &format!("ws://{}", self.hub_addr),
            "--key",
            path_str(&self.backbone_key),
            "--dispatch-timeout-ms",
            "3000",
            "--wait-ms",
            "20000",
            "--remote",
        ]
        .map(String::from)
        .to_vec();
        args.extend(remote_and_more.iter().map(|a| a.to_string()));
        if let Some(ledger) = &self.ledger_url {
            // Bonds checked before dispatching, and evidence of wrong answers submitted.
            args.extend(["--ledger".to_string(), ledger.clone()]);
        }
        Proc::start("kvasir-node", &args)
    }

    /// A backbone run to completion: its JSON report.
    pub fn backbone(&self, remote: &str, prompt: &str, tokens: usize) -> GenerationReport {
        self.backbone_with(remote, prompt, tokens, &[])
    }

    /// As `backbone`, the backbone also given `extra` (e.g. `--audit-rate 1`).
    pub fn backbone_with(
        &self,
        remote: &str,
        prompt: &str,
        tokens: usize,
        extra: &[&str],
    ) -> GenerationReport {
        let tokens = tokens.to_string();
        let mut args = vec![remote, "--prompt", prompt, "--tokens", &tokens, "--json"];
        args.extend_from_slice(extra);
        let out = self
            .backbone_process(&args)
            .finish(Duration::from_secs(300));
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    /// The same generation with every expert local.
    pub fn local(&self, prompt: &str, tokens: usize) -> GenerationReport {
        let tokens = tokens.to_string();
        let out = run(
            "kvasir-node",
            &[
                "generate",
                "--model",
                path_str(&self.model),
                "--prompt",
                prompt,
                "--tokens",
                &tokens,
                "--json",
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_str(&stdout(&out)).unwrap()
    }

    /// Cumulative metered bytes per session id, from the hub's registry.
    pub fn metered(&self) -> Vec<(u64, String, u64)> {
        let body = http_get(&self.registry_addr, "/receipts");
        let listing: ReceiptListing =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        listing
            .receipts
            .into_iter()
            .map(|r| (r.session_id, r.worker.to_string(), r.cumulative_bytes))
            .collect()
    }
}

/// `remote` equals the all-local run `local` bit for bit, and every expert it asked of the
/// swarm was answered there (none fell back).
pub fn assert_all_remote_and_identical(remote: &GenerationReport, local: &GenerationReport) {
    assert_eq!(remote.token_ids, local.token_ids);
    assert_eq!(remote.logits_blake3, local.logits_blake3);
    let dispatch = remote.dispatch.expect("dispatch counts");
    assert!(
        dispatch.remote_requests > 0 && dispatch.fallbacks == 0,
        "{dispatch:?}"
    );
}

/// A worker session with a fresh key that claims nothing (so no backbone ever dispatches to
/// it), dialled through `url`: its sending half, its read half and its session id, or None if
/// the hub refused it.
pub async fn claimless_session(
    url: &str,
    tls: &Arc<ClientConfig>,
    key: &Keypair,
) -> Option<(
    tokio::sync::mpsc::UnboundedSender<tokio_tungstenite::tungstenite::Bytes>,
    Dialed,
    u64,
)> {
    let identity = Identity {
        key,
        role: Role::Worker,
        model_id: "silent".into(),
        backend: "cpu".into(),
        experts: vec![],
        order: 0,
    };
    let Connected {
        tx,
        source,
        session,
        ..
    } = connect(url, tls, identity).await.ok()?;
    Some((tx, source, session))
}

/// The `preset` checkpoint, synthesized into `dir/model`.
pub fn synth_model(dir: &Path, preset: &str) -> PathBuf {
    let model = dir.join("model");
    let synth = run(
        "kvasir-node",
        &[
            "model",
            "synth",
            "--out",
            path_str(&model),
            "--preset",
            preset,
        ],
    );
    assert!(synth.status.success(), "{}", stderr(&synth));
    model
}

/// A gateway on its own (its hub unreachable at port 9), self-signed into `cert`, with
/// `extra` arguments; the process and its address.
pub fn lone_gateway(cert: &Path, extra: &[&str]) -> (Proc, String) {
    let mut gateway = Proc::start(
        "kvasir-node",
        &[
            &[
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--self-signed",
                "--cert-out",
                path_str(cert),
                "--hub",
                "127.0.0.1:9",
            ],
            extra,
        ]
        .concat(),
    );
    let addr = gateway.listening("gateway");
    (gateway, addr)
}

/// Resident memory of process `pid`, in KiB (`VmRSS`).
pub fn resident_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// A fresh wallet key file; its address.
pub fn new_key(path: &Path) -> String {
    let out = run("kvasir-wallet", &["new", "--keyfile", path_str(path)]);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out).trim().to_string()
}

/// A ledger service for the chain in `chain` (genesis.json, keys/validator.key), storing in
/// `data`; the process and its API address.
pub fn start_ledger(chain: &Path, data: &Path) -> (Proc, String) {
    start_ledger_on(chain, data, "127.0.0.1:0", None)
}

/// As `start_ledger`, on `listen`, checking evidence with the checkpoint in `model`.
fn start_ledger_on(
    chain: &Path,
    data: &Path,
    listen: &str,
    model: Option<&Path>,
) -> (Proc, String) {
    let (genesis, key) = (chain.join("genesis.json"), chain.join("keys/validator.key"));
    let mut args = vec![
        "ledger",
        "--genesis",
        path_str(&genesis),
        "--data-dir",
        path_str(data),
        "--listen",
        listen,
        "--key",
        path_str(&key),
    ];
    if let Some(model) = model {
        args.extend(["--model", path_str(model)]);
    }
    let mut ledger = Proc::start("kvasir-node", &args);
    let addr = ledger.listening("ledger");
    (ledger, addr)
}
