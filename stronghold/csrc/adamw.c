/*
 * CPU AdamW for stronghold's streamed blocks: one pass over a block's fp32 master, m and v that
 * reads its gradient (bf16 as it came off the GPU, or fp32), updates in place and writes the bf16
 * working copy that the next forward's H2D reads. Called through ctypes, which releases the GIL,
 * so the main thread keeps launching GPU work while this runs on `nthreads` OpenMP threads.
 *
 * The arithmetic follows torch.optim.AdamW's single-tensor path step by step (decay, lerp, mul +
 * addcmul, sqrt / bc2_sqrt + eps, addcdiv), so fp32 results match it to rounding.
 * Chunks are handed out dynamically: the optimizer shares the cores with the threads that launch GPU
 * work, and with a static split one preempted thread would hold up the whole update.
 * Built with -ffp-contract=off for the same reason: no fused multiply-adds that torch does not do;
 * -fno-math-errno only lets sqrtf vectorize (errno is never read).
 */
#include <math.h>
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

/* One chunk of the update; returns the sum of squares of the unscaled gradient. */
static inline __attribute__((always_inline)) double step_chunk(float *p, float *m, float *v, const void *g,
                                                              uint16_t *out, int64_t lo, int64_t hi, float scale,
                                                              const sh_coeffs *c, const int g_bf16,
                                                              const int has_out) {
    /* fp32 within a chunk (as torch's fp32 norms), fp64 across chunks: full-width vectors. */
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_bf16);
        sq += gi * gi;
        float pi = adamw_elem(p, m, v, i, gi * scale, c);
        if (has_out) out[i] = f32_to_bf16(pi);
    }
    return sq;
}

#define STEP_LOOP(G_BF16, HAS_OUT)                                                              \
    _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 4) reduction(+ : total)")     \
    for (int64_t k = 0; k < nchunks; ++k) {                                                     \
        int64_t lo = k * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;                           \
        total += step_chunk(p, m, v, g, out, lo, hi, scale, c, G_BF16, HAS_OUT);        \
    }

/* AdamW step of n elements with gradient g * scale; returns sum(g^2) of the unscaled g. */
double sh_adamw_step(float *p, float *m, float *v, const void *g, int g_bf16, uint16_t *out, int64_t n,
                     const sh_coeffs *c, float scale, int nthreads) {
    double total = 0.0;
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    if (g_bf16 && out) {
        STEP_LOOP(1, 1)
    } else if (g_bf16) {
        STEP_LOOP(1, 0)
    } else if (out) {
        STEP_LOOP(0, 1)
    } else {
        STEP_LOOP(0, 0)
    }
    return total;
}

static inline __attribute__((always_inline)) void redo_chunk(float *p, float *m, float *v, const void *g,
                                                             uint16_t *out, int64_t lo, int64_t hi, float scale,
                                                             const sh_coeffs *s, const sh_coeffs *f,
                                                             const int g_bf16, const int has_out) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_bf16);
        /* Undo the speculative step s (made with the unscaled g): invert each line of adamw_elem. */
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
}

#define REDO_LOOP(G_BF16, HAS_OUT)                                                              \
    _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 4)")                          \
    for (int64_t k = 0; k < nchunks; ++k) {                                                     \
        int64_t lo = k * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;                           \
        redo_chunk(p, m, v, g, out, lo, hi, scale, s, f, G_BF16, HAS_OUT);                      \
    }

/* Replace a speculative step made with coefficients s and the unscaled g by the step that the
 * final coefficients f and the clipped gradient g * scale give (speculate, then validate). */
void sh_adamw_redo(float *p, float *m, float *v, const void *g, int g_bf16, uint16_t *out, int64_t n,
                   const sh_coeffs *s, const sh_coeffs *f, float scale, int nthreads) {
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    if (g_bf16 && out) {
        REDO_LOOP(1, 1)
    } else if (g_bf16) {
        REDO_LOOP(1, 0)
    } else if (out) {
        REDO_LOOP(0, 1)
    } else {
        REDO_LOOP(0, 0)
    }
}

/* sum(g^2), for the global norm when the update itself waits for it (deferred steps). */
double sh_sum_squares(const void *g, int g_bf16, int64_t n, int nthreads) {
    double total = 0.0;
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4) reduction(+ : total)
    for (int64_t k = 0; k < nchunks; ++k) {
        int64_t lo = k * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        float sq = 0.0f; /* same summation as sh_adamw_step's, so both modes see the same norm */
        if (g_bf16) {
#pragma omp simd reduction(+ : sq)
            for (int64_t i = lo; i < hi; ++i) {
                float gi = bf16_to_f32(((const uint16_t *)g)[i]);
                sq += gi * gi;
            }
        } else {
#pragma omp simd reduction(+ : sq)
            for (int64_t i = lo; i < hi; ++i) {
                float gi = ((const float *)g)[i];
                sq += gi * gi;
            }
        }
        total += (double)sq;
    }
    return total;
}

/* acc = (first ? 0 : acc) + g, for gradient accumulation across micro-steps. */
void sh_accumulate(float *acc, const void *g, int g_bf16, int64_t n, int first, int nthreads) {
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 4)
    for (int64_t k = 0; k < nchunks; ++k) {
        int64_t lo = k * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        if (g_bf16) {
            const uint16_t *gb = (const uint16_t *)g;
            for (int64_t i = lo; i < hi; ++i) acc[i] = (first ? 0.0f : acc[i]) + bf16_to_f32(gb[i]);
        } else {
            const float *gf = (const float *)g;
            for (int64_t i = lo; i < hi; ++i) acc[i] = (first ? 0.0f : acc[i]) + gf[i];
        }
    }
}
