/* Every decoder layer of a CPU decode step in one call: the kernels a Llama-family layer runs from Python
 * (kernels/cpu_glue.py's norm, rotary, KV write and silu; the attention kernel; the projections' matmul kernels),
 * called through function pointers in the same order with the same arguments, so the result is the Python
 * path's bit for bit. What it removes is the host work between the kernels: a 16-sequence step of SmolLM2 made
 * about 300 Python calls into them, each with its module dispatch, views, checks and ctypes conversions, ~40 % of
 * the step beside kernels of tens of microseconds (docs/benchmarks.md). No kernel is duplicated here: the
 * caller (kernels/cpu_decode_layers.py) hands over the addresses of the functions the Python path would call,
 * and the decision of which kernel serves a projection stays with that projection's Python code.
 *
 * One layer, with x the residual stream (float32: worker_node/models/decoder.py's `residual_stream`) and delta the
 * previous layer's MLP output (NULL before the first):
 *   h = norm1(x + delta), x = x + delta;  qkv = h Wqkv;  rotary(q, k);  cache[slots] = k, v;
 *   a = attention(q);  h = norm2(x + a Wo), x = x + a Wo;  delta = down(silu(gate) * up) of h Wgate_up.
 * The last delta is left to the caller's final norm, as in worker_node/models/decoder.py.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef uint16_t bf16_t;

/* skinny_gemm / int8_gemm / int8_gemm_silu_gated: (x, w, scales, out, M, N, K, format or act_bits, threads) */
typedef int (*gemm_int_fn)(const void *, const void *, const float *, void *, int64_t, int64_t, int64_t, int, int);
/* awq_gemm: (x, codes, scales, out, M, N, K, group, threads) */
typedef int (*gemm_i64_fn)(const void *, const void *, const float *, void *, int64_t, int64_t, int64_t, int64_t,
                           int);
/* int4_weight_gemm (portable_gemm_cpu.c, AWQ without AMX): (x, codes, pairs, out, M, N, K, group, act, threads) */
typedef int (*gemm_int4_fn)(const void *, const void *, const float *, void *, int64_t, int64_t, int64_t, int64_t,
                            int, int);
/* add_rms_norm_f32: (x float32, stride, delta, stride, weight, out, sum float32, rows, width, eps, offset, threads) */
typedef void (*norm_fn)(const float *, int64_t, const bf16_t *, int64_t, const bf16_t *, bf16_t *, float *, int64_t,
                        int64_t, float, float, int);
typedef void (*rotary_fn)(bf16_t *, int64_t, int64_t, bf16_t *, int64_t, int64_t, const bf16_t *, const bf16_t *,
                          int64_t, int64_t, int64_t, int);
typedef void (*silu_fn)(const bf16_t *, bf16_t *, int64_t, int64_t, int);
typedef int (*write_kv_fn)(const bf16_t *, int64_t, const bf16_t *, int64_t, bf16_t *, bf16_t *, const int64_t *,
                           int64_t, int64_t, int64_t);
typedef void (*attention_fn)(const void *, const void *, const void *, const float *, const float *, const int32_t *,
                             const int32_t *, void *, int64_t, int64_t, int64_t, int64_t, float, int, int64_t, float,
                             int);

#define GEMM_INT_ARG 0 /* gemm_int_fn */
#define GEMM_I64_ARG 1 /* gemm_i64_fn */
#define GEMM_INT4_BF16 2 /* gemm_int4_fn, its activations bf16 (the portable kernel's act 1) */

/* One projection as its Python code would multiply `rows` rows: the kernel, its weight tensors and last argument.
 * `gated` (down projections only): the kernel takes the MLP's [rows, 2 K] gate/up rows and makes silu(gate) * up
 * itself; else the layer makes them first (silu_mul). */
typedef struct {
    void *fn;
    int64_t kind;
    const void *weight;
    const float *scales;
    int64_t arg;
    int64_t n, k;
    int64_t gated;
} Gemm;

typedef struct {
    const bf16_t *input_norm, *post_norm;
    Gemm qkv, o, gate_up, down;
    bf16_t *k_cache, *v_cache;
} Layer;

typedef struct {
    norm_fn norm;
    rotary_fn rotary;
    silu_fn silu_mul;
    write_kv_fn write_kv;
    attention_fn attention;
} Kernels;

