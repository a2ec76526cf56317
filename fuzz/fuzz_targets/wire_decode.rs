//! A dispatch frame from a stranger: `Message::decode` and the hub's copy-free
//! `Message::inspect` never panic, agree on every frame, and what decodes re-encodes to the
//! same bytes (one message, one encoding).
#![no_main]

use kvasir_node::wire::{Message, Relayed};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|frame: &[u8]| {
    let decoded = Message::decode(frame);
    let inspected = Message::inspect(frame);
    match (&decoded, &inspected) {
        (Ok(message), Ok(relayed)) => {
            assert_eq!(
                message.encode(),
                frame,
                "decoded {message:?} re-encodes differently"
            );
            let expected = match message {
                Message::Request(r) => Relayed::Request {
                    session: r.session,
                    id: r.id,
                    response_values: r.response_values(),
                },
                Message::Response(r) => Relayed::Response {
                    id: r.id,
                    values: r.partials.len(),
                },
                Message::Failure(f) => Relayed::Failure { id: f.id },
                _ => Relayed::Other,
            };
            assert_eq!(*relayed, expected);
        }
        (Err(_), Err(_)) => {}
        _ => panic!("decode {decoded:?} and inspect {inspected:?} disagree"),
    }
});
