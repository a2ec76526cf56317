//! The one thing consensus asks of the ledger it replicates, kept small so the engine can be
//! driven by the real ledger in the node and by a toy chain in tests.

use kvasir_ledger::{Address, Certificate, Hash};

/// What the consensus engine needs of the ledger it replicates.
///
/// Methods are synchronous and may take tens of milliseconds; the engine calls them off its
/// async workers.
pub trait Chain: Send + 'static {
    /// Height of the last committed block (0 = only genesis).
    fn committed_height(&self) -> u64;

    /// Builds the block for `height` (called only when this node proposes); its id and
    /// canonical bytes.
    fn propose(&mut self, height: u64) -> anyhow::Result<(Hash, Vec<u8>)>;

    /// Checks a block received for `height`: Ok(its id) when it may be decided. Called only
    /// for `committed_height() + 1`.
    ///
    /// `author`: `Some(p)` when the block is a fresh proposal, which must be built and
    /// signed by `p`, the round's proposer. `None` when it is a block re-proposed under a
    /// proof-of-lock or shipped by sync with a commit certificate: some earlier proposer
    /// built it, and any validator may be its author.
    fn validate(
        &mut self,
        height: u64,
        author: Option<&Address>,
        bytes: &[u8],
    ) -> Result<Hash, String>;

    /// Commits the decided block with its certificate, atomically and durably (fsynced)
    /// before returning.
    fn commit(&mut self, bytes: &[u8], certificate: &Certificate) -> anyhow::Result<()>;

    /// A committed block and its certificate, for peers that sync.
    fn decided(&self, height: u64) -> anyhow::Result<Option<(Vec<u8>, Certificate)>>;
}
