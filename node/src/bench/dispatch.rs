//! `kvasir-node bench dispatch`: decode with the `--remote` experts on a worker behind a link
//! of a given round-trip time, next to the same decode with every expert local, in one run,
//! for each number of concurrent streams in `--streams`.
//!
//! The round trip is injected by this harness (a TCP proxy between worker and gateway that
//! holds each chunk for half the RTT in each direction), never by the product. A stream's
//! step cannot be shorter than one round trip per remote layer, so aggregate throughput
//! needs many streams in flight, and micro-batches (`Pipeline`) so that while one waits at a
//! layer another computes. Per point: local and remote tokens/s (aggregate, and per stream),
//! `remote_vs_local` (remote aggregate / local aggregate at the same streams), and at one
//! stream `exposed_round_trips` = added time per step / (RTT x remote layers), the round
//! trips a step exposes. RTT is the round trip measured through the proxy in the same run.
//! Beside them, the mean dispatch round trip the backbone saw in the timed steps of the best
//! remote run, and the exposed round trips split into what the requests' round trips take
//! beyond the RTT (relay path, worker queue and compute) and what the step's own compute
//! takes beyond all local.
//! After the runs, the worker's resident memory (`VmRSS`): its held experts' weights, all
//! paged in by then, and the process; on a quantized GGUF file next to its bf16 checkpoint,
//! what quantization saves a worker.
//! A run in which any request fell back to local experts measured something else, and is an
//! error. Each figure is the best of `RUNS` runs (the machine's noise only slows a run; a
//! one-stream step is short enough that one slow run moved the exposed round trips by 0.1).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::Pipeline;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::LocalExperts;
use kvasir_inference::synth::{preset, synthesize};
use std::io::{Read, Write};

