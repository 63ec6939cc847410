/*
 * CPU AdamW for stronghold's streamed blocks: one pass over a block's fp32 master, m and v that
 * reads its gradient (bf16 as it came off the GPU, or fp32), updates in place and writes the bf16
 * working copy that the next forward's H2D reads. Called through ctypes, which releases the GIL,
 * so the main thread keeps launching GPU work while this runs on `nthreads` threads.
 *
 * The arithmetic follows torch.optim.AdamW's single-tensor path step by step (decay, lerp, mul +
 * addcmul, sqrt / bc2_sqrt + eps, addcdiv), so fp32 results match it to rounding.
 *
 * Threads: plain pthreads started per call, taking fixed-size chunks from an atomic counter, and
 * gone when the call returns. Not OpenMP: its idle threads spin-wait after each parallel region
 * (OMP_WAIT_POLICY is process-wide and read once, before we load), stealing the cores that the
 * threads launching GPU work and torch's own CPU ops need between two block updates. Dynamic
 * chunks keep one preempted thread from holding up the whole update.
 * Built with -ffp-contract=off (no fused multiply-adds that torch does not do); -fno-math-errno
 * only lets sqrtf vectorize (errno is never read); -fopenmp-simd honours the `omp simd` loop
 * pragmas (vectorized reductions) without linking an OpenMP runtime.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float decay;          /* 1 - lr * weight_decay */
    float w1;             /* 1 - beta1 (the lerp weight) */
    float beta2;
    float omb2;           /* 1 - beta2 */
    float neg_step_size;  /* -lr / (1 - beta1^step) */
    float bc2_sqrt;       /* sqrt(1 - beta2^step) */
    float eps;
} sh_coeffs;

#define CHUNK 16384
#define MAX_THREADS 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's c10::BFloat16 does (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (f != f) ? (uint16_t)0x7FC0 : (uint16_t)rounded;
}

static inline __attribute__((always_inline)) float load_g(const void *g, int64_t i, const int g_bf16) {
    return g_bf16 ? bf16_to_f32(((const uint16_t *)g)[i]) : ((const float *)g)[i];
}

/* ---- the parallel loop: chunks [lo, hi) of n elements handed out by an atomic counter ---- */

typedef struct task task;
typedef double (*chunk_fn)(const task *t, int64_t lo, int64_t hi);

struct task {
    chunk_fn fn;
    int64_t n;
    int64_t next_chunk; /* atomic */
    float *p, *m, *v, *acc;
    const void *g;
    uint16_t *out;
    const sh_coeffs *c, *f;
    float scale;
    int first;
};

typedef struct {
    task *t;
    double sum;
} worker;

static void *work(void *arg) {
    worker *w = (worker *)arg;
    task *t = w->t;
    for (;;) {
        int64_t lo = __atomic_fetch_add(&t->next_chunk, 1, __ATOMIC_RELAXED) * (int64_t)CHUNK;
        if (lo >= t->n) break;
        int64_t hi = lo + CHUNK < t->n ? lo + CHUNK : t->n;
        w->sum += t->fn(t, lo, hi);
    }
    return NULL;
}

/* Run t->fn over all chunks on up to nthreads threads (the caller is one); sum of what fn returns. */
static double run(task *t, int nthreads) {
    int64_t nchunks = (t->n + CHUNK - 1) / CHUNK;
    if (nthreads > nchunks) nthreads = (int)nchunks;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads < 1) nthreads = 1;
    pthread_t ids[MAX_THREADS];
    worker workers[MAX_THREADS];
    int started = 1;
    for (int i = 0; i < nthreads; ++i) workers[i] = (worker){t, 0.0};
    for (; started < nthreads; ++started) {
        /* If the system refuses a thread, the ones running (and the caller) do all the chunks. */
        if (pthread_create(&ids[started], NULL, work, &workers[started]) != 0) break;
    }
    work(&workers[0]);
    double total = workers[0].sum;
    for (int i = 1; i < started; ++i) {
        pthread_join(ids[i], NULL);
        total += workers[i].sum;
    }
    return total;
}

/* ---- AdamW ---- */

static inline __attribute__((always_inline)) float adamw_elem(float *p, float *m, float *v, int64_t i, float gs,
                                                              const sh_coeffs *c) {
    float pi = p[i] * c->decay;
    float mi = m[i] + c->w1 * (gs - m[i]);
    float vi = v[i] * c->beta2;
    vi = vi + c->omb2 * gs * gs;
    float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
    pi = pi + c->neg_step_size * (mi / denom);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    return pi;
}

/* One chunk of the update; returns the sum of squares of the unscaled gradient (fp32 within the
 * chunk, as torch's fp32 norms; fp64 across chunks). */
static inline __attribute__((always_inline)) double step_chunk(const task *t, int64_t lo, int64_t hi,
                                                               const int g_bf16, const int has_out) {
    float *p = t->p, *m = t->m, *v = t->v;
    const void *g = t->g; /* hoisted: a store through p/m/v could otherwise alias the task */
    uint16_t *out = t->out;
    const sh_coeffs *c = t->c;
    const float scale = t->scale;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_bf16);
        sq += gi * gi;
        float pi = adamw_elem(p, m, v, i, gi * scale, c);
        if (has_out) out[i] = f32_to_bf16(pi);
    }
    return (double)sq;
}

/* Undo the speculative step t->c (made with the unscaled g) by inverting each line of adamw_elem,
 * then apply the final step t->f with g * scale. */
