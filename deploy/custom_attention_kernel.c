/* An example compiled attention library for minivllm's attention ABI (kernels/csrc/custom_attention_abi.h):
 * plain float32 paged attention, one query head at a time, written to be read rather than to be fast.
 *
 *   gcc -O2 -shared -fPIC -I kernels/csrc deploy/custom_attention_kernel.c -o custom_attention.so -lm
 *
 *   from minivllm import LLM, _custom_ops
 *   _custom_ops.register_kernel("my_attention", "custom_attention.so")
 *   LLM(model, dtype="float32", attention={"type": "my_attention", "params": {"trace": "/tmp/calls.txt"}})
 *
 * It implements decode, prefill and the KV write, sliding windows included; it declines soft-capped scores
 * (Gemma 2), which minivllm then computes with its torch reference. Built with -DDECODE_ONLY it exports the
 * required functions only (minivllm keeps its own prefill and KV write, and refuses params).
 *
 * Its one parameter, "trace" (a file path, without quotes or backslashes in it), names a file that each decode
 * call rewrites with the number of decode calls so far: a way to see that, and where, the library ran. The
 * counters are exported for the same reason (tests/kernels/test_custom_ops.py reads them).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "custom_attention_abi.h"

int64_t example_decode_calls = 0;
int64_t example_prefill_calls = 0;
int64_t example_write_kv_calls = 0;
int64_t example_declined_calls = 0;

static char trace_path[4096];

int32_t minivllm_attention_abi_version(void) { return MINIVLLM_ATTENTION_ABI_VERSION; }

static void trace_decode_calls(void) {
    if (trace_path[0] == '\0') return;
    FILE *f = fopen(trace_path, "w");
    if (f == NULL) return;
    fprintf(f, "%lld\n", (long long)example_decode_calls);
    fclose(f);
}

/* The cache row of (token `pos` of the sequence whose block table is `table`, kv head `kv_head`). */
static const float *cache_row(const float *cache, const int32_t *table, int64_t pos, int64_t kv_head,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
    return cache + (slot * num_kv_heads + kv_head) * head_dim;
}

/* out = softmax(scale * q . k) . v over positions lo .. hi - 1 of one sequence, for one query head. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t lo,
                   int64_t hi, int64_t kv_head, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   float scale, float *out) {
    double best = -INFINITY, total = 0.0;
    for (int64_t p = lo; p < hi; p++) {
        const float *k = cache_row(k_cache, table, p, kv_head, num_kv_heads, head_dim, block_size);
        double score = 0.0;
        for (int64_t d = 0; d < head_dim; d++) score += (double)q[d] * k[d];
        if (score * scale > best) best = score * scale;
    }
    double acc[head_dim];
    for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.0;
    for (int64_t p = lo; p < hi; p++) {
        const float *k = cache_row(k_cache, table, p, kv_head, num_kv_heads, head_dim, block_size);
        const float *v = cache_row(v_cache, table, p, kv_head, num_kv_heads, head_dim, block_size);
        double score = 0.0;
        for (int64_t d = 0; d < head_dim; d++) score += (double)q[d] * k[d];
        double weight = exp(score * scale - best);
        total += weight;
        for (int64_t d = 0; d < head_dim; d++) acc[d] += weight * v[d];
    }
    for (int64_t d = 0; d < head_dim; d++) out[d] = (float)(acc[d] / total);
}

/* The first position the query at `pos` sees. */
static int64_t window_start(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

int32_t minivllm_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                  const int32_t *block_tables, const int32_t *seq_lens, float *out,
                                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t num_blocks, int64_t block_size, int64_t max_blocks_per_seq, float scale,
                                  int64_t window, float softcap, void *stream) {
    (void)num_blocks, (void)stream;
    if (softcap != 0.0f) {
        example_declined_calls++;
        return MINIVLLM_ATTENTION_DECLINED;
    }
    int64_t group = num_heads / num_kv_heads;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int32_t *table = block_tables + b * max_blocks_per_seq;
        int64_t len = seq_lens[b];
        for (int64_t h = 0; h < num_heads; h++) {
            int64_t row = (b * num_heads + h) * head_dim;
            attend(q + row, k_cache, v_cache, table, window_start(len - 1, window), len, h / group, num_kv_heads,
                   head_dim, block_size, scale, out + row);
        }
    }
    example_decode_calls++;
    trace_decode_calls();
    return MINIVLLM_ATTENTION_OK;
}

#ifndef DECODE_ONLY
/* Accepts {} or {"trace": "PATH"}; anything else is refused (returns 2). */
int32_t minivllm_attention_configure(const char *params_json) {
    const char *key = strstr(params_json, "\"trace\"");
    trace_path[0] = '\0';
    if (key == NULL) return strcmp(params_json, "{}") == 0 ? MINIVLLM_ATTENTION_OK : 2;
    const char *start = strchr(key + 7, '"');
    const char *end = start ? strchr(start + 1, '"') : NULL;
    if (end == NULL || (size_t)(end - start - 1) >= sizeof trace_path) return 2;
    memcpy(trace_path, start + 1, (size_t)(end - start - 1));
    trace_path[end - start - 1] = '\0';
    return MINIVLLM_ATTENTION_OK;
}

int32_t minivllm_prefill_attention(const float *q, const float *k_cache, const float *v_cache,
                                   const int32_t *block_tables, const int32_t *cu_seqlens_q, const int32_t *seq_lens,
                                   float *out, int64_t num_seqs, int64_t num_tokens, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                   int64_t max_blocks_per_seq, float scale, int64_t window, float softcap,
                                   void *stream) {
    (void)num_tokens, (void)num_blocks, (void)stream;
    if (softcap != 0.0f) {
        example_declined_calls++;
        return MINIVLLM_ATTENTION_DECLINED;
    }
    int64_t group = num_heads / num_kv_heads;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int32_t *table = block_tables + s * max_blocks_per_seq;
        int64_t first = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - first;
        int64_t prefix = seq_lens[s] - q_len;
        for (int64_t i = 0; i < q_len; i++) {
            int64_t pos = prefix + i;
            for (int64_t h = 0; h < num_heads; h++) {
                int64_t row = ((first + i) * num_heads + h) * head_dim;
                attend(q + row, k_cache, v_cache, table, window_start(pos, window), pos + 1, h / group,
                       num_kv_heads, head_dim, block_size, scale, out + row);
            }
        }
    }
    example_prefill_calls++;
    return MINIVLLM_ATTENTION_OK;
}

int32_t minivllm_write_kv(const float *key, const float *value, float *k_cache, float *v_cache,
                          const int64_t *slot_mapping, int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, void *stream) {
    (void)stream;
    int64_t row = num_kv_heads * head_dim;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) return 3; /* an error: minivllm fails the step naming this value */
        memcpy(k_cache + slot * row, key + t * row, (size_t)row * sizeof(float));
        memcpy(v_cache + slot * row, value + t * row, (size_t)row * sizeof(float));
    }
    example_write_kv_calls++;
    return MINIVLLM_ATTENTION_OK;
}
#endif
