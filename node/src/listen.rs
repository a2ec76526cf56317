//! Accepting TCP connections on a port strangers can reach, in a way they cannot stop: an
//! accept error (out of file descriptors, a connection aborted before it was accepted, ...)
//! is logged at most once a second and retried after a short pause instead of ending the
//! loop, and connections beyond a global cap or a per-address cap are closed at once, before
//! any byte is read. Each accepted connection holds a `Slot` that frees its place when the
//! connection's task ends. The per-address cap counts an IPv6 peer by its /64 (one subscriber
//! is routinely given a whole /64) and an IPv4-mapped IPv6 address as its IPv4 address. The
//! same counting (`Places`) caps other things a peer holds, such as requests in progress.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// How long the loop waits after an accept error before trying again: long enough for
/// connections to close and free descriptors, short enough that service resumes at once.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// At most one log line per this interval about failing accepts or refused connections.
const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// The caps a listener enforces, from the role's command line.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct Limits {
    /// Connections held open at once, from everyone; beyond it new ones are closed at once.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Connections held open at once from one IP address (for IPv6, from one /64).
    #[arg(long, default_value_t = 64)]
    pub max_connections_per_ip: usize,
}

impl Limits {
    /// Only a total: for a LAN service whose clients arrive through the gateway, all from
    /// its address, so that a per-address cap would cap the gateway itself.
    pub fn total(max_connections: usize) -> Limits {
        Limits {
            max_connections,
            max_connections_per_ip: usize::MAX,
        }
    }

    /// Only a cap per address, for places other than connections (which the listener
    /// already caps in all).
    pub fn per_address(per_address: usize) -> Limits {
        Limits {
            max_connections: usize::MAX,
            max_connections_per_ip: per_address,
        }
    }
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// Places held at once, under a cap on all of them and a cap per peer address: the
/// listener's connections, or the gateway's `/v1/` requests in progress. An address is kept
/// only while it holds a place, so the map is no larger than the places held.
pub struct Places {
    limits: Limits,
    counts: Mutex<Counts>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Places {
    pub fn new(limits: Limits) -> Arc<Places> {
        Arc::new(Places {
            limits,
            counts: Mutex::default(),
        })
    }

    /// Places one address may hold.
    pub fn per_address(&self) -> usize {
        self.limits.max_connections_per_ip
    }

    /// Takes a place for `ip`, if the caps allow one.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Slot> {
        let ip = cap_key(ip);
        let mut counts = lock(&self.counts);
        let from_ip = counts.per_ip.get(&ip).copied().unwrap_or(0);
        if counts.total >= self.limits.max_connections
            || from_ip >= self.limits.max_connections_per_ip
        {
            return None;
        }
        counts.total += 1;
        counts.per_ip.insert(ip, from_ip + 1);
        Some(Slot {
            places: self.clone(),
            ip,
        })
    }
}

/// At most one log line a second, the others counted.
#[derive(Default)]
struct QuietLog {
    quiet_until: Mutex<Option<Instant>>,
    suppressed: Mutex<u64>,
}

impl QuietLog {
    /// Logs `what` unless a line was logged less than a second ago (then counts it).
    fn log(&self, role: &str, what: std::fmt::Arguments) {
        let now = Instant::now();
        let mut quiet = lock(&self.quiet_until);
        if quiet.is_some_and(|until| now < until) {
            *lock(&self.suppressed) += 1;
            return;
        }
        *quiet = Some(now + LOG_INTERVAL);
        let suppressed = std::mem::take(&mut *lock(&self.suppressed));
        tracing::warn!("{role}: {what} ({suppressed} similar lines suppressed)");
    }
}

/// What the per-address cap counts `ip` as: an IPv4 address as itself, an IPv4-mapped IPv6
/// address as the IPv4 address, any other IPv6 address as its /64 (the rest zeroed).
fn cap_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !(u128::MAX >> 64))),
        },
    }
}

/// A place under the caps (`Places`); dropping it frees the place.
pub struct Slot {
    places: Arc<Places>,
    /// The per-address cap's key for the peer (`cap_key`).
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = lock(&self.places.counts);
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                counts.per_ip.remove(&self.ip);
            }
        }
    }
}

/// A connection holding its place under the caps (freed when it is dropped): what an HTTP
/// server built on an `Acceptor` serves.
pub struct Capped {
    stream: TcpStream,
    _slot: Slot,
}

