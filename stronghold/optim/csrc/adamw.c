/*
 * CPU AdamW for stronghold's streamed blocks: one pass over a block's fp32 master, m and v that
 * reads its gradient (bf16 or fp16 as it came off the GPU, or fp32), updates in place and writes the
 * bf16 or fp16 working copy that the next forward's H2D reads. Called through ctypes, which releases the GIL,
 * so the main thread keeps launching GPU work while this runs on `nthreads` threads.
 *
 * The arithmetic follows torch.optim.AdamW's single-tensor path step by step (decay, lerp, mul +
 * addcmul, sqrt / bc2_sqrt + eps, addcdiv), so fp32 results match it to rounding.
 *
 * Threads: plain pthreads started per call (on small stacks that glibc reuses: run_threads), taking fixed-size
 * chunks from an atomic counter, and gone when the call returns. Not OpenMP: its idle threads spin-wait after each parallel region
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
#include <time.h>

typedef struct {
    float decay;          /* 1 - lr * weight_decay */
    float w1;             /* 1 - beta1 (the lerp weight) */
    float beta2;
    float omb2;           /* 1 - beta2 */
    float neg_step_size;  /* -lr / (1 - beta1^step) */
    float bc2_sqrt;       /* sqrt(1 - beta2^step) */
    float eps;
    float fresh;          /* 1: this is the parameter's first step, so m and v were exactly 0 before it */
} sh_coeffs;

#define CHUNK 16384
#define MAX_THREADS 256

/* Element dtypes, as cpu_adam.py passes them: of the gradient (F32, BF16, F16) and of the working
 * copy written out (NONE: fp32 mode, where the master is the working copy; BF16; F16). */
enum { F32 = 0, NONE = 0, BF16 = 1, F16 = 2 };

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32(((uint32_t)h) << 16); }

/* Round to nearest even, as torch's c10::BFloat16 does (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (f != f) ? (uint16_t)0x7FC0 : (uint16_t)rounded;
}

/* IEEE half to float, exact for every input: normals, subnormals, +-0, +-inf, NaN (quiet). The
 * algorithm of c10::detail::fp16_ieee_to_fp32_value (from the FP16 library), branch-free so the
 * loops that call it stay vectorized; F16C's vcvtph2ps would need a separate code path per ISA.
 * Normal, inf and NaN: the exponent and mantissa bits move to their float positions with the
 * exponent rebiased by +224, then a multiply by 2^-112 makes it +112 = 127 - 15 (exact; an
 * exponent of 31 becomes 255, so inf and NaN stay inf and NaN). Subnormal (exponent 0): the 10
 * mantissa bits m below a float 0.5 give 0.5 + m 2^-24; subtracting 0.5 leaves m 2^-24 exactly. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w; /* exponent and mantissa at the top, sign shifted out */
    const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t magnitude = two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized);
    return bits_f32(sign | magnitude);
}

/* Float to IEEE half, rounded to nearest even like torch's c10::Half conversion (the algorithm of
 * c10::detail::fp16_ieee_from_fp32_value), branch-free. The FPU does the rounding: with e the
 * exponent of f (clamped at -14, the half's smallest normal exponent), 2^(e+15) + 4|f| has an ulp of
 * 2^(e-8), so the add rounds |f| to a multiple of 2^(e-10), the half's ulp at e, nearest even (on the
 * subnormal grid 2^-24 below 2^-14). The sum's low 5 exponent bits are the half's exponent minus one
 * and its low 11 mantissa bits the half's mantissa with the implicit 1, which adds that one back (and
 * a rounding carry moves into the exponent, up to 31 = inf at 65520, the midpoint above 65504).
 * |f| >= 2^16, an exponent the half cannot hold, is made inf first by the scale up by 2^112. NaN becomes the
 * quiet NaN 0x7E00 with f's sign. Needs IEEE float arithmetic without reassociation (no -ffast-math). */
