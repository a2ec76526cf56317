//! The raw splice: a connection whose request head is a WebSocket upgrade on the swarm path
//! is handed to the hub as bytes; nothing after the head is ever parsed. Everything else is
//! replayed, head included, to the REST side.

use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use anyhow::{bail, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use super::SWARM_PATH;

/// A request head larger than this is dropped.
const MAX_HEAD: usize = 16 << 10;

/// Reads until the end of the HTTP request head; returns everything read (the head and
/// whatever followed it in the same reads).
pub(super) async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!("closed before the end of the request head");
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(buf);
        }
        if buf.len() > MAX_HEAD {
            bail!("request head over {MAX_HEAD} bytes");
        }
    }
}

/// `GET /swarm` with `Upgrade: websocket`; decided on the head alone, the frames that follow
/// are never looked at.
pub(super) fn is_swarm_upgrade(head: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(head.split(|b| *b == 0).next().unwrap_or_default()) else {
        return false;
    };
    let mut lines = text.split("\r\n");
    let target = lines.next().and_then(|line| {
        let mut parts = line.split(' ');
        (parts.next() == Some("GET"))
            .then(|| parts.next())
            .flatten()
    });
    let path = target.map(|t| t.split('?').next().unwrap_or_default());
    path == Some(SWARM_PATH)
        && lines.take_while(|l| !l.is_empty()).any(|l| {
            l.split_once(':').is_some_and(|(name, value)| {
                name.trim().eq_ignore_ascii_case("upgrade")
                    && value.trim().eq_ignore_ascii_case("websocket")
            })
        })
}

/// A stream that first replays bytes already read from it.
pub(super) struct Rewind<S> {
    pub prefix: Vec<u8>,
    pub at: usize,
    pub inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.at);
            buf.put_slice(&self.prefix[self.at..self.at + n]);
            self.at += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_websocket_get_on_the_swarm_path_is_spliced() {
        let upgrade =
            b"GET /swarm HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n";
        assert!(is_swarm_upgrade(upgrade));
        assert!(is_swarm_upgrade(
            b"GET /swarm?v=1 HTTP/1.1\r\nupgrade:  WebSocket \r\n\r\n"
        ));
        for other in [
            &b"GET /swarm HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"POST /swarm HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            b"GET /swarmy HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\n\r\nUpgrade: websocket\r\n\r\n",
            b"\xff\xfe",
            b"",
        ] {
            assert!(!is_swarm_upgrade(other), "{other:?}");
        }
    }
}
