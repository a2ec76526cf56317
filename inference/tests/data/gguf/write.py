"""Writes tiny-qwen3moe-q8_0.gguf and quantized-rows.gguf with llama.cpp's own Python GGUF
library (gguf-py, the one its converter uses), so the engine's reader and its quantization
are checked against another implementation.

    python3 -m venv /tmp/gguf && /tmp/gguf/bin/pip install gguf==0.19.0 numpy
    /tmp/gguf/bin/python inference/tests/data/gguf/write.py

Two layers, the first dense; 8 experts of width 32 at hidden size 64, stored Q8_0 (gate, up)
and Q4_0 (down); norms F32, attention F16, the output head BF16. The weights are a fixed
function of their index, so the same library version writes the same bytes.

quantized-rows.gguf holds rows of values (`rows.f32`, with a half, a zero block and a NaN-free
spread of magnitudes), the same rows quantized by gguf-py as Q8_0 (`rows.q8_0`, llama.cpp's
`quantize_row_q8_0`) and Q4_0 (`rows.q4_0`), and the Q4_0 rows dequantized (`rows.q4_0.f32`).
gguf-py does not quantize the K formats, so for each of Q4_K, Q5_K and Q6_K it holds blocks of
seeded random bytes with finite scales (`rows.q4_k`, ...) and gguf-py's dequantization of them
(`rows.q4_k.f32`, ...): the layout as llama.cpp's library reads it.

With `--llama-quantize PATH` (llama.cpp's `llama-quantize`, built as
docs/notes/llama-cpp-side-by-side.md says), it also writes tiny-qwen3moe-f32.gguf in a
temporary folder (every matrix rows of 256 values, so the K formats' blocks fit; both layers
MoE, as llama.cpp's qwen3moe requires) and has llama.cpp's own quantizer make
tiny-qwen3moe-q4_k_m.gguf and tiny-qwen3moe-q5_k_m.gguf from it (its presets' mix of Q4_K,
Q5_K and Q6_K tensors, as users' files have them), and tiny-qwen3moe-llama-q8_0.gguf and
-llama-q4_0.gguf. With `--llama-logits PATH` too (llama_logits.cpp, built), each of those
gets llama.cpp's teacher-forced logits over a fixed sequence beside it (`NAME.llama.json`).

With `--llama-gguf-split PATH` (llama.cpp's `llama-gguf-split`), tiny-qwen3moe-q8_0.gguf is
split in three parts of at most ten tensors, tiny-qwen3moe-q8_0-00001-of-00003.gguf and on.

With `--qwen35 CKPT --llama-cpp SRC` too (CKPT from `kvasir-node model synth --preset
qwen35-tiny --out CKPT`, SRC llama.cpp's source tree; the converter needs torch, safetensors,
transformers and sentencepiece in this venv), llama.cpp's own converter writes the Qwen3.5
checkpoint as tiny-qwen35moe-f32.gguf (its value heads tiled, norms plus one, `-exp(A_log)`),
`llama-quantize` makes tiny-qwen35moe-llama-q8_0.gguf of it, and that gets llama.cpp's logits.
"""
import os
import subprocess
import sys
import tempfile

import gguf
import numpy as np

HIDDEN, WIDTH, EXPERTS, DENSE, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 8, 128, 16, 4, 2, 16
Q = gguf.GGMLQuantizationType
# The sequence llama.cpp's logits are taken over (`--llama-logits`): fixed, every token of the
# vocabulary among them.
TEACHER_TOKENS = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 32)]


def values(n, seed):
    i = np.arange(n, dtype=np.float64)
    return (np.sin(i * 0.37 + seed) * 0.5).astype(np.float32)


def tensor(writer, name, shape, kind, seed, scale=1.0):
    data = (values(int(np.prod(shape)), seed) * np.float32(scale)).reshape(shape)
    if kind == Q.F32:
        writer.add_tensor(name, data)
    elif kind == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


HERE = os.path.dirname(os.path.abspath(__file__))