static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline __attribute__((always_inline)) float load_g(const void *g, int64_t i, const int g_kind) {
    if (g_kind == BF16) return bf16_to_f32(((const uint16_t *)g)[i]);
    if (g_kind == F16) return f16_to_f32(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

static inline __attribute__((always_inline)) void store_out(uint16_t *out, int64_t i, float x, const int out_kind) {
    if (out_kind == BF16) out[i] = f32_to_bf16(x);
    if (out_kind == F16) out[i] = f32_to_f16(x);
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
    const void *g2; /* accumulate_chunk: a second gradient added after g (NULL: none) */
    uint16_t *out;
    uint16_t *lo16; /* master_*_chunk: the low 16 bits of a compact fp32 master (`out` holds the high, bf16) */
    const sh_coeffs *c, *f;
    float scale;      /* the final gradient is g * scale */
    float spec_scale; /* redo_chunk: the speculative step's gradient was g * spec_scale */
    int first;
    int undo; /* redo_chunk: restore the state before the speculative step and stop there */
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

/* Nanoseconds spent in run() over the process, all callers: beside the calling job's wall time it tells the
 * kernel's own time from what the job spent outside it (the GIL after ctypes returns, Python bookkeeping). */
static int64_t kernel_ns = 0; /* atomic */

int64_t sh_kernel_ns(void) { return __atomic_load_n(&kernel_ns, __ATOMIC_RELAXED); }

/* Faults [p, p + n) in writable without changing a byte: one locked add of zero to a word of each page. The prefault's
 * thread (streaming/prefault.py) calls it on the fp32 moments ahead of their first update. A fault taken this way
 * holds its own mapping's lock for the one page (per-VMA locks, Linux 6.4 on; the process's mmap lock for the one
 * fault before), where MADV_POPULATE_WRITE holds the mmap lock for the whole call, and every other thread's mmap
 * and munmap wait behind it. A locked add on x86 (an atomic add of zero where a compiler might turn it into a load,
 * which would map the zero page rather than fault writable), so an update already writing the page loses nothing. */
static inline void touch_word(int32_t *w) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("lock addl $0, %0" : "+m"(*w) : : "memory");
#else
    __atomic_fetch_add((volatile int32_t *)w, 0, __ATOMIC_RELAXED);
#endif
}

void sh_fault_in(char *p, int64_t n, int64_t page) {
    uintptr_t a = ((uintptr_t)p + 3) & ~(uintptr_t)3, end = (uintptr_t)p + (uintptr_t)n;
    while (a + 4 <= end) {
        touch_word((int32_t *)a);
        a = (a / (uintptr_t)page + 1) * (uintptr_t)page;
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double run_threads(task *t, int nthreads);

/* Run t->fn over all chunks on up to nthreads threads (the caller is one); sum of what fn returns. */
static double run(task *t, int nthreads) {
    int64_t start = now_ns();
    double total = run_threads(t, nthreads);
    __atomic_fetch_add(&kernel_ns, now_ns() - start, __ATOMIC_RELAXED);
    return total;
}

/* Stack of each kernel thread. glibc keeps the stacks of exited threads for reuse up to 40 MiB in all; at the default
 * 8 MiB (RLIMIT_STACK) 15 threads overflow that cache, so every call mapped and unmapped most stacks, and each unmap
 * interrupts every core running this process (a TLB shootdown), the thread launching GPU work among them. The
 * chunk loops need a few KiB; 256 KiB stacks all stay cached. 0: the system default (sh_set_thread_stack). */
static int64_t thread_stack_bytes = 256 * 1024;

void sh_set_thread_stack(int64_t bytes) { __atomic_store_n(&thread_stack_bytes, bytes, __ATOMIC_RELAXED); }

static double run_threads(task *t, int nthreads) {
    int64_t nchunks = (t->n + CHUNK - 1) / CHUNK;
    if (nthreads > nchunks) nthreads = (int)nchunks;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads < 1) nthreads = 1;
    pthread_t ids[MAX_THREADS];
    worker workers[MAX_THREADS];
    int started = 1;
    for (int i = 0; i < nthreads; ++i) workers[i] = (worker){t, 0.0};
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    int64_t stack = __atomic_load_n(&thread_stack_bytes, __ATOMIC_RELAXED);
    if (stack > 0) pthread_attr_setstacksize(&attr, (size_t)stack); /* below the minimum: EINVAL, default kept */
    for (; started < nthreads; ++started) {
        /* If the system refuses a thread, the ones running (and the caller) do all the chunks. */
        if (pthread_create(&ids[started], &attr, work, &workers[started]) != 0) break;
    }
    pthread_attr_destroy(&attr);
    work(&workers[0]);
    double total = workers[0].sum;
    for (int i = 1; i < started; ++i) {
        pthread_join(ids[i], NULL);
        total += workers[i].sum;
    }
    return total;
}

/* ---- AdamW ---- */

/* The update of one element, pure: the new parameter, with the new moments through mo / vo. Both the in-place step
 * (adamw_elem) and the weights-only preview (preview_chunk) compute it here, so the compute-dtype weights the
 * preview writes are bit for bit those of the master the full step writes later. */
static inline __attribute__((always_inline)) float adamw_math(float p, float m, float v, float gs,
                                                              const sh_coeffs *c, float *mo, float *vo) {
    float pi = p * c->decay;
    float mi = m + c->w1 * (gs - m);
    float vi = v * c->beta2;
    vi = vi + c->omb2 * gs * gs;
    float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
    pi = pi + c->neg_step_size * (mi / denom);
    *mo = mi;
    *vo = vi;
    return pi;
}

static inline __attribute__((always_inline)) float adamw_elem(float *p, float *m, float *v, int64_t i, float gs,
                                                              const sh_coeffs *c) {
    float mi, vi;
    float pi = adamw_math(p[i], m[i], v[i], gs, c, &mi, &vi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    return pi;
}

/* One chunk of the update with gradient g * scale (scale folds the loss scale's inverse and the clip
 * coefficient into one multiply); returns the sum of squares of g as stored (fp32 within the chunk,
 * as torch's fp32 norms; fp64 across chunks). */
static inline __attribute__((always_inline)) double step_chunk(const task *t, int64_t lo, int64_t hi,
                                                               const int g_kind, const int out_kind) {
    float *p = t->p, *m = t->m, *v = t->v;
    const void *g = t->g; /* hoisted: a store through p/m/v could otherwise alias the task */
    uint16_t *out = t->out;
    const sh_coeffs *c = t->c;
    const float scale = t->scale;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_kind);
        sq += gi * gi;
        float pi = adamw_elem(p, m, v, i, gi * scale, c);
        store_out(out, i, pi, out_kind);
    }
    return (double)sq;
}

/* The compute-dtype weights that step_chunk would write, with p, m and v left as they are: it reads p, m, v and g
 * and writes only `out` (about 18 of the step's 30 bytes a parameter with an fp32 gradient), so a deferred update
 * can release the next forward sooner and write the fp32 state in a later pass (cpu_optim.py, weights first). */
static inline __attribute__((always_inline)) double preview_chunk(const task *t, int64_t lo, int64_t hi,
                                                                  const int g_kind, const int out_kind) {
    const float *p = t->p, *m = t->m, *v = t->v;
    const void *g = t->g;
    uint16_t *out = t->out;
    const sh_coeffs *c = t->c;
    const float scale = t->scale;
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
        float mi, vi;
        float pi = adamw_math(p[i], m[i], v[i], load_g(g, i, g_kind) * scale, c, &mi, &vi);
        store_out(out, i, pi, out_kind);
    }
    return 0.0;
}

/* Undo the speculative step t->c (made with g * spec_scale) by inverting each line of adamw_elem,
 * then (unless t->undo) apply the final step t->f with g * scale. Inverting loses the low bits of a
 * state that g dominated; the runtime bounds that by speculating only while the step's running sum
 * of squares stays under max_norm^2, and a first step (fresh) restores m = v = 0 exactly. */
static inline __attribute__((always_inline)) double redo_chunk(const task *t, int64_t lo, int64_t hi,
                                                               const int g_kind, const int out_kind) {
    float *p = t->p, *m = t->m, *v = t->v;
    const void *g = t->g; /* hoisted: a store through p/m/v could otherwise alias the task */
    uint16_t *out = t->out;
    const sh_coeffs *s = t->c, *f = t->f;
    const float scale = t->scale, spec_scale = t->spec_scale;
    const int undo = t->undo;
    const float keep = s->fresh != 0.0f ? 0.0f : 1.0f;
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_kind);
        float gs = gi * spec_scale; /* the gradient the speculative step used, bit for bit */
        float upd = m[i] / (sqrtf(v[i]) / s->bc2_sqrt + s->eps);
        float p0 = (p[i] - s->neg_step_size * upd) / s->decay;
        float m0 = keep * ((m[i] - s->w1 * gs) / (1.0f - s->w1));
        float v0 = keep * ((v[i] - s->omb2 * gs * gs) / s->beta2);
        p[i] = p0;
        m[i] = m0;
        /* Rounding can leave a tiny negative where v was ~0; v is a sum of squares. */
        v[i] = v0 > 0.0f ? v0 : 0.0f;
        float pi = undo ? p0 : adamw_elem(p, m, v, i, gi * scale, f);
        store_out(out, i, pi, out_kind);
    }
    return 0.0;
}

