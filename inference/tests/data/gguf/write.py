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
"""
import os

import gguf
import numpy as np

HIDDEN, WIDTH, EXPERTS, DENSE, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 8, 128, 16, 4, 2, 16
Q = gguf.GGMLQuantizationType


def values(n, seed):
    i = np.arange(n, dtype=np.float64)
    return (np.sin(i * 0.37 + seed) * 0.5).astype(np.float32)


def tensor(writer, name, shape, kind, seed):
    data = values(int(np.prod(shape)), seed).reshape(shape)
    if kind == Q.F32:
        writer.add_tensor(name, data)
    elif kind == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-qwen3moe-q8_0.gguf")
w = gguf.GGUFWriter(path, "qwen3moe")
w.add_block_count(2)
w.add_embedding_length(HIDDEN)
w.add_feed_forward_length(DENSE)
w.add_head_count(HEADS)
w.add_head_count_kv(KV_HEADS)
w.add_key_length(HEAD_DIM)
w.add_value_length(HEAD_DIM)
w.add_expert_count(EXPERTS)
w.add_expert_used_count(2)
w.add_expert_feed_forward_length(WIDTH)
w.add_context_length(512)
w.add_layer_norm_rms_eps(1e-6)
w.add_rope_freq_base(1e6)
w.add_tokenizer_model("gpt2")
w.add_token_list([f"t{i}" for i in range(VOCAB)])
w.add_eos_token_id(2)
seed = 0
for name, shape, kind in [
    ("token_embd.weight", (VOCAB, HIDDEN), Q.F32),
    ("output_norm.weight", (HIDDEN,), Q.F32),
    ("output.weight", (VOCAB, HIDDEN), Q.BF16),
]:
    seed += 1
    tensor(w, name, shape, kind, seed)
for layer in range(2):
    for name, shape, kind in [
        ("attn_norm.weight", (HIDDEN,), Q.F32),
        ("attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.F16),
        ("attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.F16),
        ("attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.F16),
        ("attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.F16),
        ("attn_q_norm.weight", (HEAD_DIM,), Q.F32),
        ("attn_k_norm.weight", (HEAD_DIM,), Q.F32),
        ("ffn_norm.weight", (HIDDEN,), Q.F32),
    ]:
        seed += 1
        tensor(w, f"blk.{layer}.{name}", shape, kind, seed)
    if layer == 0:
        parts = [("ffn_gate.weight", (DENSE, HIDDEN), Q.Q8_0),
                 ("ffn_up.weight", (DENSE, HIDDEN), Q.Q8_0),
                 ("ffn_down.weight", (HIDDEN, DENSE), Q.Q8_0)]
    else:
        parts = [("ffn_gate_inp.weight", (EXPERTS, HIDDEN), Q.F32),
                 ("ffn_gate_exps.weight", (EXPERTS, WIDTH, HIDDEN), Q.Q8_0),
                 ("ffn_up_exps.weight", (EXPERTS, WIDTH, HIDDEN), Q.Q8_0),
                 ("ffn_down_exps.weight", (EXPERTS, HIDDEN, WIDTH), Q.Q4_0)]
    for name, shape, kind in parts:
        seed += 1
        tensor(w, f"blk.{layer}.{name}", shape, kind, seed)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(path, os.path.getsize(path), "bytes")

rows = values(4 * 128, 99).reshape(4, 128)
rows[1] *= 1000.0
rows[2, :32] = 0.0
rows[3, 0] = 1.27
rows[3, 1] = -0.635
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quantized-rows.gguf")
w = gguf.GGUFWriter(path, "rows")
w.add_tensor("rows.f32", rows)
q4 = gguf.quants.quantize(rows, Q.Q4_0)
w.add_tensor("rows.q8_0", gguf.quants.quantize(rows, Q.Q8_0), raw_dtype=Q.Q8_0)
w.add_tensor("rows.q4_0", q4, raw_dtype=Q.Q4_0)
w.add_tensor("rows.q4_0.f32", gguf.quants.dequantize(q4, Q.Q4_0).astype(np.float32))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(path, os.path.getsize(path), "bytes")
