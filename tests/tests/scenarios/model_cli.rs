//! The inference engine's command line over real processes: synthesis and generation as the
//! README shows them, and clear errors for bad input.

use kvasir_api::generation::GenerationReport;
use kvasir_tests::{run, stderr, stdout};

/// `model synth --preset tiny` into `dir`: the checkpoint's path.
fn synth_tiny(dir: &tempfile::TempDir) -> String {
    let model = dir.path().join("tiny");
    let model = model.to_str().unwrap().to_string();
    let synth = run(
        "kvasir-node",
        &["model", "synth", "--out", &model, "--preset", "tiny"],
    );
    assert!(synth.status.success(), "{}", stderr(&synth));
    model
}

#[test]
fn synth_then_generate_greedy_is_reproducible_and_reports_ids() {
    let dir = tempfile::tempdir().unwrap();
    let model = synth_tiny(&dir);
    let model = model.as_str();
    let args = [
        "generate",
        "--model",
        model,
        "--prompt",
        "The capital of France is",
        "--tokens",
        "8",
        "--json",
    ];
    let first = run("kvasir-node", &args);
    assert!(first.status.success(), "{}", stderr(&first));
    let report: GenerationReport = serde_json::from_str(&stdout(&first)).unwrap();
    assert_eq!(report.token_ids.len(), 8);
    assert!(!report.prompt_ids.is_empty());
    assert!(report.tokens_per_s > 0.0);
    assert_eq!(report.backend.as_deref(), Some("cpu"));
    let second = run("kvasir-node", &args);
    let again: GenerationReport = serde_json::from_str(&stdout(&second)).unwrap();
    assert_eq!(
        report.token_ids, again.token_ids,
        "greedy generation must repeat exactly"
    );
    let text = run(
        "kvasir-node",
        &[
            "generate", "--model", model, "--prompt", "Hello", "--tokens", "4",
        ],
    );
    assert!(
        text.status.success() && stdout(&text).starts_with("Hello"),
        "{}",
        stdout(&text)
    );
}

#[test]
fn bad_input_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    let out = out.to_str().unwrap();
    let unknown = run(
        "kvasir-node",
        &["model", "synth", "--out", out, "--preset", "huge"],
    );
    assert!(!unknown.status.success());
    assert!(
        stderr(&unknown).contains("unknown preset \"huge\""),
        "{}",
        stderr(&unknown)
    );
    let missing = run(
        "kvasir-node",
        &["generate", "--model", out, "--prompt", "hi"],
    );
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).starts_with("error: loading"),
        "{}",
        stderr(&missing)
    );
    assert_eq!(
        stderr(&missing).trim_end().lines().count(),
        1,
        "{}",
        stderr(&missing)
    );
    let empty = run("kvasir-node", &["generate", "--model", out, "--prompt", ""]);
    assert!(
        stderr(&empty).contains("--prompt must not be empty"),
        "{}",
        stderr(&empty)
    );
}

/// `model compare`: a GGUF file against itself agrees at every position with no divergence;
/// against the tiny preset's checkpoint, whose vocabulary differs, it is refused in one line.
/// Against another quantization of the same model it reports a divergence above zero.
#[test]
fn model_compare_measures_one_model_against_another() {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../inference/tests/data/gguf/");
    let q8 = format!("{data}tiny-qwen3moe-llama-q8_0.gguf");
    let q4 = format!("{data}tiny-qwen3moe-llama-q4_0.gguf");
    let compare = |model: &str, reference: &str| {
        let args = [
            "model",
            "compare",
            "--model",
            model,
            "--reference",
            reference,
            "--tokens",
            "24",
            "--json",
        ];
        let output = run("kvasir-node", &args);
        assert!(output.status.success(), "{}", stderr(&output));
        serde_json::from_str::<serde_json::Value>(&stdout(&output)).unwrap()
    };
    let same = compare(&q8, &q8);
    assert_eq!(same["positions"], 24);
    assert_eq!(same["top1_same"], 24);
    assert_eq!(same["mean_kl"], 0.0);
    let other = compare(&q4, &q8);
    assert_eq!(other["positions"], 24);
    assert!(other["mean_kl"].as_f64().unwrap() > 0.0, "{other}");

    let dir = tempfile::tempdir().unwrap();
    let tiny = synth_tiny(&dir);
    let tiny = tiny.as_str();
    let refused = run(
        "kvasir-node",
        &["model", "compare", "--model", &q8, "--reference", tiny],
    );
    assert!(!refused.status.success());
    let message = stderr(&refused);
    assert!(message.contains("do not share a vocabulary"), "{message}");
    assert_eq!(message.trim_end().lines().count(), 1, "{message}");
}