static inline __attribute__((always_inline)) double sum_squares_chunk(const task *t, int64_t lo, int64_t hi,
                                                                      const int g_kind) {
    const void *g = t->g;
    float sq = 0.0f; /* the same summation as step_chunk's, so both clipping modes see the same norm */
#pragma omp simd reduction(+ : sq)
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_kind);
        sq += gi * gi;
    }
    return (double)sq;
}

/* acc = (first ? 0 : acc) + g, then + g2 if given (two micro-steps in one pass, rounded as two passes would be);
 * returns the sum of squares of the new acc (the accumulated gradient the update will use), summed like
 * step_chunk's. */
static inline __attribute__((always_inline)) double accumulate_chunk(const task *t, int64_t lo, int64_t hi,
                                                                     const int g_kind) {
    float *acc = t->acc;
    const void *g = t->g, *g2 = t->g2;
    const int first = t->first;
    float sq = 0.0f;
    if (g2 == NULL) {
#pragma omp simd reduction(+ : sq)
        for (int64_t i = lo; i < hi; ++i) {
            float a = (first ? 0.0f : acc[i]) + load_g(g, i, g_kind);
            acc[i] = a;
            sq += a * a;
        }
    } else {
#pragma omp simd reduction(+ : sq)
        for (int64_t i = lo; i < hi; ++i) {
            float a = (first ? 0.0f : acc[i]) + load_g(g, i, g_kind);
            a = a + load_g(g2, i, g_kind);
            acc[i] = a;
            sq += a * a;
        }
    }
    return (double)sq;
}

