"""Reference logits from Hugging Face transformers for the synthetic presets.

Writes inference/golden/<preset>.json, which the Rust test `inference/tests/golden.rs`
compares against. CI needs no Python; rerun this only when a preset or the prompt changes:

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch transformers==5.24.0 safetensors numpy
    cargo build --release -p kvasir-node
    /tmp/golden-venv/bin/python inference/golden/make_golden.py target/release/kvasir-node

For the Qwen3.5 presets it also checks the other direction: transformers loads the synthetic
checkpoint with no missing or unexpected tensor, writes it again with `save_pretrained`
(one tensor per expert, where the synthetic `qwen35-tiny-vl` fuses them), and kvasir-node
must decode that copy to the same tokens and the same logits' hash.
"""

import json
import pathlib
import subprocess
import sys
import tempfile

import shutil

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

PRESETS = ["tiny", "tiny-qwen2", "qwen35-tiny", "qwen35-tiny-vl"]
PROMPT_IDS = [5, 17, 99, 3, 250, 7, 42, 128]
NEW_TOKENS = 16


def main(node_binary: str) -> None:
    out_dir = pathlib.Path(__file__).resolve().parent
    torch.manual_seed(0)
    for preset in PRESETS:
        with tempfile.TemporaryDirectory() as checkpoint:
            subprocess.run(
                [node_binary, "model", "synth", "--out", checkpoint, "--preset", preset],
                check=True,
            )
            model_class = model_class_of(checkpoint)
            model, info = model_class.from_pretrained(
                checkpoint, dtype=torch.float32, output_loading_info=True
            )
            problems = {k: v for k, v in info.items() if v and k != "unexpected_keys"}
            assert not problems, f"{preset}: transformers could not load it whole: {problems}"
            model.eval()
            if preset.startswith("qwen35"):
                check_save_pretrained(node_binary, checkpoint, model_class)
            ids = torch.tensor([PROMPT_IDS])
            with torch.no_grad():
                last_logits = model(ids).logits[0, -1].tolist()
                generated = model.generate(
                    ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
                )[0, len(PROMPT_IDS):].tolist()
        golden = {
            "preset": preset,
            "prompt_ids": PROMPT_IDS,
            "last_logits": last_logits,
            "greedy_tokens": generated,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        }
        path = out_dir / f"{preset}.json"
        path.write_text(json.dumps(golden) + "\n")
        print(f"wrote {path}: {len(last_logits)} logits, tokens {generated}")


def model_class_of(checkpoint: str):
    config = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    if config["model_type"] == "qwen3_5_moe":
        return Qwen3_5MoeForConditionalGeneration
    return AutoModelForCausalLM


def decode(node_binary: str, checkpoint: str) -> dict:
    out = subprocess.run(
        [node_binary, "generate", "--model", checkpoint, "--prompt", "the quick brown fox",
         "--tokens", str(NEW_TOKENS), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    report = json.loads(out)
    return {"tokens": report["token_ids"], "logits_blake3": report["logits_blake3"]}


def check_save_pretrained(node_binary: str, checkpoint: str, model_class) -> None:
    config = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    dtype = torch.bfloat16 if "bfloat16" in json.dumps(config) else torch.float32
    with tempfile.TemporaryDirectory() as saved:
        model_class.from_pretrained(checkpoint, dtype=dtype).save_pretrained(saved)
        shutil.copy(pathlib.Path(checkpoint) / "tokenizer.json", saved)
        ours, theirs = decode(node_binary, checkpoint), decode(node_binary, saved)
        assert ours == theirs, f"save_pretrained's copy decodes differently: {ours} vs {theirs}"
        print(f"save_pretrained's copy decodes the same: {theirs}")


if __name__ == "__main__":
    main(sys.argv[1])
