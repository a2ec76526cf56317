//! Every scenario, in one test binary (one module per scenario file): they start the real
//! `kvasir-node` and `kvasir-wallet` processes (built once per run, see `kvasir_tests::bin`),
//! so this binary links only the crates it talks to them with, not the node.

mod bond_standing;
mod chain_cli;
mod dev_stop;
mod flood;
mod keepalive;
mod ledger_api;
mod load;
mod market;
mod model_cli;
mod openai;
mod public_edge;
mod settlement;
mod swarm;
mod swarm_adversarial;
mod validators;
mod verified_work;
mod versions;
mod wallet;