/* A compact master (compact.py): the fp32 master as its bf16 rounding (the working copy, `h`) and its low 16 bits
 * (`l`). Rounding up moved the high half one past the master's own, which a low half above 0x8000 tells; a tie
 * (exactly 0x8000) cannot tell, so a store never keeps one: it moves the master one ulp towards what the working
 * copy holds (the rounding of either is the same). */
static inline __attribute__((always_inline)) float compact_load(const uint16_t *h, const uint16_t *l, int64_t i) {
    uint32_t low = l[i];
    uint32_t high = ((uint32_t)h[i] - (low > 0x8000u ? 1u : 0u)) & 0xFFFFu;
    return bits_f32((high << 16) | low);
}

static inline __attribute__((always_inline)) void compact_store(uint16_t *h, uint16_t *l, int64_t i, float p) {
    uint32_t u = f32_bits(p);
    uint32_t low = u & 0xFFFFu;
    h[i] = f32_to_bf16(p);
    l[i] = (uint16_t)(low == 0x8000u ? (((u >> 16) & 1u) ? 0x8001u : 0x7FFFu) : low);
}

static double merge_chunk(const task *t, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) t->p[i] = compact_load(t->out, t->lo16, i);
    return 0.0;
}

static double split_chunk(const task *t, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t i = lo; i < hi; ++i) compact_store(t->out, t->lo16, i, t->p[i]);
    return 0.0;
}

