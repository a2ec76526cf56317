//! The engine over real synthetic checkpoints, written and read through the real loader.

use std::path::Path;

use kvasir_inference::checkpoint::Checkpoint;
use kvasir_inference::config::Config;
use kvasir_inference::generate::{generate, step, Pipeline, Sampling, Sequence};
use kvasir_inference::model::qwen_moe::{ForwardError, Model, Step};
use kvasir_inference::moe::{ExpertExecutor, LocalExperts, SplitExperts};
use kvasir_inference::synth::{preset, synthesize};
use kvasir_inference::tokenizer::Tokenizer;
use kvasir_inference::LoadError;

fn synth(preset_name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synthesize(dir.path(), preset(preset_name).unwrap(), |_, _| {}).unwrap();
    dir
}

fn load(dir: &Path, keep: impl Fn(usize, usize) -> bool) -> (Model, LocalExperts) {
    let config = Config::load(dir).unwrap();
    let checkpoint = Checkpoint::open(dir).unwrap();
    let experts = LocalExperts::load(&checkpoint, &config, keep).unwrap();
    (Model::load(&checkpoint, config).unwrap(), experts)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn files_hash(dir: &Path) -> String {
    let mut hasher = blake3::Hasher::new();
    for name in ["config.json", "model.safetensors", "tokenizer.json"] {
        hasher.update(name.as_bytes());
        hasher.update(&std::fs::read(dir.join(name)).unwrap());
    }
    hasher.finalize().to_hex().to_string()
}

#[test]
fn synthesis_is_byte_for_byte_reproducible() {
    let (a, b) = (synth("tiny"), synth("tiny"));
    assert_eq!(files_hash(a.path()), files_hash(b.path()));
    // The same bytes on every machine, not only twice here.
    assert_eq!(
        files_hash(a.path()),
        TINY_HASH,
        "the tiny preset's bytes changed"
    );
}

const TINY_HASH: &str = "3362f46bc4f0aa292f0c46f7044efc1ee69b90dbb46712618e953d55fe82c236";

#[test]
fn the_tokenizer_round_trips_text() {
    let dir = synth("tiny");
    let tokenizer = Tokenizer::load(dir.path()).unwrap();
    let text = "The capital of France is Paris. ¿Qué? 42";
    let ids = tokenizer.encode(text).unwrap();
    assert!(ids.len() < text.len(), "BPE merges shorten common text");
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
}

#[test]
fn output_bits_do_not_depend_on_thread_count() {
    for preset_name in ["tiny", "qwen35-tiny"] {
        let dir = synth(preset_name);
        let (model, experts) = load(dir.path(), |_, _| true);
        let prompt = [5, 17, 99, 3, 250, 7];
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| generate(&model, &experts, &prompt, 12, Sampling::GREEDY).unwrap())
        };
        let (one, two, four) = (run(1), run(2), run(4));
        assert_eq!(one.generated(), two.generated(), "{preset_name}");
        assert_eq!(bits(one.last_logits()), bits(two.last_logits()));
        assert_eq!(bits(one.last_logits()), bits(four.last_logits()));
    }
}

#[test]
fn a_sequence_gives_the_same_bits_alone_or_in_a_changing_batch() {
    for preset_name in ["tiny", "qwen35-tiny"] {
        sequences_join_and_leave(preset_name);
    }
}

/// A prompt fed whole (prefill) or one token a step leaves the same state: the next
/// tokens and logits are the same bits. Qwen3.5's DeltaNet layers carry a convolution and
/// a recurrent state instead of keys and values, so this is their check.
#[test]
fn prefill_and_token_by_token_decode_give_the_same_bits() {
    for preset_name in ["tiny", "qwen35-tiny"] {
        let dir = synth(preset_name);
        let (model, experts) = load(dir.path(), |_, _| true);
        let prompt = [5, 17, 99, 3, 250, 7, 42];
        let whole = generate(&model, &experts, &prompt, 8, Sampling::GREEDY).unwrap();
        let mut cache = model.new_cache();
        let mut logits = Vec::new();
        for token in &prompt {
            let mut steps = [Step {
                cache: &mut cache,
                tokens: std::slice::from_ref(token),
            }];
            logits = model.forward(&mut steps, &experts).unwrap().remove(0);
        }
        let mut tokens = Vec::new();
        for _ in 0..8 {
            let next = argmax(&logits);
            tokens.push(next);
            let mut steps = [Step {
                cache: &mut cache,
                tokens: &[next],
            }];
            logits = model.forward(&mut steps, &experts).unwrap().remove(0);
        }
        assert_eq!(whole.generated(), tokens, "{preset_name}");
        // `whole` stopped after its eighth token; one more step here, so compare the
        // eighth step's logits through a second run that stops at the same place.
        let again = generate(&model, &experts, &prompt, 9, Sampling::GREEDY).unwrap();
        assert_eq!(bits(again.last_logits()), bits(&logits), "{preset_name}");
        assert_eq!(cache.len(), prompt.len() + 8);
    }
}

