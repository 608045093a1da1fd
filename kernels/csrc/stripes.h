/* How a matrix product's stripes (runs of output channels) are shared by the threads of one OpenMP team.
 *
 * Each thread owns a contiguous run of stripes and takes them from its front, so the stripe it prefetches while
 * one multiplies (the next of its run) is the one it takes next: handed out one at a time in order
 * (`schedule(dynamic, 1)`), the next stripe in memory usually went to the other thread, and the prefetch filled
 * the wrong core's L2 (a cold pass over SmolLM2's projections, 2 threads: bf16 one row 11.0 -> 8.5 ms, int8 16
 * rows 6.2 -> 4.7 ms). A thread whose run is done takes stripes from the back of another's, so one that is
 * descheduled mid-call (on cores shared with the engine's threads) holds back one stripe, never half the call.
 *
 * Usage, in the calling thread before the parallel region: `StripeRun runs[MAX_STRIPE_THREADS]` and
 * `stripe_runs_init(runs, stripes, threads)`; in the region, `while ((s = stripe_take(runs, threads, t, &ahead))
 * >= 0)`, prefetching stripe `ahead` (when >= 0) while stripe `s` multiplies.
 */
#ifndef STRIPES_H
#define STRIPES_H

#include <stdatomic.h>
#include <stdint.h>

#define MAX_STRIPE_THREADS 64

typedef struct {
    _Alignas(64) _Atomic uint64_t span; /* [lo, hi): lo in the low 32 bits, hi in the high 32; a line each */
} StripeRun;

static inline uint64_t stripe_span(uint64_t lo, uint64_t hi) { return lo | hi << 32; }

/* Threads for `stripes` stripes: at most one per stripe and MAX_STRIPE_THREADS, at least one. */
static inline int team_size(int threads, int64_t stripes) {
    if (threads > stripes)
        threads = (int)stripes;
    if (threads > MAX_STRIPE_THREADS)
        threads = MAX_STRIPE_THREADS;
    return threads < 1 ? 1 : threads;
}

/* Thread t's run: [t * stripes / threads, (t + 1) * stripes / threads). */
static inline void stripe_runs_init(StripeRun *runs, int64_t stripes, int threads) {
    for (int t = 0; t < threads; t++)
        atomic_init(&runs[t].span, stripe_span((uint64_t)(t * stripes / threads),
                                               (uint64_t)((t + 1) * stripes / threads)));
}

/* The next stripe for thread t (-1: none is left anywhere), and in *ahead the one it will likely take after it
 * (-1: none), worth prefetching: the next of its own run, or when it takes from another's back, the one before. */
static inline int64_t stripe_take(StripeRun *runs, int threads, int t, int64_t *ahead) {
    uint64_t span = atomic_load_explicit(&runs[t].span, memory_order_relaxed);
    for (;;) { /* from the front of its own run */
        const uint64_t lo = span & 0xFFFFFFFFu, hi = span >> 32;
        if (lo >= hi)
            break;
        if (atomic_compare_exchange_weak_explicit(&runs[t].span, &span, stripe_span(lo + 1, hi),
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *ahead = lo + 1 < hi ? (int64_t)lo + 1 : -1;
            return (int64_t)lo;
        }
    }
    for (int i = 1; i < threads; i++) { /* from the back of another's */
        StripeRun *run = &runs[(t + i) % threads];
        span = atomic_load_explicit(&run->span, memory_order_relaxed);
        for (;;) {
            const uint64_t lo = span & 0xFFFFFFFFu, hi = span >> 32;
            if (lo >= hi)
                break;
            if (atomic_compare_exchange_weak_explicit(&run->span, &span, stripe_span(lo, hi - 1),
                                                      memory_order_relaxed, memory_order_relaxed)) {
                *ahead = hi - 1 > lo ? (int64_t)hi - 2 : -1;
                return (int64_t)hi - 1;
            }
        }
    }
    *ahead = -1;
    return -1;
}

#endif /* STRIPES_H */
