/* zerompi._kernels: the fused Adam/AdamW step, one pass over memory.
 *
 * The same IEEE operations, in the same order and in the array's own precision,
 * as the blocked numpy kernel in adam.py and the reference in reference.py: the
 * scalars are rounded to the element type first (as numpy does with a Python
 * float), and the build turns off floating-point contraction (-ffp-contract=off)
 * so that no multiply-add is fused. A world of one rank therefore still
 * reproduces the reference bit for bit; only the memory traffic changes: each
 * element of p, m, v is read and written once and g read once (28 bytes per
 * float32 element) instead of a dozen passes over a cache-sized block.
 *
 * The loop releases the GIL, so a progress thread can drive MPI meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* One portable binary that still uses the widest vectors the CPU has: each loop is
 * compiled once per target below (the same C, so the same IEEE operations in the same
 * order: the variants differ only in vector width) and the best one the CPU supports
 * is picked when the module loads. variants() lists them; variant= runs one
 * explicitly (the tests run every one against numpy). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(ZEROMPI_BASELINE_ONLY)
#define X86_VARIANTS 1
/* target("avx512f"): GCC 4.9, clang 3.9 (older compilers build AVX2 and baseline;
 * -DZEROMPI_NO_AVX512 builds them so on any compiler) */
#if defined(ZEROMPI_NO_AVX512)
#elif defined(__clang__) ? (__clang_major__ > 3 || (__clang_major__ == 3 && __clang_minor__ >= 9)) \
                       : (__GNUC__ > 4 || (__GNUC__ == 4 && __GNUC_MINOR__ >= 9))
#define HAVE_AVX512F 1
#endif
#endif

enum { V_AVX512F, V_AVX2, V_BASELINE, N_VARIANTS };
static const char *const variant_names[N_VARIANTS] = {"avx512f", "avx2", "baseline"};
static int variant_built[N_VARIANTS];     /* compiled into this module */
static int variant_supported[N_VARIANTS]; /* compiled, and the CPU runs it */
static int variant_auto = V_BASELINE;     /* the best supported: normal calls */

#define ADAM_LOOP(NAME, ATTR, T, SQRT)                                            \
    ATTR static void NAME(T *restrict p, const T *restrict g, T *restrict m,             \
                          T *restrict v, Py_ssize_t n, double lr_, double b1_,         \
                          double b2_, double eps_, double wd_, int decoupled,          \
                          double bc1_, double bc2_, double div_) {                     \
        const T lr = (T)lr_, b1 = (T)b1_, b2 = (T)b2_, eps = (T)eps_;                  \
        const T omb1 = (T)(1.0 - b1_), omb2 = (T)(1.0 - b2_);                          \
        const T wd = (T)wd_, bc1 = (T)bc1_, bc2 = (T)bc2_, div = (T)div_;              \
        const int divide = div_ != 1.0, l2 = wd_ != 0.0 && !decoupled,                 \
                  dec = wd_ != 0.0 && decoupled;                                       \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            T gi = g[i];                                                               \
            const T pi = p[i];                                                         \
            if (divide) gi = gi / div;                                                 \
            if (l2) gi = gi + pi * wd;                                                 \
            const T mi = m[i] * b1 + gi * omb1;                                        \
            const T vi = v[i] * b2 + (gi * gi) * omb2;                                 \
            T u = (mi / bc1) / (SQRT(vi / bc2) + eps);                                 \
            if (dec) u = u + pi * wd;                                                  \
            m[i] = mi;                                                                 \
            v[i] = vi;                                                                 \
            p[i] = pi - u * lr;                                                        \
        }                                                                              \
    }

/* SGD (torch's, zerompi.rules.sgd): the operations of the numpy rule in its order, so
 * the results are the same bits (no FMA: -ffp-contract=off). The weight-decay mode
 * (WD: 0 none, 1 L2, 2 decoupled) and the momentum mode (MM: 0 none, 1 heavy ball,
 * 2 with dampening, 3 Nesterov, 4 the first step's heavy ball b = g, 5 the first
 * step's Nesterov) are constants of each inlined copy of the body, so every copy is
 * one branch-free vector loop; a division by the divisor only where it is not 1. */
#define SGD_LOOP(NAME, ATTR, T)                                                        \
    ATTR static inline __attribute__((always_inline)) void NAME##_body(                \
        T *restrict p, const T *restrict g, T *restrict b, Py_ssize_t n, T lr, T mom,  \
        T omd, T wd, T lrwd, T div, int divide, const int WD, const int MM) {          \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            T gi = g[i];                                                               \
            const T pi = p[i];                                                         \
            if (divide) gi = gi / div;                                                 \
            if (WD == 1) gi = gi + pi * wd;                                            \
            T s = gi;                                                                  \
            if (MM == 1 || MM == 3) {                                                  \
                const T bi = b[i] * mom + gi;                                          \
                b[i] = bi;                                                             \
                s = MM == 3 ? gi + bi * mom : bi;                                      \
            } else if (MM == 2) {                                                      \
                const T bi = b[i] * mom + gi * omd;                                    \
                b[i] = bi;                                                             \
                s = bi;                                                                \
            } else if (MM == 4 || MM == 5) {                                           \
                b[i] = gi;                                                             \
                s = MM == 5 ? gi + gi * mom : gi;                                      \
            }                                                                          \
            const T q = WD == 2 ? pi - pi * lrwd : pi;                                 \
            p[i] = q - s * lr;                                                         \
        }                                                                              \
    }                                                                                  \
    ATTR static void NAME(T *restrict p, const T *restrict g, T *restrict b,             \
                          Py_ssize_t n, double lr_, double mom_, double damp_,         \
                          int nesterov, double wd_, int decoupled, int first,          \
                          double div_) {                                               \
        const T lr = (T)lr_, mom = (T)mom_, omd = (T)(1.0 - damp_), wd = (T)wd_;       \
        const T lrwd = (T)(lr_ * wd_), div = (T)div_;                                  \
        const int divide = div_ != 1.0;                                                \
        const int wdm = wd_ == 0.0 ? 0 : decoupled ? 2 : 1;                            \
        const int mm = mom_ == 0.0 ? 0                                                 \
                       : first     ? (nesterov ? 5 : 4)                                \
                       : nesterov  ? 3                                                 \
                       : damp_ != 0.0 ? 2 : 1;                                         \
        switch (wdm * 6 + mm) {                                                        \
        SGD_CASES(NAME, 0) SGD_CASES(NAME, 1) SGD_CASES(NAME, 2)                       \
        }                                                                              \
    }

#define SGD_CALL(NAME, W, M) \
    NAME##_body(p, g, b, n, lr, mom, omd, wd, lrwd, div, divide, W, M)
#define SGD_CASES(NAME, W)                                                 \
    case W * 6 + 0: SGD_CALL(NAME, W, 0); break;                           \
    case W * 6 + 1: SGD_CALL(NAME, W, 1); break;                           \
    case W * 6 + 2: SGD_CALL(NAME, W, 2); break;                           \
    case W * 6 + 3: SGD_CALL(NAME, W, 3); break;                           \
    case W * 6 + 4: SGD_CALL(NAME, W, 4); break;                           \
    case W * 6 + 5: SGD_CALL(NAME, W, 5); break;

/* Lion (Chen et al. 2023, zerompi.rules.lion), the numpy rule's operations in its
 * order: sign(c) as (c > 0) - (c < 0) (0 for a NaN, as there). */
#define LION_LOOP(NAME, ATTR, T)                                                       \
    ATTR static void NAME(T *restrict p, const T *restrict g, T *restrict m,             \
                          Py_ssize_t n, double lr_, double b1_, double b2_,            \
                          double wd_, double div_) {                                   \
        const T lr = (T)lr_, b1 = (T)b1_, omb1 = (T)(1.0 - b1_), b2 = (T)b2_;          \
        const T omb2 = (T)(1.0 - b2_), wd = (T)wd_, div = (T)div_;                     \
        const int divide = div_ != 1.0, decay = wd_ != 0.0;                            \
        for (Py_ssize_t i = 0; i < n; i++) {                                           \
            T gi = g[i];                                                               \
            if (divide) gi = gi / div;                                                 \
            const T mi = m[i], pi = p[i];                                              \
            const T ci = mi * b1 + gi * omb1;                                          \
            T u = (T)((ci > (T)0) - (ci < (T)0));                                      \
            if (decay) u = u + pi * wd;                                                \
            p[i] = pi - u * lr;                                                        \
            m[i] = mi * b2 + gi * omb2;                                                \
        }                                                                              \
    }

/* Rounding to the 16-bit floats, round to nearest even, bit-identical to numpy's
 * float16 cast and ml_dtypes' bfloat16 cast for every non-NaN value (a NaN becomes
 * the quiet NaN of its sign). A double is first rounded to float with round-to-odd,
 * which keeps the later rounding to 8 or 11 significant bits correct (float has more
 * than two bits to spare): one rounding, as a direct cast does. */
static inline uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* Branch-free (selects, not jumps), so that the loops below stay vectorized. */
static inline uint16_t
f32_to_bf16(float x)
{
    const uint32_t u = f32_bits(x);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

static inline uint16_t
f32_to_f16(float x)
{
    const uint32_t all = f32_bits(x);
    const uint32_t sign = all & 0x80000000u, u = all ^ sign;
    /* >= 65536, inf or NaN */
    const uint32_t big = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    /* a subnormal half, or zero: the significand in units of 2**-24, rounded to
     * nearest even, in integers only (a float add here keeps GCC from vectorizing) */
    const uint32_t e = u >> 23, sig = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e < 31u ? 126u - e : 31u; /* e <= 112 here: >= 14 */
    const uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    const uint32_t sub = q + ((rem > half) | ((rem == half) & q & 1u));
    /* normal: rebias the exponent (-112 << 23) and round */
    const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    const uint32_t o = u >= 0x47800000u ? big : (u < 0x38800000u ? sub : normal);
    return (uint16_t)(o | (sign >> 16));
}

static inline float
f64_to_f32_odd(double x)
{
    const float f = (float)x;
    const uint32_t u = f32_bits(f);
    const int away = fabs((double)f) > fabs(x);    /* rounded away from zero */
    const uint32_t odd = (u - (uint32_t)away) | 1u; /* truncated, with the sticky bit */
    const int inexact = (double)f != x && isfinite(x) && isfinite(f);
    return bits_f32(inexact ? odd : u);
}

static inline uint16_t f64_to_bf16(double x) { return f32_to_bf16(f64_to_f32_odd(x)); }

/* Stochastic rounding to bfloat16: round the magnitude up with probability equal to
 * the part of an ulp below it, from 16 random bits; a NaN stays a (quiet) NaN. The
 * random bits of element i are a hash of (key, i): the same on every rank, every
 * variant and the numpy kernel, run after run. */
static inline uint32_t
mix32(uint32_t x)
{ /* lowbias32 (Chris Wellons' hash prospector) */
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline uint16_t
f32_to_bf16_sr(float x, uint32_t random)
{
    const uint32_t u = f32_bits(x);
    const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
    const uint32_t up = (u + (random & 0xffffu)) >> 16;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? nan : up);
}

#define ROUND_SR_LOOP(NAME, ATTR, T, TO_F32)                                           \
    ATTR static void NAME(const T *restrict p, uint16_t *restrict low, Py_ssize_t n,  \
                          uint32_t key, uint32_t base) {                              \
        for (Py_ssize_t i = 0; i < n; i++)                                            \
            low[i] = f32_to_bf16_sr(TO_F32(p[i]),                                    \
                                    mix32((base + (uint32_t)i) * 0x9e3779b1u + key)); \
    }
static inline float same_f32(float x) { return x; }

/* 16-bit floats to float, exactly. */
static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline float
f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    /* normal (and inf/NaN, exponent 31 -> 255): rebias; subnormal: m * 2**-24, exact */
    const uint32_t normal = sign | ((e == 31u ? 255u : e + 112u) << 23) | (m << 13);
    const float sub = (float)m * 5.9604644775390625e-08f; /* 2**-24 */
    return e == 0u ? (sign ? -sub : sub) : bits_f32(normal);
}
static inline uint16_t f64_to_f16(double x) { return f32_to_f16(f64_to_f32_odd(x)); }

