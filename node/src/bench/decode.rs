//! The decode benchmark. References measured in the same run: the memory-bandwidth bound
//! (bytes that must be read per token over this machine's measured read bandwidth) for
//! batch-1 decode, and the `gemm` crate on the expert kernel's shapes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvasir_inference::config::Config;
use kvasir_inference::generate::{step, Sampling, Sequence};
use kvasir_inference::kernels::cpu::matmul_t;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::{ExpertExecutor, ExpertRequest, LocalExperts};
use kvasir_inference::weights::Weight;
use rayon::prelude::*;

use crate::model::load_local;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint directory (the `bench` preset is sized for this: `model synth --preset bench`).
    #[arg(long)]
    model: PathBuf,
    /// Decode steps timed at batch 1.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

const PROMPT_LEN: usize = 8;
const BATCHES: [usize; 4] = [1, 8, 64, 512];

/// Read bandwidth of this machine on all cores: best of three passes over 1 GiB.
fn read_bandwidth() -> f64 {
    let words: Vec<u64> = (0..(1usize << 27))
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        let sum: u64 = words
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, b| a.wrapping_add(*b)))
            .sum();
        std::hint::black_box(sum);
        best = best.min(start.elapsed().as_secs_f64());
    }
    (words.len() * 8) as f64 / best
}

fn prompt(seed: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((seed * 7919 + i * 104_729) % (vocab - 1) + 1) as u32)
        .collect()
}

/// Evaluates every expert once, so the timed steps find all the memory-mapped weights paged
/// in: a short decode routes to only some experts, and a page fault costs more than its read.
fn page_in(experts: &LocalExperts, config: &Config) -> Result<()> {
    for layer in config.moe_layers() {
        let requests: Vec<ExpertRequest> = (0..config.num_experts)
            .map(|expert| ExpertRequest {
                expert,
                tokens: vec![0],
                rows: vec![0.0; config.hidden_size],
            })
            .collect();
        experts.evaluate(layer, &requests)?;
    }
    Ok(())
}

/// Tokens per second over `steps` decode steps of `batch` sequences (prefill not timed).
pub(super) fn decode_rate(
    model: &Model,
    experts: &dyn ExpertExecutor,
    batch: usize,
    steps: usize,
) -> Result<f64> {
    let vocab = model.config().vocab_size;
    let mut sequences: Vec<Sequence> = (0..batch)
        .map(|s| {
            Sequence::new(
                model,
                &prompt(s, PROMPT_LEN, vocab),
                steps + 1,
                Sampling::GREEDY,
            )
        })
        .collect();
    let mut refs: Vec<&mut Sequence> = sequences.iter_mut().collect();
    step(model, experts, &mut refs)?;
    let start = Instant::now();
    for _ in 0..steps {
        step(model, experts, &mut refs)?;
    }
    Ok((batch * steps) as f64 / start.elapsed().as_secs_f64())
}

/// The expert kernel (`matmul_t`, f32 weights) and `gemm` on the same shapes: rows x hidden
/// times (width x hidden)^T. Returns the best time of each.
fn kernel_vs_gemm(rows: usize, hidden: usize, width: usize) -> (Duration, Duration) {
    let x: Vec<f32> = (0..rows * hidden)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let w: Vec<f32> = (0..width * hidden)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 128.0)
        .collect();
    let weight = Weight::from_f32(w.clone(), width, hidden);
    let mut ours = vec![0f32; rows * width];
    let mut theirs = vec![0f32; rows * width];
    let timed = |f: &mut dyn FnMut()| {
        let start = Instant::now();
        f();
        start.elapsed()
    };
    let mut run_ours = || matmul_t(&x, rows, &weight, &mut ours);
    let threads = rayon::current_num_threads();
    let mut run_gemm = || unsafe {
        // Safety: every pointer covers its matrix: x is rows x hidden (row-major), w^T is
        // read as hidden x width with column stride `hidden`, the output is rows x width.
        gemm::gemm(
            rows,
            width,
            hidden,
            theirs.as_mut_ptr(),
            1,
            width as isize,
            false,
            x.as_ptr(),
            1,
            hidden as isize,
            w.as_ptr(),
            hidden as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(threads),
        )
    };
    // Alternated, best of 20 each: a slow spell of the machine falls on both alike.
    let (mut ours_time, mut gemm_time) = (Duration::MAX, Duration::MAX);
    for _ in 0..20 {
        ours_time = ours_time.min(timed(&mut run_ours));
        gemm_time = gemm_time.min(timed(&mut run_gemm));
    }
    let max_diff = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max_diff < 1e-3, "kernel and gemm disagree by {max_diff}");
    (ours_time, gemm_time)
}