/* The step of a compact master in place: compact_load, the update (as step_chunk's), compact_store, in one pass over
 * the halves and moments: 2 + 2 bytes of master read and written instead of step_chunk's 4 read and 4 + 2 written,
 * and no staging passes. Without `write_moments`, the first pass of weights first on a compact master, whose working
 * copy is the master's high half (so no preview can write the weights alone): the halves alone, the moments left as
 * they are (20 of the one-pass update's 28 bytes a parameter with an fp32 gradient); moments_chunk writes them after.
 * adamw_math's moments do not depend on the parameter. */
static inline __attribute__((always_inline)) double compact_chunk(const task *t, int64_t lo, int64_t hi,
                                                                  const int g_kind, const int write_moments) {
    /* Hoisted, as in step_chunk: a store through the halves or moments could otherwise alias the task. */
    const void *g = t->g;
    const sh_coeffs *c = t->c;
    const float scale = t->scale;
    uint16_t *h = t->out, *l = t->lo16;
    float *m = t->m, *v = t->v, sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_kind), mi, vi;
        sq += gi * gi;
        compact_store(h, l, i, adamw_math(compact_load(h, l, i), m[i], v[i], gi * scale, c, &mi, &vi));
        if (write_moments) {
            m[i] = mi;
            v[i] = vi;
        }
    }
    return (double)sq;
}

static inline __attribute__((always_inline)) double step_compact_chunk(const task *t, int64_t lo, int64_t hi,
                                                                       const int g_kind) {
    return compact_chunk(t, lo, hi, g_kind, 1);
}

static inline __attribute__((always_inline)) double step_compact_master_chunk(const task *t, int64_t lo, int64_t hi,
                                                                              const int g_kind) {
    return compact_chunk(t, lo, hi, g_kind, 0);
}

/* The moments of the update with gradient g * scale, as step_chunk writes them, no parameter read or written; returns
 * the sum of squares of g as stored (as step_chunk). */
static inline __attribute__((always_inline)) double moments_chunk(const task *t, int64_t lo, int64_t hi,
                                                                  const int g_kind) {
    const void *g = t->g;
    const sh_coeffs *c = t->c;
    const float scale = t->scale;
    float *m = t->m, *v = t->v, sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = lo; i < hi; ++i) {
        float gi = load_g(g, i, g_kind), mi, vi;
        sq += gi * gi;
        (void)adamw_math(0.0f, m[i], v[i], gi * scale, c, &mi, &vi);
        m[i] = mi;
        v[i] = vi;
    }
    return (double)sq;
}

/* Specializations with the dtypes as constants, so each inner loop vectorizes without branches. */
#define WITH_KINDS(NAME, BODY, G, O) \
    static double NAME##_##G##O(const task *t, int64_t lo, int64_t hi) { return BODY(t, lo, hi, G, O); }
#define WITH_KIND(NAME, BODY, G) \
    static double NAME##_##G(const task *t, int64_t lo, int64_t hi) { return BODY(t, lo, hi, G); }
