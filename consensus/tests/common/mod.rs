//! A toy ledger for driving the engine in tests: a block is its height, its parent's id, its
//! proposer and a payload; its id is blake3 over that. Validation checks the chain links,
//! the author, and a deny-list of proposers whose blocks it refuses.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use borsh::{BorshDeserialize, BorshSerialize};
use kvasir_consensus::{Chain, Handle, Multiaddr, Settings};
use kvasir_ledger::genesis::{Authorities, ChainParams};
use kvasir_ledger::{Address, Amount, Certificate, Genesis, Hash, Keypair};

#[derive(BorshSerialize, BorshDeserialize)]
pub struct ToyBlock {
    pub height: u64,
    pub parent: Hash,
    pub proposer: Address,
    pub payload: Vec<u8>,
}

impl ToyBlock {
    pub fn decode(bytes: &[u8]) -> Result<ToyBlock, String> {
        borsh::from_slice(bytes).map_err(|e| e.to_string())
    }
}

pub fn id_of(bytes: &[u8]) -> Hash {
    Hash(*blake3::hash(bytes).as_bytes())
}

/// What a toy chain committed, shared with the test that watches it.
#[derive(Default)]
pub struct Ledger {
    pub blocks: BTreeMap<u64, (Vec<u8>, Certificate)>,
    /// Blocks validation turned down because their proposer is refused here.
    pub refusals: usize,
}

impl Ledger {
    fn tip(&self) -> Hash {
        self.blocks
            .values()
            .next_back()
            .map(|(bytes, _)| id_of(bytes))
            .unwrap_or(Hash::ZERO)
    }
}

pub struct ToyChain {
    pub ledger: Arc<Mutex<Ledger>>,
    genesis: Genesis,
    me: Option<Address>,
    refused: Vec<Address>,
}

impl ToyChain {
    pub fn new(genesis: &Genesis, me: Option<Address>, refused: Vec<Address>) -> ToyChain {
        ToyChain {
            ledger: Arc::default(),
            genesis: genesis.clone(),
            me,
            refused,
        }
    }

    /// The chain of a node restarted on the blocks it had committed.
    pub fn reopen(genesis: &Genesis, me: Option<Address>, ledger: Arc<Mutex<Ledger>>) -> ToyChain {
        ToyChain {
            ledger,
            genesis: genesis.clone(),
            me,
            refused: Vec::new(),
        }
    }
}

impl Chain for ToyChain {
    fn committed_height(&self) -> u64 {
        self.ledger.lock().unwrap().blocks.len() as u64
    }

    fn propose(&mut self, height: u64) -> anyhow::Result<(Hash, Vec<u8>)> {
        let me = self.me.ok_or_else(|| anyhow::anyhow!("not a validator"))?;
        // The time makes every block built anew differ, as a real one would: proposing
        // the same block again after a restart is the engine's store's doing.
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)?
            .as_nanos();
        let block = ToyBlock {
            height,
            parent: self.ledger.lock().unwrap().tip(),
            proposer: me,
            payload: format!("block {height} by {me} at {now}").into_bytes(),
        };
        let bytes = borsh::to_vec(&block)?;
        Ok((id_of(&bytes), bytes))
    }

    fn validate(
        &mut self,
        height: u64,
        author: Option<&Address>,
        bytes: &[u8],
    ) -> Result<Hash, String> {
        let block = ToyBlock::decode(bytes)?;
        let mut ledger = self.ledger.lock().unwrap();
        if block.height != height || height != ledger.blocks.len() as u64 + 1 {
            return Err(format!("block for height {}, not {height}", block.height));
        }
        if block.parent != ledger.tip() {
            return Err("wrong parent".into());
        }
        if author.is_some_and(|a| *a != block.proposer)
            || !self.genesis.is_validator(&block.proposer)
        {
            return Err("wrong proposer".into());
        }
        if self.refused.contains(&block.proposer) {
            ledger.refusals += 1;
            return Err(format!("blocks of {} are refused here", block.proposer));
        }
        Ok(id_of(bytes))
    }

    fn commit(&mut self, bytes: &[u8], certificate: &Certificate) -> anyhow::Result<()> {
        let block = ToyBlock::decode(bytes).map_err(anyhow::Error::msg)?;
        let mut ledger = self.ledger.lock().unwrap();
        anyhow::ensure!(
            block.height == ledger.blocks.len() as u64 + 1,
            "out of order"
        );
        anyhow::ensure!(
            certificate.block == id_of(bytes),
            "certificate for another block"
        );
        ledger
            .blocks
            .insert(block.height, (bytes.to_vec(), certificate.clone()));
        Ok(())
    }

    fn decided(&self, height: u64) -> anyhow::Result<Option<(Vec<u8>, Certificate)>> {
        Ok(self.ledger.lock().unwrap().blocks.get(&height).cloned())
    }
}

