//! GGUF files through the engine: the file llama.cpp's own Python library wrote
//! (`tests/data/gguf/write.py`: Q8_0 and Q4_0 experts and dense layer, f16 attention, a bf16
//! head) and those llama.cpp's `llama-quantize` made in its Q4_K_M and Q5_K_M presets (Q4_K,
//! Q5_K and Q6_K, embeddings included) load under the engine's names and generate, with bits
//! that depend on neither the thread count nor the batch, as the exact quantized arithmetic
//! promises.

use std::path::PathBuf;

use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::{generate, Sampling};
use kvasir_inference::kernels::cpu::matmul_t;
use kvasir_inference::kernels::quant::BlockFormat;
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::LocalExperts;
use kvasir_inference::weights::DType;

fn fixture(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/gguf")
        .join(file)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The tokens and the last logits' blake3 `file` generates from a fixed prompt, the same on 1
/// and 2 threads.
fn generation(file: &str) -> (Vec<u32>, String) {
    let path = fixture(file);
    let config = Config::load(&path).unwrap();
    let checkpoint = Checkpoint::open(&path).unwrap();
    let experts = LocalExperts::load(&checkpoint, &config, |_, _| true).unwrap();
    let model = Model::load(&checkpoint, config).unwrap();
    let prompt = [1, 5, 9, 2, 14];
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| generate(&model, &experts, &prompt, 6, Sampling::GREEDY).unwrap())
    };
    let (one, two) = (run(1), run(2));
    assert_eq!(one.generated(), two.generated());
    assert_eq!(bits(one.last_logits()), bits(two.last_logits()));
    assert_eq!(one.last_logits().len(), 16);
    assert!(one.last_logits().iter().all(|v| v.is_finite()));
    let mut hasher = blake3::Hasher::new();
    for value in one.last_logits() {
        hasher.update(&value.to_le_bytes());
    }
    (
        one.generated().to_vec(),
        hasher.finalize().to_hex().to_string(),
    )
}

/// The same bits on every machine (the aarch64 check runs these under qemu).
#[test]
fn gguf_files_generate_with_pinned_bits_on_any_thread_count() {
    for (file, tokens, logits) in [
        (
            "tiny-qwen3moe-q8_0.gguf",
            vec![5; 6],
            "dc34688069f5fb44ad6a08153f4d2d9a4d12600ecf09f3e1464e379629ff651f",
        ),
        (
            "tiny-qwen3moe-q4_k_m.gguf",
            vec![10, 3, 10, 3, 11, 5],
            "73f9d5eed625ca9f3b3b324704e6a1eef2b093dec934d891c671ecb43ee436c5",
        ),
        (
            "tiny-qwen3moe-q5_k_m.gguf",
            vec![10, 5, 0, 10, 5, 0],
            "0d75a9e1486dbdc71fc9abca9abb7fe97112fc2336319570a063de4fe2cfa847",
        ),
    ] {
        assert_eq!(
            generation(file),
            (tokens, logits.to_string()),
            "the pinned bits of {file} changed"
        );
    }
}

/// A stacked Q8_0 expert reads as its own matrix, rows as the converter laid them: its
/// product is the f32 product of its dequantized values, up to the quantization of the rows.
#[test]
fn a_stacked_expert_is_its_own_matrix_in_the_converters_layout() {
    let checkpoint = Checkpoint::open(&fixture("tiny-qwen3moe-q8_0.gguf")).unwrap();
    for (expert, dtype) in [
        (0, DType::Quantized(BlockFormat::Q8_0)),
        (7, DType::Quantized(BlockFormat::Q8_0)),
    ] {
        let name = format!("model.layers.1.mlp.experts.{expert}.gate_proj.weight");
        let weight = checkpoint.tensor(&name, &[32, 64]).unwrap();
        assert_eq!(weight.dtype(), dtype);
        let x: Vec<f32> = (0..2 * 64)
            .map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0)
            .collect();
        let mut out = vec![0f32; 2 * 32];
        matmul_t(&x, 2, &weight, &mut out);
        let w = weight.to_f32();
        for r in 0..2 {
            for j in 0..32 {
                let row = &x[r * 64..(r + 1) * 64];
                let plain: f32 = row
                    .iter()
                    .zip(&w[j * 64..(j + 1) * 64])
                    .map(|(a, b)| a * b)
                    .sum();
                let scale: f32 = row.iter().map(|a| a.abs()).sum::<f32>() / 64.0;
                assert!(
                    (out[r * 32 + j] - plain).abs() <= 0.02 * scale * 64.0,
                    "expert {expert} row {r} column {j}: {} vs {plain}",
                    out[r * 32 + j]
                );
            }
        }
    }
    let down = checkpoint
        .tensor("model.layers.1.mlp.experts.3.down_proj.weight", &[64, 32])
        .unwrap();
    assert_eq!(down.dtype(), DType::Quantized(BlockFormat::Q4_0));
}
