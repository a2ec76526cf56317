//! The hub's metering of what workers and the backbone send, against a model of what each
//! session is owed (see `kvasir_node::hub::relay_script`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|script: &[u8]| kvasir_node::hub::relay_script(script));