/* The step: `rows` decode tokens, one per sequence, and the buffers each layer writes (contiguous; bf16 but for
 * the float32 residual stream, x and residual). */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, rot, inter;
    float eps, scale;
    const bf16_t *cos, *sin;  /* [rows, rot] */
    const int64_t *slots;     /* [rows] */
    int64_t num_slots, block_size, max_blocks;
    const int32_t *block_tables, *seq_lens;
    const float *x;   /* [rows, hidden]: the embeddings in, float32; not written */
    float *residual;  /* [rows, hidden]: the residual stream out, float32 */
    bf16_t *delta;    /* [rows, hidden]: the last layer's MLP output out */
    bf16_t *h, *qkv, *q, *attn, *gate_up, *act; /* scratch: [rows, hidden], [rows, q + 2 kv], [rows, q] x 2, ... */
    int threads;
    double *phase_seconds; /* NULL, or [PHASES] seconds added per phase (a profile: scripts/bench_decode_phases.py) */
} Step;

/* qkv norm, qkv, rotary + KV write + query copy, attention, o, post norm, gate/up, silu + down */
#define PHASES 8

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Adds the time since *last to phase `i` (when profiling) and restarts the clock. */
static inline void lap(const Step *s, int i, double *last) {
    if (!s->phase_seconds)
        return;
    const double t = now();
    s->phase_seconds[i] += t - *last;
    *last = t;
}

static int gemm(const Gemm *g, const void *x, void *out, int64_t rows, int threads) {
    if (g->kind == GEMM_I64_ARG)
        return ((gemm_i64_fn)g->fn)(x, g->weight, g->scales, out, rows, g->n, g->k, g->arg, threads);
    if (g->kind == GEMM_INT4_BF16)
        return ((gemm_int4_fn)g->fn)(x, g->weight, g->scales, out, rows, g->n, g->k, g->arg, 1, threads);
    return ((gemm_int_fn)g->fn)(x, g->weight, g->scales, out, rows, g->n, g->k, (int)g->arg, threads);
}

/* Returns 0; 1 + 4 * layer + part when a projection's kernel refused its call (part 0-3: qkv, o, gate_up, down),
 * -1 when a slot is outside the cache. Nothing is undone: the caller fails the step. */
int run_decode_layers(const Kernels *kernels, const Layer *layers, int64_t num_layers, const Step *s) {
    const int64_t m = s->rows, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qkv_width = q_size + 2 * kv_size;
    const float *x = s->x;
    const bf16_t *delta = NULL;
    double last = s->phase_seconds ? now() : 0.0;
    for (int64_t i = 0; i < num_layers; i++) {
        const Layer *l = layers + i;
        /* x + delta into the residual buffer (in place after the first layer: an element is read, then written) */
        kernels->norm(x, s->hidden, delta, s->hidden, l->input_norm, s->h, delta ? s->residual : NULL, m, s->hidden,
                      s->eps, 0.0f, s->threads);
        if (delta)
            x = s->residual;
        lap(s, 0, &last);
        if (gemm(&l->qkv, s->h, s->qkv, m, s->threads))
            return 1 + 4 * (int)i;
        lap(s, 1, &last);
        bf16_t *q = s->qkv, *k = s->qkv + q_size, *v = k + kv_size;
        kernels->rotary(q, qkv_width, s->heads, k, qkv_width, s->kv_heads, s->cos, s->sin, m, d, s->rot, s->threads);
        if (kernels->write_kv(k, qkv_width, v, qkv_width, l->k_cache, l->v_cache, s->slots, m, kv_size, s->num_slots))
            return -1;
        for (int64_t r = 0; r < m; r++) /* the attention kernel reads contiguous queries */
            memcpy(s->q + r * q_size, q + r * qkv_width, (size_t)q_size * sizeof(bf16_t));
        lap(s, 2, &last);
        kernels->attention(s->q, l->k_cache, l->v_cache, NULL, NULL, s->block_tables, s->seq_lens, s->attn, m,
                           s->kv_heads, s->block_size, s->max_blocks, s->scale, s->threads, 0, 0.0f, 1);
        lap(s, 3, &last);
        if (gemm(&l->o, s->attn, s->delta, m, s->threads))
            return 2 + 4 * (int)i;
        lap(s, 4, &last);
        kernels->norm(x, s->hidden, s->delta, s->hidden, l->post_norm, s->h, s->residual, m, s->hidden, s->eps, 0.0f,
                      s->threads);
        x = s->residual;
        lap(s, 5, &last);
        if (gemm(&l->gate_up, s->h, s->gate_up, m, s->threads))
            return 3 + 4 * (int)i;
        lap(s, 6, &last);
        const void *down_in = s->gate_up;
        if (!l->down.gated) {
            kernels->silu_mul(s->gate_up, s->act, m, s->inter, s->threads);
            down_in = s->act;
        }
        if (gemm(&l->down, down_in, s->delta, m, s->threads))
            return 4 + 4 * (int)i;
        lap(s, 7, &last);
        delta = s->delta;
    }
    return 0;
}