/* Only the rounded copy (after a load, or for a kernel-less check). */
#define ROUND_LOOP(NAME, ATTR, T, CONV)                                                \
    ATTR static void NAME(const T *restrict p, uint16_t *restrict low, Py_ssize_t n) { \
        for (Py_ssize_t i = 0; i < n; i++) low[i] = CONV(p[i]);                        \
    }

/* out[i] (+)= the 16-bit part[i], upcast exactly (the sum in out's dtype). */
#define ACCUMULATE_LOOP(NAME, ATTR, T, UP)                                               \
    ATTR static void NAME(T *restrict out, const uint16_t *restrict part, Py_ssize_t n,  \
                          int add) {                                                     \
        if (add)                                                                         \
            for (Py_ssize_t i = 0; i < n; i++) out[i] = out[i] + (T)UP(part[i]);         \
        else                                                                             \
            for (Py_ssize_t i = 0; i < n; i++) out[i] = (T)UP(part[i]);                  \
    }

/* A non-temporal store of one vector of VB bytes (VB-aligned), for the within-node
 * sum's output where it is not one of the parts: the line goes to memory without
 * being read first (no read for ownership: 4 bytes an element less than a plain
 * store of a float32 array larger than the cache). NT_FENCE orders those stores
 * before what follows (the node fence, another rank's read). Plain stores where the
 * target has no such instruction. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define NT_STORE_16(p, v) _mm_stream_si128((__m128i *)(void *)(p), (__m128i)(v))
#define NT_STORE_32(p, v) _mm256_stream_si256((__m256i *)(void *)(p), (__m256i)(v))
#define NT_STORE_64(p, v) _mm512_stream_si512((__m512i *)(void *)(p), (__m512i)(v))
#define NT_FENCE() _mm_sfence()
#define NT_ALIGN 1
#else
#define NT_STORE_16(p, v) memcpy((p), &(v), 16)
#define NT_STORE_32(p, v) memcpy((p), &(v), 32)
#define NT_STORE_64(p, v) memcpy((p), &(v), 64)
#define NT_FENCE() ((void)0)
#endif

#define LANES 16
#define STATS_LOOP(NAME, ATTR, T)                                                     \
    ATTR static void NAME(const T *restrict g, Py_ssize_t n, Py_ssize_t *nonfinite,   \
                          double *sumsq) {                                            \
        double acc[LANES] = {0.0}, total = 0.0;                                       \
        Py_ssize_t bad = 0, i = 0;                                                    \
        for (; i + LANES <= n; i += LANES) /* LANES partial sums: vectorizable */     \
            for (int j = 0; j < LANES; j++) {                                         \
                const double x = (double)g[i + j];                                    \
                acc[j] += x * x;                                                      \
            }                                                                         \
        for (; i < n; i++) total += (double)g[i] * (double)g[i];                      \
        for (int j = 0; j < LANES; j++) total += acc[j];                              \
        if (!isfinite(total))                                                         \
            for (Py_ssize_t k = 0; k < n; k++) bad += !isfinite(g[k]);                \
        *nonfinite = bad;                                                             \
        *sumsq = total;                                                               \
    }

/* The reciprocal of a divisor d that is a power of two, whose every quotient x / d is
 * then x * (1 / d) exactly (both are the one rounding of the same real number, a
 * subnormal one too); 0 for any other d (and for a reciprocal out of T's normal
 * range). A loop bound by its divisions then multiplies instead. */
static inline float exact_reciprocal_f32(float d)
{
    int e;
    const float m = frexpf(d, &e);
    return (m == 0.5f && isfinite(d) && e > -125 && e < 127) ? 1.0f / d : 0.0f;
}
static inline double exact_reciprocal_f64(double d)
{
    int e;
    const double m = frexp(d, &e);
    return (m == 0.5 && isfinite(d) && e > -1021 && e < 1023) ? 1.0 / d : 0.0;
}

/* Adafactor (zerompi/rules/adafactor.py), over one rectangle of a matrix: `rows` rows of
 * `w` elements each, row-major and contiguous (parts of rows of a wider matrix come
 * one row at a time). The numpy functions there compute the same bits. The gradient
 * is averaged where it is read, never written back averaged: each loop computes
 * g / div as Q(g), so AF_SUMS only reads g.
 *
 * AF_SUMS: rowsum[i] = the float64 sum of the squares of row i's quotients, in
 * STATS_LOOP's order (LANES lanes over the whole groups, the tail, then the lanes),
 * and colsum[j] = the float64 sum of the squares of column j's, row after row.
 * AF_U: g[i][j] = (g[i][j] / div) / sqrt(max((r[i] / denom) * c[j], floor)) in
 * place, in T (a NaN stays NaN, as numpy's maximum keeps it): one division and one
 * square root per element (r[i] / denom once per row), which bound this loop.
 * AF_APPLY: p = p * decay (when `decays`), then p = p + u * scale, in T.
 *
 * Q is AF_MUL (a power-of-two div, 1 included: its exact reciprocal multiplies, the
 * division's bits) or AF_DIV; one loop body per way, each branch-free. */
#define AF_MUL(x) ((x) * rdiv)
#define AF_DIV(x) ((x) / div)
#define AF_ROW_SUMS(Q)                                                                   \
    do {                                                                                 \
        double acc[LANES] = {0.0}, total = 0.0;                                          \
        for (Py_ssize_t j = 0; j < whole; j += LANES)                                    \
            for (int l = 0; l < LANES; l++) {                                            \
                const double x = (double)Q(r[j + l]);                                    \
                const double sq = x * x;                                                 \
                acc[l] += sq;                                                            \
                colsum[j + l] += sq;                                                     \
            }                                                                            \
        for (Py_ssize_t j = whole; j < w; j++) {                                         \
            const double x = (double)Q(r[j]);                                            \
            total += x * x;                                                              \
            colsum[j] += x * x;                                                          \
        }                                                                                \
        for (int l = 0; l < LANES; l++) total += acc[l];                                 \
        rowsum[i] = total;                                                               \
    } while (0)
#define AF_SUMS_LOOP(NAME, ATTR, T, RECIP)                                               \
    ATTR static void NAME(const T *restrict g, Py_ssize_t rows, Py_ssize_t w,             \
                          double *restrict rowsum, double *restrict colsum, double div_) \
    {                                                                                    \
        const Py_ssize_t whole = w - w % LANES;                                          \
        const T div = (T)div_, rdiv = RECIP(div); /* rdiv 0: divide */                   \
        for (Py_ssize_t j = 0; j < w; j++) colsum[j] = 0.0;                              \
        for (Py_ssize_t i = 0; i < rows; i++) {                                          \
            const T *restrict r = g + i * w;                                             \
            if (rdiv != (T)0)                                                            \
                AF_ROW_SUMS(AF_MUL);                                                     \
            else                                                                         \
                AF_ROW_SUMS(AF_DIV);                                                     \
        }                                                                                \
    }

#define AF_U_ROW(Q, T, SQRT)                                                             \
    for (Py_ssize_t j = 0; j < w; j++) {                                                 \
        T v = ri * c[j];                                                                 \
        v = v < floor ? floor : v;                                                       \
        gi[j] = Q(gi[j]) / SQRT(v);                                                      \
    }
#define AF_U_LOOP(NAME, ATTR, T, SQRT, RECIP)                                            \
    ATTR static void NAME(T *restrict g, Py_ssize_t rows, Py_ssize_t w,                   \
                          const T *restrict r, const T *restrict c, double denom_,       \
                          double floor_, double div_) {                                  \
        const T denom = (T)denom_, floor = (T)floor_, div = (T)div_;                     \
        const T rdiv = RECIP(div); /* 1 for div 1; 0: divide */                         \
        for (Py_ssize_t i = 0; i < rows; i++) {                                          \
            T *restrict gi = g + i * w;                                                  \
            const T ri = r[i] / denom;                                                   \
            if (rdiv != (T)0)                                                            \
                AF_U_ROW(AF_MUL, T, SQRT)                                                \
            else                                                                         \
                AF_U_ROW(AF_DIV, T, SQRT)                                                \
        }                                                                                \
    }

#define AF_APPLY_LOOP(NAME, ATTR, T)                                                     \
    ATTR static void NAME(T *restrict p, const T *restrict u, Py_ssize_t n, int decays,   \
                          double decay_, double scale_) {                                \
        const T decay = (T)decay_, scale = (T)scale_;                                    \
        if (decays)                                                                      \
            for (Py_ssize_t i = 0; i < n; i++) p[i] = p[i] * decay + u[i] * scale;       \
        else                                                                             \
            for (Py_ssize_t i = 0; i < n; i++) p[i] = p[i] + u[i] * scale;               \
    }

/* out[i] (+)= parts[0][i] + parts[1][i] + ... in that order, in T, and with `stats`
 * the sum of squares of the result in float64 in the same order as STATS_LOOP (so the
 * same bits as grad_stats(out) afterwards), in the same pass: the within-node
 * reduction and the gradient statistics read each byte once. out may be one of the
 * parts (the same elements): every element is read from all parts before it is
 * written. `clear` zeroes what was read of every part.
 *
 * A tile of NV vectors of VB bytes (the variant's native width: 256 bytes with
 * AVX-512 and AVX2, 128 without) is summed in registers, every part read in turn for
 * the same tile, so all k parts stream at once. Summing one part at a time into a
 * buffer of 512 elements in L1 (the loop before) let compilers vectorize across the
 * parts with gathers and read one part's 2 KiB at a time: 8-9 GB/s on one core at
 * k = 16 parts against 38 GB/s this way, 27 against 47 at k = 2 (AMD EPYC, AVX-512). */
