/* minivllm's attention ABI, version 1: what a compiled attention library exports so that minivllm can run it.
 *
 *   from minivllm import _custom_ops
 *   _custom_ops.register_kernel("my_attention", "path/to/custom_attention.so")
 *   LLM(model, dtype="float32", attention_backend="my_attention")   # or attention={"type": "my_attention"}
 *
 * The library is loaded with dlopen (Python's ctypes) in every worker that uses it; kernels/attention_abi.py is
 * the other side of this file. An example that implements all of it: deploy/custom_attention_kernel.c.
 *
 * Tensors. Every pointer is the start of a contiguous row-major float32 tensor on the worker's device (host
 * memory on a CPU worker; device memory on a CUDA worker, where `stream` is the current cudaStream_t and the
 * library enqueues its work on it; NULL on CPU). The paged KV cache of one layer is
 *
 *     k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
 *
 * and token p of a sequence lives in slot block_tables[seq][p / block_size] * block_size + p % block_size.
 * Query head h reads kv head h / (num_heads / num_kv_heads) (grouped-query attention). Block-table entries past
 * a sequence's last block are padding: read none of them.
 *
 * Every function returns MINIVLLM_ATTENTION_OK, or MINIVLLM_ATTENTION_DECLINED when it does not handle this call
 * (a soft-cap, a head size it was not written for, ...): minivllm then runs its torch reference
 * (kernels/torch_attention.py) for the call; any other value is an error and fails the step, naming the
 * library, the function and the value.
 *
 * Only float32 KV caches (run the model with dtype float32); a quantized cache (--kv-cache-dtype int8/fp8_e4m3)
 * is refused when the worker starts.
 */
#ifndef MINIVLLM_CUSTOM_ATTENTION_ABI_H
#define MINIVLLM_CUSTOM_ATTENTION_ABI_H

#include <stdint.h>

#define MINIVLLM_ATTENTION_ABI_VERSION 1

#define MINIVLLM_ATTENTION_OK 0
#define MINIVLLM_ATTENTION_DECLINED 1

#ifdef __cplusplus
extern "C" {
#endif

/* Required: MINIVLLM_ATTENTION_ABI_VERSION as this header says it. A library of another version is refused. */
int32_t minivllm_attention_abi_version(void);

/* Required: one query token per sequence (decode), over that sequence's first seq_lens[b] cached tokens, its own
 * key and value included (already written).
 *   q, out:       [num_seqs, num_heads, head_dim]
 *   block_tables: [num_seqs, max_blocks_per_seq] int32
 *   seq_lens:     [num_seqs] int32
 *   scale:        multiplies q . k
 *   window:       0, or a sliding window: the query at position p sees positions p - window + 1 .. p
 *   softcap:      0, or scores become softcap * tanh(score / softcap) before the softmax */
int32_t minivllm_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                  const int32_t *block_tables, const int32_t *seq_lens, float *out,
                                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t num_blocks, int64_t block_size, int64_t max_blocks_per_seq, float scale,
                                  int64_t window, float softcap, void *stream);

/* Optional (without it: kernels/torch_attention.py's paged_prefill_attention). Causal attention of each
 * sequence's new tokens over its cached prefix and themselves: sequence s has the query rows
 * cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1, the last seq_lens[s] - q_len .. seq_lens[s] - 1 of its positions.
 * The new tokens' keys and values are already in the cache when it is called.
 *   q, out:       [num_tokens, num_heads, head_dim]
 *   cu_seqlens_q: [num_seqs + 1] int32
 *   the rest as for decode */
int32_t minivllm_prefill_attention(const float *q, const float *k_cache, const float *v_cache,
                                   const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                                   float *out, int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                   int64_t max_blocks_per_seq, float scale, int64_t window, float softcap,
                                   void *stream);

/* Optional (without it: kernels/torch_attention.py's write_kv). The new tokens' keys and values into their slots.
 *   key, value:   [num_tokens, num_kv_heads, head_dim]
 *   slot_mapping: [num_tokens] int64, a flat slot (block * block_size + offset) < num_slots; negative: skip it */
int32_t minivllm_write_kv(const float *key, const float *value, float *k_cache, float *v_cache,
                          const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, void *stream);

/* Optional: the `params` of the attention setting ({"type": "my_attention", "params": {...}}) as JSON text, called
 * before the worker's first step (and again whenever a backend is built from this library in the process: the
 * settings are the library's, global). Non-zero refuses them; the worker then stops naming attention.params.
 * A library without it is refused when params are given. */
int32_t minivllm_attention_configure(const char *params_json);

#ifdef __cplusplus
}
#endif

#endif
