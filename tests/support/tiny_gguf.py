"""A tiny random Llama as a GGUF file, with the default model's tokenizer: what a test of a GGUF command line feeds
it where the default model's 30 layers would take minutes (vllm-convert's AWQ search runs layer by layer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from worker_node.default_model import find_gguf

# Fields the writer sets itself, and the default model's shape (written anew below).
SKIPPED = ("GGUF.", "general.architecture", "general.file_type", "llama.")


def build_tiny_gguf(path: Path, layers: int = 2, hidden: int = 64, inter: int = 128, heads: int = 4) -> Path:
    """A float32 Llama of `layers` layers (2 KV heads) at `path`, the default model's tokenizer in its metadata."""
    from gguf import GGUFReader, GGUFWriter, LlamaFileType

    reader = GGUFReader(str(find_gguf()))
    writer = GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if not key.startswith(SKIPPED):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    vocab, kv_heads, head_dim = len(reader.fields["tokenizer.ggml.tokens"].contents()), 2, hidden // heads
    writer.add_block_count(layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(LlamaFileType.ALL_F32)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:  # (out, in), as HF lays a linear out
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden)}
        shapes |= {"attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden)}
        shapes |= {"ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