#define SUM_LOOP(NAME, ATTR, T, VB, NV, NT)                                                \
    ATTR static void NAME(T *out, T *const *parts, int k, Py_ssize_t n, int add,         \
                          int stats, int clear, int stream, Py_ssize_t *nonfinite,       \
                          double *sumsq) {                                               \
        typedef T vec __attribute__((vector_size(VB)));                                  \
        enum { W = (int)(VB / sizeof(T)), TILE = NV * W }; /* TILE: a multiple of LANES */ \
        double acc[LANES] = {0.0}, total = 0.0;                                          \
        Py_ssize_t bad = 0;                                                              \
        const Py_ssize_t tiled = n - n % TILE;                                           \
        for (Py_ssize_t lo = 0; lo < tiled; lo += TILE) {                                \
            vec s[NV];                                                                   \
            T *o = out + lo, *p0 = parts[0] + lo;                                        \
            for (int v = 0; v < NV; v++) memcpy(&s[v], p0 + v * W, sizeof(vec));         \
            if (add)                                                                     \
                for (int v = 0; v < NV; v++) {                                           \
                    vec x;                                                               \
                    memcpy(&x, o + v * W, sizeof(vec));                                  \
                    s[v] = x + s[v];                                                     \
                }                                                                        \
            if (clear) memset(p0, 0, TILE * sizeof(T));                                  \
            for (int q = 1; q < k; q++) {                                                \
                T *pq = parts[q] + lo;                                                   \
                for (int v = 0; v < NV; v++) {                                           \
                    vec x;                                                               \
                    memcpy(&x, pq + v * W, sizeof(vec));                                 \
                    s[v] = s[v] + x;                                                     \
                }                                                                        \
                if (clear) memset(pq, 0, TILE * sizeof(T));                              \
            }                                                                            \
            if (stream) /* out is VB-aligned: no read for ownership, past the cache */  \
                for (int v = 0; v < NV; v++) NT(o + v * W, s[v]);                        \
            else                                                                         \
                for (int v = 0; v < NV; v++) memcpy(o + v * W, &s[v], sizeof(vec));      \
            if (stats) { /* from the registers: a streamed tile is not read back */      \
                T t[TILE];                                                               \
                for (int v = 0; v < NV; v++) memcpy(t + v * W, &s[v], sizeof(vec));      \
                for (int j = 0; j < TILE; j += LANES)                                    \
                    for (int l = 0; l < LANES; l++)                                      \
                        acc[l] += (double)t[j + l] * (double)t[j + l];                   \
            }                                                                            \
        }                                                                                \
        if (stream) NT_FENCE();                                                          \
        for (Py_ssize_t j = tiled; j < n; j++) { /* the last partial tile */             \
            T x = add ? out[j] + parts[0][j] : parts[0][j];                              \
            if (clear) parts[0][j] = 0;                                                  \
            for (int q = 1; q < k; q++) {                                                \
                x = x + parts[q][j];                                                     \
                if (clear) parts[q][j] = 0;                                              \
            }                                                                            \
            out[j] = x;                                                                  \
        }                                                                                \
        if (!stats) return;                                                              \
        const Py_ssize_t laned = n - n % LANES;                                          \
        for (Py_ssize_t j = tiled; j < laned; j += LANES)                                \
            for (int l = 0; l < LANES; l++) acc[l] += (double)out[j + l] * (double)out[j + l]; \
        for (Py_ssize_t j = laned; j < n; j++) total += (double)out[j] * (double)out[j]; \
        for (int l = 0; l < LANES; l++) total += acc[l];                                 \
        if (!isfinite(total))                                                            \
            for (Py_ssize_t m = 0; m < n; m++) bad += !isfinite(out[m]);                 \
        *nonfinite = bad;                                                                \
        *sumsq = total;                                                                  \
    }

/* 8-bit Adam (zerompi.quant.adam8_step): whole blocks of `block` elements, each
 * decoded (zerompi.quant.Format: E4M3 with a sign bit for m, E5M3 for v; times the
 * block's scale), stepped with zerompi.quant.adam8_math's arithmetic in its order
 * (Kingma & Ba's efficient form; bit for bit the numpy path's), its new largest
 * magnitudes the new scales, and encoded again: the nearest code of |x| * (1 / scale),
 * ties to even, computed from the float's bits (the mantissa rounded to three bits;
 * below the smallest normal, x * 2^sub rounded by adding and subtracting 2^23).
 * Branch-free inner loops without tables, so each variant's compiler vectorizes them.
 * The formats' constants are zerompi.quant.SIGNED's and UNSIGNED's. */
static inline uint32_t pick8(int c, uint32_t x, uint32_t y)
{ /* c ? x : y with masks: the compilers if-convert this (not a ternary over floats) */
    const uint32_t m = -(uint32_t)(c != 0);
    return (x & m) | (y & ~m);
}
static inline float dec8(uint32_t mag, uint32_t off8, float sub)
{
    return bits_f32(pick8(mag < 8u, f32_bits((float)(int32_t)mag * sub), (mag + off8) << 20));
}
static inline uint32_t enc8(float a, uint32_t off8, float min_normal, float sub_scale)
{
    const uint32_t u = f32_bits(a);
    const uint32_t normal = ((u + 0x7ffffu + ((u >> 20) & 1u)) >> 20) - off8;
    const uint32_t sub = f32_bits(a * sub_scale + 8388608.0f) - 0x4b000000u; /* rint */
    return pick8(a < min_normal, sub, normal);
}
#define M_OFF8 (8u * (127u - 15u))
#define V_OFF8 (8u * (127u - 31u))
#define ADAM8_LOOP(NAME, ATTR)                                                            \
    ATTR static void NAME(                                                                \
        float *restrict p, const float *restrict g, uint8_t *restrict qm,                 \
        uint8_t *restrict qv, float *restrict sm, float *restrict sv, Py_ssize_t nblocks, \
        Py_ssize_t block, double lr_, double b1_, double b2_, double alpha_, double eps_, \
        double div_, double l2_, double dec_, float *restrict tm, float *restrict tv) {   \
        const float lr = (float)lr_, b1 = (float)b1_, b2 = (float)b2_, eps = (float)eps_; \
        const float omb1 = (float)(1.0 - b1_), omb2 = (float)(1.0 - b2_);                 \
        const float alpha = (float)alpha_, dv = (float)div_;                              \
        const float l2 = (float)l2_, dec = (float)dec_;                                   \
        const float msub = 0x1p-17f, vsub = 0x1p-33f;                                     \
        for (Py_ssize_t b = 0; b < nblocks; b++) {                                        \
            const Py_ssize_t at = b * block;                                              \
            float *restrict pb = p + at;                                                  \
            const float *restrict gb = g + at;                                            \
            uint8_t *restrict qmb = qm + at, *restrict qvb = qv + at;                     \
            const float ms = sm[b], vs = sv[b];                                           \
            uint32_t mxb = 0, vxb = 0; /* |x|'s bits order as |x| does: an integer max */ \
            for (Py_ssize_t i = 0; i < block; i++) {                                      \
                const uint32_t cm = qmb[i];                                               \
                const float m0 = bits_f32(f32_bits(dec8(cm & 0x7fu, M_OFF8, msub))        \
                                          | ((cm & 0x80u) << 24));                        \
                const float v0 = dec8(qvb[i], V_OFF8, vsub);                              \
                const float pi = pb[i];                                                   \
                const float gi = gb[i] / dv + pi * l2;                                    \
                const float mi = (m0 * ms) * b1 + gi * omb1;                              \
                const float vi = (v0 * vs) * b2 + (gi * gi) * omb2;                       \
                const float u = (mi / (sqrtf(vi) + eps)) * alpha + pi * dec;              \
                pb[i] = pi - u * lr;                                                      \
                tm[i] = mi;                                                               \
                tv[i] = vi;                                                               \
                const uint32_t am = f32_bits(mi) & 0x7fffffffu;                           \
                const uint32_t av = f32_bits(vi) & 0x7fffffffu;                           \
                mxb = am > mxb ? am : mxb;                                                \
                vxb = av > vxb ? av : vxb;                                                \
            }                                                                             \
            const float mx = bits_f32(mxb), vx = bits_f32(vxb);                           \
            sm[b] = mx;                                                                   \
            sv[b] = vx;                                                                   \
            const float rm = mx >= FLT_MIN ? 1.0f / mx : 0.0f;                            \
            const float rv = vx >= FLT_MIN ? 1.0f / vx : 0.0f;                            \
            for (Py_ssize_t i = 0; i < block; i++) {                                      \
                const uint32_t bm = f32_bits(tm[i]);                                      \
                const float a = bits_f32(bm & 0x7fffffffu) * rm;                          \
                qmb[i] = (uint8_t)(enc8(a, M_OFF8, 0x1p-14f, 0x1p17f)                     \
                                   | ((bm >> 24) & 0x80u));                               \
                qvb[i] = (uint8_t)enc8(fabsf(tv[i]) * rv, V_OFF8, 0x1p-30f, 0x1p33f);     \
            }                                                                             \
        }                                                                                 \
    }

typedef void (*adam8_fn)(float *restrict, const float *restrict, uint8_t *restrict,
                         uint8_t *restrict, float *restrict, float *restrict, Py_ssize_t,
                         Py_ssize_t, double, double, double, double, double, double, double,
                         double, float *restrict, float *restrict);
typedef void (*adam_f32_fn)(float *restrict, const float *restrict, float *restrict,
                            float *restrict, Py_ssize_t, double, double, double, double,
                            double, int, double, double, double);
typedef void (*adam_f64_fn)(double *restrict, const double *restrict, double *restrict,
                            double *restrict, Py_ssize_t, double, double, double, double,
                            double, int, double, double, double);
typedef void (*sgd_f32_fn)(float *restrict, const float *restrict, float *restrict,
                           Py_ssize_t, double, double, double, int, double, int, int, double);
typedef void (*sgd_f64_fn)(double *restrict, const double *restrict, double *restrict,
                           Py_ssize_t, double, double, double, int, double, int, int, double);
typedef void (*lion_f32_fn)(float *restrict, const float *restrict, float *restrict,
                            Py_ssize_t, double, double, double, double, double);
typedef void (*lion_f64_fn)(double *restrict, const double *restrict, double *restrict,
                            Py_ssize_t, double, double, double, double, double);
typedef void (*round_sr_f32_fn)(const float *restrict, uint16_t *restrict, Py_ssize_t,
                                uint32_t, uint32_t);
typedef void (*round_sr_f64_fn)(const double *restrict, uint16_t *restrict, Py_ssize_t,
                                uint32_t, uint32_t);
typedef void (*acc_f32_fn)(float *restrict, const uint16_t *restrict, Py_ssize_t, int);
typedef void (*acc_f64_fn)(double *restrict, const uint16_t *restrict, Py_ssize_t, int);
typedef void (*round_f32_fn)(const float *restrict, uint16_t *restrict, Py_ssize_t);
typedef void (*round_f64_fn)(const double *restrict, uint16_t *restrict, Py_ssize_t);
typedef void (*stats_f32_fn)(const float *restrict, Py_ssize_t, Py_ssize_t *, double *);
typedef void (*af_sums_f32_fn)(const float *restrict, Py_ssize_t, Py_ssize_t,
                               double *restrict, double *restrict, double);
typedef void (*af_sums_f64_fn)(const double *restrict, Py_ssize_t, Py_ssize_t,
                               double *restrict, double *restrict, double);
typedef void (*af_u_f32_fn)(float *restrict, Py_ssize_t, Py_ssize_t, const float *restrict,
                            const float *restrict, double, double, double);
