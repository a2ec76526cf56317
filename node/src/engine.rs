//! What every role that runs the model shares: loading a checkpoint (every expert, or a
//! slice on a chosen backend), the pin a genesis names a checkpoint by, the sampling flags,
//! and one generation with its printable result. (The model id the swarm agrees on is the
//! protocol's: `kvasir_wire::model_id`.)

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kvasir_api::generation::GenerationReport;
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::{generate, Sampling};
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::{ExpertExecutor, LocalExperts};
use kvasir_inference::tokenizer::Tokenizer;
use kvasir_ledger::genesis::{ModelPin, ModelShape};
use kvasir_ledger::hash::{merkle_root, Hash};

use crate::expert_evidence::{expert_leaves, Leaves};

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

    /// The backend a hello names, if it is one of these: every one of them gives the CPU
    /// kernels' bits (the CUDA backend is checked bit for bit against them), so a worker
    /// on any other could be honest and still answer other bits.
    pub fn named(name: &str) -> Option<Backend> {
        [Backend::Cpu, Backend::Cuda]
            .into_iter()
            .find(|b| b.name() == name)
    }
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

/// The identity a genesis `models` entry pins for the checkpoint in `dir` (a directory or a
/// GGUF file): its model id, the blake3 of its config (`read_checkpoint`), and the merkle
/// root over one leaf per expert (layer-major, ascending expert) of its gate, up and down
/// weights as stored (a GGUF file's quantized blocks as they are), with their dtypes
/// (`expert_evidence::Leaves::Tagged`). Reads every expert's bytes
/// once: on a frontier-size checkpoint this takes minutes, which a ledger node pays at start.
pub fn model_pin(dir: &Path) -> Result<ModelPin> {
    let (config_bytes, config, checkpoint) = read_checkpoint(dir)?;
    let (leaves, expert_bytes) = expert_leaves(&checkpoint, &config, Leaves::Tagged)?;
    Ok(ModelPin {
        id: kvasir_wire::model_id(dir)?,
        config_hash: config_hash(&config_bytes),
        experts_root: merkle_root(&leaves),
        name: pin_name(dir),
        shape: Some(ModelShape {
            layers: u16::try_from(config.num_hidden_layers).context("too many layers")?,
            experts: u16::try_from(config.num_experts).context("too many experts")?,
            expert_bytes,
        }),
        arithmetic: kvasir_inference::ARITHMETIC_VERSION,
    })
}

/// The pin a format-1 genesis holds for the checkpoint in `dir`: its model id, config hash and
/// the root over the leaves of format 1 (`Leaves::Untagged`), and nothing else. What a
/// format-1 ledger node checks its `--model` checkpoints against.
pub fn format_1_pin(dir: &Path) -> Result<ModelPin> {
    let (config_bytes, config, checkpoint) = read_checkpoint(dir)?;
    let (leaves, _) = expert_leaves(&checkpoint, &config, Leaves::Untagged)?;
    Ok(ModelPin {
        id: kvasir_wire::model_id(dir)?,
        config_hash: config_hash(&config_bytes),
        experts_root: merkle_root(&leaves),
        name: String::new(),
        shape: None,
        arithmetic: 0,
    })
}

/// A checkpoint's config bytes, the config, and the checkpoint: what a pin and evidence's
/// weights are made from. The config bytes are a directory's config.json as stored; a GGUF
/// file has none, so they are its metadata as this engine reads it, written as JSON
/// (`Config`'s serde fields in their order), which a validator parses like a config.json.
/// That rendering is part of what a pin of a GGUF file commits to: a release that renders
/// it otherwise proves nothing against an older pin, like a new arithmetic version.
pub(crate) fn read_checkpoint(dir: &Path) -> Result<(Vec<u8>, Config, Checkpoint)> {
    let config = Config::load(dir)?;
    let config_bytes = if kvasir_inference::gguf::is_gguf(dir) {
        serde_json::to_vec(&config).context("writing the GGUF file's config as JSON")?
    } else {
        let config_path = dir.join("config.json");
        std::fs::read(&config_path).with_context(|| format!("reading {}", config_path.display()))?
    };
    Ok((config_bytes, config, Checkpoint::open(dir)?))
}

