//! A dispatch frame from a stranger: `Message::decode` and the hub's copy-free
//! `Message::inspect` never panic, agree on every frame, and what decodes re-encodes to the
//! same bytes (one message, one encoding); so does a frame of the previous version, which a
//! hub decodes from a client of that version.
#![no_main]

use kvasir_wire::{Message, PREVIOUS_VERSION};
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
            assert_eq!(*relayed, message.relayed());
        }
        (Err(_), Err(_)) => {}
        _ => panic!("decode {decoded:?} and inspect {inspected:?} disagree"),
    }
    if let Ok(message) = Message::decode_as(frame, PREVIOUS_VERSION) {
        assert_eq!(
            message.encode_as(PREVIOUS_VERSION),
            frame,
            "decoded {message:?} (version {PREVIOUS_VERSION}) re-encodes differently"
        );
    }
});
