//! Swarm roles as child processes of this binary on loopback: what `dev` and the swarm
//! benchmarks start, and the funding and bonding of worker keys that a chain with bonds asks
//! before a hub admits them (`bond_workers`, which the test scenarios use too). A child is
//! stopped when its handle drops (SIGTERM, then SIGKILL if it lingers), and it stops by
//! itself when its parent dies; its `<role> listening on ADDR` line says where it listens.
//! Its log lines pass through to our stderr and the last one is kept, so that a child that
//! exits when it should not can be named with its last words.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use kvasir_api::Client;
use kvasir_ledger::keys::{Address, Keypair};
use kvasir_ledger::mempool::Limits;
use kvasir_ledger::{Amount, SignedTx, TxKind};

use crate::commands::genesis::{genesis_path, install_dev_chain, key_path, validator_role};
use crate::engine::Backend;

const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a child may take over a clean stop (the ledger finishing its block).
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Set in a child's environment to the pid of the process that started it.
const PARENT_ENV: &str = "KVASIR_PARENT_PID";

/// Called first thing in every process: a role started by `Child::spawn` gets SIGTERM when its
/// parent dies (however it dies), so no worker outlives a killed `dev`.
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

pub struct Child {
    child: std::process::Child,
    lines: Receiver<String>,
    what: String,
    /// The last line it wrote to stderr.
    last_message: Arc<Mutex<String>>,
}