#define ALL_OUTS(NAME, BODY, G) WITH_KINDS(NAME, BODY, G, 0) WITH_KINDS(NAME, BODY, G, 1) WITH_KINDS(NAME, BODY, G, 2)
#define ALL_GRADS_OUTS(NAME, BODY) ALL_OUTS(NAME, BODY, 0) ALL_OUTS(NAME, BODY, 1) ALL_OUTS(NAME, BODY, 2)
#define ALL_GRADS(NAME, BODY) WITH_KIND(NAME, BODY, 0) WITH_KIND(NAME, BODY, 1) WITH_KIND(NAME, BODY, 2)
ALL_GRADS_OUTS(step, step_chunk)
ALL_GRADS_OUTS(redo, redo_chunk)
ALL_GRADS_OUTS(preview, preview_chunk)
ALL_GRADS(sumsq, sum_squares_chunk)
ALL_GRADS(accumulate, accumulate_chunk)
ALL_GRADS(stepcompact, step_compact_chunk)
ALL_GRADS(stepcompactmaster, step_compact_master_chunk)
ALL_GRADS(moments, moments_chunk)

/* Indexed [g_kind][out_kind] / [g_kind]; the entry points clamp unknown kinds to F32 / NONE. */
static const chunk_fn STEP[3][3] = {
    {step_00, step_01, step_02}, {step_10, step_11, step_12}, {step_20, step_21, step_22}};
static const chunk_fn REDO[3][3] = {
    {redo_00, redo_01, redo_02}, {redo_10, redo_11, redo_12}, {redo_20, redo_21, redo_22}};
static const chunk_fn PREVIEW[3][3] = {
    {preview_00, preview_01, preview_02}, {preview_10, preview_11, preview_12}, {preview_20, preview_21, preview_22}};
static const chunk_fn SUMSQ[3] = {sumsq_0, sumsq_1, sumsq_2};
static const chunk_fn ACCUMULATE[3] = {accumulate_0, accumulate_1, accumulate_2};
static const chunk_fn STEP_COMPACT[3] = {stepcompact_0, stepcompact_1, stepcompact_2};
static const chunk_fn STEP_COMPACT_MASTER[3] = {stepcompactmaster_0, stepcompactmaster_1, stepcompactmaster_2};
static const chunk_fn MOMENTS[3] = {moments_0, moments_1, moments_2};

static inline int kind(int k) { return k == BF16 || k == F16 ? k : F32; }

/* AdamW step of n elements with gradient g * scale; returns sum(g^2) of g as stored. `out` (of
 * out_kind) receives the updated parameters in the compute dtype; NULL with NONE. */
double sh_adamw_step(float *p, float *m, float *v, const void *g, int g_kind, uint16_t *out, int out_kind,
                     int64_t n, const sh_coeffs *c, float scale, int nthreads) {
    out_kind = out == NULL ? NONE : kind(out_kind);
    task t = {.fn = STEP[kind(g_kind)][out_kind], .n = n, .p = p, .m = m, .v = v, .g = g, .out = out,
              .c = c, .scale = scale};
    return run(&t, nthreads);
}

/* The compute-dtype weights (`out`, of out_kind BF16 or F16) of sh_adamw_step with the same arguments, leaving
 * p, m and v unchanged: sh_adamw_step must still run to make the step. */
void sh_adamw_preview(const float *p, const float *m, const float *v, const void *g, int g_kind, uint16_t *out,
                      int out_kind, int64_t n, const sh_coeffs *c, float scale, int nthreads) {
    task t = {.fn = PREVIEW[kind(g_kind)][kind(out_kind)], .n = n, .p = (float *)p, .m = (float *)m,
              .v = (float *)v, .g = g, .out = out, .c = c, .scale = scale};
    run(&t, nthreads);
}

/* Replace a speculative step made with coefficients s and gradient g * spec_scale by the step that
 * the final coefficients f and gradient g * scale give (speculate, then validate); with undo != 0,
 * only restore the state from before the speculative step (f and scale are unused). */