/// Pipelining on or off: every sequence's tokens and logits are the same bits.
#[test]
fn micro_batches_in_flight_at_once_give_the_bits_of_one_pass() {
    for preset_name in ["tiny", "qwen35-tiny"] {
        let dir = synth(preset_name);
        let (model, experts) = load(dir.path(), |_, _| true);
        let prompts: [&[u32]; 5] = [&[5, 17, 99], &[200, 1, 2, 3, 4], &[42], &[7, 7], &[300, 9]];
        let run = |micro_batches: usize| {
            let pipeline = Pipeline::new(micro_batches, 1).unwrap();
            let mut sequences: Vec<Sequence> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| Sequence::new(&model, p, 6 + i, Sampling::GREEDY))
                .collect();
            let mut batch: Vec<&mut Sequence> = sequences.iter_mut().collect();
            // Past every sequence's end: a done sequence takes no step.
            pipeline.decode(&model, &experts, &mut batch, 12).unwrap();
            sequences
                .iter()
                .map(|s| (s.generated().to_vec(), bits(s.last_logits())))
                .collect::<Vec<_>>()
        };
        let one = run(1);
        assert_eq!(one, run(2), "{preset_name}");
        assert_eq!(one, run(3), "{preset_name}");
    }
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn a_cache_from_another_model_or_an_empty_step_is_an_error() {
    let (tiny, qwen35) = (synth("tiny"), synth("qwen35-tiny"));
    let (model, experts) = load(qwen35.path(), |_, _| true);
    let (other, _) = load(tiny.path(), |_, _| true);
    let mut foreign = other.new_cache();
    let mut steps = [Step {
        cache: &mut foreign,
        tokens: &[1],
    }];
    assert!(matches!(
        model.forward(&mut steps, &experts),
        Err(ForwardError::ForeignCache)
    ));
    let mut cache = model.new_cache();
    let mut steps = [Step {
        cache: &mut cache,
        tokens: &[],
    }];
    assert!(matches!(
        model.forward(&mut steps, &experts),
        Err(ForwardError::NoTokens)
    ));
}

fn sequences_join_and_leave(preset_name: &str) {
    let dir = synth(preset_name);
    let (model, experts) = load(dir.path(), |_, _| true);
    let prompts: [&[u32]; 3] = [&[5, 17, 99, 3], &[200, 1, 2, 3, 4, 5, 6], &[42]];
    let alone: Vec<Sequence> = prompts
        .iter()
        .map(|p| generate(&model, &experts, p, 10, Sampling::GREEDY).unwrap())
        .collect();
    // The second sequence joins after two steps and the third after four; the first
    // leaves early because it asked for fewer tokens.
    let mut a = Sequence::new(&model, prompts[0], 10, Sampling::GREEDY);
    let mut b = Sequence::new(&model, prompts[1], 10, Sampling::GREEDY);
    let mut c = Sequence::new(&model, prompts[2], 10, Sampling::GREEDY);
    for _ in 0..2 {
        step(&model, &experts, &mut [&mut a]).unwrap();
    }
    for _ in 0..2 {
        step(&model, &experts, &mut [&mut a, &mut b]).unwrap();
    }
    while !(a.is_done() && b.is_done() && c.is_done()) {
        step(&model, &experts, &mut [&mut a, &mut b, &mut c]).unwrap();
    }
    for (batched, alone) in [a, b, c].iter().zip(&alone) {
        assert_eq!(batched.generated(), alone.generated(), "{preset_name}");
        assert_eq!(bits(batched.last_logits()), bits(alone.last_logits()));
    }
}

#[test]
fn experts_split_between_two_executors_give_identical_tokens_and_logits() {
    for preset_name in ["tiny", "tiny-qwen2", "qwen35-tiny", "qwen35-tiny-vl"] {
        let dir = synth(preset_name);
        let (model, all) = load(dir.path(), |_, _| true);
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        let config = Config::load(dir.path()).unwrap();
        let even = LocalExperts::load(&checkpoint, &config, |_, e| e % 2 == 0).unwrap();
        let odd = LocalExperts::load(&checkpoint, &config, |l, e| e % 2 == 1 || l == 0).unwrap();
        assert!(!even.holds(0, 1) && odd.holds(0, 1));
        let split = SplitExperts::new(vec![&even, &odd]);
        let prompt = [9, 8, 7, 6, 5];
        let reference = generate(&model, &all, &prompt, 16, Sampling::GREEDY).unwrap();
        let divided = generate(&model, &split, &prompt, 16, Sampling::GREEDY).unwrap();
        assert_eq!(reference.generated(), divided.generated(), "{preset_name}");
        assert_eq!(
            bits(reference.last_logits()),
            bits(divided.last_logits()),
            "{preset_name}"
        );
        // An executor missing experts is an error, not a wrong answer.
        assert!(generate(&model, &even, &prompt, 4, Sampling::GREEDY).is_err());
    }
}

