//! What the gateway counts, served as Prometheus text on its own `/metrics`: connections by
//! kind, the bytes its splice moved (counted as they pass, so a long session shows before it
//! ends), and how far crediting lags (time since its last complete round, and the bytes the
//! hub had signed for that the ledger had not yet credited when that round began).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::metrics::Exposition;

#[derive(Default)]
pub struct Stats {
    swarm_connections: AtomicU64,
    open_swarm_connections: AtomicU64,
    api_connections: AtomicU64,
    failed_handshakes: AtomicU64,
    /// `/v1/` requests relayed to the backbone, and refused for the per-address cap.
    relayed_requests: AtomicU64,
    refused_requests: AtomicU64,
    /// Worker to hub, and hub to worker.
    spliced_up: AtomicU64,
    spliced_down: AtomicU64,
    credits_admitted: AtomicU64,
    failed_rounds: AtomicU64,
    /// Complete rounds whose every credit was admitted and committed.
    committed_rounds: AtomicU64,
    /// Complete rounds in which the ledger refused some credit (listed again next round).
    partial_rounds: AtomicU64,
    /// Unix milliseconds at the end of the last complete crediting round (0: none yet).
    last_round_ms: AtomicU64,
    uncredited_bytes: AtomicU64,
}

fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// Bumps a gauge while alive.
pub(super) struct Open(Arc<Stats>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0
            .open_swarm_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl Stats {
    pub(super) fn swarm_connection(self: &Arc<Self>) -> Open {
        self.swarm_connections.fetch_add(1, Ordering::Relaxed);
        self.open_swarm_connections.fetch_add(1, Ordering::Relaxed);
        Open(self.clone())
    }

    /// Bytes passed to the hub outside the `Counted` stream (the upgrade's head).
    pub(super) fn spliced_to_hub(&self, bytes: usize) {
        self.spliced_up.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(super) fn api_connection(&self) {
        self.api_connections.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn failed_handshake(&self) {
        self.failed_handshakes.fetch_add(1, Ordering::Relaxed);
    }

    /// A `/v1/` request: relayed, or refused for its address's cap.
    pub(super) fn inference_request(&self, relayed: bool) {
        let counter = if relayed {
            &self.relayed_requests
        } else {
            &self.refused_requests
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Credits the ledger just admitted.
    pub(super) fn admitted(&self, credits: usize) {
        self.credits_admitted
            .fetch_add(credits as u64, Ordering::Relaxed);
    }

    /// A complete crediting round, at whose start `uncredited` bytes were above the ledger's
    /// marks.
    pub(super) fn round(&self, uncredited: u64, all_admitted: bool) {
        let outcome = match all_admitted {
            true => &self.committed_rounds,
            false => &self.partial_rounds,
        };
        outcome.fetch_add(1, Ordering::Relaxed);
        self.uncredited_bytes.store(uncredited, Ordering::Relaxed);
        self.last_round_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub(super) fn failed_round(&self) {
        self.failed_rounds.fetch_add(1, Ordering::Relaxed);
    }

    /// Since the last complete round; `None` before the first.
    fn crediting_lag(&self) -> Option<Duration> {
        match self.last_round_ms.load(Ordering::Relaxed) {
            0 => None,
            at => Some(Duration::from_millis(now_ms().saturating_sub(at))),
        }
    }

    pub(super) fn text(&self) -> String {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let mut exposition = Exposition::default();
        exposition
            .counter(
                "kvasir_gateway_swarm_connections_total",
                "Worker upgrades spliced to the hub.",
                get(&self.swarm_connections),
            )
            .gauge(
                "kvasir_gateway_open_swarm_connections",
                "Worker splices open now.",
                get(&self.open_swarm_connections),
            )
            .counter(
                "kvasir_gateway_api_connections_total",
                "Connections served as the REST API.",
                get(&self.api_connections),
            )
            .counter(
                "kvasir_gateway_failed_handshakes_total",
                "Connections dropped before a request head (TLS failed or too slow).",
                get(&self.failed_handshakes),
            )
            .labelled_counter(
                "kvasir_gateway_inference_requests_total",
                "OpenAI API (/v1/) requests: relayed to the backbone, or refused because their address had --max-generations-per-ip in progress.",
                "outcome",
                [
                    ("relayed", get(&self.relayed_requests)),
                    ("refused", get(&self.refused_requests)),
                ],
            )
            .labelled_counter(
                "kvasir_gateway_spliced_bytes_total",
                "Bytes the splice moved, by direction.",
                "direction",
                [
                    ("to_hub", get(&self.spliced_up)),
                    ("to_worker", get(&self.spliced_down)),
                ],
            )
            .counter(
                "kvasir_gateway_credits_admitted_total",
                "Credit transactions the ledger admitted.",
                get(&self.credits_admitted),
            )
            .labelled_counter(
                "kvasir_gateway_crediting_rounds_total",
                "Complete crediting rounds: every credit committed, or some refused by the ledger (listed again next round).",
                "outcome",
                [
                    ("committed", get(&self.committed_rounds)),
                    ("partial", get(&self.partial_rounds)),
                ],
            )
            .counter(
                "kvasir_gateway_failed_crediting_rounds_total",
                "Crediting rounds that stopped on an error (registry or ledger unreachable).",
                get(&self.failed_rounds),
            )
            .gauge(
                "kvasir_gateway_uncredited_bytes",
                "Bytes signed by the hub and not yet credited, as of the last round's start.",
                get(&self.uncredited_bytes),
            );
        if let Some(lag) = self.crediting_lag() {
            exposition.gauge(
                "kvasir_gateway_crediting_lag_seconds",
                "Seconds since the last complete crediting round.",
                lag.as_secs(),
            );
        }
        exposition.text()
    }
}

/// A stream whose reads and writes are added to the splice's byte counts as they happen.
pub(super) struct Counted<S> {
    pub inner: S,
    pub stats: Arc<Stats>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = (buf.filled().len() - before) as u64;
        self.stats.spliced_up.fetch_add(read, Ordering::Relaxed);
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(written)) = &polled {
            let written = *written as u64;
            self.stats
                .spliced_down
                .fetch_add(written, Ordering::Relaxed);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn spliced_bytes_are_counted_as_they_pass_each_way() {
        let stats = Arc::new(Stats::default());
        let (near, mut far) = tokio::io::duplex(64);
        let mut counted = Counted {
            inner: near,
            stats: stats.clone(),
        };
        far.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        counted.read_exact(&mut buf).await.unwrap();
        counted.write_all(b"hi").await.unwrap();
        let text = stats.text();
        assert!(text.contains("kvasir_gateway_spliced_bytes_total{direction=\"to_hub\"} 5\n"));
        assert!(text.contains("kvasir_gateway_spliced_bytes_total{direction=\"to_worker\"} 2\n"));
        // No round yet: no lag is claimed.
        assert!(!text.contains("crediting_lag"));
        stats.admitted(3);
        stats.round(1_000, true);
        stats.round(1_000, false);
        stats.round(1_000, true);
        let text = stats.text();
        assert!(text.contains("kvasir_gateway_credits_admitted_total 3\n"));
        let rounds = "kvasir_gateway_crediting_rounds_total{outcome=";
        assert!(
            text.contains(&format!("{rounds}\"committed\"}} 2\n")),
            "{text}"
        );
        assert!(
            text.contains(&format!("{rounds}\"partial\"}} 1\n")),
            "{text}"
        );
        assert!(text.contains("kvasir_gateway_uncredited_bytes 1000\n"));
        assert!(text.contains("kvasir_gateway_crediting_lag_seconds 0\n"));
    }

    #[test]
    fn the_open_gauge_follows_the_guard() {
        let stats = Arc::new(Stats::default());
        let open = stats.swarm_connection();
        assert!(stats
            .text()
            .contains("kvasir_gateway_open_swarm_connections 1\n"));
        drop(open);
        assert!(stats
            .text()
            .contains("kvasir_gateway_open_swarm_connections 0\n"));
        assert!(stats
            .text()
            .contains("kvasir_gateway_swarm_connections_total 1\n"));
    }
}