impl AsyncRead for Capped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Capped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// `axum::serve` over an `Acceptor`: the ledger's, the backbone's and the hub registry's HTTP
/// APIs get the same caps and never-dying accept loop as the swarm ports.
impl axum::serve::Listener for Acceptor {
    type Io = Capped;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Capped, SocketAddr) {
        let (stream, peer, slot) = self.next().await;
        (
            Capped {
                stream,
                _slot: slot,
            },
            peer,
        )
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// A listener whose `next` always yields a connection eventually.
pub struct Acceptor {
    role: &'static str,
    listener: TcpListener,
    places: Arc<Places>,
    log: QuietLog,
}

impl Acceptor {
    pub fn new(role: &'static str, listener: TcpListener, limits: Limits) -> Acceptor {
        Acceptor {
            role,
            listener,
            places: Places::new(limits),
            log: QuietLog::default(),
        }
    }

    /// The next connection within the caps, with its place. Errors never end the loop: they
    /// are logged and the accept retried; connections over a cap are closed unread.
    pub async fn next(&self) -> (TcpStream, SocketAddr, Slot) {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => match self.places.admit(peer.ip()) {
                    Some(slot) => return (stream, peer, slot),
                    None => {
                        drop(stream);
                        let limits = self.places.limits;
                        self.log.log(
                            self.role,
                            format_args!(
                                "refused a connection from {} (caps: {} in all, {} per address)",
                                peer.ip(),
                                limits.max_connections,
                                limits.max_connections_per_ip
                            ),
                        );
                    }
                },
                Err(error) => {
                    self.log
                        .log(self.role, format_args!("accepting a connection: {error}"));
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// Connections held now.
    pub fn open(&self) -> usize {
        lock(&self.places.counts).total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn acceptor(limits: Limits) -> (Acceptor, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (Acceptor::new("test", listener, limits), addr)
    }

    /// True when the server closed `stream` without a byte.
    async fn closed(stream: &mut TcpStream) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), stream.read(&mut byte)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    #[tokio::test]
    async fn connections_over_the_per_address_cap_are_closed_and_places_come_back() {
        let limits = Limits {
            max_connections: 100,
            max_connections_per_ip: 2,
        };
        let (acceptor, addr) = acceptor(limits).await;
        let mut clients = Vec::new();
        let mut slots = Vec::new();
        for _ in 0..2 {
            clients.push(TcpStream::connect(addr).await.unwrap());
            slots.push(acceptor.next().await.2);
        }
        assert_eq!(acceptor.open(), 2);
        let mut third = TcpStream::connect(addr).await.unwrap();
        // The third is refused inside `next`, which then waits for a connection it can take.
        let waiting = tokio::spawn(async move {
            let (_, _, slot) = acceptor.next().await;
            (acceptor, slot)
        });
        assert!(closed(&mut third).await, "over the cap, yet served");
        // A connection ending frees its place: the next one from that address is taken.
        slots.pop();
        let _fourth = TcpStream::connect(addr).await.unwrap();
        let (acceptor, _slot) = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a freed place is taken")
            .unwrap();
        assert_eq!(acceptor.open(), 2);
    }

    #[test]
    fn ipv6_peers_are_counted_by_their_64_and_mapped_ipv4_as_ipv4() {
        let key = |ip: &str| cap_key(ip.parse().unwrap()).to_string();
        assert_eq!(key("203.0.113.7"), "203.0.113.7");
        assert_eq!(key("::ffff:203.0.113.7"), "203.0.113.7");
        assert_eq!(key("2001:db8:1:2:aaaa:bbbb:cccc:dddd"), "2001:db8:1:2::");
        assert_eq!(key("2001:db8:1:2::1"), "2001:db8:1:2::");
        assert_eq!(key("2001:db8:1:3::1"), "2001:db8:1:3::");
        assert_eq!(key("::1"), "::");
    }

    #[test]
    fn one_64_shares_one_per_address_cap() {
        let places = Places::new(Limits {
            max_connections: 100,
            max_connections_per_ip: 2,
        });
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let first = places.admit(ip("2001:db8::1")).expect("room");
        let _second = places.admit(ip("2001:db8::ffff:2")).expect("room");
        assert!(
            places.admit(ip("2001:db8::3")).is_none(),
            "a third from that /64"
        );
        assert!(places.admit(ip("2001:db8:0:1::3")).is_some(), "another /64");
        // Two connections from an IPv4 address, one of them through a mapped IPv6 socket.
        let _v4 = places.admit(ip("198.51.100.1")).expect("room");
        let _mapped = places.admit(ip("::ffff:198.51.100.1")).expect("room");
        assert!(
            places.admit(ip("198.51.100.1")).is_none(),
            "a third from that address"
        );
        drop(first);
        assert!(
            places.admit(ip("2001:db8::4")).is_some(),
            "a freed place is taken"
        );
    }

    #[tokio::test]
    async fn the_global_cap_holds_across_addresses() {
        let limits = Limits {
            max_connections: 1,
            max_connections_per_ip: 10,
        };
        let (acceptor, addr) = acceptor(limits).await;
        let _first = TcpStream::connect(addr).await.unwrap();
        let _slot = acceptor.next().await.2;
        let mut second = TcpStream::connect(addr).await.unwrap();
        let acceptor = Arc::new(acceptor);
        let background = {
            let acceptor = acceptor.clone();
            tokio::spawn(async move { acceptor.next().await.2 })
        };
        assert!(closed(&mut second).await);
        assert_eq!(acceptor.open(), 1);
        background.abort();
    }

    #[tokio::test]
    async fn an_http_api_served_over_an_acceptor_keeps_its_caps() {
        use tokio::io::AsyncWriteExt;
        let limits = Limits {
            max_connections: 10,
            max_connections_per_ip: 1,
        };
        let (acceptor, addr) = acceptor(limits).await;
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        tokio::spawn(async move { axum::serve(acceptor, app).await });
        let holder = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut second = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed(&mut second).await,
            "a second connection from one address was served"
        );
        drop(holder);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut client = TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        client.read_to_string(&mut reply).await.unwrap();
        assert!(
            reply.starts_with("HTTP/1.1 200") && reply.ends_with("ok"),
            "{reply}"
        );
    }
}
