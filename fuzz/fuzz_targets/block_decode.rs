//! A block from a stranger (what a verifier reads from a store or, with consensus, a peer).
//! Decoding never panics and re-encodes to the same bytes. Then the block, with its header
//! pointed at the dev genesis and re-signed by the dev validator so that it gets past the
//! header checks, is applied: never a panic, and if it applies, supply is unchanged.
#![no_main]

use kvasir_fuzz::{assert_supply_kept, dev_chain};
use kvasir_ledger::intent::{self, Intent};
use kvasir_ledger::{apply_block, Block};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let chain = dev_chain();
    let state = &chain.state;
    let genesis = state.genesis();
    let Ok(mut block) = Block::from_bytes(bytes, genesis.params.max_block_bytes) else {
        return;
    };
    assert_eq!(block.to_bytes(), bytes, "non-canonical block accepted");
    let _ = apply_block(state, &block);
    let header = &mut block.header;
    header.chain_id = genesis.chain_id();
    header.height = state.height() + 1;
    header.prev_hash = state.block_hash();
    header.proposer = chain.validator.address();
    header.tx_root = Block::tx_root(&block.txs);
    block.signature = intent::sign(
        &chain.validator,
        Intent::Block,
        &genesis.chain_id(),
        &block.header,
    );
    if let Ok((after, _)) = apply_block(state, &block) {
        assert_supply_kept(&after);
    }
});