static inline __attribute__((always_inline)) double redo_chunk(const task *t, int64_t lo, int64_t hi,
                                                               const int g_bf16, const int has_out) {
    float *p = t->p, *m = t->m, *v = t->v;
    const void *g = t->g; /* hoisted: a store through p/m/v could otherwise alias the task */
    uint16_t *out = t->out;
    const sh_coeffs *s = t->c, *f = t->f;
    const float scale = t->scale;
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_bf16);
        float upd = m[i] / (sqrtf(v[i]) / s->bc2_sqrt + s->eps);
        float p0 = (p[i] - s->neg_step_size * upd) / s->decay;
        float m0 = (m[i] - s->w1 * gi) / (1.0f - s->w1);
        float v0 = (v[i] - s->omb2 * gi * gi) / s->beta2;
        p[i] = p0;
        m[i] = m0;
        /* Rounding can leave a tiny negative where v was ~0; v is a sum of squares. */
        v[i] = v0 > 0.0f ? v0 : 0.0f;
        float pi = adamw_elem(p, m, v, i, gi * scale, f);
        if (has_out) out[i] = f32_to_bf16(pi);
    }
    return 0.0;
}

static inline __attribute__((always_inline)) double sum_squares_chunk(const task *t, int64_t lo, int64_t hi,
                                                                      const int g_bf16) {
    const void *g = t->g;
    float sq = 0.0f; /* the same summation as step_chunk's, so both clipping modes see the same norm */
#pragma omp simd reduction(+ : sq)
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_bf16);
        sq += gi * gi;
    }
    return (double)sq;
}

static inline __attribute__((always_inline)) double accumulate_chunk(const task *t, int64_t lo, int64_t hi,
                                                                     const int g_bf16) {
    float *acc = t->acc;
    const void *g = t->g;
    const int first = t->first;
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) acc[i] = (first ? 0.0f : acc[i]) + load_g(g, i, g_bf16);
    return 0.0;
}

/* Specializations with the flags as constants, so each inner loop vectorizes without branches. */
#define WITH_FLAGS(NAME, BODY, G, O) \
    static double NAME##_##G##O(const task *t, int64_t lo, int64_t hi) { return BODY(t, lo, hi, G, O); }
#define WITH_FLAG(NAME, BODY, G) \
    static double NAME##_##G(const task *t, int64_t lo, int64_t hi) { return BODY(t, lo, hi, G); }
WITH_FLAGS(step, step_chunk, 0, 0)
WITH_FLAGS(step, step_chunk, 0, 1)
WITH_FLAGS(step, step_chunk, 1, 0)
WITH_FLAGS(step, step_chunk, 1, 1)
WITH_FLAGS(redo, redo_chunk, 0, 0)
WITH_FLAGS(redo, redo_chunk, 0, 1)
WITH_FLAGS(redo, redo_chunk, 1, 0)
WITH_FLAGS(redo, redo_chunk, 1, 1)
WITH_FLAG(sumsq, sum_squares_chunk, 0)
WITH_FLAG(sumsq, sum_squares_chunk, 1)
WITH_FLAG(accumulate, accumulate_chunk, 0)
WITH_FLAG(accumulate, accumulate_chunk, 1)

static const chunk_fn STEP[2][2] = {{step_00, step_01}, {step_10, step_11}};
static const chunk_fn REDO[2][2] = {{redo_00, redo_01}, {redo_10, redo_11}};
static const chunk_fn SUMSQ[2] = {sumsq_0, sumsq_1};
static const chunk_fn ACCUMULATE[2] = {accumulate_0, accumulate_1};

/* AdamW step of n elements with gradient g * scale; returns sum(g^2) of the unscaled g. */
double sh_adamw_step(float *p, float *m, float *v, const void *g, int g_bf16, uint16_t *out, int64_t n,
                     const sh_coeffs *c, float scale, int nthreads) {
    task t = {.fn = STEP[g_bf16 != 0][out != NULL], .n = n, .p = p, .m = m, .v = v, .g = g, .out = out,
              .c = c, .scale = scale};
    return run(&t, nthreads);
}

/* Replace a speculative step made with coefficients s and the unscaled g by the step that the
 * final coefficients f and the clipped gradient g * scale give (speculate, then validate). */
void sh_adamw_redo(float *p, float *m, float *v, const void *g, int g_bf16, uint16_t *out, int64_t n,
                   const sh_coeffs *s, const sh_coeffs *f, float scale, int nthreads) {
    task t = {.fn = REDO[g_bf16 != 0][out != NULL], .n = n, .p = p, .m = m, .v = v, .g = g, .out = out,
              .c = s, .f = f, .scale = scale};
    run(&t, nthreads);
}

/* sum(g^2), for the global norm when the update itself waits for it (deferred steps). */
double sh_sum_squares(const void *g, int g_bf16, int64_t n, int nthreads) {
    task t = {.fn = SUMSQ[g_bf16 != 0], .n = n, .g = g};
    return run(&t, nthreads);
}

/* acc = (first ? 0 : acc) + g, for gradient accumulation across micro-steps. */
void sh_accumulate(float *acc, const void *g, int g_bf16, int64_t n, int first, int nthreads) {
    task t = {.fn = ACCUMULATE[g_bf16 != 0], .n = n, .acc = acc, .g = g, .first = first};
    run(&t, nthreads);
}