fn config_hash(config_bytes: &[u8]) -> Hash {
    Hash(*blake3::hash(config_bytes).as_bytes())
}

/// The short name a pin gets from its checkpoint's directory: `model-small` is `small`,
/// `Qwen3.5-122B-A10B` is `qwen3.5-122b-a10b` (anything but [a-z0-9.-] becomes `-`; at most
/// 32 characters); a GGUF file is named by its file name without `.gguf`. `genesis.json` may
/// be edited to name it otherwise before the chain starts.
fn pin_name(dir: &Path) -> String {
    let base = if kvasir_inference::gguf::is_gguf(dir) {
        dir.file_stem()
    } else {
        dir.file_name()
    };
    let base = base
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let base = base.strip_prefix("model-").unwrap_or(&base);
    let name: String = base
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '.' | '-' => c,
            _ => '-',
        })
        .take(kvasir_ledger::genesis::MAX_MODEL_NAME_LEN)
        .collect();
    if name.is_empty() {
        "model".to_string()
    } else {
        name
    }
}

/// One generation from `prompt`: its report, as `generate` and `backbone` print it.
pub fn run_generation(
    model: &Model,
    tokenizer: &Tokenizer,
    experts: &dyn ExpertExecutor,
    prompt: &str,
    tokens: usize,
    sampling: Sampling,
) -> Result<GenerationReport> {
    if prompt.is_empty() {
        bail!("--prompt must not be empty");
    }
    let prompt_ids = tokenizer.encode(prompt)?;
    let start = Instant::now();
    let sequence = generate(model, experts, &prompt_ids, tokens, sampling)?;
    let generate_s = start.elapsed().as_secs_f64();
    let logits: Vec<u8> = sequence
        .last_logits()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let token_ids = sequence.generated().to_vec();
    Ok(GenerationReport {
        text: tokenizer.decode(&token_ids)?,
        tokens_per_s: token_ids.len() as f64 / generate_s,
        token_ids,
        prompt_ids,
        generate_s,
        logits_blake3: blake3::hash(&logits).to_hex().to_string(),
        load_s: None,
        backend: None,
        dispatch: None,
        audit: None,
    })
}

/// The tiny synthetic checkpoint, synthesized once per test binary: what unit tests that
/// need real weights run on.
#[cfg(test)]
pub(crate) fn tiny_checkpoint() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temp dir");
        let tiny = kvasir_inference::synth::preset("tiny").expect("the tiny preset");
        kvasir_inference::synth::synthesize(&dir.path().join("tiny"), tiny, |_, _| {})
            .expect("synthesizing tiny");
        dir
    });
    dir.path().join("tiny")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF file's pin. Its config, rendered as JSON, parses back to the very config the
    /// file gives, which is what a validator judges evidence with. And the pin itself is
    /// pinned: a change to how `Config` renders (a field added, renamed or reordered)
    /// changes every GGUF pin's config hash, and evidence against workers on chains that pin
    /// one could no longer be proven; such a change fails here first.
    #[test]
    fn a_gguf_pin_is_stable_and_its_config_parses_back() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../inference/tests/data/gguf/tiny-qwen3moe-q8_0.gguf");
        let (bytes, config, _) = read_checkpoint(&path).unwrap();
        let text = std::str::from_utf8(&bytes).unwrap();
        assert_eq!(Config::parse(text).unwrap(), config);
        let pin = model_pin(&path).unwrap();
        assert_eq!(
            (pin.config_hash.to_string(), pin.experts_root.to_string()),
            (
                "7a313d894553d3320b0a9d978ccfd2ac46e3d8b77abcadd1ecef076e8b884695".to_string(),
                "6f84945e7b75a065bea6b8a4438908f83834059b940519b36d40802c9968eba9".to_string()
            )
        );
        assert_eq!(pin.name, "tiny-qwen3moe-q8-0");
        assert_eq!(pin.arithmetic, kvasir_inference::ARITHMETIC_VERSION);
    }
}
