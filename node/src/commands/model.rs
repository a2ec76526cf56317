//! `kvasir-node model synth|pin|quantize|inspect` and `kvasir-node generate`: the inference engine on
//! the command line, all experts local.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::synth::{preset, synthesize};
use kvasir_inference::tokenizer::Tokenizer;

use crate::engine::{load_experts, model_pin, run_generation, Backend, SamplingArgs};
use kvasir_wire::spec::ExpertSpec;

#[derive(clap::Subcommand)]
pub enum ModelCommand {
    /// Write a synthetic checkpoint in the Hugging Face format (config.json,
    /// model.safetensors, tokenizer.json); the same preset gives the same bytes.
    Synth {
        /// Directory to write into.
        #[arg(long)]
        out: PathBuf,
        /// tiny, tiny-qwen2 or small.
        #[arg(long, default_value = "small")]
        preset: String,
    },
    /// Print the checkpoint's identity as a genesis `models` entry (JSON): its model id, the
    /// blake3 of config.json and the root over its experts' weight hashes.
    Pin {
        /// Checkpoint directory.
        #[arg(long)]
        model: PathBuf,
    },
    /// Write a Hugging Face checkpoint (Qwen3-MoE or Qwen2-MoE) as a GGUF file that llama.cpp
    /// loads: matrices quantized as llama.cpp's reference quantizers do (routers, norms and
    /// rows not of whole blocks kept as stored), its tokenizer in the metadata. The same
    /// checkpoint gives the same bytes.
    Quantize {
        /// Checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// The GGUF file to write.
        #[arg(long)]
        out: PathBuf,
        /// q8_0, or q4_0 (its output head in Q8_0).
        #[arg(long = "type", default_value = "q8_0")]
        preset: kvasir_inference::gguf::write::Preset,
    },
    /// What an operator reads before offering capacity: family, model id, layers by kind,
    /// experts, bytes per expert and the share of the weights in experts, and with
    /// `--experts` the bytes a worker serving that slice holds.
    Inspect {
        /// Checkpoint directory, or a GGUF file (`*.gguf`, qwen3moe or qwen2moe).
        #[arg(long)]
        model: PathBuf,
        /// A slice, `LAYERS:EXPERTS` items (`*:0-63`).
        #[arg(long)]
        experts: Option<ExpertSpec>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Checkpoint directory (config.json, model.safetensors[.index.json], tokenizer.json), or
    /// a GGUF file of qwen3moe or qwen2moe with F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K or Q6_K tensors and a
    /// tokenizer.json beside it.
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Where the experts run: cpu, or cuda (GPU 0; needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Print one JSON object with token ids and timings.
    #[arg(long)]
    json: bool,
}

pub fn run(command: ModelCommand) -> Result<()> {
    match command {
        ModelCommand::Synth { out, preset } => synth(&out, &preset),
        ModelCommand::Pin { model } => {
            let pin = model_pin(&model)
                .with_context(|| format!("reading the checkpoint in {}", model.display()))?;
            println!("{}", serde_json::to_string_pretty(&pin)?);
            Ok(())
        }
        ModelCommand::Quantize { model, out, preset } => {
            let start = Instant::now();
            let written = kvasir_inference::gguf::write::quantize(&model, &out, preset)
                .with_context(|| format!("writing {} as {}", model.display(), out.display()))?;
            println!(
                "wrote {} ({} tensors, {} quantized as {preset:?}; {:.1} MB) in {:.1} s",
                out.display(),
                written.tensors,
                written.quantized,
                written.bytes as f64 / 1e6,
                start.elapsed().as_secs_f64()
            );
            Ok(())
        }
        ModelCommand::Inspect {
            model,
            experts,
            json,
        } => {
            let report = super::inspect::report(&model, experts.as_ref())?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!("{}", super::inspect::text(&report));
            }
            Ok(())
        }
    }
}

fn synth(out: &std::path::Path, name: &str) -> Result<()> {
    let preset = preset(name)?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("synthesizing {bar:40} {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    synthesize(out, preset, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    println!(
        "wrote the {} checkpoint ({}) to {}",
        preset.name,
        preset.about,
        out.display()
    );
    Ok(())
}

pub fn generate_command(args: GenerateArgs) -> Result<()> {
    if args.prompt.is_empty() {
        bail!("--prompt must not be empty");
    }
    let start = Instant::now();
    let loading = || format!("loading {}", args.model.display());
    let config = Config::load(&args.model).with_context(loading)?;
    let checkpoint = Checkpoint::open(&args.model).with_context(loading)?;
    let model = Model::load(&checkpoint, config).with_context(loading)?;
    let tokenizer = Tokenizer::load(&args.model).with_context(loading)?;
    let experts = load_experts(&args.model, args.backend, |_, _| true).with_context(loading)?;
    let load_s = start.elapsed().as_secs_f64();
    let sampling = args.sampling.sampling();
    let mut generation = run_generation(
        &model,
        &tokenizer,
        experts.as_ref(),
        &args.prompt,
        args.sampling.tokens,
        sampling,
    )?;
    if args.json {
        generation.load_s = Some(load_s);
        generation.backend = Some(args.backend.name().to_string());
        println!("{}", serde_json::to_string(&generation)?);
    } else {
        println!("{}{}", args.prompt, generation.text);
    }
    Ok(())
}
