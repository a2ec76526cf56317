mod common;
use common::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn probe() {
    init_logs();
    let (genesis, keys) = genesis_with(1);
    let home = tempfile::tempdir().unwrap();
    let chain = ToyChain::new(&genesis, Some(keys[0].address()), Vec::new());
    let ledger = chain.ledger.clone();
    let addresses = free_addresses(2);
    let handle = kvasir_consensus::start(
        &genesis,
        Some(keys[0].clone()),
        settings(&home, &addresses, 0),
        chain,
    )
    .await
    .unwrap();
    wait_for(std::slice::from_ref(&ledger), 2, Duration::from_secs(30)).await;
    let t = std::time::Instant::now();
    handle.stop().await.unwrap();
    eprintln!("stop took {:?}", t.elapsed());
    let port: u16 = addresses[0]
        .to_string()
        .rsplit('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    for _ in 0..5 {
        eprintln!(
            "bind: {:?}",
            std::net::TcpListener::bind(("127.0.0.1", port)).map(|_| ())
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