typedef void (*af_u_f64_fn)(double *restrict, Py_ssize_t, Py_ssize_t, const double *restrict,
                            const double *restrict, double, double, double);
typedef void (*af_apply_f32_fn)(float *restrict, const float *restrict, Py_ssize_t, int, double,
                                double);
typedef void (*af_apply_f64_fn)(double *restrict, const double *restrict, Py_ssize_t, int,
                                double, double);
typedef void (*stats_f64_fn)(const double *restrict, Py_ssize_t, Py_ssize_t *, double *);
typedef void (*sum_f32_fn)(float *, float *const *, int, Py_ssize_t, int, int, int, int,
                           Py_ssize_t *, double *);
typedef void (*sum_f64_fn)(double *, double *const *, int, Py_ssize_t, int, int, int, int,
                           Py_ssize_t *, double *);

/* One set of loops per variant (ATTR: its target attribute). */
#define VARIANT_LOOPS(SUFFIX, ATTR, VB, NV)                                         \
    ADAM_LOOP(adam_float_##SUFFIX, ATTR, float, sqrtf)                        \
    ADAM_LOOP(adam_double_##SUFFIX, ATTR, double, sqrt)                       \
    SGD_LOOP(sgd_float_##SUFFIX, ATTR, float)                                 \
    SGD_LOOP(sgd_double_##SUFFIX, ATTR, double)                               \
    LION_LOOP(lion_float_##SUFFIX, ATTR, float)                               \
    LION_LOOP(lion_double_##SUFFIX, ATTR, double)                             \
    ROUND_LOOP(round_float_bf16_##SUFFIX, ATTR, float, f32_to_bf16)           \
    ROUND_LOOP(round_float_f16_##SUFFIX, ATTR, float, f32_to_f16)             \
    ROUND_LOOP(round_double_bf16_##SUFFIX, ATTR, double, f64_to_bf16)         \
    ROUND_LOOP(round_double_f16_##SUFFIX, ATTR, double, f64_to_f16)           \
    ROUND_SR_LOOP(round_sr_float_##SUFFIX, ATTR, float, same_f32)             \
    ROUND_SR_LOOP(round_sr_double_##SUFFIX, ATTR, double, f64_to_f32_odd)     \
    ACCUMULATE_LOOP(acc_float_bf16_##SUFFIX, ATTR, float, bf16_to_f32)        \
    ACCUMULATE_LOOP(acc_float_f16_##SUFFIX, ATTR, float, f16_to_f32)          \
    ACCUMULATE_LOOP(acc_double_bf16_##SUFFIX, ATTR, double, bf16_to_f32)      \
    ACCUMULATE_LOOP(acc_double_f16_##SUFFIX, ATTR, double, f16_to_f32)        \
    STATS_LOOP(stats_float_##SUFFIX, ATTR, float)                             \
    STATS_LOOP(stats_double_##SUFFIX, ATTR, double)                           \
    AF_SUMS_LOOP(af_sums_float_##SUFFIX, ATTR, float, exact_reciprocal_f32)   \
    AF_SUMS_LOOP(af_sums_double_##SUFFIX, ATTR, double, exact_reciprocal_f64) \
    AF_U_LOOP(af_u_float_##SUFFIX, ATTR, float, sqrtf, exact_reciprocal_f32)  \
    AF_U_LOOP(af_u_double_##SUFFIX, ATTR, double, sqrt, exact_reciprocal_f64) \
    AF_APPLY_LOOP(af_apply_float_##SUFFIX, ATTR, float)                       \
    AF_APPLY_LOOP(af_apply_double_##SUFFIX, ATTR, double)                     \
    SUM_LOOP(sum_float_##SUFFIX, ATTR, float, VB, NV, NT_STORE_##VB)            \
    SUM_LOOP(sum_double_##SUFFIX, ATTR, double, VB, NV, NT_STORE_##VB)          \
    ADAM8_LOOP(adam8_float_##SUFFIX, ATTR)

#ifdef HAVE_AVX512F
VARIANT_LOOPS(avx512f, __attribute__((target("avx512f"))), 64, 4)
/* With AVX512BW the compiler vectorizes the 8-bit step's byte loads and stores at the
 * full width (16 elements a vector, not 8): chosen where the CPU has it. */
ADAM8_LOOP(adam8_float_avx512bw, __attribute__((target("avx512f,avx512bw"))))
#endif
#ifdef X86_VARIANTS
VARIANT_LOOPS(avx2, __attribute__((target("avx2"))), 32, 8)
#endif
VARIANT_LOOPS(baseline, , 16, 8)

static adam_f32_fn adam_float_v[N_VARIANTS];
static adam_f64_fn adam_double_v[N_VARIANTS];
static sgd_f32_fn sgd_float_v[N_VARIANTS];
static sgd_f64_fn sgd_double_v[N_VARIANTS];
static lion_f32_fn lion_float_v[N_VARIANTS];
static lion_f64_fn lion_double_v[N_VARIANTS];
static stats_f32_fn stats_float_v[N_VARIANTS];
static stats_f64_fn stats_double_v[N_VARIANTS];
static af_sums_f32_fn af_sums_float_v[N_VARIANTS];
static af_sums_f64_fn af_sums_double_v[N_VARIANTS];
static af_u_f32_fn af_u_float_v[N_VARIANTS];
static af_u_f64_fn af_u_double_v[N_VARIANTS];
static af_apply_f32_fn af_apply_float_v[N_VARIANTS];
static af_apply_f64_fn af_apply_double_v[N_VARIANTS];
static sum_f32_fn sum_float_v[N_VARIANTS];
static sum_f64_fn sum_double_v[N_VARIANTS];
static adam8_fn adam8_float_v[N_VARIANTS];
/* [variant][0: bfloat16, 1: float16] */
static round_f32_fn round_float_v[N_VARIANTS][2];
static round_sr_f32_fn round_sr_float_v[N_VARIANTS];
static round_sr_f64_fn round_sr_double_v[N_VARIANTS];
static acc_f32_fn acc_float_v[N_VARIANTS][2];
static acc_f64_fn acc_double_v[N_VARIANTS][2];
static round_f64_fn round_double_v[N_VARIANTS][2];

#define REGISTER(V, SUFFIX)                                   \
    do {                                                      \
        adam_float_v[V] = adam_float_##SUFFIX;                \
        adam_double_v[V] = adam_double_##SUFFIX;              \
        sgd_float_v[V] = sgd_float_##SUFFIX;                  \
        sgd_double_v[V] = sgd_double_##SUFFIX;                \
        lion_float_v[V] = lion_float_##SUFFIX;                \
        lion_double_v[V] = lion_double_##SUFFIX;              \
        round_sr_float_v[V] = round_sr_float_##SUFFIX;        \
        round_sr_double_v[V] = round_sr_double_##SUFFIX;      \
        acc_float_v[V][0] = acc_float_bf16_##SUFFIX;          \
        acc_float_v[V][1] = acc_float_f16_##SUFFIX;           \
        acc_double_v[V][0] = acc_double_bf16_##SUFFIX;        \
        acc_double_v[V][1] = acc_double_f16_##SUFFIX;         \
        round_float_v[V][0] = round_float_bf16_##SUFFIX;      \
        round_float_v[V][1] = round_float_f16_##SUFFIX;       \
        round_double_v[V][0] = round_double_bf16_##SUFFIX;    \
        round_double_v[V][1] = round_double_f16_##SUFFIX;     \
        stats_float_v[V] = stats_float_##SUFFIX;              \
        stats_double_v[V] = stats_double_##SUFFIX;            \
        af_sums_float_v[V] = af_sums_float_##SUFFIX;          \
        af_sums_double_v[V] = af_sums_double_##SUFFIX;        \
        af_u_float_v[V] = af_u_float_##SUFFIX;                \
        af_u_double_v[V] = af_u_double_##SUFFIX;              \
        af_apply_float_v[V] = af_apply_float_##SUFFIX;        \
        af_apply_double_v[V] = af_apply_double_##SUFFIX;      \
        sum_float_v[V] = sum_float_##SUFFIX;                  \
        sum_double_v[V] = sum_double_##SUFFIX;                \
        adam8_float_v[V] = adam8_float_##SUFFIX;              \
        variant_built[V] = 1;                                 \
    } while (0)

#ifdef X86_VARIANTS
#include <immintrin.h>
/* float -> float16 with the F16C instruction (every AVX2 CPU has it): round to
 * nearest even in hardware, the same bits as f32_to_f16, 8 at a time. */
__attribute__((target("avx2,f16c"))) static void
round_float_f16_f16c(const float *restrict p, uint16_t *restrict low, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(p + i);
        const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(void *)(low + i), h);
    }
    for (; i < n; i++) low[i] = f32_to_f16(p[i]);
}
/* out (+)= float16 parts with F16C's exact conversion, 8 at a time. */
__attribute__((target("avx2,f16c"))) static void
acc_float_f16_f16c(float *restrict out, const uint16_t *restrict part, Py_ssize_t n, int add)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(part + i)));
        _mm256_storeu_ps(out + i, add ? _mm256_add_ps(_mm256_loadu_ps(out + i), x) : x);
    }
    for (; i < n; i++) out[i] = add ? out[i] + f16_to_f32(part[i]) : f16_to_f32(part[i]);
}
#endif



static void
init_variants(void)
{
    REGISTER(V_BASELINE, baseline);
    variant_supported[V_BASELINE] = 1;
#ifdef X86_VARIANTS
    __builtin_cpu_init();
    REGISTER(V_AVX2, avx2);
    variant_supported[V_AVX2] = __builtin_cpu_supports("avx2") != 0;
    if (__builtin_cpu_supports("f16c")) {
        round_float_v[V_AVX2][1] = round_float_f16_f16c;
        acc_float_v[V_AVX2][1] = acc_float_f16_f16c;
    }
#ifdef HAVE_AVX512F
    REGISTER(V_AVX512F, avx512f);
    if (__builtin_cpu_supports("avx512bw")) adam8_float_v[V_AVX512F] = adam8_float_avx512bw;
    variant_supported[V_AVX512F] = __builtin_cpu_supports("avx512f") != 0;
    if (__builtin_cpu_supports("f16c")) {
        round_float_v[V_AVX512F][1] = round_float_f16_f16c;
        acc_float_v[V_AVX512F][1] = acc_float_f16_f16c;
    }
#endif
#endif
    for (int v = 0; v < N_VARIANTS; v++)
        if (variant_supported[v]) {
            variant_auto = v;
            break;
        }
}

/* The variant named by `name` (NULL: the automatic one), or -1 with an exception. */
static int
parse_variant(const char *name)
{
    if (name == NULL) return variant_auto;
    for (int v = 0; v < N_VARIANTS; v++) {
        if (strcmp(name, variant_names[v]) != 0) continue;
        if (!variant_supported[v]) {
            PyErr_Format(PyExc_ValueError, "kernel variant '%s' %s", name,
                         variant_built[v] ? "is not supported by this CPU"
                                          : "was not compiled into this build");
            return -1;
        }
        return v;
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown kernel variant '%s' (one of 'avx512f', 'avx2', 'baseline')", name);
    return -1;
}

static int
get_vector(PyObject *obj, Py_buffer *view, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a %scontiguous float32/float64 array",
                     name, writable ? "writable " : "");
        return -1;
    }
    return 0;
}

/* A buffer's struct format character, without a byte-order prefix ('B' if none). */
static char
format_char(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[0];
}

static char
element_kind(const Py_buffer *view)
{
    const char f = format_char(view);
    if ((f == 'f' && view->itemsize == 4) || (f == 'd' && view->itemsize == 8)) return f;
    return 0;
}

PyDoc_STRVAR(adam_doc,
"adam(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay,\n"
"     decoupled, bc1, bc2, divisor, *, variant=None, low=None, low_kind=0)\n\n"
"One Adam/AdamW step in place on four contiguous 1-D arrays of one dtype\n"
"(float32 or float64). grad is read only. bc1 and bc2 are the bias corrections\n"
"1 - beta**t; divisor averages a summed gradient. variant names the compiled loop\n"
"to run (see variants()); None runs the best one this CPU supports. low: a\n"
"contiguous uint16 array of as many elements, into which the same pass writes the\n"
"updated parameters rounded to nearest even to bfloat16 (low_kind=0) or float16\n"
"(low_kind=1); with sr_key >= 0, rounded stochastically to bfloat16 instead, element\n"
"i from the hash of (sr_key, sr_base + i).");

/* Adam that also writes the rounded copy of the updated parameters: block by block,
 * the Adam loop then the rounding loop over the block while it is in L1 cache (one
 * pass over memory. In one loop body GCC no longer unswitches Adam's invariant
 * branches, nor vectorizes it: 8x slower). */
#define LOW_BLOCK 2048
static void
adam_low(char kind, int variant, int low_kind, Py_buffer *views, uint16_t *low, Py_ssize_t n,
         double lr, double b1, double b2, double eps, double wd, int decoupled, double bc1,
         double bc2, double div, long long sr_key, unsigned long long sr_base)
{
    for (Py_ssize_t lo = 0; lo < n; lo += LOW_BLOCK) {
        const Py_ssize_t k = n - lo < LOW_BLOCK ? n - lo : LOW_BLOCK;
        if (kind == 'f') {
            float *p = (float *)views[0].buf + lo;
            adam_float_v[variant](p, (float *)views[1].buf + lo, (float *)views[2].buf + lo,
                                  (float *)views[3].buf + lo, k, lr, b1, b2, eps, wd,
                                  decoupled, bc1, bc2, div);
            if (sr_key >= 0)
                round_sr_float_v[variant](p, low + lo, k, (uint32_t)sr_key,
                                          (uint32_t)(sr_base + (unsigned long long)lo));
            else
                round_float_v[variant][low_kind](p, low + lo, k);
        } else {
            double *p = (double *)views[0].buf + lo;
            adam_double_v[variant](p, (double *)views[1].buf + lo,
                                   (double *)views[2].buf + lo, (double *)views[3].buf + lo,
                                   k, lr, b1, b2, eps, wd, decoupled, bc1, bc2, div);
            if (sr_key >= 0)
                round_sr_double_v[variant](p, low + lo, k, (uint32_t)sr_key,
                                           (uint32_t)(sr_base + (unsigned long long)lo));
            else
                round_double_v[variant][low_kind](p, low + lo, k);
        }
    }
}

/* A contiguous array `obj` of `n` elements (any number for n < 0) of struct format
 * `fmt` and `itemsize` bytes each, `what` naming the type and `name` the argument in
 * errors, or -1 with an exception and nothing held. */
static int
get_typed(PyObject *obj, Py_buffer *view, Py_ssize_t n, char fmt, Py_ssize_t itemsize,
          int writable, const char *name, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a %scontiguous %s array", name,
                     writable ? "writable " : "", what);
        return -1;
    }
    if (view->itemsize != itemsize || format_char(view) != fmt ||
        (n >= 0 && view->len != itemsize * n)) {
        if (n >= 0)
            PyErr_Format(PyExc_ValueError, "%s must be %zd %s elements, got %zd bytes of '%s'",
                         name, n, what, view->len, view->format);
        else
            PyErr_Format(PyExc_ValueError, "%s must be %s elements, got '%s'", name, what,
                         view->format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A contiguous float32/float64 array: its kind ('f' or 'd'), or 0 with an exception
 * naming `name` and nothing held. */
static char
get_floats(PyObject *obj, Py_buffer *view, int writable, const char *name)
{
    if (get_vector(obj, view, writable, name) < 0) return 0;
    const char kind = element_kind(view);
    if (!kind) {
        PyErr_Format(PyExc_TypeError, "%s must be float32 or float64, got format '%s'", name,
                     view->format);
        PyBuffer_Release(view);
    }
    return kind;
}

/* The optional `divisor` argument (None: 1), or -1 with an exception. */
static int
get_divisor(PyObject *obj, double *divisor)
{
    *divisor = obj == Py_None ? 1.0 : PyFloat_AsDouble(obj);
    return *divisor == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* The uint16 array `obj` of `n` elements holding 16-bit floats (`name`: for errors),
 * or -1 with an exception. */
static int
get_low(PyObject *obj, Py_buffer *view, Py_ssize_t n, int kind, int writable, const char *name)
{
    if (kind != 0 && kind != 1) {
        PyErr_Format(PyExc_ValueError, "low_kind must be 0 (bfloat16) or 1 (float16), got %d",
                     kind);
        return -1;
    }
    return get_typed(obj, view, n, 'H', 2, writable, name, "uint16");
}

/* A contiguous float32/float64 array (its kind, 'f' or 'd') and a uint16 array of as
 * many 16-bit floats, or 0 with an exception and nothing held. */
static char
get_wide_and_low(PyObject *wide_obj, Py_buffer *wide, int wide_writable, const char *wide_name,
                 PyObject *low_obj, Py_buffer *low, int low_kind, int low_writable,
                 const char *low_name)
{
    const char kind = get_floats(wide_obj, wide, wide_writable, wide_name);
    if (!kind) return 0;
    if (get_low(low_obj, low, wide->len / wide->itemsize, low_kind, low_writable, low_name) < 0) {
        PyBuffer_Release(wide);
        return 0;
    }
    return kind;
}

/* An update's ``count`` arrays (param, grad, its states; grad read-only) into views,
 * each contiguous, of param's kind and length: that kind ('f'/'d'), or 0 with an
 * exception set and no view held. */
static char
get_update_arrays(PyObject *const *objs, Py_buffer *views, int count,
                  const char *const *names)
{
    int got = 0;
    for (; got < count; got++)
        if (get_vector(objs[got], &views[got], got != 1, names[got]) < 0) goto fail;
    const char kind = element_kind(&views[0]);
    if (!kind) {
        PyErr_Format(PyExc_TypeError, "param must be float32 or float64, got format '%s'",
                     views[0].format);
        goto fail;
    }
    for (int i = 1; i < count; i++) {
        if (element_kind(&views[i]) != kind) {
            PyErr_Format(PyExc_TypeError, "%s has format '%s', param '%s'", names[i],
                         views[i].format, views[0].format);
            goto fail;
        }
        if (views[i].len != views[0].len) {
            PyErr_Format(PyExc_ValueError, "%s has %zd bytes, param %zd", names[i],
                         views[i].len, views[0].len);
            goto fail;
        }
    }
    return kind;
fail:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    return 0;
}

static PyObject *
adam(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"param", "grad", "exp_avg", "exp_avg_sq", "lr", "beta1",
                             "beta2", "eps", "weight_decay", "decoupled", "bc1", "bc2",
                             "divisor", "variant", "low", "low_kind", "sr_key", "sr_base",
                             NULL};
    PyObject *objs[4], *low_obj = Py_None;
    double lr, b1, b2, eps, wd, bc1, bc2, div;
    int decoupled, low_kind = 0;
    long long sr_key = -1;
    unsigned long long sr_base = 0;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOdddddpddd|$zOiLK", kwlist, &objs[0],
                                     &objs[1], &objs[2], &objs[3], &lr, &b1, &b2, &eps, &wd,
                                     &decoupled, &bc1, &bc2, &div, &variant_name, &low_obj,
                                     &low_kind, &sr_key, &sr_base))
        return NULL;
    if (sr_key >= 0 && low_kind != 0) {
        PyErr_SetString(PyExc_ValueError, "stochastic rounding (sr_key) is for bfloat16 only");
        return NULL;
    }
    Py_buffer low_view;
    int have_low = 0;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    static const char *const names[4] = {"param", "grad", "exp_avg", "exp_avg_sq"};
    Py_buffer views[4];
    PyObject *result = NULL;
    const char kind = get_update_arrays(objs, views, 4, names);
    if (!kind) return NULL;
    Py_ssize_t n = views[0].len / views[0].itemsize;
    if (low_obj != Py_None) {
        if (get_low(low_obj, &low_view, n, low_kind, 1, "low") < 0) goto done;
        have_low = 1;
    }
    Py_BEGIN_ALLOW_THREADS
    if (have_low)
        adam_low(kind, variant, low_kind, views, low_view.buf, n, lr, b1, b2, eps, wd,
                 decoupled, bc1, bc2, div, sr_key, sr_base);
    else if (kind == 'f')
        adam_float_v[variant](views[0].buf, views[1].buf, views[2].buf, views[3].buf, n, lr,
                              b1, b2, eps, wd, decoupled, bc1, bc2, div);
    else
        adam_double_v[variant](views[0].buf, views[1].buf, views[2].buf, views[3].buf, n, lr,
                               b1, b2, eps, wd, decoupled, bc1, bc2, div);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (have_low) PyBuffer_Release(&low_view);
    for (int i = 0; i < 4; i++) PyBuffer_Release(&views[i]);
    return result;
}

PyDoc_STRVAR(sgd_doc,
"sgd(param, grad, momentum_buffer, lr, momentum, dampening, nesterov, weight_decay,\n"
"    decoupled, first, divisor, *, variant=None)\n\n"
"One SGD step in place over contiguous float32/float64 arrays of one length, the\n"
"same bits as zerompi.rules.sgd's numpy update (first: the step that starts the\n"
"momentum buffer). grad is only read.");

static PyObject *
sgd(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"param", "grad", "momentum_buffer", "lr", "momentum",
                             "dampening", "nesterov", "weight_decay", "decoupled", "first",
                             "divisor", "variant", NULL};
    PyObject *objs[3];
    double lr, mom, damp, wd, div;
    int nesterov, decoupled, first;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOdddpdppd|$z", kwlist, &objs[0],
                                     &objs[1], &objs[2], &lr, &mom, &damp, &nesterov, &wd,
                                     &decoupled, &first, &div, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    static const char *const names[3] = {"param", "grad", "momentum_buffer"};
    Py_buffer views[3];
    const char kind = get_update_arrays(objs, views, 3, names);
    if (!kind) return NULL;
    const Py_ssize_t n = views[0].len / views[0].itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        sgd_float_v[variant](views[0].buf, views[1].buf, views[2].buf, n, lr, mom, damp,
                             nesterov, wd, decoupled, first, div);
    else
        sgd_double_v[variant](views[0].buf, views[1].buf, views[2].buf, n, lr, mom, damp,
                              nesterov, wd, decoupled, first, div);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 3; i++) PyBuffer_Release(&views[i]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lion_doc,
"lion(param, grad, exp_avg, lr, beta1, beta2, weight_decay, divisor, *, variant=None)\n\n"
"One Lion step in place over contiguous float32/float64 arrays of one length, the\n"
"same bits as zerompi.rules.lion's numpy update. grad is only read.");

static PyObject *
lion(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"param", "grad", "exp_avg", "lr", "beta1", "beta2",
                             "weight_decay", "divisor", "variant", NULL};
    PyObject *objs[3];
    double lr, b1, b2, wd, div;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOddddd|$z", kwlist, &objs[0], &objs[1],
                                     &objs[2], &lr, &b1, &b2, &wd, &div, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    static const char *const names[3] = {"param", "grad", "exp_avg"};
    Py_buffer views[3];
    const char kind = get_update_arrays(objs, views, 3, names);
    if (!kind) return NULL;
    const Py_ssize_t n = views[0].len / views[0].itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        lion_float_v[variant](views[0].buf, views[1].buf, views[2].buf, n, lr, b1, b2, wd, div);
    else
        lion_double_v[variant](views[0].buf, views[1].buf, views[2].buf, n, lr, b1, b2, wd,
                               div);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 3; i++) PyBuffer_Release(&views[i]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(round_low_doc,
"round_low(src, low, low_kind, *, variant=None)\n\n"
"Write the contiguous float32/float64 array src, rounded to nearest even to\n"
"bfloat16 (low_kind=0) or float16 (low_kind=1), into the uint16 array low.");

static PyObject *
round_low(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"src", "low", "low_kind", "variant", NULL};
    PyObject *src_obj, *low_obj;
    int low_kind;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOi|$z", kwlist, &src_obj, &low_obj,
                                     &low_kind, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    Py_buffer src, low;
    const char kind = get_wide_and_low(src_obj, &src, 0, "src", low_obj, &low, low_kind, 1, "low");
    if (!kind) return NULL;
    const Py_ssize_t n = src.len / src.itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        round_float_v[variant][low_kind](src.buf, low.buf, n);
    else
        round_double_v[variant][low_kind](src.buf, low.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&low);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(accumulate_doc,
"accumulate(out, part, low_kind, add, *, variant=None)\n\n"
"out[i] = part[i] (add false) or out[i] + part[i] (add true), part a uint16 array\n"
"of bfloat16 (low_kind=0) or float16 (low_kind=1) values upcast exactly, out a\n"
"contiguous float32/float64 array of as many elements: numpy's mixed-dtype add.");

static PyObject *
accumulate(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"out", "part", "low_kind", "add", "variant", NULL};
    PyObject *out_obj, *part_obj;
    int low_kind, add;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOip|$z", kwlist, &out_obj, &part_obj,
                                     &low_kind, &add, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    Py_buffer out, part;
    const char kind =
        get_wide_and_low(out_obj, &out, 1, "out", part_obj, &part, low_kind, 0, "part");
    if (!kind) return NULL;
    const Py_ssize_t n = out.len / out.itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        acc_float_v[variant][low_kind](out.buf, part.buf, n, add);
    else
        acc_double_v[variant][low_kind](out.buf, part.buf, n, add);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&part);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(grad_stats_doc,
"grad_stats(grad, *, variant=None) -> (nonfinite, sumsq)\n\n"
"Sum of squares of a contiguous float32/float64 array, accumulated in float64 in\n"
"one pass, and the number of non-finite elements (counted only when the sum is\n"
"not finite). A float64 array of finite values may overflow the sum: the caller\n"
"rescales then. variant as for adam().");

static PyObject *
grad_stats(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"grad", "variant", NULL};
    PyObject *arg;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$z", kwlist, &arg, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    Py_buffer view;
    const char kind = get_floats(arg, &view, 0, "grad");
    if (!kind) return NULL;
    Py_ssize_t n = view.len / view.itemsize, bad = 0;
    double total = 0.0;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        stats_float_v[variant](view.buf, n, &bad, &total);
    else
        stats_double_v[variant](view.buf, n, &bad, &total);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(nd)", bad, total);
}

PyDoc_STRVAR(af_sums_doc,
"af_sums(g, rows, rowsum, colsum, *, divisor=None, variant=None)\n\n"
"Adafactor's statistics of a rectangle: g a contiguous float32/float64 array of\n"
"rows x w elements (row-major); rowsum (rows) and colsum (w) contiguous float64\n"
"arrays, overwritten with the float64 sums of the squares of each row (in\n"
"grad_stats' order) and of each column (row after row). With divisor, the sums\n"
"are those of the quotients g / divisor (in g's dtype, as numpy divides); g is\n"
"only read.");

static PyObject *
af_sums(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"g", "rows", "rowsum", "colsum", "divisor", "variant", NULL};
    PyObject *objs[3], *divisor_obj = Py_None;
    Py_ssize_t rows;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnOO|$Oz", kwlist, &objs[0], &rows,
                                     &objs[1], &objs[2], &divisor_obj, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    double divisor;
    if (get_divisor(divisor_obj, &divisor) < 0) return NULL;
    Py_buffer g, rs, cs;
    const char kind = get_floats(objs[0], &g, 0, "g");
    if (!kind) return NULL;
    const Py_ssize_t n = g.len / g.itemsize;
    if (rows <= 0 || n % rows) {
        PyErr_Format(PyExc_ValueError, "g must be float32/float64 of rows x w elements, got "
                     "%zd elements, rows=%zd", n, rows);
        PyBuffer_Release(&g);
        return NULL;
    }
    const Py_ssize_t w = n / rows;
    if (get_typed(objs[1], &rs, rows, 'd', 8, 1, "rowsum", "float64") < 0) {
        PyBuffer_Release(&g);
        return NULL;
    }
    if (get_typed(objs[2], &cs, w, 'd', 8, 1, "colsum", "float64") < 0) {
        PyBuffer_Release(&g);
        PyBuffer_Release(&rs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        af_sums_float_v[variant](g.buf, rows, w, rs.buf, cs.buf, divisor);
    else
        af_sums_double_v[variant](g.buf, rows, w, rs.buf, cs.buf, divisor);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&g);
    PyBuffer_Release(&rs);
    PyBuffer_Release(&cs);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(af_u_doc,
"af_u(g, r, c, denom, floor, *, divisor=None, variant=None)\n\n"
"Adafactor's update of a rectangle in place: g (rows x w elements, row-major,\n"
"contiguous float32/float64) becomes (g / divisor) / sqrt(max((r[i] / denom) *\n"
"c[j], floor)), r (rows) and c (w) of g's dtype, in that dtype (no divisor: g).");

static PyObject *
af_u(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"g", "r", "c", "denom", "floor", "divisor", "variant", NULL};
    PyObject *objs[3], *divisor_obj = Py_None;
    double denom, floor_;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOdd|$Oz", kwlist, &objs[0], &objs[1],
                                     &objs[2], &denom, &floor_, &divisor_obj, &variant_name))
        return NULL;
    double divisor;
    if (get_divisor(divisor_obj, &divisor) < 0) return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    Py_buffer g, r, c;
    const char kind = get_floats(objs[0], &g, 1, "g");
    if (!kind) return NULL;
    const Py_ssize_t size = kind == 'f' ? 4 : 8, n = g.len / size;
    const char *what = kind == 'f' ? "float32" : "float64";
    if (get_typed(objs[1], &r, -1, kind, size, 0, "r", what) < 0) {
        PyBuffer_Release(&g);
        return NULL;
    }
    const Py_ssize_t rows = r.len / size;
    if (get_typed(objs[2], &c, rows ? n / rows : -1, kind, size, 0, "c", what) < 0) {
        PyBuffer_Release(&g);
        PyBuffer_Release(&r);
        return NULL;
    }
    const Py_ssize_t w = c.len / size;
    if (rows * w != n) {
        PyErr_Format(PyExc_ValueError, "g must be len(r) x len(c) = %zd x %zd elements, got %zd",
                     rows, w, n);
    } else {
        Py_BEGIN_ALLOW_THREADS
        if (kind == 'f')
            af_u_float_v[variant](g.buf, rows, w, r.buf, c.buf, denom, floor_, divisor);
        else
            af_u_double_v[variant](g.buf, rows, w, r.buf, c.buf, denom, floor_, divisor);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&g);
    PyBuffer_Release(&r);
    PyBuffer_Release(&c);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* Adafactor's passes over a parameter's range in one call each, where
 * zerompi/rules/adafactor.py's numpy path loops in Python (the same bits: the same
 * loops above, in its order). `start` is the range's first element counted from the
 * parameter's first, `chunk` its CHUNK: sums of squares are taken per piece cut at
 * the parameter's multiples of `chunk` and added in turn to `init`; a stack of
 * `n x m` matrices is cut into the rectangles of its `rects` (a part of one row, or
 * whole rows, at most max(1, chunk / m) of them, within one matrix). */
#define RANGE_FNS(T, SUFFIX)                                                              \
    static double sumsq_chunks_##SUFFIX(const T *x, Py_ssize_t len, Py_ssize_t start,     \
                                        Py_ssize_t chunk, double acc, int variant) {      \
        for (Py_ssize_t pos = start; pos < start + len;) {                                \
            Py_ssize_t end = (pos / chunk + 1) * chunk, bad = 0;                          \
            double total = 0.0;                                                           \
            if (end > start + len) end = start + len;                                     \
            stats_##SUFFIX##_v[variant](x + (pos - start), end - pos, &bad, &total);      \
            acc += total;                                                                 \
            pos = end;                                                                    \
        }                                                                                 \
        return acc;                                                                       \
    }                                                                                     \
    static void af_sums_range_##SUFFIX(const T *g, Py_ssize_t len, Py_ssize_t start,      \
                                       Py_ssize_t n, Py_ssize_t m, Py_ssize_t chunk,      \
                                       double div, double *rowsum, double *colsum,        \
                                       double *row_tmp, double *col_tmp, int variant) {   \
        const Py_ssize_t most = chunk / m > 1 ? chunk / m : 1;                            \
        for (Py_ssize_t pos = start; pos < start + len;) {                                \
            const Py_ssize_t k = pos / (n * m), within = pos % (n * m);                   \
            const Py_ssize_t i = within / m, j = within % m;                              \
            Py_ssize_t end = (k + 1) * n * m, rows, w;                                    \
            if (end > start + len) end = start + len;                                     \
            if (j || end - pos < m) { /* a part of a row */                               \
                const Py_ssize_t stop = end < pos - j + m ? end : pos - j + m;            \
                rows = 1;                                                                 \
                w = stop - pos;                                                           \
            } else {                                                                      \
                rows = (end - pos) / m < most ? (end - pos) / m : most;                   \
                w = m;                                                                    \
            }                                                                             \
            af_sums_##SUFFIX##_v[variant](g + (pos - start), rows, w, row_tmp, col_tmp,   \
                                          div);                                           \
            for (Py_ssize_t r = 0; r < rows; r++) rowsum[k * n + i + r] += row_tmp[r];    \
            for (Py_ssize_t c = 0; c < w; c++) colsum[k * m + j + c] += col_tmp[c];       \
            pos += rows * w;                                                              \
        }                                                                                 \
    }                                                                                     \
    static double af_u_range_##SUFFIX(T *g, Py_ssize_t len, Py_ssize_t start,             \
                                      Py_ssize_t n, Py_ssize_t m, const T *r,             \
                                      const T *c, const T *denoms, Py_ssize_t k0,         \
                                      double floor_, Py_ssize_t chunk, Py_ssize_t lo,     \
                                      Py_ssize_t hi, double acc, double div, int variant) \
    {                                                                                     \
        for (Py_ssize_t pos = start; pos < start + len;) {                                \
            Py_ssize_t end = (pos / chunk + 1) * chunk;                                   \
            if (end > start + len) end = start + len;                                     \
            for (Py_ssize_t at = pos; at < end;) { /* U, a part of a row at a time */     \
                const Py_ssize_t k = at / (n * m) - k0, within = at % (n * m);            \
                const Py_ssize_t i = within / m, j = within % m;                          \
                const Py_ssize_t stop = end < at - j + m ? end : at - j + m;              \
                af_u_##SUFFIX##_v[variant](g + (at - start), 1, stop - at, r + k * n + i, \
                                           c + k * m + j, (double)denoms[k], floor_,      \
                                           div);                                          \
                at = stop;                                                                \
            }                                                                             \
            const Py_ssize_t a = pos > lo ? pos : lo, b = end < hi ? end : hi;            \
            if (b > a) { /* sum(U^2) of the counted part, still in cache */               \
                Py_ssize_t bad = 0;                                                       \
                double total = 0.0;                                                       \
                stats_##SUFFIX##_v[variant](g + (a - start), b - a, &bad, &total);        \
                acc += total;                                                             \
            }                                                                             \
            pos = end;                                                                    \
        }                                                                                 \
        return acc;                                                                       \
    }
RANGE_FNS(float, float)
RANGE_FNS(double, double)

PyDoc_STRVAR(sumsq_chunks_doc,
"sumsq_chunks(x, start, chunk, init, *, variant=None)\n\n"
"init plus the float64 sums of the squares of x (contiguous float32/float64) cut at\n"
"the multiples of chunk counted from start (x[0]'s index), each in grad_stats'\n"
"order, added in turn.");

static PyObject *
sumsq_chunks(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"x", "start", "chunk", "init", "variant", NULL};
    PyObject *obj;
    Py_ssize_t start, chunk;
    double init;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onnd|$z", kwlist, &obj, &start, &chunk,
                                     &init, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    if (start < 0 || chunk < 1) {
        PyErr_Format(PyExc_ValueError, "start must be >= 0 and chunk >= 1, got %zd and %zd",
                     start, chunk);
        return NULL;
    }
    Py_buffer x;
    const char kind = get_floats(obj, &x, 0, "x");
    if (!kind) return NULL;
    const Py_ssize_t len = x.len / x.itemsize;
    double acc;
    Py_BEGIN_ALLOW_THREADS
    acc = kind == 'f' ? sumsq_chunks_float(x.buf, len, start, chunk, init, variant)
                      : sumsq_chunks_double(x.buf, len, start, chunk, init, variant);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    return PyFloat_FromDouble(acc);
}

/* The arguments of a range of a stack of n x m matrices, checked. */
static int
check_stack(Py_ssize_t start, Py_ssize_t n, Py_ssize_t m, Py_ssize_t chunk)
{
    if (start < 0 || n < 1 || m < 1 || chunk < 1) {
        PyErr_Format(PyExc_ValueError, "start must be >= 0 and n, m, chunk >= 1, got %zd, "
                     "%zd, %zd, %zd", start, n, m, chunk);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(af_sums_range_doc,
"af_sums_range(g, start, n, m, chunk, rowsum, colsum, *, divisor=None, variant=None)\n\n"
"af_sums over the rectangles of elements start ... start + len(g) of a stack of\n"
"n x m matrices (g contiguous float32/float64, only read), each rectangle's row and\n"
"column sums added to rowsum[k * n + i] and colsum[k * m + j] (float64, matrix k\n"
"counted from the stack's first: its rows' and columns' sums of every matrix).");

static PyObject *
af_sums_range(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"g", "start", "n", "m", "chunk", "rowsum", "colsum", "divisor",
                             "variant", NULL};
    PyObject *objs[3], *divisor_obj = Py_None;
    Py_ssize_t start, n, m, chunk;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnnOO|$Oz", kwlist, &objs[0], &start,
                                     &n, &m, &chunk, &objs[1], &objs[2], &divisor_obj,
                                     &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0 || check_stack(start, n, m, chunk) < 0) return NULL;
    double divisor;
    if (get_divisor(divisor_obj, &divisor) < 0) return NULL;
    Py_buffer g, rs, cs;
    const char kind = get_floats(objs[0], &g, 0, "g");
    if (!kind) return NULL;
    const Py_ssize_t len = g.len / g.itemsize;
    const Py_ssize_t stack = len ? (start + len - 1) / (n * m) + 1 : 0; /* matrices needed */
    if (get_typed(objs[1], &rs, -1, 'd', 8, 1, "rowsum", "float64") < 0) {
        PyBuffer_Release(&g);
        return NULL;
    }
    if (get_typed(objs[2], &cs, -1, 'd', 8, 1, "colsum", "float64") < 0) {
        PyBuffer_Release(&g);
        PyBuffer_Release(&rs);
        return NULL;
    }
    const Py_ssize_t most = chunk / m > 1 ? chunk / m : 1;
    double *tmp = NULL;
    if (rs.len / 8 < stack * n || cs.len / 8 < stack * m)
        PyErr_Format(PyExc_ValueError, "rowsum and colsum must hold %zd matrices' rows and "
                     "columns (%zd and %zd), got %zd and %zd", stack, stack * n, stack * m,
                     rs.len / 8, cs.len / 8);
    else if ((tmp = PyMem_Malloc((most + m) * sizeof(double))) == NULL)
        PyErr_NoMemory();
    else {
        Py_BEGIN_ALLOW_THREADS
        if (kind == 'f')
            af_sums_range_float(g.buf, len, start, n, m, chunk, divisor, rs.buf, cs.buf, tmp,
                                tmp + most, variant);
        else
            af_sums_range_double(g.buf, len, start, n, m, chunk, divisor, rs.buf, cs.buf, tmp,
                                 tmp + most, variant);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(tmp);
    PyBuffer_Release(&g);
    PyBuffer_Release(&rs);
    PyBuffer_Release(&cs);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(af_u_range_doc,
"af_u_range(g, start, n, m, r, c, denoms, k0, floor, chunk, lo, hi, init, *,\n"
"           divisor=None, variant=None)\n\n"
"af_u over elements start ... start + len(g) of a stack of n x m matrices, in place\n"
"(g contiguous float32/float64; matrix k's rows' state r[(k - k0) * n ...], columns'\n"
"c[(k - k0) * m ...], denominator denoms[k - k0], all of g's dtype), one piece of\n"
"the multiples of chunk at a time; returns init plus the sums of the squares of\n"
"each piece's elements within lo ... hi (the counted ones), added in turn.");

static PyObject *
af_u_range(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"g", "start", "n", "m", "r", "c", "denoms", "k0", "floor",
                             "chunk", "lo", "hi", "init", "divisor", "variant", NULL};
    PyObject *objs[4], *divisor_obj = Py_None;
    Py_ssize_t start, n, m, k0, chunk, lo, hi;
    double floor_, init;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnOOOndnnnd|$Oz", kwlist, &objs[0],
                                     &start, &n, &m, &objs[1], &objs[2], &objs[3], &k0,
                                     &floor_, &chunk, &lo, &hi, &init, &divisor_obj,
                                     &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0 || check_stack(start, n, m, chunk) < 0) return NULL;
    double divisor;
    if (get_divisor(divisor_obj, &divisor) < 0) return NULL;
    Py_buffer g, views[3];
    const char kind = get_floats(objs[0], &g, 1, "g");
    if (!kind) return NULL;
    const Py_ssize_t size = kind == 'f' ? 4 : 8, len = g.len / size;
    const char *what = kind == 'f' ? "float32" : "float64";
    static const char *const names[3] = {"r", "c", "denoms"};
    int got = 0;
    for (; got < 3; got++)
        if (get_typed(objs[got + 1], &views[got], -1, kind, size, 0, names[got], what) < 0)
            break;
    double acc = init;
    if (got == 3) {
        const Py_ssize_t count = views[2].len / size; /* matrices k0 ... k0 + count - 1 */
        const Py_ssize_t first = start / (n * m), last = len ? (start + len - 1) / (n * m) : first;
        if (len && (first < k0 || last >= k0 + count))
            PyErr_Format(PyExc_ValueError, "elements %zd to %zd span matrices %zd to %zd, "
                         "denoms holds %zd to %zd", start, start + len, first, last, k0,
                         k0 + count - 1);
        else if (views[0].len / size < count * n || views[1].len / size < count * m)
            PyErr_Format(PyExc_ValueError, "r and c must hold %zd matrices' rows and columns "
                         "(%zd and %zd), got %zd and %zd", count, count * n, count * m,
                         views[0].len / size, views[1].len / size);
        else {
            Py_BEGIN_ALLOW_THREADS
            if (kind == 'f')
                acc = af_u_range_float(g.buf, len, start, n, m, views[0].buf, views[1].buf,
                                       views[2].buf, k0, floor_, chunk, lo, hi, init, divisor,
                                       variant);
            else
                acc = af_u_range_double(g.buf, len, start, n, m, views[0].buf, views[1].buf,
                                        views[2].buf, k0, floor_, chunk, lo, hi, init,
                                        divisor, variant);
            Py_END_ALLOW_THREADS
        }
    }
    for (int v = 0; v < got; v++) PyBuffer_Release(&views[v]);
    PyBuffer_Release(&g);
    if (PyErr_Occurred()) return NULL;
    return PyFloat_FromDouble(acc);
}

PyDoc_STRVAR(af_apply_doc,
"af_apply(param, u, decay, scale, *, variant=None)\n\n"
"param = param * decay + u * scale in place (decay None: param + u * scale), in\n"
"param's dtype; param and u contiguous float32/float64 arrays of one dtype and\n"
"length.");

static PyObject *
af_apply(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"param", "u", "decay", "scale", "variant", NULL};
    PyObject *objs[2], *decay_obj;
    double scale;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOd|$z", kwlist, &objs[0], &objs[1],
                                     &decay_obj, &scale, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    const int decays = decay_obj != Py_None;
    const double decay = decays ? PyFloat_AsDouble(decay_obj) : 1.0;
    if (decays && decay == -1.0 && PyErr_Occurred()) return NULL;
    static const char *const names[2] = {"param", "u"};
    Py_buffer views[2];
    const char kind = get_update_arrays(objs, views, 2, names);
    if (!kind) return NULL;
    const Py_ssize_t n = views[0].len / views[0].itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        af_apply_float_v[variant](views[0].buf, views[1].buf, n, decays, decay, scale);
    else
        af_apply_double_v[variant](views[0].buf, views[1].buf, n, decays, decay, scale);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&views[0]);
    PyBuffer_Release(&views[1]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(zero_doc,
"zero(a, *, stream=False)\n\n"
"Every byte of a writable C-contiguous buffer set to 0 (0.0 in every float format).\n"
"With stream, its 64-byte lines are written with non-temporal stores (past the\n"
"cache, no read for ownership): for a buffer that is not read again before it\n"
"would leave the cache anyway (the gradient buffers after a step); memset else.");

static PyObject *
zero(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"a", "stream", NULL};
    PyObject *obj;
    int stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$p", kwlist, &obj, &stream))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_SetString(PyExc_TypeError, "a must be a writable contiguous array");
        return NULL;
    }
    char *p = view.buf;
    Py_ssize_t n = view.len;
    Py_BEGIN_ALLOW_THREADS
#ifdef NT_ALIGN
    if (stream && n >= 128) {
        const Py_ssize_t head = (Py_ssize_t)((64 - (uintptr_t)p % 64) % 64);
        memset(p, 0, (size_t)head);
        p += head;
        n -= head;
        const __m128i z = _mm_setzero_si128();
        const Py_ssize_t body = n - n % 64;
        for (Py_ssize_t i = 0; i < body; i += 16) NT_STORE_16(p + i, z);
        NT_FENCE();
        p += body;
        n -= body;
    }
#endif
    memset(p, 0, (size_t)n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sum_parts_doc,
"sum_parts(out, parts, add, stats, *, clear=False, variant=None) -> (nonfinite, sumsq) or None\n\n"
"out[i] = parts[0][i] + parts[1][i] + ... (add false) or out[i] + parts[0][i] + ...\n"
"(add true), summed in that order in out's dtype; out and every part contiguous\n"
"float32/float64 arrays of one dtype and length (out may be one of the parts). With\n"
"stats, also what grad_stats(out) returns afterwards, from the same pass. With\n"
"clear, every part is set to zero as it is read (parts writable; out, written\n"
"last, ends with the sum even where it is one of the parts). With stream, out's\n"
"whole tiles are written with non-temporal stores (no read for ownership, past the\n"
"cache) where add is false, out is none of the parts and 64-byte aligned; the same\n"
"values either way.");

#define MAX_PARTS 256

static PyObject *
sum_parts(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"out", "parts", "add", "stats", "clear", "stream", "variant",
                             NULL};
    PyObject *out_obj, *parts_obj, *result = NULL;
    int add, stats, clear = 0, stream = 0;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOpp|$ppz", kwlist, &out_obj, &parts_obj,
                                     &add, &stats, &clear, &stream, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    PyObject *seq = PySequence_Fast(parts_obj, "parts must be a sequence of arrays");
    if (seq == NULL) return NULL;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k < 1 || k > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "sum_parts needs 1 to %d parts, got %zd", MAX_PARTS, k);
        Py_DECREF(seq);
        return NULL;
    }
    Py_buffer out, views[MAX_PARTS];
    void *ptrs[MAX_PARTS];
    Py_ssize_t got = 0;
    if (get_vector(out_obj, &out, 1, "out") < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    const char kind = element_kind(&out);
    const Py_ssize_t n = out.len / (out.itemsize ? out.itemsize : 1);
    if (!kind) {
        PyErr_Format(PyExc_TypeError, "out must be float32 or float64, got format '%s'",
                     out.format);
        goto done;
    }
    for (; got < k; got++) {
        if (get_vector(PySequence_Fast_GET_ITEM(seq, got), &views[got], clear, "each part") < 0)
            goto done;
        if (element_kind(&views[got]) != kind || views[got].len != out.len) {
            PyErr_Format(PyExc_ValueError, "part %zd is not %zd elements of out's dtype",
                         got, n);
            got++;
            goto done;
        }
        ptrs[got] = views[got].buf;
    }
    Py_ssize_t bad = 0;
    double total = 0.0;
    /* streamed only where out is written and never read: not added to, not a part,
     * and aligned for every variant's vectors */
#ifdef NT_ALIGN
    stream = stream && !add && ((uintptr_t)out.buf % 64) == 0;
    for (Py_ssize_t q = 0; stream && q < k; q++) stream = ptrs[q] != out.buf;
#else
    stream = 0;
#endif
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        sum_float_v[variant](out.buf, (float *const *)ptrs, (int)k, n, add, stats, clear,
                             stream, &bad, &total);
    else
        sum_double_v[variant](out.buf, (double *const *)ptrs, (int)k, n, add, stats, clear,
                              stream, &bad, &total);
    Py_END_ALLOW_THREADS
    if (stats)
        result = Py_BuildValue("(nd)", bad, total);
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (Py_ssize_t q = 0; q < got; q++) PyBuffer_Release(&views[q]);
    PyBuffer_Release(&out);
    Py_DECREF(seq);
    return result;
}


PyDoc_STRVAR(adam8_doc,
"adam8(param, grad, qm, qv, sm, sv, lr, beta1, beta2, alpha, eps, divisor, l2,\n"
"      decoupled_decay, block)\n\n"
"8-bit Adam on whole blocks: param, grad float32 (a multiple of block elements), qm,\n"
"qv uint8 of as many (zerompi.quant's E4M3 with a sign and E5M3 codes), sm, sv\n"
"float32 scales (one per block). alpha and eps: Adam's with the bias corrections\n"
"folded in (zerompi.quant.scalars8). In place; grad is read only.\n"
"variant as for adam().");

static PyObject *
adam8(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"param", "grad", "qm", "qv", "sm", "sv", "lr", "beta1", "beta2",
                             "alpha", "eps", "divisor", "l2", "decoupled_decay", "block",
                             "variant", NULL};
    PyObject *o[6];
    double lr, b1, b2, alpha, eps, div, l2, dec;
    Py_ssize_t block;
    const char *variant_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOddddddddn|$z", kwlist, &o[0],
                                     &o[1], &o[2], &o[3], &o[4], &o[5], &lr, &b1, &b2, &alpha,
                                     &eps, &div, &l2, &dec, &block, &variant_name))
        return NULL;
    const int variant = parse_variant(variant_name);
    if (variant < 0) return NULL;
    if (block < 1 || block > 1 << 16) {
        PyErr_Format(PyExc_ValueError, "block must be 1 to 65536, got %zd", block);
        return NULL;
    }
    Py_buffer v[6];
    int got = 0;
    PyObject *result = NULL;
    float *tmp = NULL;
    if (get_typed(o[0], &v[got], -1, 'f', 4, 1, "param", "float32") < 0) goto done;
    got++;
    const Py_ssize_t n = v[0].len / 4;
    if (n % block) {
        PyErr_Format(PyExc_ValueError, "param has %zd elements, not whole blocks of %zd", n,
                     block);
        goto done;
    }
    const char fmts[6] = {'f', 'f', 'B', 'B', 'f', 'f'};
    const Py_ssize_t sizes[6] = {n, n, n, n, n / block, n / block};
    const char *names[6] = {"param", "grad", "qm", "qv", "sm", "sv"};
    for (; got < 6; got++)
        if (get_typed(o[got], &v[got], sizes[got], fmts[got], fmts[got] == 'B' ? 1 : 4,
                      got != 1, names[got], fmts[got] == 'B' ? "uint8" : "float32") < 0)
            goto done;
    tmp = PyMem_Malloc(2 * block * sizeof(float));
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    adam8_float_v[variant](v[0].buf, v[1].buf, v[2].buf, v[3].buf, v[4].buf, v[5].buf,
                           n / block, block, lr, b1, b2, alpha, eps, div, l2, dec, tmp,
                           tmp + block);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyMem_Free(tmp);
    for (int q = 0; q < got; q++) PyBuffer_Release(&v[q]);
    return result;
}

PyDoc_STRVAR(variants_doc,
"variants() -> tuple of str\n\n"
"The compiled loops this CPU can run, widest vectors first, among 'avx512f',\n"
"'avx2' and 'baseline' (x86-64 without extensions, or the only one elsewhere).\n"
"The first one runs when no variant is named.");

/* The names of the variants whose flag is set, in order, as a tuple. */
static PyObject *
variant_tuple(const int *flags)
{
    PyObject *names = PyList_New(0);
    for (int v = 0; names != NULL && v < N_VARIANTS; v++) {
        if (!flags[v]) continue;
        PyObject *name = PyUnicode_FromString(variant_names[v]);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    if (names == NULL) return NULL;
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

static PyObject *
variants(PyObject *self, PyObject *unused)
{
    return variant_tuple(variant_supported);
}

PyDoc_STRVAR(compiled_doc,
"compiled() -> tuple of str\n\n"
"Every loop compiled into this build, whether or not this CPU can run it.");

static PyObject *
compiled(PyObject *self, PyObject *unused)
{
    return variant_tuple(variant_built);
}

static PyMethodDef methods[] = {
    {"adam", (PyCFunction)(void (*)(void))adam, METH_VARARGS | METH_KEYWORDS, adam_doc},
    {"sgd", (PyCFunction)(void (*)(void))sgd, METH_VARARGS | METH_KEYWORDS, sgd_doc},
    {"lion", (PyCFunction)(void (*)(void))lion, METH_VARARGS | METH_KEYWORDS, lion_doc},
    {"grad_stats", (PyCFunction)(void (*)(void))grad_stats, METH_VARARGS | METH_KEYWORDS,
     grad_stats_doc},
    {"round_low", (PyCFunction)(void (*)(void))round_low, METH_VARARGS | METH_KEYWORDS,
     round_low_doc},
    {"accumulate", (PyCFunction)(void (*)(void))accumulate, METH_VARARGS | METH_KEYWORDS,
     accumulate_doc},
    {"sum_parts", (PyCFunction)(void (*)(void))sum_parts, METH_VARARGS | METH_KEYWORDS,
     sum_parts_doc},
    {"zero", (PyCFunction)(void (*)(void))zero, METH_VARARGS | METH_KEYWORDS, zero_doc},
    {"adam8", (PyCFunction)(void (*)(void))adam8, METH_VARARGS | METH_KEYWORDS, adam8_doc},
    {"af_sums", (PyCFunction)(void (*)(void))af_sums, METH_VARARGS | METH_KEYWORDS, af_sums_doc},
    {"af_u", (PyCFunction)(void (*)(void))af_u, METH_VARARGS | METH_KEYWORDS, af_u_doc},
    {"sumsq_chunks", (PyCFunction)(void (*)(void))sumsq_chunks, METH_VARARGS | METH_KEYWORDS,
     sumsq_chunks_doc},
    {"af_sums_range", (PyCFunction)(void (*)(void))af_sums_range, METH_VARARGS | METH_KEYWORDS,
     af_sums_range_doc},
    {"af_u_range", (PyCFunction)(void (*)(void))af_u_range, METH_VARARGS | METH_KEYWORDS,
     af_u_range_doc},
    {"af_apply", (PyCFunction)(void (*)(void))af_apply, METH_VARARGS | METH_KEYWORDS,
     af_apply_doc},
    {"variants", variants, METH_NOARGS, variants_doc},
    {"compiled", compiled, METH_NOARGS, compiled_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zerompi._kernels",
    "Compiled kernels of zerompi (optional: adam.py falls back to numpy without them).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    init_variants();
    return PyModule_Create(&module);
}
