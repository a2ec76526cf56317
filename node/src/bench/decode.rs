//! The decode benchmark. References measured in the same run: the memory-bandwidth bound
//! (bytes that must be read per token over this machine's measured read bandwidth) for
//! batch-1 decode, and the `gemm` crate on the expert kernel's shapes, both for f32 weights
//! and for the bf16 weights the `bench` preset stores (gemm gets them widened to f32). Every
//! batch size is reported with the same statistic: the best of `RUNS` runs. The gemm
//! reference is built only with the feature `bench-reference`, so that the production build
//! carries no gemm.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use kvasir_inference::config::Config;
use kvasir_inference::generate::{step, Pipeline, Sampling, Sequence};
use kvasir_inference::model::qwen_moe::{ForwardError, Model};
use kvasir_inference::moe::{ExpertExecutor, ExpertRequest, LocalExperts};
use rayon::prelude::*;

use crate::engine::load_local;

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
    timed_decode(model, batch, steps, |refs| step(model, experts, refs))
}

/// As `decode_rate`, each step split into `pipeline`'s micro-batches in flight at once.
pub(super) fn pipelined_rate(
    model: &Model,
    experts: &dyn ExpertExecutor,
    pipeline: &Pipeline,
    batch: usize,
    steps: usize,
) -> Result<f64> {
    timed_decode(model, batch, steps, |refs| {
        pipeline.step(model, experts, refs)
    })
}

/// Tokens per second of `steps` calls of `one_step` over `batch` fresh sequences, after an
/// untimed first step (the prefill).
fn timed_decode(
    model: &Model,
    batch: usize,
    steps: usize,
    mut one_step: impl FnMut(&mut [&mut Sequence]) -> Result<(), ForwardError>,
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
    one_step(&mut refs)?;
    let start = Instant::now();
    for _ in 0..steps {
        one_step(&mut refs)?;
    }
    Ok((batch * steps) as f64 / start.elapsed().as_secs_f64())
}

/// Best of `RUNS` runs, for every batch size alike: the machine's noise only slows a run.
const RUNS: usize = 3;

/// The highest `decode_rate` of `RUNS` runs.
fn best_rate(
    model: &Model,
    experts: &dyn ExpertExecutor,
    batch: usize,
    steps: usize,
) -> Result<f64> {
    let mut best = 0f64;
    for _ in 0..RUNS {
        best = best.max(decode_rate(model, experts, batch, steps)?);
    }
    Ok(best)
}

/// The expert kernel (`matmul_t`) and the `gemm` crate timed on one matrix product (made
/// only where the gemm reference is built).
#[cfg_attr(not(feature = "bench-reference"), allow(dead_code))]
struct KernelTiming {
    /// How the kernel's weights are stored; gemm always gets them widened to f32.
    dtype: &'static str,
    kernel: Duration,
    gemm: Duration,
}

/// The `gemm` crate as the reference for the expert kernel (feature `bench-reference`).
#[cfg(feature = "bench-reference")]
mod reference {
    use std::time::{Duration, Instant};

    use anyhow::{bail, Result};
    use kvasir_inference::kernels::cpu::matmul_t;
    use kvasir_inference::weights::Weight;

    use super::KernelTiming;

    /// The expert kernel on `weight` and `gemm` on the same values widened to f32:
    /// `rows x hidden` times `(width x hidden)^T`, alternated, best of 20 each (a slow spell of
    /// the machine falls on both alike).
    fn kernel_vs_gemm(rows: usize, weight: &Weight, dtype: &'static str) -> Result<KernelTiming> {
        let (width, hidden) = (weight.rows(), weight.cols());
        let x: Vec<f32> = (0..rows * hidden)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let w = weight.to_f32();
        let mut ours = vec![0f32; rows * width];
        let mut theirs = vec![0f32; rows * width];
        let timed = |f: &mut dyn FnMut()| {
            let start = Instant::now();
            f();
            start.elapsed()
        };
        let mut run_ours = || matmul_t(&x, rows, weight, &mut ours);
        let threads = rayon::current_num_threads();
        let mut run_gemm = || gemm_f32(rows, width, hidden, &x, &w, &mut theirs, threads);
        let (mut kernel, mut gemm) = (Duration::MAX, Duration::MAX);
        for _ in 0..20 {
            kernel = kernel.min(timed(&mut run_ours));
            gemm = gemm.min(timed(&mut run_gemm));
        }
        let max_diff = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        if max_diff >= 1e-3 {
            bail!("the {dtype} kernel and gemm disagree by {max_diff}");
        }
        Ok(KernelTiming {
            dtype,
            kernel,
            gemm,
        })
    }