use super::decode::{best_of, best_run_of, decode_rate, timed_decode, RUNS};
use kvasir_devnet::measure::{auto_micro_batches, mean_between, Exposed, Point};
use kvasir_devnet::Loopback;
use kvasir_node::backbone::dispatch::RemoteExperts;
use kvasir_wire::spec::ExpertSpec;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (default: the `small` preset, synthesized into a temp dir).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Round-trip time injected between worker and gateway, in milliseconds.
    #[arg(long, default_value_t = 13.0)]
    rtt_ms: f64,
    /// The experts the worker serves (LAYERS:EXPERTS items; `*:*` is every MoE layer).
    #[arg(long, default_value = "0:*")]
    remote: ExpertSpec,
    /// Concurrent streams to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    streams: Vec<usize>,
    /// Micro-batches in flight at once on the remote side; by default enough that the
    /// others' compute covers one's round trips, at most 8 and at most the streams.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    micro_batches: Option<u16>,
    /// Decode steps timed per measurement (a quarter of them, at least 8, past 16 streams:
    /// the micro-batches start together and take a few steps to fall out of phase).
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
pub(super) fn delay_proxy(
    listener: std::net::TcpListener,
    upstream: SocketAddr,
    one_way: Duration,
) {
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
pub(super) fn measured_rtt(one_way: Duration) -> Result<Duration> {
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

/// `streams` sequences decoded for `steps` steps in `pipeline`'s micro-batches with the
/// `remote` experts: tokens per second, and the requests' mean round trip over the timed
/// steps (not the prefill, whose requests carry whole prompts).
fn remote_run(
    model: &Model,
    remote: &RemoteExperts,
    pipeline: &Pipeline,
    streams: usize,
    steps: usize,
) -> Result<(f64, Option<f64>)> {
    let mut calls = 0;
    let mut round_trip = None;
    let rate = timed_decode(model, streams, steps, |sequences, steps| {
        calls += 1;
        let before = remote.round_trip.totals();
        let decoded = pipeline.decode(model, remote, sequences, steps);
        if calls == 2 {
            round_trip = mean_between(before, remote.round_trip.totals());
        }
        decoded
    })?;
    Ok((rate, round_trip))
}

pub fn run(args: Args) -> Result<()> {
    if args.streams.is_empty() || args.streams.contains(&0) {
        bail!("--streams takes numbers of concurrent streams, each at least 1");
    }
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
    let remote_layers = {
        let mut layers: Vec<u16> = args
            .remote
            .resolve(&config)
            .iter()
            .map(|(l, _)| *l)
            .collect();
        layers.dedup();
        layers.len()
    };
    if remote_layers == 0 {
        bail!("--remote {} names no expert of this model", args.remote);
    }

    let runtime = tokio::runtime::Runtime::new()?;
    let mut swarm = Loopback::on_dev_chain(scratch.path())?;
    let rtt = Duration::from_secs_f64(args.rtt_ms / 1e3);
    let proxy = std::net::TcpListener::bind("127.0.0.1:0")?;
    let proxy_port = proxy.local_addr()?.port();
    let gateway = swarm.gateway_addr;
    std::thread::spawn(move || delay_proxy(proxy, gateway, rtt / 2));
    let link_rtt = measured_rtt(rtt / 2)?;
    let keyfile = scratch.path().join("worker.key");
    swarm.add_worker(
        &model_dir,
        &args.remote.to_string(),
        &Loopback::swarm_url(proxy_port),
        &keyfile,
        "cpu",
        &[],
    )?;
    let worker_pid = swarm.last_pid().context("the worker's process")?;
    let remote = RemoteExperts::attach(
        &runtime,
        &format!("ws://{}", swarm.hub_addr),
        swarm.backbone.clone(),
        0,
        &model_dir,
        fallback,
        args.remote.clone(),
        Duration::from_secs(60),
    )?;
    if !remote.wait_until_covered(&config, Duration::from_secs(60)) {
        bail!("the worker never attached");
    }
    // Warm-up: page the weights in, open the link.
    decode_rate(&model, &local, 1, 2)?;
    decode_rate(&model, &remote, 1, 2)?;
    let link = link_rtt.as_secs_f64();
    let threads = rayon::current_num_threads();
    let mut points = Vec::new();
    for &streams in &args.streams {
        let steps = if streams > 16 {
            (args.steps / 4).max(8).min(args.steps)
        } else {
            args.steps
        };
        let context = |what: &str| format!("{what} decode of {streams} streams");
        let local_rate = best_of(|| decode_rate(&model, &local, streams, steps))
            .with_context(|| context("local"))?;
        let micro_batches = args.micro_batches.map(usize::from).unwrap_or_else(|| {
            auto_micro_batches(streams, streams as f64 / local_rate, link, remote_layers)
        });
        let pipeline = Pipeline::new(micro_batches, threads)?;
        let (remote_rate, round_trip) =
            best_run_of(|| remote_run(&model, &remote, &pipeline, streams, steps))
                .with_context(|| context("remote"))?;
        points.push(Point {
            streams,
            micro_batches,
            local: local_rate,
            remote: remote_rate,
            round_trip,
        });
    }
    remote
        .stats()
        .all_remote()
        .map_err(|why| anyhow::anyhow!("{why}: not a measurement of remote dispatch"))?;
    // Every expert it holds has run by now, so its weights are paged in: what a worker
    // holding this slice keeps resident.
    let worker_resident = resident_bytes(worker_pid)?;
    // Round trips a one-stream step exposes, against the round trip measured through the proxy.
    let single = points
        .iter()
        .find(|p| p.streams == 1)
        .map(|p| Exposed::of(p, link, remote_layers));
    if args.json {
        let by_streams: Vec<serde_json::Value> = points
            .iter()
            .map(|p| {
                serde_json::json!({
                    "streams": p.streams, "micro_batches": p.micro_batches,
                    "local_tok_s": p.local, "remote_tok_s": p.remote,
                    "remote_per_stream_tok_s": p.remote / p.streams as f64,
                    "remote_vs_local": p.remote_vs_local(),
                    "round_trip_ms": p.round_trip.map(|s| s * 1e3),
                })
            })
            .collect();
        let value = serde_json::json!({
            "model": model_dir,
            "remote": args.remote.to_string(),
            "remote_layers": remote_layers,
            "rtt_ms": args.rtt_ms,
            "proxy_rtt_ms": link * 1e3,
            "by_streams": by_streams,
            "remote_vs_local": points.last().map(Point::remote_vs_local),
            "exposed_round_trips_1_stream": single.as_ref().map(|e| e.total),
            "exposed_by_relay_1_stream": single.as_ref().and_then(|e| e.relay),
            "exposed_by_compute_1_stream": single.as_ref().and_then(Exposed::compute),
            "worker_resident_bytes": worker_resident,
            "statistic": format!("best of {RUNS} runs for every figure"),
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench dispatch: {}, {} remote ({remote_layers} layers) at {} ms RTT ({threads} threads)",
        model_dir.display(),
        args.remote,
        args.rtt_ms,
    );
    println!(
        "injected round trip measured through the proxy: {:.2} ms (the RTT the figures divide by)",
        link * 1e3
    );
    println!(
        "worker resident after the runs: {:.1} MB (VmRSS: its experts' weights as stored, paged in, and the process)",
        worker_resident as f64 / 1e6
    );
    println!(
        "{:>8} {:>6} {:>12} {:>12} {:>16} {:>16} {:>14}",
        "streams",
        "micro",
        "local tok/s",
        "remote tok/s",
        "per stream tok/s",
        "remote_vs_local",
        "round trip ms"
    );
    for p in &points {
        println!(
            "{:>8} {:>6} {:>12.2} {:>12.2} {:>16.2} {:>16.3} {:>14}",
            p.streams,
            p.micro_batches,
            p.local,
            p.remote,
            p.remote / p.streams as f64,
            p.remote_vs_local(),
            p.round_trip
                .map_or("n/a".to_string(), |s| format!("{:.2}", s * 1e3))
        );
    }
    if let Some(e) = single {
        println!(
            "exposed round trips per step at 1 stream: {:.3} (target <= 1.05 with one remote layer)",
            e.total
        );
        if let (Some(relay), Some(compute)) = (e.relay, e.compute()) {
            println!(
                "  of which {relay:.3} in the requests' round trips beyond the injected RTT, \
                 {compute:.3} in the step's own compute taking longer than all local"
            );
        }
    }
    println!(
        "(best of {RUNS} runs for every figure) remote_vs_local target: >= 0.8 at 256 streams with '*:*' remote at 13 ms"
    );
    Ok(())
}

/// The resident memory of process `pid` (`VmRSS` of `/proc/PID/status`), in bytes.
fn resident_bytes(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse::<u64>().ok())
        .with_context(|| format!("{path} has no VmRSS line"))?;
    Ok(kib * 1024)
}