void sh_adamw_redo(float *p, float *m, float *v, const void *g, int g_kind, uint16_t *out, int out_kind, int64_t n,
                   const sh_coeffs *s, const sh_coeffs *f, float spec_scale, float scale, int undo, int nthreads) {
    out_kind = out == NULL ? NONE : kind(out_kind);
    task t = {.fn = REDO[kind(g_kind)][out_kind], .n = n, .p = p, .m = m, .v = v, .g = g, .out = out,
              .c = s, .f = f, .scale = scale, .spec_scale = spec_scale, .undo = undo};
    run(&t, nthreads);
}

/* sum(g^2), for the global norm when the update itself waits for it (deferred steps). */
double sh_sum_squares(const void *g, int g_kind, int64_t n, int nthreads) {
    task t = {.fn = SUMSQ[kind(g_kind)], .n = n, .g = g};
    return run(&t, nthreads);
}

/* acc = (first ? 0 : acc) + g, for gradient accumulation across micro-steps; returns sum(acc^2). */
double sh_accumulate(float *acc, const void *g, int g_kind, int64_t n, int first, int nthreads) {
    task t = {.fn = ACCUMULATE[kind(g_kind)], .n = n, .acc = acc, .g = g, .first = first};
    return run(&t, nthreads);
}

/* acc = ((first ? 0 : acc) + g) + g2: two micro-steps' gradients (of one dtype) in one pass; returns sum(acc^2). */
double sh_accumulate2(float *acc, const void *g, const void *g2, int g_kind, int64_t n, int first, int nthreads) {
    task t = {.fn = ACCUMULATE[kind(g_kind)], .n = n, .acc = acc, .g = g, .g2 = g2, .first = first};
    return run(&t, nthreads);
}

/* sh_adamw_step on a compact master held as its bf16 high half `hi` (the working copy) and low half `lo`, in place;
 * returns sum(g^2) of g as stored. */
double sh_adamw_step_compact(uint16_t *hi, uint16_t *lo, float *m, float *v, const void *g, int g_kind, int64_t n,
                             const sh_coeffs *c, float scale, int nthreads) {
    task t = {.fn = STEP_COMPACT[kind(g_kind)], .n = n, .m = m, .v = v, .g = g, .out = hi, .lo16 = lo, .c = c,
              .scale = scale};
    return run(&t, nthreads);
}

/* The halves that sh_adamw_step_compact with the same arguments writes, m and v left as they are; sh_adamw_moments
 * then makes the step (weights first on a compact master). */
void sh_adamw_step_compact_master(uint16_t *hi, uint16_t *lo, const float *m, const float *v, const void *g, int g_kind,
                                  int64_t n, const sh_coeffs *c, float scale, int nthreads) {
    task t = {.fn = STEP_COMPACT_MASTER[kind(g_kind)], .n = n, .m = (float *)m, .v = (float *)v, .g = g, .out = hi,
              .lo16 = lo, .c = c, .scale = scale};
    run(&t, nthreads);
}

/* The moments that sh_adamw_step with the same arguments writes, no parameter touched; returns sum(g^2) of g as
 * stored. */
double sh_adamw_moments(float *m, float *v, const void *g, int g_kind, int64_t n, const sh_coeffs *c, float scale,
                        int nthreads) {
    task t = {.fn = MOMENTS[kind(g_kind)], .n = n, .m = m, .v = v, .g = g, .c = c, .scale = scale};
    return run(&t, nthreads);
}

/* p = the fp32 master that the bf16 high half `hi` and the low half `lo` hold (a compact master). */
void sh_master_merge(const uint16_t *hi, const uint16_t *lo, float *p, int64_t n, int nthreads) {
    task t = {.fn = merge_chunk, .n = n, .p = p, .out = (uint16_t *)hi, .lo16 = (uint16_t *)lo};
    run(&t, nthreads);
}

/* hi = bf16 rounding of p (to nearest even), lo = its low half, a tie moved one ulp (see merge_chunk). */
void sh_master_split(const float *p, uint16_t *hi, uint16_t *lo, int64_t n, int nthreads) {
    task t = {.fn = split_chunk, .n = n, .p = (float *)p, .out = hi, .lo16 = lo};
    run(&t, nthreads);
}