pub fn run(args: Args) -> Result<()> {
    let (model, experts, _) = load_local(&args.model)?;
    let config = model.config().clone();
    if config.vocab_size < 2 {
        bail!("the model's vocabulary is too small to benchmark");
    }
    let bandwidth = read_bandwidth();
    page_in(&experts, &config)?;
    decode_rate(&model, &experts, 1, 4)?;
    // Best of three, as the bandwidth it is compared with: the machine's noise only slows.
    let mut batch1 = 0f64;
    for _ in 0..3 {
        batch1 = batch1.max(decode_rate(&model, &experts, 1, args.tokens)?);
    }
    let moe_layers = config.moe_layers().count();
    let context = PROMPT_LEN + args.tokens / 2;
    let kv_bytes =
        config.num_hidden_layers * 2 * context * config.num_key_value_heads * config.head_dim() * 4;
    let bytes_per_token = model.dense_bytes_per_token()
        + moe_layers * config.num_experts_per_tok * experts.expert_bytes()
        + kv_bytes;
    let bound = bandwidth / bytes_per_token as f64;
    let bandwidth_ratio = batch1 / bound;
    let mut rates = vec![(1usize, batch1)];
    for batch in BATCHES.into_iter().skip(1) {
        let steps = if batch >= 512 { 2 } else { 4 };
        rates.push((batch, decode_rate(&model, &experts, batch, steps)?));
    }
    let (ours, gemm_time) = kernel_vs_gemm(64, config.hidden_size, config.moe_intermediate_size);
    let kernel_ratio = gemm_time.as_secs_f64() / ours.as_secs_f64();
    let flops = 2.0 * 64.0 * config.hidden_size as f64 * config.moe_intermediate_size as f64;

    if args.json {
        let value = serde_json::json!({
            "model": args.model,
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "bytes_per_token": bytes_per_token,
            "bound_tok_s": bound,
            "batch1_tok_s": batch1,
            "bandwidth_ratio": bandwidth_ratio,
            "tok_s_by_batch": rates.iter().map(|(b, r)| serde_json::json!({"batch": b, "tok_s": r, "x_batch1": r / batch1})).collect::<Vec<_>>(),
            "kernel_gflops": flops / ours.as_secs_f64() / 1e9,
            "gemm_gflops": flops / gemm_time.as_secs_f64() / 1e9,
            "kernel_vs_gemm": kernel_ratio,
        });
        println!("{value}");
        return Ok(());
    }
    println!(
        "kvasir-node bench decode: {} ({} threads)",
        args.model.display(),
        rayon::current_num_threads()
    );
    println!("{:<40} {:>12}  reference", "figure", "value");
    println!(
        "{:<40} {:>9.2} GB/s  1 GiB read on all cores",
        "read bandwidth",
        bandwidth / 1e9
    );
    println!(
        "{:<40} {:>9.1} MB    active weights + KV cache",
        "bytes read per token",
        bytes_per_token as f64 / 1e6
    );
    println!(
        "{:<40} {:>8.2} tok/s  bandwidth / bytes per token",
        "memory-bandwidth bound", bound
    );
    println!(
        "{:<40} {:>8.2} tok/s  best of 3 x {} steps",
        "batch-1 decode", batch1, args.tokens
    );
    println!(
        "{:<40} {:>12.3}  target >= 0.6",
        "bandwidth_ratio", bandwidth_ratio
    );
    for (batch, rate) in &rates {
        println!(
            "{:<40} {:>8.2} tok/s  {:.1}x batch 1",
            format!("decode at batch {batch}"),
            rate,
            rate / batch1
        );
    }
    println!(
        "{:<40} {:>8.2} GFLOP/s  gemm crate {:.2} GFLOP/s",
        format!(
            "expert kernel, 64 x {} x {} f32",
            config.hidden_size, config.moe_intermediate_size
        ),
        flops / ours.as_secs_f64() / 1e9,
        flops / gemm_time.as_secs_f64() / 1e9
    );
    println!(
        "{:<40} {:>12.3}  target >= 0.8",
        "kernel_vs_gemm", kernel_ratio
    );
    Ok(())
}
