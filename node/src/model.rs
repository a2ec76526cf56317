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
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Where the experts run: cpu, or cuda (GPU 0; needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Print one JSON object with token ids and timings.
    #[arg(long)]
    json: bool,
}

/// How many tokens, and how they are picked: shared by `generate` and `backbone`.
#[derive(clap::Args, Clone, Copy)]
pub struct SamplingArgs {
    /// Tokens to generate.
    #[arg(long, default_value_t = 32)]
    pub tokens: usize,
    /// 0 is greedy; above 0, seeded sampling at this temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            seed: self.seed,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
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

/// The experts `keep` selects, on the chosen backend; only their weights are read.
pub fn load_experts(
    dir: &Path,
    backend: Backend,
    keep: impl Fn(usize, usize) -> bool,
) -> Result<Box<dyn ExpertExecutor + Send>> {
    let config = Config::load(dir)?;
    let checkpoint = Checkpoint::open(dir)?;
    match backend {
        Backend::Cpu => Ok(Box::new(LocalExperts::load(&checkpoint, &config, keep)?)),
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            use kvasir_inference::kernels::cuda::CudaExperts;
            Ok(Box::new(CudaExperts::load(&checkpoint, &config, 0, keep)?))
        }
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => {
            let _ = keep;
            bail!("this kvasir-node was built without CUDA; rebuild with --features cuda")
        }
    }
}

/// What identifies a model to the swarm: workers and backbone must agree on it. The hash of
/// config.json and of the tensors' layout (names, shapes, dtypes, offsets).
pub fn model_id(dir: &Path) -> Result<String> {
    let mut hasher = blake3::Hasher::new();
    let config = dir.join("config.json");
    hasher
        .update(&std::fs::read(&config).with_context(|| format!("reading {}", config.display()))?);
    hasher.update(Checkpoint::open(dir)?.layout().as_bytes());
    Ok(hasher.finalize().to_hex()[..32].to_string())
}

/// A generation's result, printed the same way by `generate` and `backbone`.
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub seconds: f64,
    /// blake3 of the last step's logits as little-endian f32 bytes: equal hashes, equal bits.
    pub logits_blake3: String,
}

pub fn run_generation(
    model: &Model,
    tokenizer: &Tokenizer,
    experts: &dyn ExpertExecutor,
    prompt: &str,
    tokens: usize,
    sampling: Sampling,
) -> Result<Generation> {
    if prompt.is_empty() {
        bail!("--prompt must not be empty");
    }
    let prompt_ids = tokenizer.encode(prompt)?;
    let start = Instant::now();
    let sequence = generate(model, experts, &prompt_ids, tokens, sampling)?;
    let seconds = start.elapsed().as_secs_f64();
    let logits: Vec<u8> = sequence
        .last_logits()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    Ok(Generation {
        text: tokenizer.decode(sequence.generated())?,
        token_ids: sequence.generated().to_vec(),
        prompt_ids,
        seconds,
        logits_blake3: blake3::hash(&logits).to_hex().to_string(),
    })
}

impl Generation {
    /// The JSON object scripts read, with `extra` fields merged in.
    pub fn to_json(&self, extra: serde_json::Value) -> serde_json::Value {
        let mut value = serde_json::json!({
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "generate_s": self.seconds,
            "tokens_per_s": self.token_ids.len() as f64 / self.seconds,
            "logits_blake3": self.logits_blake3,
        });
        if let (Some(map), serde_json::Value::Object(more)) = (value.as_object_mut(), extra) {
            map.extend(more);
        }
        value
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
    let experts = load_experts(&args.model, args.backend, |_, _| true).with_context(loading)?;
    let load_s = start.elapsed().as_secs_f64();
    let sampling = args.sampling.sampling();
    let generation = run_generation(
        &model,
        &tokenizer,
        experts.as_ref(),
        &args.prompt,
        args.sampling.tokens,
        sampling,
    )?;
    if args.json {
        let backend = format!("{:?}", args.backend).to_lowercase();
        let extra = serde_json::json!({"load_s": load_s, "backend": backend});
        println!("{}", generation.to_json(extra));
    } else {
        println!("{}{}", args.prompt, generation.text);
    }
    Ok(())
}
