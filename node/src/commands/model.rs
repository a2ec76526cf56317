//! `kvasir-node model synth|pin|quantize|compare|inspect` and `kvasir-node generate`: the inference engine on
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
    /// How far a model (a quantized GGUF file, say) strays from a reference (its bf16
    /// checkpoint), in llama.cpp's perplexity tool's terms: both teacher-forced over the same
    /// tokens, the mean and largest KL divergence of its next-token distribution from the
    /// reference's, top-1 agreement (overall, and where the reference's top two logits are
    /// `--margin` apart), and the logits' cosine. Both must share a vocabulary.
    Compare {
        /// The model measured: checkpoint directory or GGUF file.
        #[arg(long)]
        model: PathBuf,
        /// The model it is measured against.
        #[arg(long)]
        reference: PathBuf,
        /// The text both read, tokenized by the reference's tokenizer (default: the synthetic
        /// checkpoints' training corpus).
        #[arg(long)]
        text: Option<String>,
        /// At most this many of its tokens.
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(2..=8192))]
        tokens: u64,
        /// A position counts as decided when the reference's top two logits are this far apart.
        #[arg(long, default_value_t = 0.5)]
        margin: f32,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
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
    /// a GGUF file of qwen3moe, qwen2moe or qwen35moe (the first file of a split one) with F32,
    /// F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K or Q6_K tensors, its tokenizer in its metadata or in
    /// a tokenizer.json beside it.
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
        ModelCommand::Compare {
            model,
            reference,
            text,
            tokens,
            margin,
            json,
        } => compare(
            &model,
            &reference,
            text.as_deref(),
            tokens as usize,
            margin,
            json,
        ),
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

/// `model compare`: both models teacher-forced over the reference's tokens of `text`.
fn compare(
    model: &std::path::Path,
    reference: &std::path::Path,
    text: Option<&str>,
    tokens: usize,
    margin: f32,
    json: bool,
) -> Result<()> {
    let text = text.unwrap_or(kvasir_inference::synth::CORPUS);
    let (ref_model, ref_experts, tokenizer) = crate::engine::load_local(reference)
        .with_context(|| format!("loading {}", reference.display()))?;
    let (candidate, experts, candidate_tokenizer) =
        crate::engine::load_local(model).with_context(|| format!("loading {}", model.display()))?;
    let vocab = (ref_model.config().vocab_size, candidate.config().vocab_size);
    if vocab.0 != vocab.1 {
        bail!(
            "the reference has {} tokens and the model {}: they do not share a vocabulary",
            vocab.0,
            vocab.1
        );
    }
    let mut ids = tokenizer.encode(text)?;
    // Logits compare token by token only where both models read the same tokens.
    if candidate_tokenizer.encode(text)? != ids {
        bail!("the reference's and the model's tokenizers split the text differently: they do not share a vocabulary");
    }
    ids.truncate(tokens);
    if ids.len() < 2 {
        bail!("the text is {} tokens; at least 2 are compared", ids.len());
    }
    let start = Instant::now();
    let agreement = kvasir_inference::agreement::compare(
        (&ref_model, &ref_experts),
        (&candidate, &experts),
        &ids,
        margin,
    )?
    .context("the two models' logits do not pair")?;
    if json {
        println!("{}", serde_json::to_string(&agreement)?);
        return Ok(());
    }
    let a = &agreement;
    let share = |n: usize, of: usize| 100.0 * n as f64 / of.max(1) as f64;
    println!(
        "{} against {}, {} tokens teacher-forced ({:.1} s)",
        model.display(),
        reference.display(),
        a.positions,
        start.elapsed().as_secs_f64()
    );
    println!(
        "KL divergence: mean {:.6}, max {:.6} nats",
        a.mean_kl, a.max_kl
    );
    println!(
        "top-1 agreement: {:.2}% ({}/{}); where the reference's margin >= {margin}: {:.2}% ({}/{})",
        share(a.top1_same, a.positions),
        a.top1_same,
        a.positions,
        share(a.decided_same, a.decided),
        a.decided_same,
        a.decided
    );
    println!("logits cosine: mean {:.6}", a.mean_cosine);
    Ok(())
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
