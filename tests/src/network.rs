//! A chain run by several validators and full nodes, each a real `kvasir-node ledger`
//! process on loopback, every node dialling every other's consensus listener and forwarding
//! transactions to the validators' REST APIs. Nodes can be killed and started again on the
//! same data directory and ports, and one node's consensus links can all run through a
//! `Proxy`, to cut it off from the others.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvasir_api::Client;
use kvasir_ledger::Hash;

use crate::proxy::Proxy;
use kvasir_devnet::{roles, Process};

use crate::{genesis_init_with, path_str, run, start, stderr};

/// A template like the built-in one, with blocks every 200 ms so that tests see many.
const FAST_TEMPLATE: &str = r#"{
  "params": {
    "chain_id": "kvasir-net",
    "unit_bytes": 1000000,
    "reward_per_unit": "0.007",
    "challenge_window": 10,
    "block_interval_ms": 200,
    "max_block_txs": 10000,
    "max_block_bytes": 8388608,
    "rewards_pool": "1000000",
    "min_new_account": "0.001"
  },
  "faucet": "1000000"
}"#;

pub struct Network {
    root: PathBuf,
    /// The temporary directory `root` is in, when the network made it.
    _temp: Option<tempfile::TempDir>,
    pub chain: PathBuf,
    pub validators: usize,
    p2p: Vec<u16>,
    rest: Vec<u16>,
    nodes: Vec<Option<Process>>,
    /// Arguments every node's `ledger` command line also gets.
    ledger_extra: Vec<String>,
    /// The node whose consensus traffic all runs through this proxy, if any.
    isolatable: Option<(usize, Proxy)>,
}

impl Network {
    /// A fresh chain of `validators` validators and `full_nodes` full nodes, all started,
    /// with a block every 200 ms.
    pub fn start(validators: usize, full_nodes: usize) -> Network {
        Network::start_with(validators, full_nodes, None)
    }

    /// As `start`, every consensus link of node `isolated` through a proxy that `cut`
    /// and `heal` control: the others dial it only there, and it dials nobody.
    pub fn start_isolatable(validators: usize, full_nodes: usize, isolated: usize) -> Network {
        Network::start_with(validators, full_nodes, Some(isolated))
    }

    fn start_with(validators: usize, full_nodes: usize, isolated: Option<usize>) -> Network {
        let temp = tempfile::tempdir().expect("a temporary directory");
        let template = temp.path().join("template.json");
        std::fs::write(&template, FAST_TEMPLATE).expect("writing the template");
        let mut network = Network::init(
            temp.path(),
            validators,
            full_nodes,
            &["--template", path_str(&template)],
            &[],
        );
        network._temp = Some(temp);
        network.isolatable = isolated.map(|node| (node, Proxy::start(network.p2p[node])));
        network.start_all();
        network
    }

    /// A chain made by `genesis init` with `init_extra` in `root/chain`, its nodes' data
    /// in `root/node-N`, every node's command line also given `ledger_extra`; all started.
    pub fn start_in(
        root: &Path,
        validators: usize,
        full_nodes: usize,
        init_extra: &[&str],
        ledger_extra: &[&str],
    ) -> Network {
        let mut network = Network::init(root, validators, full_nodes, init_extra, ledger_extra);
        network.start_all();
        network
    }

    fn init(
        root: &Path,
        validators: usize,
        full_nodes: usize,
        init_extra: &[&str],
        ledger_extra: &[&str],
    ) -> Network {
        let chain = root.join("chain");
        let count = validators.to_string();
        let mut args = vec!["--validators", &count];
        args.extend_from_slice(init_extra);
        genesis_init_with(&chain, &args);
        let count = validators + full_nodes;
        let mut p2p = kvasir_devnet::loopback::free_ports(2 * count).expect("free ports");
        let rest = p2p.split_off(count);
        Network {
            root: root.to_path_buf(),
            _temp: None,
            chain,
            validators,
            p2p,
            rest,
            nodes: (0..count).map(|_| None).collect(),
            ledger_extra: ledger_extra.iter().map(|a| a.to_string()).collect(),
            isolatable: None,
        }
    }

