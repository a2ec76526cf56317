//! A swarm on loopback: a hub and a TLS gateway (self-signed) on a chain, optionally its
//! validators with the gateway crediting to them, plus workers, each a child `kvasir-node`
//! process (`Process`) started with the command lines of `roles`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use kvasir_ledger::keys::{Address, Keypair};

use crate::chain::{genesis_path, install_dev_chain, key_path, validator_role};
use crate::process::{Mode, Process};
use crate::roles;

/// A hub and a TLS gateway (self-signed) on a chain, optionally a ledger with the gateway
/// crediting to it, plus workers, all on loopback.
pub struct Loopback {
    /// The `kvasir-node` executable every role runs.
    pub exe: PathBuf,
    pub dir: PathBuf,
    pub hub_addr: SocketAddr,
    pub registry_addr: SocketAddr,
    pub gateway_addr: SocketAddr,
    /// The REST API of each validator, in the chain's validator order.
    pub ledger_addrs: Vec<SocketAddr>,
    pub cert: PathBuf,
    pub backbone: Keypair,
    roles: Vec<Process>,
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Loopback {
    /// Starts hub and gateway (`exe`'s) with their files under `dir`, on the chain in `chain`
    /// (the dev chain is installed there if it holds none). With `ledger`, the checkpoints
    /// that the chain's evidence is checked against (every model it pins), also the ledger
    /// service (its data in `chain/ledger`; a chain that pins models refuses to run one
    /// without it): the gateway credits the hub's receipts to it and the hub admits only the
    /// workers it says are bonded.
    pub fn start(
        exe: &Path,
        dir: &Path,
        chain: &Path,
        ledger: Option<&[PathBuf]>,
    ) -> Result<Loopback> {
        if !genesis_path(chain).exists() {
            install_dev_chain(chain)?;
        }
        let mut roles = Vec::new();
        let ledger_addrs = match ledger {
            Some(models) => start_validators(exe, chain, models, &mut roles)?,
            None => Vec::new(),
        };
        let ledger_url = ledger_url(&ledger_addrs);
        let backbone = Keypair::generate();
        let mut hub_args = roles::hub(
            chain,
            &dir.join("hub"),
            "127.0.0.1:0",
            "127.0.0.1:0",
            &backbone.address().to_string(),
        );
        if let Some(ledger) = &ledger_url {
            hub_args = hub_args.flag("--ledger", ledger);
        }
        let mut hub = Process::start(exe, &hub_args.into_vec(), Mode::Product)?;
        let hub_addr = hub.listening("hub")?;
        let registry_addr = hub.listening("hub registry")?;
        roles.push(hub);
        let cert = dir.join("gateway-cert.pem");
        let mut gateway_args = roles::gateway(&cert, "127.0.0.1:0", &hub_addr.to_string());
        if let Some(ledger) = &ledger_url {
            gateway_args =
                roles::crediting(gateway_args, ledger, &registry_addr.to_string(), chain, 250);
        }
        let mut gateway = Process::start(exe, &gateway_args.into_vec(), Mode::Product)?;
        let gateway_addr = gateway.listening("gateway")?;
        roles.push(gateway);
        Ok(Loopback {
            exe: exe.to_path_buf(),
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

    /// As `start` for this executable's roles, on the dev chain (installed in `dir/chain`),
    /// without a ledger: the swarm the benches measure.
    pub fn on_dev_chain(dir: &Path) -> Result<Loopback> {
        Loopback::start(&crate::current_exe()?, dir, &dir.join("chain"), None)
    }

    /// Every validator's REST API, comma-separated, as clients take it (they fail over from
    /// one to the next); none without a ledger.
    pub fn ledger_url(&self) -> Option<String> {
        ledger_url(&self.ledger_addrs)
    }

    /// An error naming the first role that has exited: every role runs until stopped, so one
    /// that exits has failed.
    pub fn check(&mut self) -> Result<()> {
        match self.roles.iter_mut().find_map(Process::exited) {
            Some(exited) => Err(anyhow!("{exited}")),
            None => Ok(()),
        }
    }

    /// The process id of the role started last (the worker `add_worker` just started).
    pub fn last_pid(&self) -> Option<u32> {
        self.roles.last().map(Process::pid)
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

    /// Starts a worker holding `experts` of `model` on `backend` (`cpu`, `cuda`), dialling
    /// `url`, with the wallet key in `keyfile` (created if absent) and `extra` arguments;
    /// returns its address once its session is open.
    pub fn add_worker(
        &mut self,
        model: &Path,
        experts: &str,
        url: &str,
        keyfile: &Path,
        backend: &str,
        extra: &[String],
    ) -> Result<Address> {
        if !keyfile.exists() {
            kvasir_keyfile::write(keyfile, &Keypair::generate(), None)?;
        }
        let key = kvasir_keyfile::open(keyfile)?;
        let args = roles::worker(url, keyfile, model, experts, &self.cert)
            .flag("--backend", backend)
            .extend(extra);
        let mut worker = Process::start(&self.exe, &args.into_vec(), Mode::Product)?;
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

/// Starts one validator (`exe`'s) per validator key of the chain in `chain`
/// (`keys/validator.key`, `keys/validator-1.key`, ...), each with every pinned checkpoint in
/// `models`, each dialling the others' consensus listeners and forwarding transactions to
/// their REST APIs; pushes them onto `roles` and returns their REST addresses.
pub fn start_validators(
    exe: &Path,
    chain: &Path,
    models: &[PathBuf],
    roles: &mut Vec<Process>,
) -> Result<Vec<SocketAddr>> {
    let genesis = kvasir_ledger::Genesis::load(&genesis_path(chain))?;
    let count = genesis.authorities.validators.len();
    let mut p2p = free_ports(2 * count)?;
    let rest = p2p.split_off(count);
    let mut started = Vec::with_capacity(count);
    for index in 0..count {
        let mut args = roles::ledger(
            chain,
            &ledger_dir(chain, index),
            &format!("127.0.0.1:{}", rest[index]),
        )
        .flag("--key", key_path(chain, &validator_role(index)))
        .flag("--p2p-listen", format!("127.0.0.1:{}", p2p[index]));
        for other in (0..count).filter(|o| *o != index) {
            args = args
                .flag("--peer", format!("127.0.0.1:{}", p2p[other]))
                .flag("--forward", format!("http://127.0.0.1:{}", rest[other]));
        }
        for model in models {
            args = args.flag("--model", model);
        }
        started.push(Process::start(exe, &args.into_vec(), Mode::Product)?);
    }
    let mut addrs = Vec::with_capacity(count);
    for mut validator in started {
        addrs.push(validator.listening("ledger")?);
        roles.push(validator);
    }
    Ok(addrs)
}