def write_model(path, hidden, width, dense, head_dim, experts, quantized, experts_down,
                first_dense=True, head_scale=1.0):
    """A two-layer qwen3moe, the first layer dense unless not `first_dense` (llama.cpp's
    qwen3moe has no dense layers); `quantized` is the experts' and dense layer's type
    (`experts_down` for the experts' down matrices); the output head's weights times
    `head_scale`."""
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(2)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(dense)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(experts)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(width)
    w.add_context_length(512)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    # A whole byte-level BPE vocabulary (llama.cpp refuses one without merges): "t", the ten
    # digits, and "t0" to "t4" merged from them.
    w.add_token_list(["t"] + [str(d) for d in range(10)] + [f"t{d}" for d in range(VOCAB - 11)])
    w.add_token_merges([f"t {d}" for d in range(VOCAB - 11)])
    w.add_eos_token_id(2)
    seed = 0
    for name, shape, kind in [
        ("token_embd.weight", (VOCAB, hidden), Q.F32),
        ("output_norm.weight", (hidden,), Q.F32),
        ("output.weight", (VOCAB, hidden), Q.BF16 if quantized != Q.F32 else Q.F32),
    ]:
        seed += 1
        tensor(w, name, shape, kind, seed, head_scale if name == "output.weight" else 1.0)
    attention = Q.F16 if quantized != Q.F32 else Q.F32
    for layer in range(2):
        for name, shape, kind in [
            ("attn_norm.weight", (hidden,), Q.F32),
            ("attn_q.weight", (HEADS * head_dim, hidden), attention),
            ("attn_k.weight", (KV_HEADS * head_dim, hidden), attention),
            ("attn_v.weight", (KV_HEADS * head_dim, hidden), attention),
            ("attn_output.weight", (hidden, HEADS * head_dim), attention),
            ("attn_q_norm.weight", (head_dim,), Q.F32),
            ("attn_k_norm.weight", (head_dim,), Q.F32),
            ("ffn_norm.weight", (hidden,), Q.F32),
        ]:
            seed += 1
            tensor(w, f"blk.{layer}.{name}", shape, kind, seed)
        if layer == 0 and first_dense:
            parts = [("ffn_gate.weight", (dense, hidden), quantized),
                     ("ffn_up.weight", (dense, hidden), quantized),
                     ("ffn_down.weight", (hidden, dense), quantized)]
        else:
            parts = [("ffn_gate_inp.weight", (experts, hidden), Q.F32),
                     ("ffn_gate_exps.weight", (experts, width, hidden), quantized),
                     ("ffn_up_exps.weight", (experts, width, hidden), quantized),
                     ("ffn_down_exps.weight", (experts, hidden, width), experts_down)]
        for name, shape, kind in parts:
            seed += 1
            tensor(w, f"blk.{layer}.{name}", shape, kind, seed)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(path, os.path.getsize(path), "bytes")


write_model(os.path.join(HERE, "tiny-qwen3moe-q8_0.gguf"), HIDDEN, WIDTH, DENSE, HEAD_DIM, EXPERTS,
            Q.Q8_0, Q.Q4_0)

if "--llama-gguf-split" in sys.argv:
    split = sys.argv[sys.argv.index("--llama-gguf-split") + 1]
    subprocess.run([split, "--split-max-tensors", "10", os.path.join(HERE, "tiny-qwen3moe-q8_0.gguf"),
                    os.path.join(HERE, "tiny-qwen3moe-q8_0")], check=True, stdout=subprocess.DEVNULL)

