//! `kvasir-node model inspect`: a checkpoint's shape as an operator needs it before offering
//! capacity on the market: its family and model id, which layers route to experts, how many
//! experts, the bytes of one and the share of the weights they hold, and (with `--experts`)
//! the bytes a worker serving that slice holds. Reads config.json and the safetensors headers
//! only, so it is instant on a frontier-size checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use kvasir_api::reports::{ModelReport, SliceReport};
use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::{Config, Mixer};
use kvasir_inference::gguf::{is_gguf, split};

use kvasir_wire::model_id;
use kvasir_wire::spec::ExpertSpec;

/// `(layer, expert)` of a tensor named `model.layers.L.mlp.experts.E.…`.
fn expert_of(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("mlp.experts.")?;
    let (expert, _) = rest.split_once('.')?;
    Some((layer.parse().ok()?, expert.parse().ok()?))
}

/// The report of the checkpoint at `path`: a Hugging Face directory or a GGUF file.
pub fn report(path: &Path, slice: Option<&ExpertSpec>) -> Result<ModelReport> {
    let reading = || format!("reading the checkpoint in {}", path.display());
    let weights = if is_gguf(path) {
        gguf_weights(path)
    } else {
        safetensors_weights(path)
    }
    .with_context(reading)?;
    Ok(summary(model_id(path)?, weights, slice))
}

/// What a report is made of: the config, the bytes of each expert, of everything, and of what
/// the engine leaves out.
struct Weights {
    config: Config,
    per_expert: BTreeMap<(usize, usize), u64>,
    total_bytes: u64,
    skipped_bytes: u64,
}

fn safetensors_weights(dir: &Path) -> Result<Weights> {
    let config = Config::load(dir)?;
    let checkpoint = Checkpoint::open(dir)?;
    let mut per_expert: BTreeMap<(usize, usize), u64> = BTreeMap::new();
    let mut total_bytes = 0u64;
    for (name, bytes) in checkpoint.tensor_sizes() {
        total_bytes += bytes;
        if let Some(key) = expert_of(name) {
            *per_expert.entry(key).or_default() += bytes;
        }
    }
    Ok(Weights {
        config,
        per_expert,
        total_bytes,
        skipped_bytes: checkpoint.skipped_bytes(),
    })
}

/// A GGUF file stacks each layer's experts in one tensor per matrix (`ffn_*_exps`): each
/// expert holds an equal share of its bytes. A split model's tensors are in all its parts.
fn gguf_weights(path: &Path) -> Result<Weights> {
    let parts = split::open(path)?;
    let config = kvasir_inference::gguf::config::of_parts(&parts)?;
    let tensors = || parts.iter().flat_map(|part| &part.header().tensors);
    let mut per_expert: BTreeMap<(usize, usize), u64> = BTreeMap::new();
    for layer in config.moe_layers() {
        for part in ["gate", "up", "down"] {
            let name = format!("blk.{layer}.ffn_{part}_exps.weight");
            let Some(tensor) = tensors().find(|t| t.name == name) else {
                anyhow::bail!("tensor {name} is missing");
            };
            let share = tensor.byte_len() / config.num_experts.max(1) as u64;
            for expert in 0..config.num_experts {
                *per_expert.entry((layer, expert)).or_default() += share;
            }
        }
    }
    Ok(Weights {
        config,
        per_expert,
        total_bytes: tensors().map(|t| t.byte_len()).sum(),
        skipped_bytes: 0,
    })
}