#[test]
fn seeded_sampling_repeats_and_differs_by_seed() {
    let dir = synth("tiny");
    let (model, experts) = load(dir.path(), |_, _| true);
    let sample = |seed| {
        let sampling = Sampling {
            temperature: 1.0,
            seed,
        };
        generate(&model, &experts, &[1, 2, 3], 24, sampling)
            .unwrap()
            .generated()
            .to_vec()
    };
    assert_eq!(sample(7), sample(7));
    assert_ne!(sample(7), sample(8));
}

#[test]
fn bad_checkpoints_are_named_errors() {
    let dir = synth("tiny");
    let path = dir.path();
    // The config disagrees with the tensors: the error names the tensor and both shapes.
    let config = std::fs::read_to_string(path.join("config.json")).unwrap();
    std::fs::write(
        path.join("config.json"),
        config.replace("\"intermediate_size\": 96", "\"intermediate_size\": 97"),
    )
    .unwrap();
    let checkpoint = Checkpoint::open(path).unwrap();
    match Model::load(&checkpoint, Config::load(path).unwrap()) {
        Err(LoadError::Shape {
            name,
            expected,
            found,
        }) => {
            assert_eq!(name, "model.layers.1.mlp.gate_proj.weight");
            assert_eq!((expected, found), (vec![97, 64], vec![96, 64]));
        }
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("a wrong shape loaded"),
    }
    assert!(
        matches!(checkpoint.tensor("model.nope", &[1]), Err(LoadError::Missing(name)) if name == "model.nope")
    );
    // Not safetensors at all, truncated, or empty.
    let weights = std::fs::read(path.join("model.safetensors")).unwrap();
    for broken in [
        b"garbage".to_vec(),
        weights[..weights.len() / 2].to_vec(),
        Vec::new(),
    ] {
        std::fs::write(path.join("model.safetensors"), &broken).unwrap();
        assert!(matches!(
            Checkpoint::open(path),
            Err(LoadError::Format { .. })
        ));
    }
    std::fs::write(path.join("config.json"), "{\"vocab_size\": \"many\"}").unwrap();
    assert!(matches!(Config::load(path), Err(LoadError::Config(_))));
    std::fs::remove_file(path.join("model.safetensors")).unwrap();
    assert!(matches!(Checkpoint::open(path), Err(LoadError::Io(..))));
}

/// What an operator pointing the engine at a broken Qwen3.5 checkpoint sees: errors naming
/// the tensor as the files store it.
#[test]
fn bad_qwen35_checkpoints_are_named_errors() {
    let dir = synth("qwen35-tiny-vl");
    let path = dir.path();
    let original = std::fs::read_to_string(path.join("config.json")).unwrap();
    let with = |from: &str, to: &str| {
        assert!(original.contains(from), "{from}");
        std::fs::write(path.join("config.json"), original.replace(from, to)).unwrap();
        Config::load(path)
    };
    let load_model = |config: Config| {
        let checkpoint = Checkpoint::open(path).unwrap();
        LocalExperts::load(&checkpoint, &config, |_, _| true)?;
        Model::load(&checkpoint, config).map(|_| ())
    };
    // A misshapen DeltaNet projection, named as stored under the multimodal wrapper.
    match load_model(
        with(
            "\"linear_value_head_dim\": 16",
            "\"linear_value_head_dim\": 8",
        )
        .unwrap(),
    ) {
        Err(LoadError::Shape { name, .. }) => {
            assert_eq!(
                name,
                "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
            )
        }
        other => panic!("wrong outcome: {:?}", other.err()),
    }
    // Fused experts of another width: the error names the fused tensor and the expert.
    match load_model(
        with(
            "\"moe_intermediate_size\": 32",
            "\"moe_intermediate_size\": 16",
        )
        .unwrap(),
    ) {
        Err(LoadError::Shape { name, .. }) => assert_eq!(
            name,
            "model.language_model.layers.0.mlp.experts.gate_up_proj (expert 0's gate_proj)"
        ),
        other => panic!("wrong outcome: {:?}", other.err()),
    }
    // A layer the checkpoint does not have.
    let five = original.replace("\"num_hidden_layers\": 4", "\"num_hidden_layers\": 5");
    std::fs::write(path.join("config.json"), &five).unwrap();
    match load_model(Config::load(path).unwrap()) {
        Err(LoadError::Missing(name)) => {
            assert!(name.starts_with("model.language_model.layers.4."), "{name}")
        }
        other => panic!("wrong outcome: {:?}", other.err()),
    }
    // Configs that cannot describe a Qwen3.5 model.
    for (from, to) in [
        ("\"full_attention_interval\": 4", "\"layer_types\": [\"full_attention\"]"),
        ("\"full_attention_interval\": 4", "\"layer_types\": [\"sliding\", \"full_attention\", \"full_attention\", \"full_attention\"]"),
        ("\"full_attention_interval\": 4", "\"full_attention_interval\": 0"),
        ("\"linear_num_key_heads\": 2", "\"linear_num_key_heads\": 3"),
        ("\"linear_conv_kernel_dim\": 4", "\"linear_conv_kernel_dim\": 0"),
        ("\"partial_rotary_factor\": 0.25", "\"partial_rotary_factor\": 0.001"),
        ("\"text_config\"", "\"text_config_moved\""),
    ] {
        assert!(
            matches!(with(from, to), Err(LoadError::Config(_))),
            "{to} was accepted"
        );
    }
    // A shard the index names is gone.
    std::fs::write(path.join("config.json"), &original).unwrap();
    std::fs::remove_file(path.join("model-00002-of-00004.safetensors")).unwrap();
    assert!(matches!(Checkpoint::open(path), Err(LoadError::Io(..))));
}

