//! A public connection whose client stops reading: the server's writes wait for it forever
//! (hyper has no write timeout), and the connection, its place under the caps and whatever
//! its answer holds (a `/v1/` place, a relayed body) with them. Slow reading is free for an
//! attacker, so a write that has waited `limit` for the client to take a byte fails the
//! connection instead.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// How long a write may wait for the client to read: far past any live client's pause, short
/// enough that a connection held by not reading is soon given back.
pub(super) const WRITE_STALL: Duration = Duration::from_secs(60);

pub(super) struct WriteStall<S> {
    inner: S,
    limit: Duration,
    /// Armed while a write waits; disarmed by any progress.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteStall<S> {
    pub(super) fn new(inner: S, limit: Duration) -> WriteStall<S> {
        WriteStall {
            inner,
            limit,
            waiting: None,
        }
    }

    /// `progress` unless it is pending, and has been for `limit` since the write began
    /// waiting.
    fn watch<T>(
        &mut self,
        cx: &mut TaskContext<'_>,
        progress: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if progress.is_ready() {
            self.waiting = None;
            return progress;
        }
        let limit = self.limit;
        let waiting = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match waiting.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteStall<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteStall<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let progress = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, progress)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        let progress = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, progress)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        let progress = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, progress)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that reads slowly but reads is served in full; one that stops reading fails
    /// the writer once its write has waited the limit.
    #[tokio::test]
    async fn a_write_waiting_past_the_limit_fails_and_a_slow_reader_is_served() {
        let limit = Duration::from_millis(200);
        let (near, mut far) = tokio::io::duplex(1024);
        let mut writer = WriteStall::new(near, limit);
        let reader = tokio::spawn(async move {
            let mut got = vec![0; 4096];
            for chunk in got.chunks_mut(512) {
                // Each pause is under the limit, and together over it.
                tokio::time::sleep(limit / 4).await;
                far.read_exact(chunk).await.unwrap();
            }
            (got, far)
        });
        let sent: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
        writer.write_all(&sent).await.unwrap();
        let (got, far) = reader.await.unwrap();
        assert_eq!(got, sent);

        // The far end is kept open but never read again.
        let stuck = writer.write_all(&[7; 8192]);
        let refused = tokio::time::timeout(limit * 10, stuck)
            .await
            .expect("the write fails, not hangs")
            .unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::TimedOut);
        drop(far);
    }
}
