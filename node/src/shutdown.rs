//! What stops a long-running process: Ctrl-C (SIGINT) or SIGTERM, the signal service
//! managers and `dev` send. A shell starts background jobs with SIGINT ignored, so SIGTERM is
//! the one a parent can count on.

/// Resolves when SIGINT or SIGTERM arrives.
pub async fn requested() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Blocks the calling thread until SIGINT or SIGTERM arrives, or until `check` (called every
/// fifth of a second) fails, with its error.
pub fn wait_unless(mut check: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let stop = requested();
            tokio::pin!(stop);
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(200));
            loop {
                tokio::select! {
                    _ = &mut stop => return Ok(()),
                    _ = tick.tick() => check()?,
                }
            }
        })
}
