//! The CUDA expert executor against the CPU one: the same tokens and the same logit bits.
//! Runs with `--features cuda`; skips, saying why, where no GPU or CUDA library is present.
#![cfg(feature = "cuda")]

use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::{generate, Sampling};
use kvasir_inference::kernels::cuda::{check_libraries, CudaExperts};
use kvasir_inference::model::qwen_moe::Model;
use kvasir_inference::moe::LocalExperts;
use kvasir_inference::synth::{preset, synthesize};

#[test]
fn gpu_experts_match_cpu_experts_bit_for_bit() {
    if let Err(why) = check_libraries() {
        eprintln!("skipping the CUDA test: {why}");
        return;
    }
    for preset_name in ["tiny", "small"] {
        let dir = tempfile::tempdir().unwrap();
        synthesize(dir.path(), preset(preset_name).unwrap(), |_, _| {}).unwrap();
        let config = Config::load(dir.path()).unwrap();
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        let gpu = match CudaExperts::load(&checkpoint, &config, 0, |_, _| true) {
            Ok(gpu) => gpu,
            Err(why) => {
                eprintln!("skipping the CUDA test: {why}");
                return;
            }
        };
        let cpu = LocalExperts::load(&checkpoint, &config, |_, _| true).unwrap();
        let model = Model::load(&checkpoint, config).unwrap();
        let prompt = [5, 17, 99, 3, 250, 7, 42, 128];
        let on_cpu = generate(&model, &cpu, &prompt, 32, Sampling::GREEDY).unwrap();
        let on_gpu = generate(&model, &gpu, &prompt, 32, Sampling::GREEDY).unwrap();
        assert_eq!(
            on_cpu.generated(),
            on_gpu.generated(),
            "{preset_name}: 32 greedy tokens"
        );
        let (a, b) = (on_cpu.last_logits(), on_gpu.last_logits());
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let dot: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        eprintln!(
            "{preset_name}: logits cosine {:.6}, bit-identical {same}",
            dot / (norm(a) * norm(b))
        );
        assert!(same, "{preset_name}: GPU logits differ from CPU logits");
    }
}
