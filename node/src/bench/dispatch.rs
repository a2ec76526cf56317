//! `kvasir-node bench dispatch`: decode with layer-0 experts on a worker behind a link of a
//! given round-trip time, next to the same decode with every expert local, in one run.
//!
//! The round trip is injected by this harness (a TCP proxy between worker and gateway that
//! holds each chunk for half the RTT in each direction), never by the product. Serial
//! dispatch costs at most one RTT per remote layer per decode step; whatever local work runs
//! while the request is in flight (the local experts of that layer) hides part of it, so
//! `exposed_rtt_fraction` = added time per step / (RTT x remote layers) is at most 1 and
//! falls as local work per layer grows. RTT there is the round trip measured through the
//! proxy in the same run. A run in which any request fell back to local experts measured
//! something else, and is an error.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::{ExpertExecutor, LocalExperts};
use kvasir_inference::synth::{preset, synthesize};
use std::io::{Read, Write};

use super::decode::decode_rate;
use crate::backbone::RemoteExperts;
use crate::dev::launch::Loopback;
use crate::engine::Backend;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (default: the `small` preset, synthesized into a temp dir).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Round-trip time injected between worker and gateway, in milliseconds.
    #[arg(long, default_value_t = 13.0)]
    rtt_ms: f64,
    /// Decode steps timed per measurement.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Accepts on `listener` and forwards each connection to `upstream`, delaying every chunk by
/// `one_way` in both directions (order kept; bandwidth not limited). Plain threads and
/// blocking sockets: a thread sleep is precise to tens of microseconds, where an async timer
/// rounds up to the millisecond.
fn delay_proxy(listener: std::net::TcpListener, upstream: SocketAddr, one_way: Duration) {
    for down in listener.incoming().map_while(Result::ok) {
        let Ok(up) = std::net::TcpStream::connect(upstream) else {
            continue;
        };
        for (from, to) in [(&down, &up), (&up, &down)] {
            if let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) {
                let _ = (from.set_nodelay(true), to.set_nodelay(true));
                delayed_copy(from, to, one_way);
            }
        }
    }
}