fn summary(model_id: String, weights: Weights, slice: Option<&ExpertSpec>) -> ModelReport {
    let Weights {
        config,
        per_expert,
        total_bytes,
        skipped_bytes,
    } = weights;
    let moe_layers: Vec<usize> = config.moe_layers().collect();
    let expert_bytes: u64 = per_expert.values().sum();
    let slice = slice.map(|spec| {
        let chosen: Vec<u64> = spec
            .resolve(&config)
            .into_iter()
            .filter_map(|(l, e)| per_expert.get(&(usize::from(l), usize::from(e))).copied())
            .collect();
        SliceReport {
            experts: spec.to_string(),
            count: chosen.len(),
            bytes: chosen.iter().sum(),
        }
    });
    ModelReport {
        model_id,
        family: config.model_type.clone(),
        layers: config.num_hidden_layers,
        linear_attention_layers: (0..config.num_hidden_layers)
            .filter(|l| config.mixer(*l) == Mixer::LinearAttention)
            .collect(),
        experts: moe_layers.len() * config.num_experts,
        moe_layers,
        experts_per_layer: config.num_experts,
        experts_per_token: config.num_experts_per_tok,
        bytes_per_expert: per_expert.values().copied().max().unwrap_or(0),
        expert_bytes,
        total_bytes,
        skipped_bytes,
        expert_share: expert_bytes as f64 / total_bytes.max(1) as f64,
        slice,
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The report as lines of text.
pub fn text(report: &ModelReport) -> String {
    let dense = report.layers - report.moe_layers.len();
    let linear = report.linear_attention_layers.len();
    let mixers = if linear > 0 {
        format!(
            "{linear} gated DeltaNet, {} full attention; ",
            report.layers - linear
        )
    } else {
        String::new()
    };
    let mut lines = vec![
        format!("model {} ({})", report.model_id, report.family),
        format!(
            "layers: {} ({mixers}{} routing to experts, {dense} dense)",
            report.layers,
            report.moe_layers.len()
        ),
        format!(
            "experts: {} per layer, {} per token, {} in all, {} each",
            report.experts_per_layer,
            report.experts_per_token,
            report.experts,
            mib(report.bytes_per_expert)
        ),
        format!(
            "weights: {} in all, {} of it in experts ({:.1}%)",
            mib(report.total_bytes),
            mib(report.expert_bytes),
            report.expert_share * 100.0
        ),
    ];
    if report.skipped_bytes > 0 {
        lines.push(format!(
            "left out: {} beside the text model (vision tower, multi-token prediction)",
            mib(report.skipped_bytes)
        ));
    }
    if let Some(slice) = &report.slice {
        lines.push(format!(
            "--experts {}: {} experts, {} for a worker to hold",
            slice.experts,
            slice.count,
            mib(slice.bytes)
        ));
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_tensors_are_told_from_the_rest() {
        assert_eq!(
            expert_of("model.layers.3.mlp.experts.17.down_proj.weight"),
            Some((3, 17))
        );
        for other in [
            "model.layers.3.mlp.gate.weight",
            "model.layers.3.mlp.shared_expert.up_proj.weight",
            "model.layers.x.mlp.experts.1.up_proj.weight",
            "model.embed_tokens.weight",
        ] {
            assert_eq!(expert_of(other), None, "{other}");
        }
    }

    /// A GGUF file, as llama.cpp's library writes one: its stacked experts counted per
    /// expert (Q8_0 gate and up, Q4_0 down), its id the hash of its header.
    #[test]
    fn a_gguf_file_is_counted_from_its_stacked_experts() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../inference/tests/data/gguf/tiny-qwen3moe-q8_0.gguf");
        let slice: ExpertSpec = "*:0-3".parse().unwrap();
        let report = report(&path, Some(&slice)).unwrap();
        assert_eq!(report.family, "qwen3_moe");
        assert_eq!(report.moe_layers, [1]);
        assert_eq!((report.experts, report.experts_per_token), (8, 2));
        // Each expert: 32 x 64 values of gate and up in Q8_0, 64 x 32 of down in Q4_0.
        let each = 2 * (32 * 64 / 32 * 34) + 64 * 32 / 32 * 18;
        assert_eq!(report.bytes_per_expert, each);
        assert_eq!(
            report.slice.as_ref().map(|s| (s.count, s.bytes)),
            Some((4, 4 * each))
        );
        assert_eq!(report.model_id.len(), 32);
        assert_eq!(report.model_id, model_id(&path).unwrap());
        let printed = text(&report);
        assert!(
            printed.contains("1 routing to experts, 1 dense"),
            "{printed}"
        );
    }

    #[test]
    fn a_published_qwen35_checkpoint_is_counted_by_layer_kind_and_its_vision_tower_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let preset = kvasir_inference::synth::preset("qwen35-tiny-vl").unwrap();
        kvasir_inference::synth::synthesize(dir.path(), preset, |_, _| {}).unwrap();
        let report = report(dir.path(), None).unwrap();
        assert_eq!(report.family, "qwen3_5_moe_text");
        assert_eq!(report.linear_attention_layers, [0, 1, 2]);
        assert_eq!(report.moe_layers, [0, 1, 2, 3]);
        // Fused experts are counted per expert: 3 x 32 x 64 bf16 values each.
        assert_eq!(report.bytes_per_expert, 3 * 32 * 64 * 2);
        assert_eq!(report.experts, 32);
        assert!(report.skipped_bytes > 0);
        let printed = text(&report);
        assert!(
            printed.contains("layers: 4 (3 gated DeltaNet, 1 full attention; 4 routing"),
            "{printed}"
        );
        assert!(printed.contains("left out:"), "{printed}");
    }

    #[test]
    fn the_tiny_preset_is_counted_and_a_slice_is_its_share() {
        let dir = tempfile::tempdir().unwrap();
        let preset = kvasir_inference::synth::preset("tiny").unwrap();
        kvasir_inference::synth::synthesize(dir.path(), preset, |_, _| {}).unwrap();
        let all = report(dir.path(), None).unwrap();
        let config = Config::load(dir.path()).unwrap();
        assert_eq!(
            all.experts,
            config.moe_layers().count() * config.num_experts
        );
        assert_eq!(all.expert_bytes, all.bytes_per_expert * all.experts as u64);
        assert!(all.expert_share > 0.0 && all.expert_share < 1.0);
        let half: ExpertSpec = format!("*:0-{}", config.num_experts / 2 - 1)
            .parse()
            .unwrap();
        let slice = report(dir.path(), Some(&half)).unwrap().slice.unwrap();
        assert_eq!(slice.count, all.experts / 2);
        assert_eq!(slice.bytes, all.expert_bytes / 2);
        assert!(text(&all).contains(&format!("{} in all", all.experts)));
    }
}