/// The bits every machine must give: a greedy generation's tokens and last logits on each
/// family, f32 and bf16 weights, pinned here and checked as they are on every build: AVX-512,
/// AVX2, the portable kernel, and aarch64 under qemu-user (`ci/aarch64` runs this test
/// there). The 17-token prompt runs the row tiles of the matrix kernels, each decode step the
/// one-row path. Only a deliberate change of the reference arithmetic may change them.
#[test]
fn every_machine_gives_the_pinned_bits() {
    let pinned = [
        (
            "tiny",
            "3a75e36ca0a4761bc4c0a615c72fd7dc38518a70448debb58452125d640f7ba0",
        ),
        (
            "tiny-qwen2",
            "4bd544529ccc41cd8192559b388a5318e13fffd12c8c3084dbcec6dce1ac8c03",
        ),
        (
            "qwen35-tiny",
            "27bbfabc089323fe8d2e7bbe2ee60437e76fd39e57907efed8b8cdafa17e5391",
        ),
        (
            "qwen35-tiny-vl",
            "3eea8712e1aca37547cf0422507cd55edae79d60c128690f241685cb56157a7e",
        ),
    ];
    let prompt = [5, 17, 99, 3, 250, 7, 42, 8, 1, 64, 30, 2, 90, 11, 77, 6, 19];
    let mut seen = Vec::new();
    for (preset_name, _) in pinned {
        let dir = synth(preset_name);
        let (model, experts) = load(dir.path(), |_, _| true);
        let sequence = generate(&model, &experts, &prompt, 12, Sampling::GREEDY).unwrap();
        let mut hasher = blake3::Hasher::new();
        for token in sequence.generated() {
            hasher.update(&token.to_le_bytes());
        }
        for value in sequence.last_logits() {
            hasher.update(&value.to_bits().to_le_bytes());
        }
        seen.push((preset_name, hasher.finalize().to_hex().to_string()));
    }
    let want: Vec<(&str, String)> = pinned.iter().map(|(p, h)| (*p, h.to_string())).collect();
    assert_eq!(seen, want);
}

/// A generation stops at any of the end tokens `generation_config.json` lists, the way a
/// chat checkpoint ends a turn at either of its two; without one it runs to its length.
#[test]
fn a_generation_stops_at_any_end_token_of_the_generation_config() {
    let dir = synth("tiny");
    let (model, experts) = load(dir.path(), |_, _| true);
    let prompt = [1, 2, 3];
    let full = generate(&model, &experts, &prompt, 6, Sampling::GREEDY).unwrap();
    let tokens = full.generated().to_vec();
    assert_eq!(
        tokens.len(),
        6,
        "before the tiny preset's end token: {tokens:?}"
    );
    assert!(!full.ended());
    // The third token, second in a list with an id never generated.
    let unused = (0..model.config().vocab_size as u32)
        .find(|t| !tokens.contains(t))
        .unwrap();
    std::fs::write(
        dir.path().join("generation_config.json"),
        format!("{{\"eos_token_id\": [{unused}, {}]}}", tokens[2]),
    )
    .unwrap();
    let (model, experts) = load(dir.path(), |_, _| true);
    let ended = generate(&model, &experts, &prompt, 6, Sampling::GREEDY).unwrap();
    let first = tokens.iter().position(|t| *t == tokens[2]).unwrap();
    assert_eq!(ended.generated(), &tokens[..=first]);
    assert!(ended.ended());
}