fn delayed_copy(mut from: std::net::TcpStream, mut to: std::net::TcpStream, delay: Duration) {
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0
                || tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
        let _ = from.shutdown(std::net::Shutdown::Both);
    });
    std::thread::spawn(move || {
        for (due, chunk) in rx {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
}

/// The round trip the proxy actually adds: a byte echoed through it, median of 20.
fn measured_rtt(one_way: Duration) -> Result<Duration> {
    let echo = std::net::TcpListener::bind("127.0.0.1:0")?;
    let echo_addr = echo.local_addr()?;
    std::thread::spawn(move || {
        for mut stream in echo.incoming().map_while(Result::ok) {
            let mut byte = [0u8; 1];
            while stream.read_exact(&mut byte).is_ok() && stream.write_all(&byte).is_ok() {}
        }
    });
    let proxy = std::net::TcpListener::bind("127.0.0.1:0")?;
    let proxy_addr = proxy.local_addr()?;
    std::thread::spawn(move || delay_proxy(proxy, echo_addr, one_way));
    let mut stream = std::net::TcpStream::connect(proxy_addr)?;
    stream.set_nodelay(true)?;
    let mut times: Vec<Duration> = (0..20)
        .map(|_| {
            let start = Instant::now();
            let mut byte = [7u8];
            stream.write_all(&byte)?;
            stream.read_exact(&mut byte)?;
            Ok(start.elapsed())
        })
        .collect::<std::io::Result<_>>()?;
    times.sort();
    Ok(times[times.len() / 2])
}

struct Point {
    batch: usize,
    local: f64,
    remote: f64,
}

pub fn run(args: Args) -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let dir = scratch.path().join("small");
            let small = preset("small")?;
            synthesize(&dir, small, |_, _| {})?;
            dir
        }
    };
    let config = Config::load(&model_dir)?;
    let checkpoint = Checkpoint::open(&model_dir)?;
    let model = Model::load(&checkpoint, config.clone())?;
    let local = LocalExperts::load(&checkpoint, &config, |_, _| true)?;
    let fallback = LocalExperts::load(&checkpoint, &config, |_, _| true)?;

    let runtime = tokio::runtime::Runtime::new()?;
    let mut swarm = Loopback::start(scratch.path(), &scratch.path().join("chain"), None)?;
    let rtt = Duration::from_secs_f64(args.rtt_ms / 1e3);
    let proxy = std::net::TcpListener::bind("127.0.0.1:0")?;
    let proxy_port = proxy.local_addr()?.port();
    let gateway = swarm.gateway_addr;
    std::thread::spawn(move || delay_proxy(proxy, gateway, rtt / 2));
    let link_rtt = measured_rtt(rtt / 2)?;
    let keyfile = scratch.path().join("worker.key");
    swarm.add_worker(
        &model_dir,
        "0:*",
        &Loopback::swarm_url(proxy_port),
        &keyfile,
        Backend::Cpu,
        &[],
    )?;
    let remote = RemoteExperts::attach(
        &runtime,
        &format!("ws://{}", swarm.hub_addr),
        swarm.backbone.clone(),
        0,
        &model_dir,
        fallback,
        "0:*".parse().map_err(anyhow::Error::msg)?,
        Duration::from_secs(30),
    )?;
    if !remote.wait_until_covered(&config, Duration::from_secs(60)) {
        bail!("the worker never attached");
    }
    // Warm-up: page the weights in, open the link.
    decode_rate(&model, &local, 1, 2)?;
    decode_rate(&model, &remote, 1, 2)?;
    let rate = |experts: &dyn ExpertExecutor, batch: usize, steps: usize| {
        decode_rate(&model, experts, batch, steps)
            .with_context(|| format!("decoding at batch {batch}"))
    };
    let mut points = Vec::new();
    for batch in [1, 8] {
        points.push(Point {
            batch,
            local: rate(&local, batch, args.steps)?,
            remote: rate(&remote, batch, args.steps)?,
        });
    }
    let big_steps = (args.steps / 4).max(2);
    let batch512 = Point {
        batch: 512,
        local: rate(&local, 512, big_steps)?,
        remote: rate(&remote, 512, big_steps)?,
    };
    remote
        .stats()
        .all_remote()
        .map_err(|why| anyhow::anyhow!("{why}: not a measurement of remote dispatch"))?;
    // Figures are against the round trip measured through the proxy, not the nominal one.
    let link = link_rtt.as_secs_f64();
    let remote_layers = 1.0;
    let exposed = |p: &Point| {
        let added = p.batch as f64 / p.remote - p.batch as f64 / p.local;
        added / (link * remote_layers)
    };
    let speedup = batch512.remote / points[0].remote;
    // The most batching can give on this machine: batch-1 steps cost the round trip, a
    // batch-512 step at least its local compute plus one round trip.
    let ceiling = 512.0 / points[0].remote / (512.0 / batch512.local + link);
    if args.json {
        let by_batch: Vec<serde_json::Value> = points
            .iter()
            .chain([&batch512])
            .map(|p| {
                serde_json::json!({
                    "batch": p.batch, "local_tok_s": p.local, "remote_tok_s": p.remote,
                    "overhead": 1.0 - p.remote / p.local, "exposed_rtt_fraction": exposed(p),
                })
            })
            .collect();
        let value = serde_json::json!({
            "model": model_dir,
            "rtt_ms": args.rtt_ms,
            "proxy_rtt_ms": link_rtt.as_secs_f64() * 1e3,
            "by_batch": by_batch,
            "exposed_rtt_fraction_batch1": exposed(&points[0]),
            "exposed_rtt_fraction_batch8": exposed(&points[1]),
            "batch512_speedup": speedup,
            "batch512_speedup_ceiling": ceiling,
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench dispatch: {}, layer 0 remote at {} ms RTT ({} threads)",
        model_dir.display(),
        args.rtt_ms,
        rayon::current_num_threads()
    );
    println!(
        "injected round trip measured through the proxy: {:.2} ms (the RTT the figures divide by)",
        link * 1e3
    );
    println!(
        "{:<10} {:>12} {:>12} {:>9} {:>22}",
        "batch", "local tok/s", "remote tok/s", "overhead", "exposed_rtt_fraction"
    );
    for p in points.iter().chain([&batch512]) {
        println!(
            "{:<10} {:>12.2} {:>12.2} {:>8.1}% {:>22.3}",
            p.batch,
            p.local,
            p.remote,
            100.0 * (1.0 - p.remote / p.local),
            exposed(p)
        );
    }
    println!("exposed_rtt_fraction target: <= 1.0 at batch 1, lower at batch 8");
    println!(
        "batch512_speedup {speedup:.1}  (per-token throughput at batch 512 / batch 1, layer 0 remote; target >= 77)"
    );
    println!(
        "  ceiling on this machine {ceiling:.1} = 512 x batch-1 remote step / (batch-512 local step + RTT): {:.2} of it",
        speedup / ceiling
    );
    Ok(())
}