    /// `out (rows x width) = x (rows x hidden) * w^T` for `w` of `width x hidden`, row-major.
    #[allow(unsafe_code)]
    fn gemm_f32(
        rows: usize,
        width: usize,
        hidden: usize,
        x: &[f32],
        w: &[f32],
        out: &mut [f32],
        threads: usize,
    ) {
        assert!(x.len() == rows * hidden && w.len() == width * hidden && out.len() == rows * width);
        // SAFETY: the lengths asserted above make every pointer cover its matrix: x is
        // rows x hidden (row-major), w^T is read as hidden x width with column stride
        // `hidden`, the output is rows x width; nothing else aliases `out`.
        unsafe {
            gemm::gemm(
                rows,
                width,
                hidden,
                out.as_mut_ptr(),
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
        }
    }

    /// The kernel against gemm on an expert's shapes (`hidden` in, `width` out) at `rows`
    /// rows: f32 weights, and the bf16 weights of the `bench` preset (the kernel widens them
    /// as it reads; gemm gets the same values widened beforehand).
    pub(super) fn compare(rows: usize, hidden: usize, width: usize) -> Result<Vec<KernelTiming>> {
        let values: Vec<f32> = (0..width * hidden)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 128.0)
            .collect();
        // The top half of each f32: a bf16 matrix of about the same values.
        let bits: Vec<u16> = values.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        Ok(vec![
            kernel_vs_gemm(rows, &Weight::from_f32(values, width, hidden), "f32")?,
            kernel_vs_gemm(rows, &Weight::from_bf16(&bits, width, hidden), "bf16")?,
        ])
    }
}

/// Without the `bench-reference` feature there is no gemm to compare with.
const NO_REFERENCE: &str = "kernel vs gemm not measured: built without the gemm reference (add --features bench-reference)";

/// Input rows of the kernel comparison.
const KERNEL_ROWS: usize = 64;

#[cfg(feature = "bench-reference")]
fn kernel_timings(config: &Config) -> Result<Option<Vec<KernelTiming>>> {
    reference::compare(
        KERNEL_ROWS,
        config.hidden_size,
        config.moe_intermediate_size,
    )
    .map(Some)
}

#[cfg(not(feature = "bench-reference"))]
fn kernel_timings(_: &Config) -> Result<Option<Vec<KernelTiming>>> {
    Ok(None)
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
    let mut rates = Vec::new();
    for batch in BATCHES {
        let steps = match batch {
            1 => args.tokens,
            512.. => 2,
            _ => 4,
        };
        rates.push((batch, steps, best_rate(&model, &experts, batch, steps)?));
    }
    let batch1 = rates[0].2;
    let moe_layers = config.moe_layers().count();
    let context = PROMPT_LEN + args.tokens / 2;
    let bytes_per_token = model.dense_bytes_per_token()
        + moe_layers * config.num_experts_per_tok * experts.expert_bytes()
        + model.cache_bytes_per_token(context);
    let bound = bandwidth / bytes_per_token as f64;
    let bandwidth_ratio = batch1 / bound;
    let kernels = kernel_timings(&config)?;
    let flops = 2.0 * (KERNEL_ROWS * config.hidden_size * config.moe_intermediate_size) as f64;
    let gflops = |time: Duration| flops / time.as_secs_f64() / 1e9;
    let ratio = |k: &KernelTiming| k.gemm.as_secs_f64() / k.kernel.as_secs_f64();

    if args.json {
        let mut value = serde_json::json!({
            "model": args.model,
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "bytes_per_token": bytes_per_token,
            "bound_tok_s": bound,
            "batch1_tok_s": batch1,
            "bandwidth_ratio": bandwidth_ratio,
            "statistic": format!("best of {RUNS} runs at every batch size"),
            "tok_s_by_batch": rates.iter().map(|(b, steps, r)| serde_json::json!({"batch": b, "steps": steps, "tok_s": r, "x_batch1": r / batch1})).collect::<Vec<_>>(),
        });
        match &kernels {
            Some(kernels) => {
                for k in kernels {
                    // The f32 figures keep their names; the bf16 ones carry a suffix.
                    let suffix = if k.dtype == "f32" { "" } else { "_bf16" };
                    value[format!("kernel{suffix}_gflops")] = gflops(k.kernel).into();
                    value[format!("gemm{suffix}_gflops")] = gflops(k.gemm).into();
                    value[format!("kernel_vs_gemm{suffix}")] = ratio(k).into();
                }
            }
            None => value["kernel_vs_gemm_note"] = NO_REFERENCE.into(),
        }
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
        "{:<40} {:>9.2} GB/s  1 GiB read on all cores, best of 3",
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
    for (batch, steps, rate) in &rates {
        println!(
            "{:<40} {:>8.2} tok/s  best of {RUNS} x {steps} steps; {:.1}x batch 1",
            format!("decode at batch {batch}"),
            rate,
            rate / batch1
        );
    }
    println!(
        "{:<40} {:>12.3}  batch-1 decode / bound; target >= 0.6",
        "bandwidth_ratio", bandwidth_ratio
    );
    let Some(kernels) = kernels else {
        println!("{NO_REFERENCE}");
        return Ok(());
    };
    for k in &kernels {
        println!(
            "{:<40} {:>8.2} GFLOP/s  gemm crate on the same values in f32: {:.2} GFLOP/s",
            format!(
                "expert kernel, {KERNEL_ROWS} x {} x {} {}",
                config.hidden_size, config.moe_intermediate_size, k.dtype
            ),
            gflops(k.kernel),
            gflops(k.gemm)
        );
        println!(
            "{:<40} {:>12.3}  target >= 0.8",
            format!("kernel_vs_gemm ({} weights)", k.dtype),
            ratio(k)
        );
    }
    Ok(())
}