    fn start_all(&mut self) {
        let count = self.len();
        for node in 0..count {
            self.spawn(node);
        }
        for node in 0..count {
            self.wait_listening(node);
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn data_dir(&self, node: usize) -> PathBuf {
        self.root.join(format!("node-{node}"))
    }

    fn key(&self, node: usize) -> PathBuf {
        kvasir_devnet::chain::key_path(&self.chain, &kvasir_devnet::chain::validator_role(node))
    }

    pub fn genesis(&self) -> PathBuf {
        self.chain.join("genesis.json")
    }

    pub fn url(&self, node: usize) -> String {
        format!("http://127.0.0.1:{}", self.rest[node])
    }

    pub fn client(&self, node: usize) -> Client {
        Client::new(&self.url(node))
    }

    fn spawn(&mut self, node: usize) {
        let mut args = roles::ledger(
            &self.chain,
            &self.data_dir(node),
            &format!("127.0.0.1:{}", self.rest[node]),
        )
        .flag("--p2p-listen", format!("127.0.0.1:{}", self.p2p[node]));
        if node < self.validators {
            args = args.flag("--key", self.key(node));
        }
        for other in (0..self.len()).filter(|o| *o != node) {
            if self.isolated() != Some(node) {
                args = args.flag("--peer", format!("127.0.0.1:{}", self.p2p_port(other)));
            }
            if other < self.validators {
                args = args.flag("--forward", self.url(other));
            }
        }
        let args = args.extend(&self.ledger_extra).into_vec();
        self.nodes[node] = Some(start("kvasir-node", &args));
    }

    fn isolated(&self) -> Option<usize> {
        self.isolatable.as_ref().map(|(node, _)| *node)
    }

    /// Where the others dial `node`'s consensus listener: its proxy if it has one.
    fn p2p_port(&self, node: usize) -> u16 {
        match &self.isolatable {
            Some((isolated, proxy)) if *isolated == node => proxy.port(),
            _ => self.p2p[node],
        }
    }

    /// Cuts every consensus link of the isolatable node, until `heal`.
    pub fn cut(&self) {
        self.isolatable
            .as_ref()
            .expect("an isolatable node")
            .1
            .cut();
    }

    pub fn heal(&self) {
        self.isolatable
            .as_ref()
            .expect("an isolatable node")
            .1
            .heal();
    }

    fn wait_listening(&mut self, node: usize) {
        if let Some(proc) = self.nodes[node].as_mut() {
            proc.listening("ledger").unwrap();
        }
    }

    /// Starts `node` again on its data directory and ports.
    pub fn restart(&mut self, node: usize) {
        self.spawn(node);
        self.wait_listening(node);
    }

    /// SIGKILLs `node`.
    pub fn kill(&mut self, node: usize) {
        if let Some(mut proc) = self.nodes[node].take() {
            proc.kill();
        }
    }

    /// Stops `node` with SIGTERM and waits for it to exit.
    pub fn stop(&mut self, node: usize) {
        if let Some(proc) = self.nodes[node].take() {
            proc.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
            let (_, errors) = proc.wait_for_exit(Duration::from_secs(30)).unwrap();
            assert!(!errors.contains("panicked"), "node {node}: {errors}");
        }
    }

    /// What `node` has written to stderr since it last started.
    pub fn stderr(&self, node: usize) -> String {
        self.nodes[node]
            .as_ref()
            .map(Process::stderr)
            .unwrap_or_default()
    }

    pub fn running(&self) -> Vec<usize> {
        (0..self.len())
            .filter(|n| self.nodes[*n].is_some())
            .collect()
    }

    /// The head height of `node`, or none while it does not answer.
    pub fn height(&self, node: usize) -> Option<u64> {
        self.client(node).head().ok().map(|head| head.height)
    }

    /// Waits until every running node's head is at least `height`; panics after `timeout`
    /// naming each node's height and the stderr of the slowest.
    pub fn wait_height(&self, height: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let heights: Vec<(usize, Option<u64>)> = self
                .running()
                .into_iter()
                .map(|n| (n, self.height(n)))
                .collect();
            if heights.iter().all(|(_, h)| h.is_some_and(|h| h >= height)) {
                return;
            }
            if Instant::now() > deadline {
                let slow = heights
                    .iter()
                    .find(|(_, h)| !h.is_some_and(|h| h >= height))
                    .map(|(n, _)| *n)
                    .unwrap_or(0);
                let errors = self.nodes[slow].as_ref().map(Process::stderr);
                panic!(
                    "not every node reached height {height} within {timeout:?}: {heights:?}; node {slow}'s stderr:\n{}",
                    errors.unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The lowest head among the running nodes.
    pub fn lowest_height(&self) -> u64 {
        self.running()
            .into_iter()
            .filter_map(|n| self.height(n))
            .min()
            .unwrap_or(0)
    }

    /// The highest head among the running nodes.
    pub fn highest_height(&self) -> u64 {
        self.running()
            .into_iter()
            .filter_map(|n| self.height(n))
            .max()
            .unwrap_or(0)
    }

    /// Checks that every running node holds the same block at every height from 1 to
    /// `through`, each with a certificate of at least `signers` validators.
    pub fn assert_agree(&self, through: u64, signers: usize) {
        for height in 1..=through {
            let mut hashes: Vec<(usize, Hash)> = Vec::new();
            for node in self.running() {
                let block = self
                    .client(node)
                    .block(height)
                    .unwrap_or_else(|e| panic!("node {node} block {height}: {e}"));
                let certificate = block.certificate.expect("every block has a certificate");
                assert!(
                    certificate.signatures.len() >= signers,
                    "node {node} block {height}: {} signers",
                    certificate.signatures.len()
                );
                hashes.push((node, block.hash));
            }
            assert!(
                hashes.windows(2).all(|w| w[0].1 == w[1].1),
                "nodes disagree at height {height}: {hashes:?}"
            );
        }
    }

    /// `verify-chain` on `node`'s data directory (stopped first) against the genesis file.
    pub fn verify(&self, node: usize) -> String {
        let data = self.data_dir(node);
        let genesis = self.genesis();
        verify_chain(&data, &genesis, &[])
    }
}

/// `kvasir-node verify-chain --data-dir DATA --genesis GENESIS` and `extra` (the `--model`s
/// of a chain that holds evidence): its stdout, or a panic with its stderr.
pub fn verify_chain(data: &Path, genesis: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "verify-chain",
        "--data-dir",
        path_str(data),
        "--genesis",
        path_str(genesis),
    ];
    args.extend_from_slice(extra);
    let output = run("kvasir-node", &args);
    assert!(
        output.status.success(),
        "verify-chain of {}: {}",
        data.display(),
        stderr(&output)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
