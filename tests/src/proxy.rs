//! A TCP proxy that can cut a link: it relays every connection accepted on its own port to
//! a target, until `cut` shuts down every relayed connection and refuses new ones (accepted
//! and closed at once, as a dropped route looks to a peer that redials); `heal` relays again.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

pub struct Proxy {
    port: u16,
    state: Arc<State>,
}

struct State {
    cut: AtomicBool,
    /// Both ends of every relayed connection, to shut down on `cut`.
    open: Mutex<Vec<TcpStream>>,
}

impl Proxy {
    /// Listens on a free loopback port and relays to `127.0.0.1:target`.
    pub fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port for the proxy");
        let port = listener.local_addr().expect("its address").port();
        let state = Arc::new(State {
            cut: AtomicBool::new(false),
            open: Mutex::new(Vec::new()),
        });
        let shared = Arc::clone(&state);
        thread::spawn(move || {
            for inbound in listener.incoming().flatten() {
                if shared.cut.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                if let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)) {
                    relay(&shared, inbound, outbound);
                }
            }
        });
        Proxy { port, state }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every relayed connection and refuses new ones until `heal`.
    pub fn cut(&self) {
        self.state.cut.store(true, Ordering::SeqCst);
        let mut open = self.state.open.lock().unwrap();
        for stream in open.drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    pub fn heal(&self) {
        self.state.cut.store(false, Ordering::SeqCst);
    }
}

fn relay(state: &State, inbound: TcpStream, outbound: TcpStream) {
    let clones = (inbound.try_clone(), outbound.try_clone());
    let (Ok(inbound_copy), Ok(outbound_copy)) = clones else {
        return;
    };
    {
        let mut open = state.open.lock().unwrap();
        // Checked under the lock `cut` drains: a connection is either refused or shut down.
        if state.cut.load(Ordering::SeqCst) {
            return;
        }
        // Connections closed long ago stay listed until the next cut; a test makes few.
        open.push(inbound.try_clone().expect("a socket clone"));
        open.push(outbound.try_clone().expect("a socket clone"));
    }
    thread::spawn(move || copy(inbound, outbound_copy));
    thread::spawn(move || copy(outbound, inbound_copy));
}

/// Copies `from` into `to` until either ends, then closes both directions.
fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    fn echo_server() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                thread::spawn(move || {
                    let mut reader = stream.try_clone().unwrap();
                    let _ = io::copy(&mut reader, &mut &stream);
                });
            }
        });
        port
    }

    fn echoes(stream: &mut TcpStream) -> bool {
        stream.write_all(b"ping").is_ok() && {
            let mut reply = [0u8; 4];
            stream.read_exact(&mut reply).is_ok() && &reply == b"ping"
        }
    }

    #[test]
    fn relays_until_cut_and_again_after_heal() {
        let proxy = Proxy::start(echo_server());
        let mut before = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        assert!(echoes(&mut before));
        proxy.cut();
        assert!(
            !echoes(&mut before),
            "a relayed connection outlived the cut"
        );
        let mut during = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        assert!(
            !echoes(&mut during),
            "a new connection was relayed while cut"
        );
        proxy.heal();
        let mut after = TcpStream::connect(("127.0.0.1", proxy.port())).unwrap();
        assert!(echoes(&mut after));
    }
}
