//! Agreement with Hugging Face transformers itself: `inference/golden/make_golden.py`
//! computed reference logits and greedy tokens for the synthetic presets; this engine must
//! match them: identical greedy tokens, and a max abs logit difference of at most 1e-3 with
//! f32 weights. The reference runs in f32, over bf16 weights widened for the bf16 presets,
//! while this engine's arithmetic for bf16 weights rounds each matrix product's inputs to
//! bf16 (`kernels::bf16`), as a bf16 implementation does: there the bound is bf16's
//! precision, 2^-8 relative, on logits of magnitude about 2, so 1e-2.

use std::path::Path;

use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::{generate, Sampling};
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::LocalExperts;
use kvasir_inference::synth::{preset, synthesize};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    prompt_ids: Vec<u32>,
    last_logits: Vec<f32>,
    greedy_tokens: Vec<u32>,
    transformers: String,
}

fn check(preset_name: &str, tolerance: f32) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("golden/{preset_name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let golden: Golden = serde_json::from_str(&text).unwrap();
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), preset(preset_name).unwrap(), |_, _| {}).unwrap();
    let config = Config::load(dir.path()).unwrap();
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let experts = LocalExperts::load(&checkpoint, &config, |_, _| true).unwrap();
    let model = Model::load(&checkpoint, config).unwrap();

    let prefill = generate(&model, &experts, &golden.prompt_ids, 1, Sampling::GREEDY).unwrap();
    let ours = prefill.last_logits();
    assert_eq!(ours.len(), golden.last_logits.len());
    let max_diff = ours
        .iter()
        .zip(&golden.last_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "{preset_name}: max |logit difference| from transformers {} = {max_diff:e}",
        golden.transformers
    );
    assert!(
        max_diff <= tolerance,
        "{preset_name}: max |logit difference| {max_diff} over {tolerance}"
    );

    let tokens = golden.greedy_tokens.len();
    let greedy = generate(
        &model,
        &experts,
        &golden.prompt_ids,
        tokens,
        Sampling::GREEDY,
    )
    .unwrap();
    assert_eq!(
        greedy.generated(),
        golden.greedy_tokens,
        "{preset_name}: greedy tokens differ from transformers"
    );
}

#[test]
fn qwen3_moe_with_a_dense_layer_matches_transformers() {
    check("tiny", 1e-3);
}

#[test]
fn qwen2_moe_with_shared_expert_and_tied_embeddings_matches_transformers() {
    check("tiny-qwen2", 1e-3);
}

#[test]
fn qwen35_moe_text_model_matches_transformers() {
    check("qwen35-tiny", 1e-3);
}

/// As Qwen3.5 is published: `Qwen3_5MoeForConditionalGeneration` (a vision tower and an
/// `mtp.` tensor to skip), experts fused, bf16, in shards with an index.
#[test]
fn qwen35_moe_multimodal_checkpoint_in_bf16_shards_matches_transformers() {
    check("qwen35-tiny-vl", 1e-2);
}
