//! `kvasir-node bench serve`: `--clients` users at once, each streaming one completion from
//! the backbone's OpenAI-compatible API, against a swarm on loopback whose every expert is on
//! a worker behind an injected round trip (a TCP proxy of this harness between worker and
//! gateway, as in `bench dispatch`), next to the same load on a backbone with every expert
//! local, in one run. Real processes: hub, gateway, worker and both backbones. Figures:
//! aggregate tokens/s (all tokens over the wall time of the load), per-stream tokens/s (the
//! mean of each stream's tokens over its own time), and time to first token p50 and p99.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvasir_api::openai::Completion;
use kvasir_inference::synth::{preset, synthesize};

use super::dispatch::{delay_proxy, measured_rtt};
use kvasir_devnet::{current_exe, Loopback, Mode, Process};

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (default: the `small` preset, synthesized into a temp dir).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Round-trip time injected between worker and gateway, in milliseconds.
    #[arg(long, default_value_t = 13.0)]
    rtt_ms: f64,
    /// Clients streaming at once.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Tokens each client asks for.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Micro-batches of the backbone whose experts are remote (the backbone's
    /// `--micro-batches`, by default its default); the all-local one runs one, its best
    /// (nothing to hide).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    micro_batches: Option<u16>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// One client's stream: when its first token and its end arrived, and how many tokens.
struct Stream {
    first: Duration,
    total: Duration,
    tokens: usize,
}

struct Load {
    wall: Duration,
    streams: Vec<Stream>,
}

impl Load {
    fn aggregate(&self) -> f64 {
        self.streams.iter().map(|s| s.tokens).sum::<usize>() as f64 / self.wall.as_secs_f64()
    }

    fn per_stream(&self) -> f64 {
        let rates: f64 = self
            .streams
            .iter()
            .map(|s| s.tokens as f64 / s.total.as_secs_f64())
            .sum();
        rates / self.streams.len() as f64
    }

    /// Time to first token at quantile `q`.
    fn first_token(&self, q: f64) -> Duration {
        let mut firsts: Vec<Duration> = self.streams.iter().map(|s| s.first).collect();
        firsts.sort();
        firsts[((firsts.len() - 1) as f64 * q).round() as usize]
    }
}

/// One streamed completion: POSTs it, reads its events to `[DONE]`.
fn stream_one(addr: SocketAddr, prompt: &str, tokens: usize) -> Result<Stream> {
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let start = Instant::now();
    let mut socket = TcpStream::connect(addr)?;
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut reader = BufReader::new(socket);
    let (mut first, mut generated) = (None, None);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            bail!("the stream ended before [DONE]");
        }
        let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: Completion =
            serde_json::from_str(data).with_context(|| format!("an event: {data}"))?;
        first.get_or_insert_with(|| start.elapsed());
        if let Some(usage) = chunk.usage {
            generated = Some(usage.completion_tokens);
        }
    }
    Ok(Stream {
        first: first.context("no event before [DONE]")?,
        total: start.elapsed(),
        tokens: generated.context("no usage in the stream")?,
    })
}

/// `clients` streams at once against the backbone at `addr`.
fn load(addr: SocketAddr, clients: usize, tokens: usize) -> Result<Load> {
    let start = Instant::now();
    let streams = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                scope.spawn(move || {
                    stream_one(addr, &format!("Client {i} asks about experts"), tokens)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a client thread panicked"))
            })
            .collect::<Result<Vec<_>>>()
    })?;
    Ok(Load {
        wall: start.elapsed(),
        streams,
    })
}

