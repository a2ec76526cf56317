//! Which versions the hub admits a client of: of the wire protocol, told apart before the
//! challenge by the WebSocket subprotocol a client offers (`kvasir_wire::link::accept`), and
//! of the reference arithmetic, declared in the hello.
//!
//! Upgrades must not cut strangers off, nor cost them their bonds:
//! - a worker of the previous wire version is admitted until `--previous-wire-until` (and
//!   never without it), its frames relayed with its version in their header; after that it
//!   is refused at its hello with a failure it can read, saying to upgrade;
//! - a client whose arithmetic is not this hub's is refused at its hello, before it has a
//!   session: it is never sent a request, so none of its answers can be audited, become
//!   evidence, or be slashed for. The backbone's audits and the validators recompute with one
//!   arithmetic; a worker computing by another would be honest and still answer other bits.

use std::time::SystemTime;

use kvasir_wire::{Hello, Role, WireError, VERSION};
use tokio_tungstenite::tungstenite::Bytes;

/// What the hub admits besides its own versions.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Versions {
    /// Until when a worker of the previous wire version is admitted; None: never.
    pub previous_wire_until: Option<SystemTime>,
}

impl Versions {
    /// Whether `hello`, which came on a link of wire `version` at `now`, is admitted: Ok with
    /// the notice its welcome carries (empty for none), or why not (sent to the client as its
    /// failure).
    pub fn admit(&self, version: u8, hello: &Hello, now: SystemTime) -> Result<String, String> {
        let mut notice = String::new();
        if version != VERSION {
            let until = match (hello.role, self.previous_wire_until) {
                (Role::Worker, Some(until)) if now < until => until,
                (Role::Worker, _) => {
                    return Err(format!(
                        "this hub no longer admits wire protocol version {version}: upgrade kvasir-node to one that speaks {VERSION}"
                    ))
                }
                (Role::Backbone, _) => {
                    return Err(format!(
                        "a backbone must speak wire protocol version {VERSION}, not {version}: upgrade kvasir-node"
                    ))
                }
            };
            // A client of the previous version has no place for a notice: only the hub's log
            // says so (`connection`).
            notice = format!(
                "wire protocol version {version} is admitted until {}: upgrade kvasir-node",
                humantime::format_rfc3339_seconds(until)
            );
        }
        let declared = hello.declared_arithmetic();
        if declared != kvasir_inference::ARITHMETIC_VERSION {
            return Err(format!(
                "this hub's swarm computes by reference arithmetic version {}, this {:?} by version {declared}: run a kvasir-node release that computes by version {} (nothing was served, so nothing is at stake)",
                kvasir_inference::ARITHMETIC_VERSION,
                hello.role,
                kvasir_inference::ARITHMETIC_VERSION,
            ));
        }
        Ok(notice)
    }

    /// Resolves, with the reason to give, when a session on a link of wire `version` must
    /// end: at the end of the window for the previous version, never for this one.
    pub async fn window_end(&self, version: u8) -> String {
        match self.previous_wire_until {
            Some(until) if version != VERSION => {
                let left = until.duration_since(SystemTime::now()).unwrap_or_default();
                tokio::time::sleep(left).await;
                format!(
                    "this hub admitted wire protocol version {version} until {}: upgrade kvasir-node to one that speaks {VERSION}",
                    humantime::format_rfc3339_seconds(until)
                )
            }
            _ => std::future::pending().await,
        }
    }
}