rows = values(4 * 128, 99).reshape(4, 128)
rows[1] *= 1000.0
rows[2, :32] = 0.0
rows[3, 0] = 1.27
rows[3, 1] = -0.635
path = os.path.join(HERE, "quantized-rows.gguf")
w = gguf.GGUFWriter(path, "rows")
w.add_tensor("rows.f32", rows)
q4 = gguf.quants.quantize(rows, Q.Q4_0)
w.add_tensor("rows.q8_0", gguf.quants.quantize(rows, Q.Q8_0), raw_dtype=Q.Q8_0)
w.add_tensor("rows.q4_0", q4, raw_dtype=Q.Q4_0)
w.add_tensor("rows.q4_0.f32", gguf.quants.dequantize(q4, Q.Q4_0).astype(np.float32))
rng = np.random.default_rng(7)
for kind, size, scales in [(Q.Q4_K, 144, [0, 2]), (Q.Q5_K, 176, [0, 2]), (Q.Q6_K, 210, [208])]:
    blocks = rng.integers(0, 256, size=(4, size), dtype=np.uint8)
    for at in scales:
        d = rng.uniform(-0.01, 0.01, size=4).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(4, 2)
    # Two rows of 512 values: two blocks each.
    blocks = blocks.reshape(2, 2 * size)
    name = "rows." + kind.name.lower()
    w.add_tensor(name, blocks, raw_dtype=kind)
    w.add_tensor(name + ".f32", gguf.quants.dequantize(blocks, kind).astype(np.float32))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(path, os.path.getsize(path), "bytes")

if "--llama-quantize" in sys.argv:
    quantize = sys.argv[sys.argv.index("--llama-quantize") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "tiny-qwen3moe-f32.gguf")
        # Four experts; attention of 4 heads of 64, so every matrix is rows of 256 values;
        # both layers MoE, so that llama.cpp itself runs these files; a head 16 times the
        # others' weights, whose logits spread over a few units as a trained model's do (the
        # others' give logits of a few hundredths, between which nothing is decided).
        write_model(f32, 256, 256, 256, 64, 4, Q.F32, Q.F32, first_dense=False, head_scale=16.0)
        for preset in ["Q4_K_M", "Q5_K_M", "Q8_0", "Q4_0"]:
            name = f"tiny-qwen3moe-{preset.lower()}"
            if preset in ("Q8_0", "Q4_0"):
                name = f"tiny-qwen3moe-llama-{preset.lower()}"
            out = os.path.join(HERE, name + ".gguf")
            subprocess.run([quantize, f32, out, preset, "1"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(out, os.path.getsize(out), "bytes")
            if "--llama-logits" in sys.argv:
                # llama.cpp's logits at every position of a fixed sequence, teacher-forced
                # (llama_logits.cpp, built as its header says), on one thread.
                logits = sys.argv[sys.argv.index("--llama-logits") + 1]
                tokens = ",".join(str(t) for t in TEACHER_TOKENS)
                with open(os.path.join(HERE, name + ".llama.json"), "w") as f:
                    subprocess.run([logits, out, tokens, "1"], check=True, stdout=f)

# The converter, run from its source tree with GPT-2's pre-tokenizer for the synthesized
# tokenizer, whose hash it does not know.
CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
import convert_hf_to_gguf
sys.argv = sys.argv[1:]
convert_hf_to_gguf.main()
"""

if "--qwen35" in sys.argv:
    checkpoint = sys.argv[sys.argv.index("--qwen35") + 1]
    source = sys.argv[sys.argv.index("--llama-cpp") + 1]
    f32 = os.path.join(HERE, "tiny-qwen35moe-f32.gguf")
    subprocess.run([sys.executable, "-c", CONVERT, source, checkpoint, "--outfile", f32,
                    "--outtype", "f32", "--no-mtp"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    print(f32, os.path.getsize(f32), "bytes")
    name = "tiny-qwen35moe-llama-q8_0"
    out = os.path.join(HERE, name + ".gguf")
    subprocess.run([quantize, f32, out, "Q8_0", "1"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    print(out, os.path.getsize(out), "bytes")
    logits = sys.argv[sys.argv.index("--llama-logits") + 1]
    tokens = ",".join(str(t) for t in TEACHER_TOKENS)
    with open(os.path.join(HERE, name + ".llama.json"), "w") as f:
        subprocess.run([logits, out, tokens, "1"], check=True, stdout=f)