/// A valid genesis naming `n` validators, and their keys in address order.
pub fn genesis_with(n: u8) -> (Genesis, Vec<Keypair>) {
    let mut keys: Vec<Keypair> = (0..n).map(|i| Keypair::from_seed(&[100 + i; 32])).collect();
    keys.sort_by_key(Keypair::address);
    let genesis = Genesis {
        genesis_time_ms: 1_764_000_000_000,
        params: ChainParams {
            chain_id: "kvasir-consensus-test".into(),
            format: kvasir_ledger::genesis::FORMAT,
            unit_bytes: 1_000_000,
            reward_per_unit: Amount::ZERO,
            challenge_window: 3,
            block_interval_ms: 200,
            max_block_txs: 100,
            max_block_bytes: 1 << 20,
            rewards_pool: Amount::ZERO,
            min_new_account: Amount::ZERO,
            min_bond: Amount::ZERO,
            unbonding_blocks: 0,
            slash_fraction: Default::default(),
            reporter_share: Default::default(),
            jail_blocks: 0,
            fees: Some(kvasir_ledger::fees::DEFAULT_FEES),
        },
        allocations: Vec::new(),
        authorities: Authorities {
            validators: keys.iter().map(Keypair::address).collect(),
            gateways: Vec::new(),
            hubs: Vec::new(),
        },
        models: Vec::new(),
    };
    genesis.validate().expect("a valid test genesis");
    (genesis, keys)
}

/// `n` loopback addresses on ports free a moment ago.
pub fn free_addresses(n: usize) -> Vec<Multiaddr> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| {
            let port = l.local_addr().unwrap().port();
            format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap()
        })
        .collect()
}

pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Settings for node `i` of a network listening on `addresses`, every other one its peer.
pub fn settings(home: &tempfile::TempDir, addresses: &[Multiaddr], i: usize) -> Settings {
    Settings {
        home: home.path().to_path_buf(),
        listen: addresses[i].clone(),
        persistent_peers: addresses
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, a)| a.clone())
            .collect(),
        moniker: format!("node-{i}"),
    }
}

/// A network of validators (each refusing `refused`'s blocks) and full nodes, one engine
/// per node, each in its own home; the full nodes come last.
pub struct Net {
    pub genesis: Genesis,
    pub ledgers: Vec<Arc<Mutex<Ledger>>>,
    pub handles: Vec<Handle>,
    _homes: Vec<tempfile::TempDir>,
}

impl Net {
    pub async fn start(
        genesis: &Genesis,
        keys: &[Keypair],
        full_nodes: usize,
        refused: Vec<Address>,
    ) -> Net {
        let nodes = keys.len() + full_nodes;
        let addresses = free_addresses(nodes);
        let mut net = Net {
            genesis: genesis.clone(),
            ledgers: Vec::new(),
            handles: Vec::new(),
            _homes: Vec::new(),
        };
        for i in 0..nodes {
            let home = tempfile::tempdir().unwrap();
            let key = keys.get(i).cloned();
            let chain = ToyChain::new(genesis, key.as_ref().map(Keypair::address), refused.clone());
            net.ledgers.push(chain.ledger.clone());
            let handle =
                kvasir_consensus::start(genesis, key, settings(&home, &addresses, i), chain)
                    .await
                    .unwrap();
            net.handles.push(handle);
            net._homes.push(home);
        }
        net
    }

    /// Waits until every node has committed `height`, or panics after `within`.
    pub async fn wait_for(&self, height: u64, within: Duration) {
        wait_for(&self.ledgers, height, within).await
    }

    /// The committed blocks of node `i` up to `height`, checked (`checked_chain`).
    pub fn checked_chain(&self, i: usize, height: u64) -> Vec<(ToyBlock, Certificate)> {
        checked_chain(&self.genesis, &self.ledgers[i], height)
    }

    pub async fn stop(self) {
        for handle in self.handles {
            handle.stop().await.unwrap();
        }
    }
}

/// Waits until every ledger holds `height` blocks, or panics after `within`.
pub async fn wait_for(ledgers: &[Arc<Mutex<Ledger>>], height: u64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let heights: Vec<usize> = ledgers
            .iter()
            .map(|l| l.lock().unwrap().blocks.len())
            .collect();
        if heights.iter().all(|&h| h as u64 >= height) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "nodes reached only heights {heights:?}, not {height}, in {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The committed blocks of a ledger up to `height`, each checked: its certificate verifies
/// offline against genesis and commits exactly that block, and it links to the block before.
pub fn checked_chain(
    genesis: &Genesis,
    ledger: &Mutex<Ledger>,
    height: u64,
) -> Vec<(ToyBlock, Certificate)> {
    let ledger = ledger.lock().unwrap();
    let mut parent = Hash::ZERO;
    (1..=height)
        .map(|h| {
            let (bytes, certificate) = ledger.blocks.get(&h).expect("committed").clone();
            let id = id_of(&bytes);
            certificate
                .verify(genesis, h, &id)
                .unwrap_or_else(|e| panic!("certificate of height {h}: {e}"));
            let block = ToyBlock::decode(&bytes).unwrap();
            assert_eq!(block.parent, parent);
            parent = id;
            (block, certificate)
        })
        .collect()
}