impl Child {
    /// Runs this executable with `args`; its logs go to our stderr at warning level unless
    /// RUST_LOG says otherwise.
    pub fn spawn(args: &[String]) -> Result<Child> {
        let exe = std::env::current_exe().context("locating this executable")?;
        let mut command = Command::new(exe);
        command
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env(PARENT_ENV, std::process::id().to_string());
        if std::env::var_os("RUST_LOG").is_none() {
            // The consensus network warns of every connection a stopping peer closes, and
            // errs on every gossip a lone validator has no peer for (see main's DEFAULT_LOG).
            command.env(
                "RUST_LOG",
                "warn,arc_malachitebft_discovery=error,arc_malachitebft_network=off,libp2p_gossipsub=error",
            );
        }
        let mut child = command.spawn().context("starting a child process")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = child.stderr.take().context("child stderr")?;
        let last_message = Arc::new(Mutex::new(String::new()));
        let last = last_message.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{line}");
                *last.lock().unwrap_or_else(|p| p.into_inner()) = line;
            }
        });
        let what = format!(
            "the {} (pid {})",
            args.first().map_or("child", String::as_str),
            child.id()
        );
        Ok(Child {
            child,
            lines,
            what,
            last_message,
        })
    }

    /// If it has exited: which child, how, and the last thing it logged.
    pub fn exited(&mut self) -> Option<String> {
        let status = self.child.try_wait().ok().flatten()?;
        let last = self
            .last_message
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let last = if last.is_empty() {
            "nothing".to_string()
        } else {
            format!("{last:?}")
        };
        Some(format!(
            "{} exited ({status}); its last message: {last}",
            self.what
        ))
    }

    /// The rest of the next stdout line starting with `prefix`.
    pub fn line(&mut self, prefix: &str) -> Result<String> {
        loop {
            let line = self.lines.recv_timeout(START_TIMEOUT).map_err(|_| {
                anyhow!(
                    "{} did not print {prefix:?} (see its messages above)",
                    self.what
                )
            })?;
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.trim().to_string());
            }
        }
    }

    pub fn listening(&mut self, role: &str) -> Result<SocketAddr> {
        let addr = self.line(&format!("{role} listening on "))?;
        addr.parse()
            .with_context(|| format!("{role} printed a bad address {addr:?}"))
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // Reaped already (see `exited`): its pid may belong to another process by now.
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        #[cfg(unix)]
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let pid = nix::unistd::Pid::from_raw(pid);
            if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_ok() {
                let deadline = std::time::Instant::now() + STOP_TIMEOUT;
                while std::time::Instant::now() < deadline {
                    if matches!(self.child.try_wait(), Ok(Some(_))) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(path: &Path) -> String {
    path.display().to_string()
}

/// A hub and a TLS gateway (self-signed) on a chain, optionally a ledger with the gateway
/// crediting to it, plus workers, all on loopback.
pub struct Loopback {
    pub dir: PathBuf,
    pub hub_addr: SocketAddr,
    pub registry_addr: SocketAddr,
    pub gateway_addr: SocketAddr,
    /// The REST API of each validator, in the chain's validator order.
    pub ledger_addrs: Vec<SocketAddr>,
    pub cert: PathBuf,
    pub backbone: Keypair,
    roles: Vec<Child>,
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Loopback {
    /// Starts hub and gateway with their files under `dir`, on the chain in `chain` (the
    /// dev chain is installed there if it holds none). With `ledger`, the checkpoints that
    /// the chain's evidence is checked against (every model it pins), also the ledger service (its data in
    /// `chain/ledger`; a chain that pins models refuses to run one without it): the gateway
    /// credits the hub's receipts to it and the hub admits only the workers it says are
    /// bonded.
    pub fn start(dir: &Path, chain: &Path, ledger: Option<&[PathBuf]>) -> Result<Loopback> {
        if !genesis_path(chain).exists() {
            install_dev_chain(chain)?;
        }
        let genesis = text(&genesis_path(chain));
        let key = |role: &str| text(&key_path(chain, role));
        let mut roles = Vec::new();
        let ledger_addrs = match ledger {
            Some(models) => start_validators(chain, models, &mut roles)?,
            None => Vec::new(),
        };
        let ledger_url = ledger_url(&ledger_addrs);
        let backbone = Keypair::generate();
        let mut hub_args = [
            "hub",
            "--listen",
            "127.0.0.1:0",
            "--registry-listen",
            "127.0.0.1:0",
            "--key",
            &key("hub"),
            "--genesis",
            &genesis,
            "--backbone",
            &backbone.address().to_string(),
            "--data-dir",
            &text(&dir.join("hub")),
        ]
        .map(String::from)
        .to_vec();
        if let Some(ledger) = &ledger_url {
            hub_args.extend(["--ledger".to_string(), ledger.clone()]);
        }
        let mut hub = Child::spawn(&hub_args)?;
        let hub_addr = hub.listening("hub")?;
        let registry_addr = hub.listening("hub registry")?;
        roles.push(hub);
        let cert = dir.join("gateway-cert.pem");
        let mut gateway_args = [
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--self-signed",
            "--cert-out",
            &text(&cert),
            "--hub",
            &hub_addr.to_string(),
        ]
        .map(String::from)
        .to_vec();
        if let Some(ledger) = &ledger_url {
            gateway_args.extend(
                [
                    "--ledger",
                    ledger,
                    "--registry",
                    &format!("http://{registry_addr}"),
                    "--key",
                    &key("gateway"),
                    "--credit-interval-ms",
                    "250",
                ]
                .map(String::from),
            );
        }
        let mut gateway = Child::spawn(&gateway_args)?;
        let gateway_addr = gateway.listening("gateway")?;
        roles.push(gateway);
        Ok(Loopback {
            dir: dir.to_path_buf(),
            hub_addr,
            registry_addr,
            gateway_addr,
            ledger_addrs,
            cert,
            backbone,
            roles,
        })
    }

    /// Every validator's REST API, comma-separated, as clients take it (they fail over from
    /// one to the next); none without a ledger.
    pub fn ledger_url(&self) -> Option<String> {
        ledger_url(&self.ledger_addrs)
    }

    /// An error naming the first role that has exited: every role runs until stopped, so one
    /// that exits has failed.
    pub fn check(&mut self) -> Result<()> {
        match self.roles.iter_mut().find_map(Child::exited) {
            Some(exited) => Err(anyhow!("{exited}")),
            None => Ok(()),
        }
    }

    /// Stops the roles, workers first, so no survivor logs the others' departure.
    pub fn stop(&mut self) {
        while let Some(role) = self.roles.pop() {
            drop(role);
        }
    }

    /// The URL workers dial to reach the gateway through `port` (the gateway's, or a proxy's).
    pub fn swarm_url(port: u16) -> String {
        format!("wss://localhost:{port}/swarm")
    }

    /// Starts a worker holding `experts` of `model`, dialling `url`, with the wallet key in
    /// `keyfile` (created if absent) and `extra` arguments; returns its address once its
    /// session is open.
    pub fn add_worker(
        &mut self,
        model: &Path,
        experts: &str,
        url: &str,
        keyfile: &Path,
        backend: Backend,
        extra: &[String],
    ) -> Result<Address> {
        if !keyfile.exists() {
            kvasir_keyfile::write(keyfile, &Keypair::generate(), None)?;
        }
        let key = kvasir_keyfile::open(keyfile)?;
        let mut args = [
            "worker",
            "--gateway",
            url,
            "--keyfile",
            &text(keyfile),
            "--model",
            &text(model),
            "--experts",
            experts,
            "--ca",
            &text(&self.cert),
            "--backend",
            backend.name(),
        ]
        .map(String::from)
        .to_vec();
        args.extend_from_slice(extra);
        let mut worker = Child::spawn(&args)?;
        worker.line("worker session ")?;
        self.roles.push(worker);
        Ok(key.address())
    }
}

fn ledger_url(addrs: &[SocketAddr]) -> Option<String> {
    let urls: Vec<String> = addrs.iter().map(|a| format!("http://{a}")).collect();
    (!urls.is_empty()).then(|| urls.join(","))
}

/// Where validator `index` of a dev chain keeps its blocks: `ledger`, then `ledger-1`, ...
pub fn ledger_dir(chain: &Path, index: usize) -> PathBuf {
    match index {
        0 => chain.join("ledger"),
        i => chain.join(format!("ledger-{i}")),
    }
}

/// `count` distinct loopback ports free now, for roles that must be told their peers' ports
/// before any of them starts (a validator's consensus listener, its REST API for forwarding).
/// They are drawn below Linux's ephemeral range (32768 and up): a port the kernel hands out
/// for `:0` comes from that range, where any outgoing connection (the validators dial each
/// other) can take it before the role given it binds it; a test once failed so, with "Address
/// already in use". Each is held until all are drawn, so none is drawn twice. They are free
/// again when returned: another process drawing at the same moment may still pick one (a
/// 1 in 22,000 chance a port), which only the role's own bind would rule out.
pub fn free_ports(count: usize) -> Result<Vec<u16>> {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    let mut held = Vec::with_capacity(count);
    // Ports taken by others are skipped; a machine with almost none free is an error, not a
    // loop that never ends.
    for _ in 0..count.saturating_mul(100).max(100) {
        if held.len() == count {
            break;
        }
        let port = rng.gen_range(10_000..32_000);
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push((port, listener));
        }
    }
    if held.len() < count {
        bail!(
            "found {} free loopback ports of the {count} needed",
            held.len()
        );
    }
    Ok(held.into_iter().map(|(port, _)| port).collect())
}

/// Starts one validator per validator key of the chain in `chain` (`keys/validator.key`,
/// `keys/validator-1.key`, ...), each with every pinned checkpoint in `models`, each dialling
/// the others' consensus listeners and forwarding transactions to their REST APIs; pushes
/// them onto `roles` and returns their REST addresses.
pub fn start_validators(
    chain: &Path,
    models: &[PathBuf],
    roles: &mut Vec<Child>,
) -> Result<Vec<SocketAddr>> {
    let genesis = kvasir_ledger::Genesis::load(&genesis_path(chain))?;
    let count = genesis.authorities.validators.len();
    let mut p2p = free_ports(2 * count)?;
    let rest = p2p.split_off(count);
    let mut started = Vec::with_capacity(count);
    for index in 0..count {
        let mut args = [
            "ledger",
            "--genesis",
            &text(&genesis_path(chain)),
            "--data-dir",
            &text(&ledger_dir(chain, index)),
            "--listen",
            &format!("127.0.0.1:{}", rest[index]),
            "--key",
            &text(&key_path(chain, &validator_role(index))),
            "--p2p-listen",
            &format!("127.0.0.1:{}", p2p[index]),
        ]
        .map(String::from)
        .to_vec();
        for other in (0..count).filter(|o| *o != index) {
            args.extend(["--peer".into(), format!("127.0.0.1:{}", p2p[other])]);
            args.extend([
                "--forward".into(),
                format!("http://127.0.0.1:{}", rest[other]),
            ]);
        }
        for model in models {
            args.extend(["--model".to_string(), text(model)]);
        }
        started.push(Child::spawn(&args)?);
    }
    let mut addrs = Vec::with_capacity(count);
    for mut validator in started {
        addrs.push(validator.listening("ledger")?);
        roles.push(validator);
    }
    Ok(addrs)
}

/// How long one funding or bonding transaction may take to be committed.
pub(super) const COMMIT_TIMEOUT: Duration = Duration::from_secs(60);

/// Makes each of `workers` bonded at least the chain's `min_bond`, as an operator does
/// before serving (a hub with a ledger admits only bonded keys): `faucet` sends each key
/// exactly what its bond lacks and the key bonds that, so whatever else a worker holds is
/// what it earned. A key bonded enough already (a second `dev` run) is left alone; a
/// jailed key is an error, since no bond lets it serve. The transfers go out together and
/// then the bonds, so any number of keys costs about two blocks. Returns what each key
/// bonded now (zero: nothing was needed, or the chain has no bonds).
pub fn bond_workers(
    ledger: &Client,
    faucet: &Keypair,
    workers: &[&Keypair],
) -> Result<Vec<Amount>> {
    let params = ledger
        .params()
        .context("reading the chain's min_bond from the ledger")?;
    let min_bond = params.min_bond.base_units;
    let mut shortfalls = Vec::with_capacity(workers.len());
    for key in workers {
        if min_bond.is_zero() {
            shortfalls.push(Amount::ZERO);
            continue;
        }
        let account = ledger.account(&key.address())?;
        if account.jailed {
            bail!(
                "{} is jailed until height {} for a wrong answer: no bond lets it serve before then",
                key.address(),
                account.jailed_until
            );
        }
        shortfalls.push(
            min_bond
                .checked_sub(account.bonded.base_units)
                .unwrap_or(Amount::ZERO),
        );
    }
    let short: Vec<(&Keypair, Amount)> = workers
        .iter()
        .zip(&shortfalls)
        .filter(|(_, amount)| !amount.is_zero())
        .map(|(key, amount)| (*key, *amount))
        .collect();
    let chain = params.chain_id.as_str();
    let mut faucet_nonce = ledger.account(&faucet.address())?.nonce;
    let transfers = short.iter().map(|(key, amount)| {
        let to = key.address();
        let tx = TxKind::Transfer {
            to,
            amount: *amount,
        }
        .signed(chain, faucet, faucet_nonce);
        faucet_nonce += 1;
        tx
    });
    commit_all(ledger, transfers.collect())?;
    let mut bonds = Vec::with_capacity(short.len());
    for (key, amount) in &short {
        let nonce = ledger.account(&key.address())?.nonce;
        bonds.push(TxKind::Bond { amount: *amount }.signed(chain, key, nonce));
    }
    commit_all(ledger, bonds)?;
    Ok(shortfalls)
}

/// Submits `txs` and waits until each is committed, in groups no larger than the nonces
/// the mempool takes ahead from one sender (the faucet's transfers share a sender).
pub(super) fn commit_all(ledger: &Client, txs: Vec<SignedTx>) -> Result<()> {
    for group in txs.chunks(Limits::default().per_sender) {
        let mut hashes = Vec::with_capacity(group.len());
        for tx in group {
            hashes.push(ledger.submit(tx).context("submitting a transaction")?);
        }
        for hash in &hashes {
            ledger
                .wait_committed(hash, COMMIT_TIMEOUT)
                .with_context(|| format!("waiting for transaction {hash} to be committed"))?;
        }
    }
    Ok(())
}
