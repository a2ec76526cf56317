//! A chain written before format 2 still verifies under today's rules: blocks that a
//! format-1 build made on the dev chain as it was published then (`data/format-1-blocks.json`,
//! written by kvasir f239c23: transfers, a bond, credits, an unbond) decode to the same
//! bytes, apply to the same state roots, and, stored, verify from genesis.

use std::path::Path;

use kvasir_ledger::{
    apply_block, verify_chain, Block, Certificate, Genesis, Keypair, SledStore, State, Storage,
};

fn dev_validator() -> Keypair {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../genesis/dev/keys/validator.key");
    kvasir_keyfile::parse(&std::fs::read_to_string(path).unwrap(), None).unwrap()
}

#[test]
fn blocks_a_format_1_build_wrote_still_apply_and_verify() {
    let genesis = Genesis::from_json(include_str!("data/format-1-dev-genesis.json")).unwrap();
    assert_eq!(genesis.params.format, 1);
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("data/format-1-blocks.json")).unwrap();
    let blocks = fixture["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), 3);
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::create(dir.path(), &genesis).unwrap();
    let validator = dev_validator();
    let mut state = State::from_genesis(genesis.clone());
    for text in blocks {
        let bytes = hex::decode(text.as_str().unwrap()).unwrap();
        let block = Block::from_bytes(&bytes, u64::MAX).unwrap();
        // One encoding: what decodes re-encodes to the same bytes, so the same hash.
        assert_eq!(block.to_bytes(), bytes);
        assert!(block.txs.iter().all(|tx| tx.tx.fee.is_none()));
        let (next, changes) = apply_block(&state, &block).unwrap();
        let certificate = Certificate::for_block(&block, 0, &[&validator]);
        store.commit(&block, &changes, &certificate).unwrap();
        state = next;
    }
    assert_eq!(
        state.root().to_string(),
        fixture["state_root"].as_str().unwrap()
    );
    let report = verify_chain(&store, Some(&genesis), None, |_, _| {}).unwrap();
    assert_eq!(report.blocks, 3);
    assert_eq!(store.load_state().unwrap().root(), state.root());
}