/// A frame from a client of wire `version`, as the hub relays it: a frame of the previous
/// version must carry that version and is relayed as one of this (only the header differs,
/// `kvasir_wire::restamped`); one of another version is refused.
pub(super) fn as_current(frame: Bytes, version: u8) -> Result<Bytes, WireError> {
    if version == VERSION {
        return Ok(frame);
    }
    match frame.get(4) {
        Some(&got) if got == version => Ok(kvasir_wire::restamped(&frame, VERSION).into()),
        Some(&got) => Err(WireError::Version {
            got,
            speaks: version,
        }),
        None => Ok(frame),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_ledger::keys::Keypair;
    use kvasir_wire::{Challenge, PREVIOUS_VERSION};
    use std::time::Duration;

    fn hello(role: Role, arithmetic: Option<u32>) -> Hello {
        let challenge = Challenge {
            nonce: [7; 32],
            hub: Keypair::generate().address(),
            chain_id: "kvasir-test".into(),
        };
        let key = Keypair::generate();
        let mut hello = Hello::answer(&challenge, &key, role, "m".into(), "cpu".into(), vec![]);
        hello.arithmetic = arithmetic;
        hello.sign(&challenge, &key);
        assert!(hello.verify(&challenge));
        hello
    }

    /// Frames from a link of the previous version are relayed as this version's only if they
    /// say the link's version; this version's pass untouched.
    #[test]
    fn a_previous_version_link_must_stamp_its_frames_with_its_version() {
        let frame = |version: u8| Bytes::from(vec![b'K', b'V', b'S', b'R', version, 6, 0, 0, 0, 0]);
        let relayed = as_current(frame(PREVIOUS_VERSION), PREVIOUS_VERSION).unwrap();
        assert_eq!(relayed, frame(VERSION));
        for other in [VERSION, 0, 99] {
            assert!(as_current(frame(other), PREVIOUS_VERSION).is_err());
        }
        assert_eq!(as_current(frame(VERSION), VERSION).unwrap(), frame(VERSION));
        assert_eq!(as_current(frame(99), VERSION).unwrap(), frame(99));
    }

    /// A session of the previous version is ended at its window's end (at once, past it);
    /// one of this version never.
    #[tokio::test]
    async fn a_previous_version_session_ends_with_the_window() {
        let past = Versions {
            previous_wire_until: Some(SystemTime::now() - Duration::from_secs(1)),
        };
        let why = past.window_end(PREVIOUS_VERSION).await;
        assert!(why.contains("upgrade kvasir-node"), "{why}");
        let soon = Versions {
            previous_wire_until: Some(SystemTime::now() + Duration::from_millis(50)),
        };
        assert!(soon.window_end(PREVIOUS_VERSION).await.contains("admitted"));
        let never = tokio::time::timeout(Duration::from_millis(100), soon.window_end(VERSION));
        assert!(never.await.is_err());
    }

    /// A worker of the previous wire version: admitted with a notice before the window's end,
    /// refused at it and after it, and without a window; a backbone of that version never.
    /// Another arithmetic is refused in either version, for either role.
    #[test]
    fn the_previous_wire_is_admitted_in_its_window_and_another_arithmetic_never() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let until = Versions {
            previous_wire_until: Some(now + Duration::from_secs(1)),
        };
        let current = kvasir_inference::ARITHMETIC_VERSION;
        let worker = hello(Role::Worker, Some(current));
        assert_eq!(
            Versions::default().admit(VERSION, &worker, now),
            Ok(String::new())
        );
        let old_worker = hello(Role::Worker, None);
        let notice = until.admit(PREVIOUS_VERSION, &old_worker, now).unwrap();
        assert!(
            notice.contains("admitted until 2027-01-15T08:00:01Z"),
            "{notice}"
        );
        for refusing in [
            Versions::default(),
            Versions {
                previous_wire_until: Some(now),
            },
        ] {
            let why = refusing
                .admit(PREVIOUS_VERSION, &old_worker, now)
                .unwrap_err();
            assert!(why.contains("upgrade kvasir-node"), "{why}");
        }
        let old_backbone = hello(Role::Backbone, None);
        assert!(until.admit(PREVIOUS_VERSION, &old_backbone, now).is_err());
        for role in [Role::Worker, Role::Backbone] {
            for other in [0, current + 1, u32::MAX] {
                let why = until
                    .admit(VERSION, &hello(role, Some(other)), now)
                    .unwrap_err();
                assert!(why.contains("arithmetic version"), "{why}");
            }
        }
    }
}
