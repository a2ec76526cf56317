//! `kvasir-node model synth` and `kvasir-node generate`: the inference engine on the
//! command line, all experts local.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::{generate, Sampling};
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::{ExpertExecutor, LocalExperts};
use kvasir_inference::synth::{preset, synthesize};
use kvasir_inference::tokenizer::Tokenizer;

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
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Checkpoint directory (config.json, model.safetensors[.index.json], tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// 0 is greedy; above 0, seeded sampling at this temperature.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where the experts run: cpu, or cuda (GPU 0; needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Print one JSON object with token ids and timings.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Cpu,
    Cuda,
}

pub fn synth(command: ModelCommand) -> Result<()> {
    let ModelCommand::Synth { out, preset: name } = command;
    let preset = preset(&name)?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("synthesizing {bar:40} {pos}/{len} tensors")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    synthesize(&out, preset, |done, total| {
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

/// The model with every expert held locally.
pub fn load_local(dir: &Path) -> Result<(Model, LocalExperts, Tokenizer)> {
    let config = Config::load(dir)?;
    let checkpoint = Checkpoint::open(dir)?;
    let experts = LocalExperts::load(&checkpoint, &config, |_, _| true)?;
    let model = Model::load(&checkpoint, config)?;
    let tokenizer = Tokenizer::load(dir)?;
    Ok((model, experts, tokenizer))
}

/// Every expert on the chosen backend.
fn load_experts(dir: &Path, backend: Backend) -> Result<Box<dyn ExpertExecutor>> {
    let config = Config::load(dir)?;
    let checkpoint = Checkpoint::open(dir)?;
    match backend {
        Backend::Cpu => Ok(Box::new(LocalExperts::load(
            &checkpoint,
            &config,
            |_, _| true,
        )?)),
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            use kvasir_inference::kernels::cuda::CudaExperts;
            Ok(Box::new(CudaExperts::load(
                &checkpoint,
                &config,
                0,
                |_, _| true,
            )?))
        }
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => {
            bail!("this kvasir-node was built without CUDA; rebuild with --features cuda")
        }
    }
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
    let experts = load_experts(&args.model, args.backend).with_context(loading)?;
    let load_s = start.elapsed().as_secs_f64();
    let prompt = tokenizer.encode(&args.prompt)?;
    let sampling = Sampling {
        temperature: args.temperature,
        seed: args.seed,
    };
    let start = Instant::now();
    let sequence = generate(&model, experts.as_ref(), &prompt, args.tokens, sampling)?;
    let seconds = start.elapsed().as_secs_f64();
    let text = tokenizer.decode(sequence.generated())?;
    if args.json {
        let value = serde_json::json!({
            "prompt_ids": prompt,
            "token_ids": sequence.generated(),
            "text": text,
            "load_s": load_s,
            "generate_s": seconds,
            "tokens_per_s": sequence.generated().len() as f64 / seconds,
            "backend": format!("{:?}", args.backend).to_lowercase(),
        });
        println!("{value}");
    } else {
        println!("{}{}", args.prompt, text);
    }
    Ok(())
}