/// A backbone serving `--listen`, with `remote` experts dispatched through `hub`.
fn backbone(
    model: &str,
    hub: SocketAddr,
    key: &str,
    remote: &str,
    clients: usize,
    micro_batches: Option<u16>,
) -> Result<(Process, SocketAddr)> {
    let clients = clients.to_string();
    let mut args = [
        "backbone",
        "--model",
        model,
        "--hub",
        &format!("ws://{hub}"),
        "--key",
        key,
        "--remote",
        remote,
        "--listen",
        "127.0.0.1:0",
        "--max-batch",
        &clients,
        "--max-queued",
        &clients,
        "--max-connections",
        "65536",
        "--wait-ms",
        "60000",
        "--dispatch-timeout-ms",
        "60000",
        "--audit-rate",
        "0",
        "--probation",
        "0",
    ]
    .map(String::from)
    .to_vec();
    if let Some(micro_batches) = micro_batches {
        args.extend(["--micro-batches".into(), micro_batches.to_string()]);
    }
    let mut child = Process::start(&current_exe()?, &args, Mode::Product)?;
    let addr = child.listening("backbone")?;
    Ok((child, addr))
}

pub fn run(args: Args) -> Result<()> {
    if args.clients == 0 || args.tokens == 0 {
        bail!("--clients and --tokens must be positive");
    }
    let scratch = tempfile::tempdir()?;
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            let dir = scratch.path().join("small");
            synthesize(&dir, preset("small")?, |_, _| {})?;
            dir
        }
    };
    let model = model_dir.display().to_string();
    let mut swarm = Loopback::on_dev_chain(scratch.path())?;
    let rtt = Duration::from_secs_f64(args.rtt_ms / 1e3);
    let proxy = std::net::TcpListener::bind("127.0.0.1:0")?;
    let proxy_port = proxy.local_addr()?.port();
    let gateway = swarm.gateway_addr;
    std::thread::spawn(move || delay_proxy(proxy, gateway, rtt / 2));
    let link_rtt = measured_rtt(rtt / 2)?;
    swarm.add_worker(
        &model_dir,
        "*:*",
        &Loopback::swarm_url(proxy_port),
        &scratch.path().join("worker.key"),
        "cpu",
        &[],
    )?;
    let key = scratch.path().join("backbone.key");
    kvasir_keyfile::write(&key, &swarm.backbone, None)?;
    let key = key.display().to_string();
    // All local: the same backbone with no expert remote (the selection names no layer).
    let local = {
        let (_child, addr) = backbone(&model, swarm.hub_addr, &key, "65535:0", args.clients, None)?;
        load(addr, 1, 2)?;
        load(addr, args.clients, args.tokens)?
    };
    let remote = {
        let (_child, addr) = backbone(
            &model,
            swarm.hub_addr,
            &key,
            "*:*",
            args.clients,
            args.micro_batches,
        )?;
        load(addr, 1, 2)?;
        load(addr, args.clients, args.tokens)?
    };
    swarm.check()?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ratio = remote.aggregate() / local.aggregate();
    if args.json {
        let figures = |l: &Load| {
            serde_json::json!({
                "aggregate_tok_s": l.aggregate(), "per_stream_tok_s": l.per_stream(),
                "ttft_p50_ms": ms(l.first_token(0.5)), "ttft_p99_ms": ms(l.first_token(0.99)),
            })
        };
        let value = serde_json::json!({
            "model": model, "clients": args.clients, "tokens": args.tokens,
            "rtt_ms": args.rtt_ms, "proxy_rtt_ms": ms(link_rtt),
            "remote": figures(&remote), "local": figures(&local),
            "remote_vs_local": ratio,
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench serve: {model}, {} clients x {} tokens, every expert remote at {:.2} ms RTT (measured), vs all local",
        args.clients,
        args.tokens,
        ms(link_rtt)
    );
    println!("{:<26} {:>12} {:>12}", "figure", "remote", "local");
    println!(
        "{:<26} {:>12.1} {:>12.1}",
        "aggregate tok/s",
        remote.aggregate(),
        local.aggregate()
    );
    println!(
        "{:<26} {:>12.2} {:>12.2}",
        "per-stream tok/s",
        remote.per_stream(),
        local.per_stream()
    );
    for (name, q) in [
        ("time to first token p50", 0.5),
        ("time to first token p99", 0.99),
    ] {
        println!(
            "{:<26} {:>9.1} ms {:>9.1} ms",
            name,
            ms(remote.first_token(q)),
            ms(local.first_token(q))
        );
    }
    println!("{:<26} {:>12.3}", "remote_vs_local", ratio);
    Ok(())
}
