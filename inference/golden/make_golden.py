"""Reference logits from Hugging Face transformers for the synthetic presets.

Writes inference/golden/<preset>.json, which the Rust test `inference/tests/golden.rs`
compares against. CI needs no Python; rerun this only when a preset or the prompt changes:

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch transformers safetensors numpy
    cargo build --release -p kvasir-node
    /tmp/golden-venv/bin/python inference/golden/make_golden.py target/release/kvasir-node
"""

import json
import pathlib
import subprocess
import sys
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM

PRESETS = ["tiny", "tiny-qwen2"]
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
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
            model.eval()
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


if __name__ == "__main__":
    main(sys.argv[1])
