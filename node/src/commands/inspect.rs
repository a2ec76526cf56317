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

pub fn report(dir: &Path, slice: Option<&ExpertSpec>) -> Result<ModelReport> {
    let reading = || format!("reading the checkpoint in {}", dir.display());
    let config = Config::load(dir).with_context(reading)?;
    let checkpoint = Checkpoint::open(dir).with_context(reading)?;
    let mut per_expert: BTreeMap<(usize, usize), u64> = BTreeMap::new();
    let mut total_bytes = 0u64;
    for (name, bytes) in checkpoint.tensor_sizes() {
        total_bytes += bytes;
        if let Some(key) = expert_of(name) {
            *per_expert.entry(key).or_default() += bytes;
        }
    }
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
    Ok(ModelReport {
        model_id: model_id(dir)?,
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
        skipped_bytes: checkpoint.skipped_bytes(),
        expert_share: expert_bytes as f64 / total_bytes.max(1) as f64,
        slice,
    })
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
