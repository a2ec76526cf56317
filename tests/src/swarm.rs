//! A swarm of real `kvasir-node` processes on loopback: hub, gateway (TLS, self-signed),
//! workers and backbone runs, each a child process (`kvasir_devnet::Process`) stopped when its
//! handle drops, started with the command lines of `kvasir_devnet::roles`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvasir_api::generation::GenerationReport;
use kvasir_api::registry::ReceiptListing;
use kvasir_devnet::{roles, Mode, Process};
use kvasir_ledger::Keypair;
use kvasir_wire::link::{connect, Connected, Dialed, Identity};
use kvasir_wire::Role;
use tokio_rustls::rustls::ClientConfig;

use crate::network::Network;
use crate::{bin, genesis_init_with, model, path_str, run, start, stderr, stdout};

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
            let tls = TlsConnector::from(kvasir_wire::tls::client(Some(cert)).unwrap());
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
    pub hub: Option<Process>,
    pub gateway: Process,
    pub workers: Vec<Process>,
    pub hub_addr: String,
    pub registry_addr: String,
    pub gateway_addr: String,
    pub ledger: Option<Process>,
    /// The ledger's REST API: comma-separated URLs over a network of validators.
    pub ledger_url: Option<String>,
    /// The validators and full nodes, in a swarm started over them.
    pub network: Option<Network>,
    backbone_key: PathBuf,
    /// Arguments added to the hub's command line, also when it is restarted.
    pub hub_extra: Vec<String>,
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
        let model = model(preset);
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
                    // A format-2 ledger judges evidence from the weights it carries.
                    &[],
                );
                let urls: Vec<String> = (validators..validators + full_nodes)
                    .map(|node| network.url(node))
                    .collect();
                (None, Some(urls.join(",")), Some(network))
            }
            (true, None) => {
                genesis_init_with(&chain, &init_extra);
                let data = dir.path().join("ledger");
                let (ledger, addr) = start_ledger_on(&chain, &data, "127.0.0.1:0");
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
        if let Some(url) = &ledger_url {
            // The backbone holds the deposit and pays the fees of the evidence it reports, as
            // `dev` funds it to.
            let faucet = kvasir_keyfile::open(&chain.join("keys/faucet.key")).unwrap();
            let client = kvasir_api::Client::new(url);
            let funds = kvasir_ledger::Amount::parse("5").unwrap();
            kvasir_devnet::funding::top_up(&client, &faucet, backbone.parse().unwrap(), funds)
                .unwrap();
        }
        let mut hub = start(
            "kvasir-node",
            &Swarm::hub_args(
                dir.path(),
                "127.0.0.1:0",
                "127.0.0.1:0",
                &backbone,
                &hub_extra,
            ),
        );
        let hub_addr = hub.listening("hub").unwrap().to_string();
        let registry_addr = hub.listening("hub registry").unwrap().to_string();
        let gateway_args = Swarm::gateway_args(
            dir.path(),
            "127.0.0.1:0",
            &hub_addr,
            &registry_addr,
            ledger_url.as_deref(),
        );
        let mut gateway = start("kvasir-node", &gateway_args);
        let gateway_addr = gateway.listening("gateway").unwrap().to_string();
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
        roles::hub(
            &dir.join("chain"),
            &dir.join("hub-data"),
            listen,
            registry,
            backbone,
        )
        .extend(extra)
        .into_vec()
    }

    fn gateway_args(
        dir: &Path,
        listen: &str,
        hub: &str,
        registry: &str,
        ledger: Option<&str>,
    ) -> Vec<String> {
        let gateway = roles::gateway(&dir.join("gateway-cert.pem"), listen, hub);
        match ledger {
            Some(ledger) => roles::crediting(gateway, ledger, registry, &dir.join("chain"), 100),
            None => gateway,
        }
        .into_vec()
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
        self.gateway = Process::spawn(command, "gateway", Mode::Test).unwrap();
        self.gateway.listening("gateway").unwrap();
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
        self.gateway = start("kvasir-node", &args);
        self.gateway.listening("gateway").unwrap();
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
        let mut hub = start("kvasir-node", &args);
        hub.listening("hub").unwrap();
        hub.listening("hub registry").unwrap();
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
        let (ledger, _) = start_ledger_on(&chain, &data, addr);
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
        let args = roles::worker(
            &self.gateway_url(),
            &key,
            &self.model,
            experts,
            &self.cert(),
        )
        .extend(extra)
        .into_vec();
        let mut worker = start("kvasir-node", &args);
        worker
            .line_within("worker session ", Duration::from_secs(60))
            .unwrap();
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
        kvasir_devnet::funding::bond_workers(&client, &faucet, &[&worker]).unwrap();
    }

    /// Sends the key in `keyfile` what it lacks of `kvr` spendable, from the faucet: what its
    /// own transactions' fees need, beside the bond `bond` gives it.
    pub fn top_up(&self, ledger: &str, keyfile: &Path, kvr: &str) {
        let client = kvasir_api::Client::new(ledger);
        let faucet = kvasir_keyfile::open(&self.dir.path().join("chain/keys/faucet.key")).unwrap();
        let to = kvasir_keyfile::address(keyfile).unwrap();
        let amount = kvasir_ledger::Amount::parse(kvr).unwrap();
        kvasir_devnet::funding::top_up(&client, &faucet, to, amount).unwrap();
    }

    /// Starts a backbone generating greedily with `remote` experts dispatched.
    pub fn start_backbone(&self, remote: &str, prompt: &str, tokens: usize) -> Process {
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
    pub fn serve_backbone(&self, remote: &str) -> (Process, String) {
        self.serve_backbone_with(remote, &[])
    }

    /// As `serve_backbone`, the backbone also given `extra` (e.g. `--order 3`).
    pub fn serve_backbone_with(&self, remote: &str, extra: &[&str]) -> (Process, String) {
        let mut args = vec![remote, "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut backbone = self.backbone_process(&args);
        let addr = backbone.listening("backbone").unwrap().to_string();
        (backbone, addr)
    }

    /// `backbone --remote <args...>` with this swarm's model, hub and key.
    fn backbone_process(&self, remote_and_more: &[&str]) -> Process {
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
        start("kvasir-node", &args)
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
            .finish(Duration::from_secs(300))
            .unwrap();
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

/// A gateway on its own (its hub unreachable at port 9), self-signed into `cert`, with
/// `extra` arguments; the process and its address.
pub fn lone_gateway(cert: &Path, extra: &[&str]) -> (Process, String) {
    let args = roles::gateway(cert, "127.0.0.1:0", "127.0.0.1:9").extend(extra);
    let mut gateway = start("kvasir-node", &args.into_vec());
    let addr = gateway.listening("gateway").unwrap().to_string();
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
pub fn start_ledger(chain: &Path, data: &Path) -> (Process, String) {
    start_ledger_on(chain, data, "127.0.0.1:0")
}

/// As `start_ledger`, on `listen`. A format-2 ledger needs no checkpoint: evidence carries
/// the weights it is judged with.
pub fn start_ledger_on(chain: &Path, data: &Path, listen: &str) -> (Process, String) {
    let args = roles::ledger(chain, data, listen)
        .flag("--key", kvasir_devnet::chain::key_path(chain, "validator"));
    let mut ledger = start("kvasir-node", &args.into_vec());
    let addr = ledger.listening("ledger").unwrap().to_string();
    (ledger, addr)
}
