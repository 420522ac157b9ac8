/* devharness's native kernels: the forward's hot loops in plain C (see cpu.py, which builds this file
   with the machine's C compiler on first use and calls it through ctypes). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vectors of VW floats (one AVX-512 register, two AVX2 ones), in GCC's vector extensions so that the same
   source builds for any -march. */
#ifndef VW   /* a build may set it (-DVW=16 on an AVX2 machine: GCC splits the vectors), as the tests do */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#endif
typedef float vfloat __attribute__((vector_size(VW * 4)));
typedef int32_t vint __attribute__((vector_size(VW * 4)));

static inline __attribute__((always_inline)) vfloat load_vec(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* e^x in VW lanes: 2^n * e^r with x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes'
   coefficients, within 2 ulp of expf) over x clamped to [-87, 88], where e^x is a normal float; past the range
   of floats, +inf above and 0 below (so e^-inf is 0 and e^inf is inf, as expf gives), NaN stays NaN. glibc's
   expf is a call per element: for the decode attention's softmax it was about a fifth of the kernel's time. */
static inline __attribute__((always_inline)) vfloat exp_vec(vfloat x0) {
    const vfloat z = {0};   /* bounds from a zero vector: x * 0 would be NaN for an infinite x */
    const vfloat lo = z - 87.f, hi = z + 88.f;
    vint m = x0 < lo;
    vfloat x = (vfloat)(((vint)x0 & ~m) | ((vint)lo & m));
    m = x > hi;
    x = (vfloat)(((vint)x & ~m) | ((vint)hi & m));
    const vfloat n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;   /* round to nearest */
    const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vfloat p = r * 0.f + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const vfloat e = p * (vfloat)((__builtin_convertvector(n, vint) + 127) << 23);
    const vint over = x0 > 88.7228394f, under = x0 < -87.3365479f;   /* e^x above FLT_MAX, below FLT_MIN */
    const vfloat inf = z + __builtin_inff();
    return (vfloat)((((vint)e & ~over) | ((vint)inf & over)) & ~under);
}

/* The sum of a vector's lanes, by halves. */
static inline __attribute__((always_inline)) float sum_lanes(vfloat v) {
#if VW == 16
    v += __builtin_shuffle(v, (vint){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vint){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vint){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vint){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (vint){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vint){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vint){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* s[g * stride] = scale * (q_g . k) for the G query heads of one KV head (q: G * D floats) against one
   cached key: the key is loaded once for the G heads. */
static inline __attribute__((always_inline)) void
scores_of_token(const float *q, const float *k, int64_t G, const int64_t D, float scale, float *s, int64_t stride) {
    if (D % VW == 0 && D <= 128) {
        enum { MAXV = 128 / VW };
        vfloat kv[MAXV];
        for (int c = 0; c < D / VW; ++c) kv[c] = load_vec(k + c * VW);
        for (int64_t g = 0; g < G; ++g) {
            vfloat acc = load_vec(q + g * D) * kv[0];
            for (int c = 1; c < D / VW; ++c) acc += load_vec(q + g * D + c * VW) * kv[c];
            s[g * stride] = sum_lanes(acc) * scale;
        }
        return;
    }
    for (int64_t g = 0; g < G; ++g) {
        const float *qh = q + g * D;
        float dot = 0.f;
        #pragma omp simd reduction(+:dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
        s[g * stride] = dot * scale;
    }
}

/* The lane sums of a[0], ..., a[VW - 1] as one vector (lane t = the sum of a[t]'s lanes), by a transposing tree:
   each stage adds pairs of vectors lane group against lane group, so that VW sums cost VW - 1 adds and twice
   as many shuffles (sum_lanes per vector: VW log2(VW) of each, and a serial chain). */
#define PAIR_SUM(x, y, lo, hi) (__builtin_shuffle(x, y, (vint)lo) + __builtin_shuffle(x, y, (vint)hi))
static inline __attribute__((always_inline)) vfloat transpose_sum(const vfloat *a) {
#if VW == 16
    vfloat b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = PAIR_SUM(a[2 * i], a[2 * i + 1], ((vint){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}),
                        ((vint){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}));
    for (int i = 0; i < 4; ++i)
        c[i] = PAIR_SUM(b[2 * i], b[2 * i + 1], ((vint){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}),
                        ((vint){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}));
    for (int i = 0; i < 2; ++i)
        d[i] = PAIR_SUM(c[2 * i], c[2 * i + 1], ((vint){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}),
                        ((vint){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}));
    return PAIR_SUM(d[0], d[1], ((vint){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                    ((vint){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}));
#else
    vfloat b[4], c[2];
    for (int i = 0; i < 4; ++i)
        b[i] = PAIR_SUM(a[2 * i], a[2 * i + 1], ((vint){0, 8, 2, 10, 4, 12, 6, 14}), ((vint){1, 9, 3, 11, 5, 13, 7, 15}));
    for (int i = 0; i < 2; ++i)
        c[i] = PAIR_SUM(b[2 * i], b[2 * i + 1], ((vint){0, 1, 8, 9, 4, 5, 12, 13}), ((vint){2, 3, 10, 11, 6, 7, 14, 15}));
    return PAIR_SUM(c[0], c[1], ((vint){0, 1, 2, 3, 8, 9, 10, 11}), ((vint){4, 5, 6, 7, 12, 13, 14, 15}));
#endif
}

/* The scores of a block's n tokens (keys `tok` = Hkv * D floats apart, heads contiguous) for every query head
   (q: Hkv * G * D floats, the G heads of KV head 0 first): s[h * stride + j] = scale * (q_h . k_j) for the
   KV head of h. VW tokens at a time where D is whole vectors: for each query head VW independent dot
   products (the one-token form is a chain of D / VW dependent FMAs and a horizontal sum per product, bound by
   latency), their sums transposed into one vector stored whole; single tokens after. Keys are read in
   memory order, a run of tokens with all their heads, while the same tokens' keys in the next block (pk; NULL
   for none) are asked for, a token's worth of lines at a time between the heads' products (the run's
   worth at once stalled on the line-fill buffers); add_values asks for the next block's values. */
static inline __attribute__((always_inline)) void
scores_of_block(const float *q, const float *k, int64_t Hkv, int64_t n, int64_t G, const int64_t D, float scale,
                float *s, int64_t stride, const float *pk) {
    const int64_t tok = Hkv * D;
    int64_t j = 0;
    if (D % VW == 0 && D <= 128)
        for (; j + VW <= n; j += VW) {
            for (int64_t kvh = 0; kvh < Hkv; ++kvh)
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t it = kvh * G + g, per = (VW + Hkv * G - 1) / (Hkv * G);
                    if (pk != NULL)   /* the run's tokens in the next block, spread over its heads */
                        for (int64_t t = it * per; t < (it + 1) * per && t < VW; ++t)
                            for (int64_t c = 0; c < tok; c += 16) __builtin_prefetch(pk + (j + t) * tok + c, 0, 2);
                    const float *qh = q + (kvh * G + g) * D, *kh = k + j * tok + kvh * D;
                    vfloat acc[VW];
                    const vfloat q0 = load_vec(qh);
                    for (int t = 0; t < VW; ++t) acc[t] = q0 * load_vec(kh + t * tok);
                    for (int c = 1; c < D / VW; ++c) {
                        const vfloat qc = load_vec(qh + c * VW);
                        for (int t = 0; t < VW; ++t) acc[t] += qc * load_vec(kh + t * tok + c * VW);
                    }
                    const vfloat r = transpose_sum(acc) * scale;
                    memcpy(s + (kvh * G + g) * stride + j, &r, sizeof r);
                }
        }
    for (; j < n; ++j) {
        if (pk != NULL)
            for (int64_t c = 0; c < tok; c += 16) __builtin_prefetch(pk + j * tok + c, 0, 2);
        for (int64_t kvh = 0; kvh < Hkv; ++kvh)
            scores_of_token(q + kvh * G * D, k + j * tok + kvh * D, G, D, scale, s + kvh * G * stride + j, stride);
    }
}

/* The lane-wise larger of a and b. */
static inline __attribute__((always_inline)) vfloat max_vec(vfloat a, vfloat b) {
    const vint gt = a > b;
    return (vfloat)(((vint)a & gt) | ((vint)b & ~gt));
}

/* The largest lane of a vector, by halves. */
static inline __attribute__((always_inline)) float max_lanes(vfloat v) {
#if VW == 16
    vfloat w = __builtin_shuffle(v, (vint){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = max_vec(v, w);
    w = __builtin_shuffle(v, (vint){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v = max_vec(v, w);
    w = __builtin_shuffle(v, (vint){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v = max_vec(v, w);
    w = __builtin_shuffle(v, (vint){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#else
    vfloat w = __builtin_shuffle(v, (vint){4, 5, 6, 7, 0, 1, 2, 3});
    v = max_vec(v, w);
    w = __builtin_shuffle(v, (vint){2, 3, 0, 1, 6, 7, 4, 5});
    v = max_vec(v, w);
    w = __builtin_shuffle(v, (vint){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    v = max_vec(v, w);
    return v[0];
}

/* The largest of x[0:n]: whole vectors by halves, then the rest. */
static inline __attribute__((always_inline)) float max_of(const float *x, int64_t n) {
    int64_t j = 0;
    float top = -INFINITY;
    if (n >= VW) {
        vfloat vm = load_vec(x);
        for (j = VW; j + VW <= n; j += VW) vm = max_vec(load_vec(x + j), vm);
        top = max_lanes(vm);
    }
    for (; j < n; ++j) top = x[j] > top ? x[j] : top;
    return top;
}

/* oh[g * D : (g + 1) * D] += sum over j < n of p[g * pstride + j] * v[j * tok : j * tok + D] for the gn query heads
   g < gn of one KV head: each value vector is loaded once for them, and their outputs stay in registers over the
   block's tokens (gn * D / VW accumulators: at most 16). pv (NULL for none): the same head's values in the next
   block, asked for a token at a time as this block's are added (the keys' and the values' lines asked for
   together, while the scores were computed, left the memory idle while the values were added: 8-12% slower). */
static inline __attribute__((always_inline)) void
add_values(float *oh, const float *p, int64_t pstride, const float *v, int64_t tok, int64_t n, const int64_t D,
           const int gn, const float *pv) {
    if (D % VW == 0 && D <= 128 && gn * (D / VW) <= 16) {
        enum { MAXV = 128 / VW };
        vfloat acc[4][MAXV];
        for (int g = 0; g < gn; ++g)
            for (int c = 0; c < D / VW; ++c) acc[g][c] = load_vec(oh + g * D + c * VW);
        for (int64_t j = 0; j < n; ++j) {
            const float *vj = v + j * tok;
            if (pv != NULL)
                for (int64_t c = 0; c < D; c += 16) __builtin_prefetch(pv + j * tok + c, 0, 2);
            vfloat vv[MAXV];
            for (int c = 0; c < D / VW; ++c) vv[c] = load_vec(vj + c * VW);
            for (int g = 0; g < gn; ++g) {
                const float pj = p[g * pstride + j];
                for (int c = 0; c < D / VW; ++c) acc[g][c] += pj * vv[c];
            }
        }
        for (int g = 0; g < gn; ++g)
            for (int c = 0; c < D / VW; ++c) memcpy(oh + g * D + c * VW, &acc[g][c], sizeof(vfloat));
        return;
    }
    if (pv != NULL)
        for (int64_t j = 0; j < n; ++j)
            for (int64_t c = 0; c < D; c += 16) __builtin_prefetch(pv + j * tok + c, 0, 2);
    for (int g = 0; g < gn; ++g)
        for (int64_t j = 0; j < n; ++j) {
            const float pj = p[g * pstride + j], *vj = v + j * tok;
            float *o = oh + g * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += pj * vj[d];
        }
}

/* One row: its H = Hkv * G query heads against its first L cached tokens, a block at a time in one pass
   (online softmax): the block's scores for every head, the running max and sum updated, the head's output
   rescaled and the block's values added, so that each block's keys and values are read once, together,
   while they are in cache; the next block is asked for while this one is computed (its keys as this one's
   scores are, its values as this one's are added, a token's worth of lines per token: more at once stalls on
   the core's line-fill buffers). D is a constant where it is one (64, 128), so the head-size loops unroll and
   a head's vectors stay in registers. Each head's running sum is a vector (its lanes added once, at the end),
   and a block's maximum is found by halves: no per-block chain of scalar operations.
   scratch: H * (block_size + 1 + VW) floats; ob [H, D] is the output. */
static inline __attribute__((always_inline)) void
attend_row(const float *qb, const float *kc, const float *vc, const int64_t *table, int64_t L, int64_t Hkv,
           int64_t G, const int64_t D, int64_t block_size, float scale, float *scratch, float *ob) {
    const int64_t H = Hkv * G, tok = Hkv * D;
    /* Query heads whose values are added together: as many as fill 16 accumulators (4 at D = 64 with VW = 16). */
    const int64_t GB = D % VW == 0 && D <= 128 ? (16 / (D / VW) > 4 ? 4 : 16 / (D / VW)) : 1;
    float *s = scratch, *mx = scratch + H * block_size, *vs = mx + H;   /* vs: H vectors of running sums */
    for (int64_t h = 0; h < H; ++h) mx[h] = -INFINITY;
    memset(vs, 0, sizeof(float) * H * VW);
    memset(ob, 0, sizeof(float) * H * D);
    for (int64_t start = 0, i = 0; start < L; start += block_size, ++i) {
        const int64_t n = L - start < block_size ? L - start : block_size;
        const float *kb = kc + table[i] * block_size * tok, *vb = vc + table[i] * block_size * tok;
        const float *nk = start + block_size < L ? kc + table[i + 1] * block_size * tok : NULL;
        const float *nv = start + block_size < L ? vc + table[i + 1] * block_size * tok : NULL;
        scores_of_block(qb, kb, Hkv, n, G, D, scale, s, block_size, nk);
        for (int64_t h = 0; h < H; ++h) {
            /* The exponents are taken against a reference that moves only when the block's maximum passes it by
               more than 8 (then the sum and the output so far are rescaled): e^s / sum e^s is the same for any
               reference, terms stay below e^8, and most blocks skip the rescale. */
            float *sh = s + h * block_size, m = mx[h];
            const float top = max_of(sh, n);
            vfloat sum;
            memcpy(&sum, vs + h * VW, sizeof sum);
            if (top > m + 8.f) {
                if (m != -INFINITY) {
                    const float corr = expf(m - top);
                    float *oh = ob + h * D;
                    sum *= corr;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; ++d) oh[d] *= corr;
                }
                mx[h] = m = top;
            }
            int64_t j = 0;
            for (; j + VW <= n; j += VW) {
                const vfloat e = exp_vec(load_vec(sh + j) - m);
                memcpy(sh + j, &e, sizeof e);
                sum += e;
            }
            for (; j < n; ++j) { sh[j] = expf(sh[j] - m); sum[0] += sh[j]; }
            memcpy(vs + h * VW, &sum, sizeof sum);
        }
        for (int64_t kvh = 0; kvh < Hkv; ++kvh)
            for (int64_t g = 0; g < G; g += GB) {
                const int64_t h = kvh * G + g, gn = G - g < GB ? G - g : GB;
                float *oh = ob + h * D;
                const float *ph = s + h * block_size, *vh = vb + kvh * D;
                const float *pvh = g == 0 && nv != NULL ? nv + kvh * D : NULL;   /* one call per head asks */
                /* Each call with a constant head count, so its register loops unroll; GB >= k is implied by gn >= k
                   but lets the compiler drop the calls a head size rules out (a switch on gn ran 5% slower). */
                if (gn >= 4 && GB >= 4) add_values(oh, ph, block_size, vh, tok, n, D, 4, pvh);
                else if (gn >= 3 && GB >= 3) add_values(oh, ph, block_size, vh, tok, n, D, 3, pvh);
                else if (gn >= 2 && GB >= 2) add_values(oh, ph, block_size, vh, tok, n, D, 2, pvh);
                else add_values(oh, ph, block_size, vh, tok, n, D, 1, pvh);
            }
    }
    for (int64_t h = 0; h < H; ++h) {
        vfloat sum;
        memcpy(&sum, vs + h * VW, sizeof sum);
        const float inv = 1.f / sum_lanes(sum);
        float *oh = ob + h * D;
        #pragma omp simd
        for (int64_t d = 0; d < D; ++d) oh[d] *= inv;
    }
}

/* Rotate-half RoPE of one head of D (even) floats: o = x * c + rotate_half(x) * s. rope_f32 and
   decode_attention_f32 share it, so that the fused op rotates to rope_f32's bits. */
static inline __attribute__((always_inline)) void
rope_head(const float *x, const float *c, const float *s, float *o, int64_t D) {
    const int64_t half = D / 2;
    #pragma omp simd
    for (int64_t d = 0; d < half; ++d) o[d] = x[d] * c[d] - x[d + half] * s[d];
    #pragma omp simd
    for (int64_t d = half; d < D; ++d) o[d] = x[d] * c[d] + x[d - half] * s[d];
}

/* Rows shared among `threads` OpenMP threads (torch's own pool where torch loaded libgomp first, as it does: one
   runtime in the process), longest context first, so that no thread is left with a long row while the others are
   done (the runner lays decodes out shortest first; a batch-32 step: 3% faster). */
static int longer_first(const void *a, const void *b) {
    const int64_t *x = a, *y = b;   /* (context length, row) pairs */
    return x[0] != y[0] ? (x[0] < y[0] ? 1 : -1) : (x[1] > y[1]) - (x[1] < y[1]);
}

/* paged_decode_f32's work, for queries q_stride floats a row apart; with cos_t/sin_t [B, D] (not NULL) each row's
   query heads are first rotated (rope_head) into the row's scratch. */
static int decode_rows(const float *q, int64_t q_stride, const float *cos_t, const float *sin_t, const float *kc,
                       const float *vc, const int64_t *tables, const int64_t *lens, float *out, int64_t B,
                       int64_t Hkv, int64_t G, int64_t D, int64_t block_size, int64_t max_blocks, float scale,
                       int threads, int64_t num_blocks) {
    for (int64_t b = 0; b < B; ++b) {
        const int64_t used = (lens[b] + block_size - 1) / block_size;
        if (lens[b] < 0 || used > max_blocks) return -2;
        for (int64_t i = 0; i < used; ++i)
            if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= num_blocks) return -2;
    }
    int64_t *order = malloc(sizeof(int64_t) * 2 * (B > 0 ? B : 1));
    if (order == NULL) return -1;
    for (int64_t b = 0; b < B; ++b) { order[2 * b] = lens[b]; order[2 * b + 1] = b; }
    qsort(order, B, 2 * sizeof(int64_t), longer_first);
    const int64_t H = Hkv * G, scratch_floats = H * (block_size + 1 + VW);
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < B; ++r) {
        const int64_t b = order[2 * r + 1];
        float *scores = malloc(sizeof(float) * (scratch_floats + (cos_t != NULL ? H * D : 0)));
        if (scores == NULL) { failed = 1; continue; }
        const float *qb = q + b * q_stride;
        if (cos_t != NULL) {   /* the rotated query: after the scores, in the same allocation */
            float *qr = scores + scratch_floats;
            for (int64_t h = 0; h < H; ++h) rope_head(qb + h * D, cos_t + b * D, sin_t + b * D, qr + h * D, D);
            qb = qr;
        }
        float *ob = out + b * H * D;
        const int64_t *table = tables + b * max_blocks;
        if (D == 64)
            attend_row(qb, kc, vc, table, lens[b], Hkv, G, 64, block_size, scale, scores, ob);
        else if (D == 128)
            attend_row(qb, kc, vc, table, lens[b], Hkv, G, 128, block_size, scale, scores, ob);
        else
            attend_row(qb, kc, vc, table, lens[b], Hkv, G, D, block_size, scale, scores, ob);
        free(scores);
    }
    free(order);
    return failed ? -1 : 0;
}

/* q [B, Hkv * G, D]; caches [num_blocks, block_size, Hkv, D]; tables [B, max_blocks]; lens [B];
   out [B, Hkv * G, D]. One query per row attends to its first lens[b] cached tokens, read from the cache in
   place, the rows shared among threads (decode_rows).
   Returns 0; -1 when out of memory; -2 when a row's context needs more blocks than its table holds or names
   a block the cache does not have (nothing is read then). */
int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *tables,
                     const int64_t *lens, float *out, int64_t B, int64_t Hkv, int64_t G, int64_t D,
                     int64_t block_size, int64_t max_blocks, float scale, int threads, int64_t num_blocks) {
    return decode_rows(q, Hkv * G * D, NULL, NULL, kc, vc, tables, lens, out, B, Hkv, G, D, block_size, max_blocks,
                       scale, threads, num_blocks);
}

/* A step of decodes in one call (the decode_attention op): rope_f32 of the queries and the keys, kv_write_f32 of
   the rotated keys and the values, then paged_decode_f32 of the rotated queries, each row's numbers those calls'
   bits (the same code). q [B, Hkv * G, D], k and v [B, Hkv, D], heads contiguous, rows q_stride, k_stride and
   v_stride floats apart (views of the qkv product); cos_t/sin_t [B, D]; slots [B] (block * block_size + offset);
   the rest as paged_decode_f32's. Every key and value is written before any row attends.
   Returns 0; -3, having written nothing, when a slot is outside the caches; else paged_decode_f32's codes. */
int decode_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                         int64_t v_stride, const float *cos_t, const float *sin_t, float *kc, float *vc,
                         const int64_t *slots, const int64_t *tables, const int64_t *lens, float *out, int64_t B,
                         int64_t Hkv, int64_t G, int64_t D, int64_t block_size, int64_t max_blocks, float scale,
                         int threads, int64_t num_blocks) {
    const int64_t width = Hkv * D;
    for (int64_t b = 0; b < B; ++b)
        if (slots[b] < 0 || slots[b] >= num_blocks * block_size) return -3;
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < Hkv; ++h)
            rope_head(k + b * k_stride + h * D, cos_t + b * D, sin_t + b * D, kc + slots[b] * width + h * D, D);
        memcpy(vc + slots[b] * width, v + b * v_stride, sizeof(float) * width);
    }
    return decode_rows(q, q_stride, cos_t, sin_t, kc, vc, tables, lens, out, B, Hkv, G, D, block_size, max_blocks,
                       scale, threads, num_blocks);
}

/* Linear layers: y [M, N] = x [M, K] @ w [N, K]^T (+ nothing: the caller adds a bias), with w
   packed once (pack_linear_f32) into panels of PANEL output columns stored k-major: panel p holds
   w[p * PANEL + c][k] at (p * K + k) * PANEL + c, zero-padded past N. A tile of MR rows of x against two
   panels keeps 2 * MR vector accumulators in registers: each step of k loads two vectors of w and
   broadcasts MR scalars of x, so the weights (the bytes that come from memory) are read once per tile as
   whole cache lines and the outputs come out as whole vectors, with no horizontal sums and no transposes.
   A panel pair (2 * K * PANEL floats, 72 KB at K = 576) stays in L2 while the tiles of x go over it. */
#define PANEL VW
#if VW == 16
#define MR 12
#else
#define MR 6
#endif
typedef vfloat vpanel;

int linear_panel(void) { return PANEL; }

void pack_linear_f32(const float *w, float *wp, int64_t N, int64_t K, int threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t k = 0; k < K; ++k)
            for (int64_t c = 0; c < PANEL; ++c) {
                const int64_t n = p * PANEL + c;
                wp[(p * K + k) * PANEL + c] = n < N ? w[n * K + k] : 0.f;
            }
}

/* acc[i][j] = rows m0 .. m0 + mr - 1 of x against panel p + j, j < np (1 or 2). */
static inline __attribute__((always_inline)) void
tile_products(const float *x, const float *wp, int64_t K, int64_t m0, int64_t p, const int mr, const int np,
              vpanel acc[MR][2]) {
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < np; ++j) acc[i][j] = (vpanel){0};
    const float *w0 = wp + p * K * PANEL, *w1 = w0 + K * PANEL, *xr = x + m0 * K;
    for (int64_t k = 0; k < K; ++k) {
        __builtin_prefetch(w0 + (k + 16) * PANEL, 0, 3);
        if (np > 1) __builtin_prefetch(w1 + (k + 16) * PANEL, 0, 3);
        const vpanel a = load_vec(w0 + k * PANEL);
        const vpanel b = np > 1 ? load_vec(w1 + k * PANEL) : a;
        for (int i = 0; i < mr; ++i) {
            const float s = xr[i * K + k];
            acc[i][0] += s * a;
            if (np > 1) acc[i][1] += s * b;
        }
    }
}

/* Rows m0 .. m0 + mr - 1 of y against np (1 or 2) panels from panel p. gated: the two panels are the gate
   and the up projection of the same PANEL columns (pack_gated), and y [M, N / 2] gets silu(gate) * up. */
static inline __attribute__((always_inline)) void
linear_tile(const float *x, const float *wp, float *y, int64_t N, int64_t K, int64_t m0, int64_t p,
            const int mr, const int np, const int gated) {
    vpanel acc[MR][2];
    tile_products(x, wp, K, m0, p, mr, np, acc);
    if (gated) {
        for (int i = 0; i < mr; ++i) {
            const vpanel g = acc[i][0], r = g / (1.f + exp_vec(-g)) * acc[i][1];
            memcpy(y + (m0 + i) * (N / 2) + (p / 2) * PANEL, &r, sizeof r);
        }
        return;
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < np; ++j) {
            const int64_t n0 = (p + j) * PANEL, left = N - n0;
            float *out = y + (m0 + i) * N + n0;
            if (left >= PANEL) memcpy(out, &acc[i][j], sizeof(vpanel));
            else for (int64_t c = 0; c < left; ++c) out[c] = acc[i][j][c];
        }
}

/* Every row of y against np panels from panel p: whole tiles of MR rows, then 8, 4, 2 and 1. */
static inline __attribute__((always_inline)) void
linear_panels(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K, int64_t p, const int np,
              const int gated) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) linear_tile(x, wp, y, N, K, m, p, MR, np, gated);
#if MR > 8
    if (M - m >= 8) { linear_tile(x, wp, y, N, K, m, p, 8, np, gated); m += 8; }
#endif
    if (M - m >= 4) { linear_tile(x, wp, y, N, K, m, p, 4, np, gated); m += 4; }
    if (M - m >= 2) { linear_tile(x, wp, y, N, K, m, p, 2, np, gated); m += 2; }
    if (M - m >= 1) linear_tile(x, wp, y, N, K, m, p, 1, np, gated);
}

/* y [M, N] = x [M, K] @ w^T, w packed by pack_linear_f32; panel pairs shared among `threads` threads. */
void packed_linear_f32(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, pairs = panels / 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < pairs; ++t) linear_panels(x, wp, y, M, N, K, 2 * t, 2, 0);
    if (panels % 2) linear_panels(x, wp, y, M, N, K, panels - 1, 1, 0);
}

/* Greedy sampling's tokens straight from the LM head: out[m] = the index of the largest of x[m] @ w^T over the
   first n_valid columns (w packed by pack_linear_f32, N columns): the products packed_linear_f32 computes, in the
   same order, so the same logits, but never written out ([M, N] floats that argmax_rows_f32 would read back).
   The first of equal values wins, and the first NaN above every number, as in argmax_rows_f32. Each of `threads`
   threads takes a run of panel pairs, each lane of each row keeping its largest value and the first column it
   was seen at; the runs are then merged in column order. Returns -1 (nothing written) where memory runs out. */
static inline __attribute__((always_inline)) void
argmax_tile(const float *x, const float *wp, int64_t n_valid, int64_t K, int64_t m0, int64_t p, const int mr,
            const int np, vfloat *best, vint *at) {
    vpanel acc[MR][2];
    tile_products(x, wp, K, m0, p, mr, np, acc);
    vint lane;
    for (int c = 0; c < VW; ++c) lane[c] = c;
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < np; ++j) {
            const vint col = lane + (int32_t)((p + j) * PANEL);
            const vfloat v = acc[i][j], b = best[m0 + i];
            const vint take = ((v > b) | ((v != v) & (b == b))) & (col < (int32_t)n_valid);
            best[m0 + i] = (vfloat)(((vint)v & take) | ((vint)b & ~take));
            at[m0 + i] = (col & take) | (at[m0 + i] & ~take);
        }
}

static inline __attribute__((always_inline)) int
beats(float v, int32_t i, float bv, int32_t bi) {   /* (v, i) before (bv, bi) in argmax's order */
    if ((v != v) != (bv != bv)) return v != v;
    if (v != v || v == bv) return i < bi;
    return v > bv;
}

int packed_linear_argmax_f32(const float *x, const float *wp, int64_t *out, int64_t M, int64_t N, int64_t n_valid,
                             int64_t K, int threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, pairs = panels / 2;
    if (threads < 1) threads = 1;
    if (threads > pairs) threads = pairs > 0 ? (int)pairs : 1;
    vfloat *best = aligned_alloc(sizeof(vfloat), sizeof(vfloat) * M * threads);
    vint *at = aligned_alloc(sizeof(vint), sizeof(vint) * M * threads);
    if (best == NULL || at == NULL) { free(best); free(at); return -1; }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; ++t) {
        vfloat *tb = best + t * M;
        vint *ta = at + t * M;
        for (int64_t m = 0; m < M; ++m) { tb[m] = (vfloat){0} - __builtin_inff(); ta[m] = (vint){0}; }
        const int64_t first = pairs * t / threads, last = pairs * (t + 1) / threads;
        for (int64_t q = first; q <= last; ++q) {
            const int np = q < last ? 2 : (t == threads - 1 && panels % 2) ? 1 : 0;
            if (!np) break;
            int64_t m = 0;
            for (; m + MR <= M; m += MR) argmax_tile(x, wp, n_valid, K, m, 2 * q, MR, np, tb, ta);
#if MR > 8
            if (M - m >= 8) { argmax_tile(x, wp, n_valid, K, m, 2 * q, 8, np, tb, ta); m += 8; }
#endif
            if (M - m >= 4) { argmax_tile(x, wp, n_valid, K, m, 2 * q, 4, np, tb, ta); m += 4; }
            if (M - m >= 2) { argmax_tile(x, wp, n_valid, K, m, 2 * q, 2, np, tb, ta); m += 2; }
            if (M - m >= 1) argmax_tile(x, wp, n_valid, K, m, 2 * q, 1, np, tb, ta);
        }
    }
    for (int64_t m = 0; m < M; ++m) {
        float bv = best[m][0];
        int32_t bi = at[m][0];
        for (int t = 0; t < threads; ++t)
            for (int c = 0; c < VW; ++c)
                if (beats(best[t * M + m][c], at[t * M + m][c], bv, bi)) { bv = best[t * M + m][c]; bi = at[t * M + m][c]; }
        out[m] = bi;
    }
    free(best);
    free(at);
    return 0;
}

/* y [M, I] = silu(x @ gate^T) * (x @ up^T) for a gate/up projection [2I, K] whose rows were interleaved a panel
   at a time (gate columns 0..PANEL-1, up columns 0..PANEL-1, gate PANEL.., ...) before pack_linear_f32, I a
   multiple of PANEL: the MLP's [M, 2I] product is never written. */
void packed_gated_linear_f32(const float *x, const float *wp, float *y, int64_t M, int64_t I, int64_t K,
                             int threads) {
    const int64_t pairs = I / PANEL;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < pairs; ++t) linear_panels(x, wp, y, M, 2 * I, K, 2 * t, 2, 1);
}

/* ---- A prompt chunk's causal attention (the prefill_attention op): n queries at positions L - n .. L - 1 of a
   sequence of L tokens, each over the keys and values at positions up to its own. As a GEMM: each KV head's keys are
   first laid out as pack_linear_f32's panels (PANEL tokens a panel, k-major over the head size D) and its values token-
   major; then each tile of up to MR query heads that share a KV head (the chunk's (query, head) pairs in order, G a
   query) takes its scores a panel pair at a time with the linear layers' register tiles (tile_products: each key read
   once for the tile's heads), masks the tokens past each query's position, keeps a running maximum and sum per row
   (online softmax), and adds the pair's values to the rows' outputs, PF_RB rows at a time in registers. Strictly
   causal: nothing at a position past a query's reaches it, a NaN included (SDPA's masked call gives a NaN key or value
   past a query to the query too: its masked weight is 0, and 0 * NaN). The (KV head, tile) items are shared among the
   threads, the longest first. The queries are scaled before the products ((q * scale) . k, where SDPA takes (q . k) *
   scale: a rounding apart). */
#define PF_RB(D) ((D) / VW > 4 ? 2 : 4)   /* rows whose outputs are added together: at most 16 accumulators */
static inline __attribute__((always_inline)) void
prefill_tile(const float *qs, const float *kp, const float *vt, const int64_t *pos, float *const *out_rows,
             const int64_t D, const int mr, float *ob, float *pb) {
    const int64_t P2 = 2 * PANEL;
    float mx[MR], sum[MR];
    int64_t last = 0;
    for (int i = 0; i < mr; ++i) {
        mx[i] = -INFINITY;
        sum[i] = 0.f;
        last = pos[i] > last ? pos[i] : last;
    }
    memset(ob, 0, sizeof(float) * mr * D);
    vint lane;
    for (int c = 0; c < VW; ++c) lane[c] = c;
    for (int64_t j0 = 0; j0 <= last; j0 += P2) {
        const int np = last - j0 >= PANEL ? 2 : 1;
        vpanel acc[MR][2];
        tile_products(qs, kp, D, 0, j0 / PANEL, mr, np, acc);
        for (int i = 0; i < mr; ++i) {
            vfloat s[2];
            float top = -INFINITY;
            for (int j = 0; j < np; ++j) {   /* the tokens past the row's position: -inf, whatever the product */
                const vint past = lane + (int32_t)(j0 + j * PANEL) > (int32_t)pos[i];
                s[j] = (vfloat)(((vint)acc[i][j] & ~past) | ((vint)((vfloat){0} - INFINITY) & past));
                const float t = max_lanes(s[j]);
                top = t > top ? t : top;
            }
            if (top > mx[i]) {   /* a new maximum: the sum and the output so far rescaled to it */
                if (mx[i] != -INFINITY) {
                    const float corr = expf(mx[i] - top);
                    sum[i] *= corr;
                    for (int64_t d = 0; d < D; ++d) ob[i * D + d] *= corr;
                }
                mx[i] = top;
            }
            vfloat tot = (vfloat){0};
            for (int j = 0; j < np; ++j) {
                const vfloat e = exp_vec(s[j] - mx[i]);
                tot += e;
                memcpy(pb + i * P2 + j * PANEL, &e, sizeof e);
            }
            sum[i] += sum_lanes(tot);
        }
        /* The values: tokens up to the rows' first position for every row, then each row's own up to its position
           (a value past it is not added, not even times 0: a NaN there does not reach the row). */
        const int64_t nt = last + 1 - j0 < np * PANEL ? last + 1 - j0 : np * PANEL;
        const float *vj0 = vt + j0 * D;
        enum { MAXV = 128 / VW };
        for (int i0 = 0; i0 < mr; i0 += PF_RB(D)) {
            const int rb = mr - i0 < PF_RB(D) ? mr - i0 : PF_RB(D);
            int64_t all = nt;
            for (int r = 0; r < rb; ++r) all = pos[i0 + r] + 1 - j0 < all ? pos[i0 + r] + 1 - j0 : all;
            vfloat o[4][MAXV];
            for (int r = 0; r < rb; ++r)
                for (int c = 0; c < D / VW; ++c) o[r][c] = load_vec(ob + (i0 + r) * D + c * VW);
            for (int64_t j = 0; j < nt; ++j) {
                vfloat vv[MAXV];
                for (int c = 0; c < D / VW; ++c) vv[c] = load_vec(vj0 + j * D + c * VW);
                for (int r = 0; r < rb; ++r) {
                    if (j >= all && j0 + j > pos[i0 + r]) continue;
                    const float p = pb[(i0 + r) * P2 + j];
                    for (int c = 0; c < D / VW; ++c) o[r][c] += p * vv[c];
                }
            }
            for (int r = 0; r < rb; ++r)
                for (int c = 0; c < D / VW; ++c) memcpy(ob + (i0 + r) * D + c * VW, &o[r][c], sizeof(vfloat));
        }
    }
    for (int i = 0; i < mr; ++i) {
        const float inv = 1.f / sum[i];
        for (int64_t d = 0; d < D; ++d) out_rows[i][d] = ob[i * D + d] * inv;
    }
}

/* Rows f0 .. f0 + mr - 1 of KV head h's (query, head) pairs: their queries scaled into buf, then prefill_tile into
   out [n, Hkv * G, D]. buf: MR * (2 D + 2 PANEL) floats. */
static inline __attribute__((always_inline)) void
prefill_rows(const float *q, int64_t q_stride, const float *kp, const float *vt, float *out, int64_t L, int64_t n,
             int64_t h, int64_t Hkv, int64_t G, const int64_t D, float scale, int64_t f0, const int mr, float *buf) {
    float *qs = buf, *ob = qs + MR * D, *pb = ob + MR * D;
    int64_t pos[MR];
    float *rows[MR];
    for (int i = 0; i < mr; ++i) {
        const int64_t f = f0 + i, t = f / G, hq = h * G + f % G;
        pos[i] = L - n + t;
        const float *src = q + t * q_stride + hq * D;
        for (int64_t d = 0; d < D; ++d) qs[i * D + d] = src[d] * scale;
        rows[i] = out + (t * Hkv * G + hq) * D;
    }
    prefill_tile(qs, kp, vt, pos, rows, D, mr, ob, pb);
}

/* The item's rows in tiles of constant sizes: MR, or what is left as 8 (where MR is more), 4, 2 and 1. */
static inline __attribute__((always_inline)) void
prefill_item(const float *q, int64_t q_stride, const float *kp, const float *vt, float *out, int64_t L, int64_t n,
             int64_t h, int64_t Hkv, int64_t G, const int64_t D, float scale, int64_t f0, int64_t rows, float *buf) {
    if (rows == MR) { prefill_rows(q, q_stride, kp, vt, out, L, n, h, Hkv, G, D, scale, f0, MR, buf); return; }
    int64_t f = f0;
#if MR > 8
    if (f0 + rows - f >= 8) { prefill_rows(q, q_stride, kp, vt, out, L, n, h, Hkv, G, D, scale, f, 8, buf); f += 8; }
#endif
    if (f0 + rows - f >= 4) { prefill_rows(q, q_stride, kp, vt, out, L, n, h, Hkv, G, D, scale, f, 4, buf); f += 4; }
    if (f0 + rows - f >= 2) { prefill_rows(q, q_stride, kp, vt, out, L, n, h, Hkv, G, D, scale, f, 2, buf); f += 2; }
    if (f0 + rows - f >= 1) prefill_rows(q, q_stride, kp, vt, out, L, n, h, Hkv, G, D, scale, f, 1, buf);
}

/* q [n, Hkv * G, D] (rows q_stride floats apart, heads contiguous) at positions L - n .. L - 1; out [n, Hkv * G, D].
   The keys and values: with L == n (nothing cached before the chunk) the chunk's own, k and v [n, Hkv, D] (rows
   k_stride and v_stride floats apart); else the caches' [num_blocks, block_size, Hkv, D] first L rows of the blocks
   block_ids[0 .. nblk - 1]. Returns 0; -1 for a shape it does not take (D not whole vectors or over 128; n outside
   1 .. L); -2, having read nothing, where the blocks do not hold L rows or one is outside the caches; -3 out of
   memory. */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, const float *kc, const float *vc, const int64_t *block_ids, int64_t nblk,
                          int64_t L, int64_t n, float *out, int64_t Hkv, int64_t G, int64_t D, int64_t block_size,
                          float scale, int threads, int64_t num_blocks) {
    if (D % VW || D > 128 || D < 1 || n < 1 || n > L || Hkv < 1 || G < 1) return -1;
    const int own = L == n;
    if (!own) {
        if (block_size < 1 || nblk * block_size < L) return -2;
        for (int64_t i = 0; i < (L + block_size - 1) / block_size; ++i)
            if (block_ids[i] < 0 || block_ids[i] >= num_blocks) return -2;
    }
    const int64_t panels = (L + PANEL - 1) / PANEL, span = panels * PANEL * D;   /* floats of a head's keys */
    float *kp = aligned_alloc(64, sizeof(float) * 2 * Hkv * span), *vt = kp + Hkv * span;
    if (kp == NULL) return -3;
    const int64_t tiles = (n * G + MR - 1) / MR, items = Hkv * tiles;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < Hkv * panels; ++it) {   /* the keys as panels, the values token-major */
            const int64_t h = it / panels, p = it % panels;
            float *kpp = kp + h * span + p * D * PANEL, *vtp = vt + h * span + p * PANEL * D;
            for (int c = 0; c < PANEL; ++c) {
                const int64_t t = p * PANEL + c;
                const float *ks = NULL, *vs = NULL;
                if (t < L && own) { ks = k + t * k_stride + h * D; vs = v + t * v_stride + h * D; }
                else if (t < L) {
                    const int64_t row = (block_ids[t / block_size] * block_size + t % block_size) * Hkv + h;
                    ks = kc + row * D;
                    vs = vc + row * D;
                }
                for (int64_t d = 0; d < D; ++d) {
                    kpp[d * PANEL + c] = ks != NULL ? ks[d] : 0.f;
                    vtp[c * D + d] = vs != NULL ? vs[d] : 0.f;
                }
            }
        }
        float *buf = malloc(sizeof(float) * MR * (2 * D + 2 * PANEL));
        if (buf == NULL) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            if (buf == NULL) continue;
            const int64_t h = it % Hkv, tile = tiles - 1 - it / Hkv, f0 = tile * MR;
            const int64_t rows = n * G - f0 < MR ? n * G - f0 : MR;
            const float *kh = kp + h * span, *vh = vt + h * span;
            if (D == 64) prefill_item(q, q_stride, kh, vh, out, L, n, h, Hkv, G, 64, scale, f0, rows, buf);
            else if (D == 128) prefill_item(q, q_stride, kh, vh, out, L, n, h, Hkv, G, 128, scale, f0, rows, buf);
            else prefill_item(q, q_stride, kh, vh, out, L, n, h, Hkv, G, D, scale, f0, rows, buf);
        }
        free(buf);
    }
    free(kp);
    return failed ? -3 : 0;
}

/* The step's keys and values into the paged caches: row t of k and of v (heads contiguous, `width` floats,
   rows k_stride / v_stride floats apart: v is a strided view of the qkv product) to cache slot slots[t].
   Returns -2, having written nothing, when a slot is outside the caches' num_slots. */
int kv_write_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *kc, float *vc,
                 const int64_t *slots, int64_t T, int64_t width, int64_t num_slots) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -2;
    for (int64_t t = 0; t < T; ++t) {
        memcpy(kc + slots[t] * width, k + t * k_stride, sizeof(float) * width);
        memcpy(vc + slots[t] * width, v + t * v_stride, sizeof(float) * width);
    }
    return 0;
}

/* out[r] = the index of the largest of x[r * cols : (r + 1) * cols], the first one where several are equal, or the
   first NaN where there is one (torch's max(dim) and argmax rank NaN above every number). Each lane keeps its
   largest value and the first index it was seen at (a strictly larger value replaces it); the lanes are then
   compared by value, ties to the lower index. */
void argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        int64_t best = 0, j = 0;
        float top = cols > 0 ? xr[0] : 0.f;
        int nan = 0;
        if (cols >= VW) {
            vfloat vm = load_vec(xr);
            vint vi, lane;
            for (int c = 0; c < VW; ++c) lane[c] = c;
            vi = lane;
            vint bad = vm != vm;
            for (j = VW; j + VW <= cols; j += VW) {
                const vfloat v = load_vec(xr + j);
                const vint gt = v > vm;
                bad |= v != v;
                vm = (vfloat)(((vint)v & gt) | ((vint)vm & ~gt));
                vi = ((lane + (int32_t)j) & gt) | (vi & ~gt);
            }
            for (int c = 0; c < VW; ++c) nan |= bad[c] != 0;
            top = vm[0]; best = vi[0];
            for (int c = 1; c < VW; ++c)
                if (vm[c] > top || (vm[c] == top && vi[c] < best)) { top = vm[c]; best = vi[c]; }
        }
        for (int64_t t = j; t < cols; ++t) {
            if (xr[t] != xr[t]) { nan = 1; break; }
            if (xr[t] > top) { top = xr[t]; best = t; }
        }
        if (nan)
            for (int64_t t = 0; t < cols; ++t)
                if (xr[t] != xr[t]) { best = t; break; }
        out[r] = best;
    }
}

/* ---- The forward's small kernels: one pass over each row instead of an op (and a tensor) per step. ---- */

/* out = x * w / sqrt(mean(x^2) + eps) per row of H; with `residual`, x + residual is normed and written to
   res_out first. Rows are shared among threads where there are enough of them to pay for it. */
void rms_norm_f32(const float *x, const float *residual, const float *w, float *out, float *res_out,
                  int64_t T, int64_t H, float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * H >= 8192)
    for (int64_t t = 0; t < T; ++t) {
        const float *xr = x + t * H;
        float *o = out + t * H;
        if (residual != NULL) {
            const float *rr = residual + t * H;
            float *s = res_out + t * H;
            #pragma omp simd
            for (int64_t i = 0; i < H; ++i) s[i] = xr[i] + rr[i];
            xr = s;
        }
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        #pragma omp simd
        for (int64_t i = 0; i < H; ++i) o[i] = xr[i] * inv * w[i];
    }
}

/* out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate first). */
void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (T * I >= 65536)
    for (int64_t t = 0; t < T; ++t) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + VW <= I; i += VW) {
            const vfloat gv = load_vec(g + i);
            const vfloat r = gv / (1.f + exp_vec(-gv)) * load_vec(u + i);
            memcpy(o + i, &r, sizeof r);
        }
        for (; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half RoPE: x [T, Hn, D] with rows `stride` floats apart (heads contiguous), cos/sin [T, D];
   out [T, Hn, D] contiguous. */
void rope_f32(const float *x, int64_t stride, const float *cos_t, const float *sin_t, float *out,
              int64_t T, int64_t Hn, int64_t D) {
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < Hn; ++h)
            rope_head(x + t * stride + h * D, cos_t + t * D, sin_t + t * D, out + (t * Hn + h) * D, D);
}

/* ---- Quantized linear layers: weights in GGUF's blocks of 32 (ggml's Q8_0 and Q4_1), each block dequantized in
   registers as the product reads it, accumulated in float32 against float32 activations. A weight row holds
   K / 32 blocks: Q8_0 34 bytes (fp16 d, 32 int8 q: d * q), Q4_1 20 bytes (fp16 d, fp16 m, 16 bytes whose low
   nibbles are weights 0-15 and high nibbles 16-31: d * q + m). Output columns are shared among threads. What a
   product costs moves with its rows: at decode's one row the weights' bytes, a quarter (Q8_0) to a sixth (Q4_1)
   of float32's, are what comes from memory, and each block is dequantized for one row; with more rows,
   dequantizing becomes the cost, so each block is dequantized once for a tile of rows (qtile), and from
   Q_PANEL_ROWS once for all of them (q_linear_panels). ---- */
#define QK 32
#define Q_TILED_ROWS 4   /* from here q_linear_tiled; below, qdot_unit */
#define GGML_Q4_1 3
#define GGML_Q8_0 8

/* An IEEE half (little-endian bytes) as a float: normal, subnormal, infinite and NaN alike. */
#if defined(__F16C__)
#include <immintrin.h>
#endif
static inline __attribute__((always_inline)) float half_at(const uint8_t *p) {
#if defined(__F16C__)   /* the CPU's own conversion (vcvtph2ps): no branches in the block loop */
    return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
#endif
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (e == 0) {
        float f = (float)man * 5.9604644775390625e-8f;   /* man * 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((e + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* VW bytes at p widened to int32 lanes, signed or not. GCC's vector extensions widen bytes lane by lane (a
   scalar load and insert per byte, several times slower than the product around it), so where the instruction
   set has the vector form it is named (the only intrinsics in this file); elsewhere a plain loop. */
#if (VW == 16 && defined(__AVX512F__)) || (VW == 8 && defined(__AVX2__))
#include <immintrin.h>
#endif
static inline __attribute__((always_inline)) vint widen_bytes(const uint8_t *p, const int is_signed) {
    vint v;
#if VW == 16 && defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m512i w = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    memcpy(&v, &w, sizeof v);
#elif VW == 8 && defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m256i w = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    memcpy(&v, &w, sizeof v);
#else
    for (int i = 0; i < VW; ++i) v[i] = is_signed ? (int32_t)(int8_t)p[i] : (int32_t)p[i];
#endif
    return v;
}

/* A block's 32 weights as QK / VW vectors, in order, from its scale d, its minimum m (Q4_1; 0 for Q8_0) and its
   payload q (Q8_0: 32 signed bytes; Q4_1: 16 bytes of nibbles, weights 0-15 low, 16-31 high). Q4_1 with AVX-512:
   the block's 16 possible weights d * q + m as a table (one fma: the same bits as the plain form's, whose d * q is
   exact) looked up by each nibble with vpermps, which reads an index's low 4 bits: no mask, no int-to-float
   conversion of the nibbles, no d * q + m per weight (about a tenth faster where the block is the ALU's work, at
   decode's rows). */
static inline __attribute__((always_inline)) void
dequant_payload(const uint8_t *q, const float d, const float m, const int qtype, vfloat w[QK / VW]) {
    if (qtype == GGML_Q8_0) {
        for (int c = 0; c < QK / VW; ++c)
            w[c] = __builtin_convertvector(widen_bytes(q + c * VW, 1), vfloat) * d;
        return;
    }
#if VW == 16 && defined(__AVX512F__)
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512i n = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    const __m512 lo = _mm512_permutexvar_ps(n, table), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(n, 4), table);
    memcpy(&w[0], &lo, sizeof lo);
    memcpy(&w[1], &hi, sizeof hi);
#else
    for (int c = 0; c < 16 / VW; ++c) {
        const vint n = widen_bytes(q + c * VW, 0);
        w[c] = __builtin_convertvector(n & 0x0f, vfloat) * d + m;
        w[c + 16 / VW] = __builtin_convertvector(n >> 4, vfloat) * d + m;
    }
#endif
}

/* Block b of a weight row (GGUF's bytes at blk: the scale, Q4_1's minimum, the payload) as dequant_payload's. */
static inline __attribute__((always_inline)) void
dequant_block(const uint8_t *blk, const int qtype, vfloat w[QK / VW]) {
    if (qtype == GGML_Q8_0) dequant_payload(blk + 2, half_at(blk), 0.f, qtype, w);
    else dequant_payload(blk + 4, half_at(blk), half_at(blk + 2), qtype, w);
}

/* Vector h of dequant_block's: weights h * VW .. (h + 1) * VW - 1 of the block. */
static inline __attribute__((always_inline)) vfloat dequant_vec(const uint8_t *blk, const int qtype, const int h) {
    const float d = half_at(blk);
    if (qtype == GGML_Q8_0) return __builtin_convertvector(widen_bytes(blk + 2 + h * VW, 1), vfloat) * d;
    const int lo = h < 16 / VW;   /* the low nibbles are weights 0-15, the high ones 16-31 */
    const vint q = widen_bytes(blk + 4 + (lo ? h : h - 16 / VW) * VW, 0);
    return __builtin_convertvector(lo ? q & 0x0f : q >> 4, vfloat) * d + half_at(blk + 2);
}

/* Weight rows a group holds below Q_TILED_ROWS: QW at once, each with its own accumulator per row of x. Each block
   is dequantized once for every row of x (a weight row against one row of x at a time dequantized it once per
   row: 2 and 3 rows ran at a half and a third of one row's GB/s), each x vector loaded serves QW weight rows, and
   the products' chains run side by side. At one row the blocks' dequantization (scales converted, the Q4_1 table,
   the lookups) is most of the work: about 10 GB/s of Q4_1 and 17 of Q8_0 a core here, where a core reads 19-24.
   2 with 8-wide vectors, where a block is 4 vectors and 16 registers hold them all. */
#if VW == 16
#define QW 4
#else
#define QW 2
#endif

/* y[m * N + r] = x[m] . weight row r (at w + r * row) for m < mr, r < nr: each accumulator adds its block's
   vectors in order, block after block, then its lanes (sum_lanes), as for any mr, so that a row of x gets the
   same bits alone or beside others. The group's rows are QW streams in one stretch of memory, which the hardware
   prefetcher followed poorly (Q8_0 from memory at a third of its rate from cache): the lines PF_GROUPS groups
   ahead are asked for, as many a block as the group reads. */
#ifndef PF_GROUPS
#define PF_GROUPS 2
#endif

/* acc[i][r] += row i of x's block b times weight row r's (wv[r]), for i < mr, r < nr: a block's vectors in order,
   so that a row of x gets the same bits alone or beside others, from the blocks or from their repack. */
static inline __attribute__((always_inline)) void
add_block_products(vfloat acc[][QW], const float *x, int64_t K, int64_t b, const int mr, const int nr,
                   vfloat wv[QW][QK / VW]) {
    for (int i = 0; i < mr; ++i)
        for (int c = 0; c < QK / VW; ++c) {
            const vfloat xv = load_vec(x + i * K + b * QK + c * VW);
            for (int r = 0; r < nr; ++r) acc[i][r] += xv * wv[r][c];
        }
}
static inline __attribute__((always_inline)) void
qdot_group(const float *x, const uint8_t *w, int64_t row, int64_t K, const int mr, const int nr, const int qtype,
           const int bytes, float *y, int64_t N) {
    vfloat acc[Q_TILED_ROWS - 1][QW];
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) acc[i][r] = (vfloat){0};
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t off = b * nr * bytes; off < (b + 1) * nr * bytes; off += 64)
            __builtin_prefetch(w + PF_GROUPS * nr * row + off, 0, 0);
        vfloat wv[QW][QK / VW];
        for (int r = 0; r < nr; ++r) dequant_block(w + r * row + b * bytes, qtype, wv[r]);
        add_block_products(acc, x, K, b, mr, nr, wv);
    }
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) y[i * N + r] = sum_lanes(acc[i][r]);
}

/* Output columns n0 .. n0 + QW - 1 (those below N) of y [mr, N]; gated: silu(gate) * up of the gate rows n0.. and
   the up rows N + n0... */
static inline __attribute__((always_inline)) void
qdot_unit(const float *x, const uint8_t *w, float *y, int64_t N, int64_t K, int64_t n0, const int mr,
          const int qtype, const int bytes, const int gated) {
    const int64_t row = K / QK * bytes;
    const int nr = N - n0 < QW ? (int)(N - n0) : QW;
    if (!gated) {
        if (nr == QW) qdot_group(x, w + n0 * row, row, K, mr, QW, qtype, bytes, y + n0, N);
        else for (int r = 0; r < nr; ++r) qdot_group(x, w + (n0 + r) * row, row, K, mr, 1, qtype, bytes, y + n0 + r, N);
        return;
    }
    float g[(Q_TILED_ROWS - 1) * QW], u[(Q_TILED_ROWS - 1) * QW];
    if (nr == QW) {
        qdot_group(x, w + n0 * row, row, K, mr, QW, qtype, bytes, g, QW);
        qdot_group(x, w + (N + n0) * row, row, K, mr, QW, qtype, bytes, u, QW);
    } else
        for (int r = 0; r < nr; ++r) {
            qdot_group(x, w + (n0 + r) * row, row, K, mr, 1, qtype, bytes, g + r, QW);
            qdot_group(x, w + (N + n0 + r) * row, row, K, mr, 1, qtype, bytes, u + r, QW);
        }
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) {
            const float gv = g[i * QW + r];
            y[i * N + n0 + r] = gv / (1.f + expf(-gv)) * u[i * QW + r];
        }
}

/* ---- Rows below Q_TILED_ROWS over a repack of the blocks (q_repack_f32): at one row of x the blocks' own work (two
   half-to-float conversions and their broadcasts a block, QW streams of memory a group) is about half the kernel's.
   The repack holds, for each group of QW weight rows and each block, the rows' scales (and Q4_1's minimums) as
   floats, then the rows' payloads: one stream of memory a group, the scales loaded as they are. It holds the
   same weights (the payloads' bytes, each scale's exact float), 24 bytes a Q4_1 block instead of 20 and 36 a Q8_0
   block instead of 34, and gives the same bits as qdot_group on the blocks: the same tables, the same sums in the
   same order. Rows past the matrix's last are zero blocks. */
typedef float afloat __attribute__((may_alias));   /* the repack's scales, read in place from its bytes */
static inline __attribute__((always_inline)) int q_rep_scales(const int qtype) { return qtype == GGML_Q4_1 ? 2 : 1; }
static inline __attribute__((always_inline)) int q_rep_payload(const int qtype) { return qtype == GGML_Q4_1 ? 16 : 32; }
/* Bytes a block of 32 weights takes for `rows` weight rows in a repack: their scales as floats, then their payloads. */
static inline __attribute__((always_inline)) int64_t q_rows_block(const int qtype, const int rows) {
    return rows * (4 * q_rep_scales(qtype) + q_rep_payload(qtype));
}
static inline __attribute__((always_inline)) int64_t q_rep_block(const int qtype) { return q_rows_block(qtype, QW); }

/* Bytes a repack of a [N, K] weight of type qtype takes in groups of `rows` weight rows (0: a type it does not read,
   or K not whole blocks). */
static int64_t q_rows_bytes(int64_t N, int64_t K, int qtype, int rows) {
    if ((qtype != GGML_Q8_0 && qtype != GGML_Q4_1) || K % QK || N < 0) return 0;
    return (N + rows - 1) / rows * (K / QK) * q_rows_block(qtype, rows);
}

/* Bytes the repack of a [N, K] weight of type qtype takes. */
int64_t q_repack_bytes(int64_t N, int64_t K, int qtype) { return q_rows_bytes(N, K, qtype, QW); }

/* The repack of w [N, K] (GGUF's blocks of qtype) into out (q_repack_bytes of it). */
void q_repack_f32(const uint8_t *w, uint8_t *out, int64_t N, int64_t K, int qtype, int threads) {
    const int64_t nb = K / QK, groups = (N + QW - 1) / QW, gb = q_rep_block(qtype);
    const int sc = q_rep_scales(qtype), pb = q_rep_payload(qtype), bytes = qtype == GGML_Q4_1 ? 20 : 34;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *o = out + (g * nb + b) * gb;
            for (int r = 0; r < QW; ++r) {
                const int64_t n = g * QW + r;
                float s[2] = {0.f, 0.f};
                uint8_t *payload = o + QW * 4 * sc + r * pb;
                if (n < N) {
                    const uint8_t *blk = w + (n * nb + b) * bytes;
                    s[0] = half_at(blk);
                    if (sc == 2) s[1] = half_at(blk + 2);
                    memcpy(payload, blk + bytes - pb, pb);
                } else memset(payload, 0, pb);
                memcpy(o + r * 4 * sc, s, 4 * sc);
            }
        }
}

/* y[m * N + r] = x[m] . weight row r of the group at g (the repack's QW rows from it) for m < mr, r < nr: as
   qdot_group, reading the repack; the lines PF_GROUPS groups ahead asked for as it goes. */
static inline __attribute__((always_inline)) void
qdot_rgroup(const float *x, const uint8_t *g, int64_t K, const int mr, const int nr, const int qtype, float *y,
            int64_t N) {
    vfloat acc[Q_TILED_ROWS - 1][QW];
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < QW; ++r) acc[i][r] = (vfloat){0};
    const int64_t nb = K / QK, gb = q_rep_block(qtype);
    const int sc = q_rep_scales(qtype), pb = q_rep_payload(qtype);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *p = g + b * gb;
        for (int64_t off = 0; off < gb; off += 64) __builtin_prefetch(p + PF_GROUPS * nb * gb + off, 0, 0);
        const afloat *s = (const afloat *)p;   /* broadcast straight from memory: a load, not a shuffle */
        vfloat wv[QW][QK / VW];
        for (int r = 0; r < QW; ++r)
            dequant_payload(p + QW * 4 * sc + r * pb, s[r * sc], sc == 2 ? s[r * sc + 1] : 0.f, qtype, wv[r]);
        add_block_products(acc, x, K, b, mr, QW, wv);
    }
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) y[i * N + r] = sum_lanes(acc[i][r]);
}

/* Output columns n0 .. n0 + QW - 1 (those below N) from the repack rp; gated: silu(gate) * up of the gate rows
   n0.. and the up rows N + n0.. (N a multiple of QW, so that the up rows start a group). */
static inline __attribute__((always_inline)) void
qdot_runit(const float *x, const uint8_t *rp, float *y, int64_t N, int64_t K, int64_t n0, const int mr,
           const int qtype, const int bytes, const int gated) {
    (void)bytes;   /* the blocks' size, which Q_KIND hands every unit: the repack has its own */
    const int64_t group = K / QK * q_rep_block(qtype);
    const int nr = N - n0 < QW ? (int)(N - n0) : QW;
    if (!gated) {
        qdot_rgroup(x, rp + n0 / QW * group, K, mr, nr, qtype, y + n0, N);
        return;
    }
    float gt[(Q_TILED_ROWS - 1) * QW], up[(Q_TILED_ROWS - 1) * QW];
    qdot_rgroup(x, rp + n0 / QW * group, K, mr, QW, qtype, gt, QW);
    qdot_rgroup(x, rp + (N + n0) / QW * group, K, mr, QW, qtype, up, QW);
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) {
            const float gv = gt[i * QW + r];
            y[i * N + n0 + r] = gv / (1.f + expf(-gv)) * up[i * QW + r];
        }
}

/* The QW-column groups shared among the threads, for each row count below Q_TILED_ROWS a loop of its own: f is
   qdot_unit (the blocks) or qdot_runit (their repack). */
#define Q_ROWS_KIND(f, M, ...) do { \
        if (M == 1) Q_KIND(f, __VA_ARGS__, 1); \
        else if (M == 2) Q_KIND(f, __VA_ARGS__, 2); \
        else Q_KIND(f, __VA_ARGS__, 3); \
    } while (0)

/* Several rows of x against two weight rows at once: each block of the two is dequantized once into registers
   and applied to QMR rows of x, 2 * QMR = VW accumulators (each a vector over the block's weights), whose lane
   sums come out as one vector by transpose_sum. Lane 2 * i + j of out is x[i] . weight row j (w0, w1; nr = 1:
   w0 alone, lanes 2 * i + 1 are 0). A dequantized block costs about as much as its products with 4-8 rows, so
   decode batches pay it once per QMR rows instead of once per row (qdot_tile's), and x's tile stays in L1/L2
   while the weight rows stream by. */
#if VW == 16
#define QMR 8
#else
#define QMR 4
#endif
static inline __attribute__((always_inline)) void
qtile(const float *x, const uint8_t *w0, const uint8_t *w1, int64_t K, const int mr, const int nr, const int qtype,
      const int bytes, float out[VW]) {
    vfloat acc[VW];
    for (int t = 0; t < VW; ++t) acc[t] = (vfloat){0};
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; ++b) {
        vfloat w[2][QK / VW];
        dequant_block(w0 + b * bytes, qtype, w[0]);
        if (nr > 1) dequant_block(w1 + b * bytes, qtype, w[1]);
        for (int i = 0; i < mr; ++i) {
            const float *xr = x + i * K + b * QK;
            for (int c = 0; c < QK / VW; ++c) {
                const vfloat xv = load_vec(xr + c * VW);
                acc[2 * i] += xv * w[0][c];
                if (nr > 1) acc[2 * i + 1] += xv * w[1][c];
            }
        }
    }
    const vfloat s = transpose_sum(acc);
    memcpy(out, &s, sizeof s);
}

/* Rows m0 .. m0 + mr - 1 of y for the output column pair u: columns 2u and 2u + 1 (the last alone where N is odd);
   gated, column u from gate row u and up row u + N. */
static inline __attribute__((always_inline)) void
qtile_out(const float *x, const uint8_t *w, float *y, int64_t N, int64_t K, int64_t row, int64_t m0, int64_t u,
          const int mr, const int qtype, const int bytes, const int gated) {
    float s[VW];
    if (gated) {
        qtile(x + m0 * K, w + u * row, w + (u + N) * row, K, mr, 2, qtype, bytes, s);
        for (int i = 0; i < mr; ++i) {
            const float g = s[2 * i];
            y[(m0 + i) * N + u] = g / (1.f + expf(-g)) * s[2 * i + 1];
        }
        return;
    }
    const int64_t n = 2 * u;
    if (n + 1 < N) {
        qtile(x + m0 * K, w + n * row, w + (n + 1) * row, K, mr, 2, qtype, bytes, s);
        for (int i = 0; i < mr; ++i) { y[(m0 + i) * N + n] = s[2 * i]; y[(m0 + i) * N + n + 1] = s[2 * i + 1]; }
    } else {
        qtile(x + m0 * K, w + n * row, w + n * row, K, mr, 1, qtype, bytes, s);
        for (int i = 0; i < mr; ++i) y[(m0 + i) * N + n] = s[2 * i];
    }
}

/* Every row of y for the output column pair u: tiles of QMR rows, then 4, 2 and 1. */
static inline __attribute__((always_inline)) void
q_tiled_unit(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t u,
             const int qtype, const int bytes, const int gated) {
    const int64_t row = K / QK * bytes;
    int64_t m = 0;
    for (; m + QMR <= M; m += QMR) qtile_out(x, w, y, N, K, row, m, u, QMR, qtype, bytes, gated);
#if QMR > 4
    if (M - m >= 4) { qtile_out(x, w, y, N, K, row, m, u, 4, qtype, bytes, gated); m += 4; }
#endif
    if (M - m >= 2) { qtile_out(x, w, y, N, K, row, m, u, 2, qtype, bytes, gated); m += 2; }
    if (M - m >= 1) qtile_out(x, w, y, N, K, row, m, u, 1, qtype, bytes, gated);
}

/* f(args..., qtype, bytes, gated) with the three as constants, so that each kind's loops are compiled for it (an
   OpenMP region's body is a function of its own, which gets them as variables). */
#define Q_KIND(f, ...) do { \
        if (qtype == GGML_Q8_0) { if (gated) f(__VA_ARGS__, GGML_Q8_0, 34, 1); else f(__VA_ARGS__, GGML_Q8_0, 34, 0); } \
        else if (gated) f(__VA_ARGS__, GGML_Q4_1, 20, 1); else f(__VA_ARGS__, GGML_Q4_1, 20, 0); \
    } while (0)

/* The column pairs shared among the threads; x's rows (fewer than Q_PANEL_ROWS) stay in L1/L2 while each
   thread's weight rows stream by once. */
static void q_linear_tiled(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int qtype,
                           int gated, int threads) {
    const int64_t units = gated ? N : (N + 1) / 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; ++u) Q_KIND(q_tiled_unit, x, w, y, M, N, K, u);
}

/* a[i][l] and a[l][i] swapped for every i, l < VW: a VW x VW transpose in log2(VW) stages, each swapping the
   off-diagonal halves of 2h x 2h blocks (two-source shuffles: vpermt2ps with AVX-512). */
static inline __attribute__((always_inline)) void transpose_vecs(vfloat *a) {
    #pragma GCC unroll 4
    for (int h = 1; h < VW; h *= 2) {
        vint lo, hi;
        #pragma GCC unroll 16
        for (int l = 0; l < VW; ++l) {
            lo[l] = (l & h) ? VW + l - h : l;
            hi[l] = (l & h) ? VW + l : l + h;
        }
        #pragma GCC unroll 16
        for (int i = 0; i < VW; ++i)
            if (!(i & h)) {
                const vfloat x = a[i], y = a[i + h];
                a[i] = __builtin_shuffle(x, y, lo);
                a[i + h] = __builtin_shuffle(x, y, hi);
            }
    }
}

/* The weight rows n0 .. n0 + PANEL - 1 (those below `rows`; zeros past them) dequantized into one panel of
   pack_linear_f32's layout (wp[k * PANEL + c] = w[n0 + c][k]): a block of each row at a time, its vectors
   transposed in registers. */
static inline __attribute__((always_inline)) void
dequant_panel(const uint8_t *w, int64_t row, int64_t n0, int64_t rows, int64_t K, const int qtype, const int bytes,
              float *wp) {
    const int64_t valid = rows - n0;
    for (int64_t b = 0; b < K / QK; ++b)
        #pragma GCC unroll 4
        for (int h = 0; h < QK / VW; ++h) {   /* a vector of each row's block (VW of its weights), transposed */
            vfloat t[VW];
            if (valid >= VW) {
                #pragma GCC unroll 16
                for (int c = 0; c < VW; ++c) t[c] = dequant_vec(w + (n0 + c) * row + b * bytes, qtype, h);
            } else
                for (int c = 0; c < VW; ++c)
                    t[c] = c < valid ? dequant_vec(w + (n0 + c) * row + b * bytes, qtype, h) : (vfloat){0};
            transpose_vecs(t);
            memcpy(wp + (b * QK + h * VW) * PANEL, t, sizeof t);
        }
}

/* Rows m0 .. m0 + mr - 1 of y against the two panels in wp (output columns n0 .. n0 + 2 PANEL - 1, those below N);
   gated: the panels are the gate and the up rows of columns n0 .. n0 + PANEL - 1 and y gets silu(gate) * up. */
static inline __attribute__((always_inline)) void
q_panel_tile(const float *x, const float *wp, float *y, int64_t N, int64_t K, int64_t m0, int64_t n0, const int mr,
             const int gated) {
    vpanel acc[MR][2];
    tile_products(x, wp, K, m0, 0, mr, 2, acc);
    for (int i = 0; i < mr; ++i) {
        float *out = y + (m0 + i) * N + n0;
        for (int j = 0; j < 2 - gated; ++j) {
            const vpanel r = gated ? acc[i][0] / (1.f + exp_vec(-acc[i][0])) * acc[i][1] : acc[i][j];
            const int64_t left = N - n0 - j * PANEL;
            if (left >= PANEL) memcpy(out + j * PANEL, &r, sizeof r);
            else for (int64_t c = 0; c < left; ++c) out[j * PANEL + c] = r[c];
        }
    }
}

/* Every row of y for the output columns n0 .. n0 + 2 PANEL - 1 (gated: n0 .. n0 + PANEL - 1) from the dequantized
   panel pair in wp: tiles of MR rows, then 8, 4, 2 and 1. */
static inline __attribute__((always_inline)) void
q_panel_rows(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K, int64_t n0, const int gated) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) q_panel_tile(x, wp, y, N, K, m, n0, MR, gated);
#if MR > 8
    if (M - m >= 8) { q_panel_tile(x, wp, y, N, K, m, n0, 8, gated); m += 8; }
#endif
    if (M - m >= 4) { q_panel_tile(x, wp, y, N, K, m, n0, 4, gated); m += 4; }
    if (M - m >= 2) { q_panel_tile(x, wp, y, N, K, m, n0, 2, gated); m += 2; }
    if (M - m >= 1) q_panel_tile(x, wp, y, N, K, m, n0, 1, gated);
}

/* From Q_PANEL_ROWS rows: the weights dequantized a panel pair at a time (2 PANEL output columns, or PANEL gate and
   PANEL up rows) into each thread's buffer in packed_linear_f32's layout, and every row of x multiplied by it with
   packed_linear_f32's register tiles. Each weight is dequantized once per call (not once per tile of rows), and
   the pair (2 K PANEL floats: 72 KB at K = 576) stays in L2 while the rows go over it. The transposes cost more
   than the tiles of qtile save until a few dozen rows. */
static inline __attribute__((always_inline)) void
q_panels_unit(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int64_t u, float *wp,
              const int qtype, const int bytes, const int gated) {
    const int64_t row = K / QK * bytes, n0 = u * (gated ? PANEL : 2 * PANEL);
    dequant_panel(w, row, n0, N, K, qtype, bytes, wp);
    dequant_panel(w, row, gated ? n0 + N : n0 + PANEL, gated ? 2 * N : N, K, qtype, bytes, wp + K * PANEL);
    q_panel_rows(x, wp, y, M, N, K, n0, gated);
}

/* Returns -2 where memory for a thread's buffer runs out. */
static int q_linear_panels(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int qtype,
                           int gated, int threads) {
    const int64_t width = gated ? PANEL : 2 * PANEL, units = (N + width - 1) / width;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *wp = aligned_alloc(64, sizeof(float) * 2 * K * PANEL);
        if (wp == NULL) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u)
            if (wp != NULL) Q_KIND(q_panels_unit, x, w, y, M, N, K, u, wp);
        free(wp);
    }
    return failed ? -2 : 0;
}

/* y [M, N] = x [M, K] @ w^T, w [N, K / 32 blocks] of ggml type qtype; gated: w is a gate/up projection [2N, K]
   (gate rows first) and y [M, N] gets silu(gate) * up. Below Q_TILED_ROWS rows groups of QW weight rows against
   every row of x (qdot_unit); up to Q_PANEL_ROWS the register tiles of q_linear_tiled (a block dequantized once per
   QMR rows); from there q_linear_panels (once per call, then packed_linear_f32's tiles), which overtook the
   tiles between 32 and 64 rows on SmolLM2's shapes. Returns -1 for a type it does not read, or a K that is not
   whole blocks; -2 where memory for the panel buffer (from Q_PANEL_ROWS) runs out. */
#ifndef Q_PANEL_ROWS
#define Q_PANEL_ROWS 64
#endif
int q_linear_f32(const float *x, const uint8_t *w, float *y, int64_t M, int64_t N, int64_t K, int qtype,
                 int gated, int threads) {
    if ((qtype != GGML_Q8_0 && qtype != GGML_Q4_1) || K % QK) return -1;
    if (M <= 0) return 0;
    if (M >= Q_PANEL_ROWS) return q_linear_panels(x, w, y, M, N, K, qtype, gated, threads);
    if (M >= Q_TILED_ROWS) {
        q_linear_tiled(x, w, y, M, N, K, qtype, gated, threads);
        return 0;
    }
    const int64_t units = (N + QW - 1) / QW;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; ++u) Q_ROWS_KIND(qdot_unit, M, x, w, y, N, K, u * QW);
    return 0;
}

/* y [M, N] = x [M, K] @ w^T from w's repack rp (q_repack_f32 of w [N, K]; gated: of the gate/up projection
   [2N, K]), for M below Q_TILED_ROWS. Returns -1 where it does not take the call: another M, a type it does not
   read, K not whole blocks, or gated with N not a multiple of QW. */
int q_linear_repacked_f32(const float *x, const uint8_t *rp, float *y, int64_t M, int64_t N, int64_t K, int qtype,
                          int gated, int threads) {
    if ((qtype != GGML_Q8_0 && qtype != GGML_Q4_1) || K % QK || M < 1 || M >= Q_TILED_ROWS || (gated && N % QW))
        return -1;
    const int64_t units = (N + QW - 1) / QW;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; ++u) Q_ROWS_KIND(qdot_runit, M, x, rp, y, N, K, u * QW);
    return 0;
}

/* ---- From Q_PREP_ROWS rows over a repack in the panels' own order (q_prepack_f32): q_linear_panels' products
   and bits, without its transposes. Dequantizing a panel from GGUF's blocks reads each weight row's block and
   transposes VW x VW tiles in registers (about 0.7 instructions a weight), which at a few dozen rows of x costs a
   third of the products' time; here each (panel, block) holds the PANEL rows' scales as floats (d, then Q4_1's
   m), then the payload k-major: Q8_0 a byte of each row for each k, Q4_1 a byte of each row for each pair of k
   (the even k's nibble low, the odd one's high). A panel's vector of k is then one widening load, a conversion
   and an FMA (d * q exact, so the bits of dequant_vec's d * q + m), stored straight into the panel buffer.
   Rows past N are zeros. 24 bytes for 32 Q4_1 weights (the blocks: 20), 36 for Q8_0 (34). */
static inline __attribute__((always_inline)) int64_t q_prep_block(const int qtype) { return q_rows_block(qtype, PANEL); }

/* Bytes the panel repack of a [N, K] weight of type qtype takes. */
int64_t q_prepack_bytes(int64_t N, int64_t K, int qtype) { return q_rows_bytes(N, K, qtype, PANEL); }

/* The panel repack of w [N, K] (GGUF's blocks of qtype) into out (q_prepack_bytes of it). */
void q_prepack_f32(const uint8_t *w, uint8_t *out, int64_t N, int64_t K, int qtype, int threads) {
    const int64_t nb = K / QK, panels = (N + PANEL - 1) / PANEL, gb = q_prep_block(qtype);
    const int sc = q_rep_scales(qtype), bytes = qtype == GGML_Q4_1 ? 20 : 34;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *o = out + (p * nb + b) * gb, *payload = o + PANEL * 4 * sc;
            for (int c = 0; c < PANEL; ++c) {
                const int64_t n = p * PANEL + c;
                const uint8_t *blk = w + (n * nb + b) * bytes;
                float s[2] = {0.f, 0.f};
                if (n < N) {
                    s[0] = half_at(blk);
                    if (sc == 2) s[1] = half_at(blk + 2);
                }
                for (int i = 0; i < sc; ++i) memcpy(o + (i * PANEL + c) * 4, &s[i], 4);
                if (qtype == GGML_Q8_0)
                    for (int k = 0; k < QK; ++k) payload[k * PANEL + c] = n < N ? blk[2 + k] : 0;
                else
                    for (int j = 0; j < QK / 2; ++j) {   /* weights 2j and 2j + 1: nibbles of bytes (2j) % 16 ... */
                        const int a = 2 * j, z = 2 * j + 1;
                        const uint8_t qa = a < 16 ? blk[4 + a] & 0x0f : blk[4 + a - 16] >> 4;
                        const uint8_t qz = z < 16 ? blk[4 + z] & 0x0f : blk[4 + z - 16] >> 4;
                        payload[j * PANEL + c] = n < N ? (uint8_t)(qa | qz << 4) : 0;
                    }
            }
        }
}

/* Panel p of the repack (its K / QK blocks from pp) dequantized into wp in pack_linear_f32's layout. */
static inline __attribute__((always_inline)) void
dequant_prep_panel(const uint8_t *pp, int64_t K, const int qtype, float *wp) {
    const int sc = q_rep_scales(qtype);
    const int64_t gb = q_prep_block(qtype);
    for (int64_t b = 0; b < K / QK; ++b) {
        const uint8_t *o = pp + b * gb, *q = o + PANEL * 4 * sc;
        float *dst = wp + b * QK * PANEL;
        const vfloat d = load_vec((const afloat *)o);
        if (qtype == GGML_Q8_0) {
            #pragma GCC unroll 8
            for (int k = 0; k < QK; ++k) {
                const vfloat v = __builtin_convertvector(widen_bytes(q + k * PANEL, 1), vfloat) * d;
                memcpy(dst + k * PANEL, &v, sizeof v);
            }
        } else {
            const vfloat m = load_vec((const afloat *)o + PANEL);
            #pragma GCC unroll 8
            for (int j = 0; j < QK / 2; ++j) {
                const vint n = widen_bytes(q + j * PANEL, 0);
                const vfloat lo = __builtin_convertvector(n & 0x0f, vfloat) * d + m;
                const vfloat hi = __builtin_convertvector(n >> 4, vfloat) * d + m;
                memcpy(dst + 2 * j * PANEL, &lo, sizeof lo);
                memcpy(dst + (2 * j + 1) * PANEL, &hi, sizeof hi);
            }
        }
    }
}

/* q_panels_unit over the panel repack rp: output columns n0 = u * 2 PANEL.. (gated: u * PANEL.., from gate panel
   n0 / PANEL and up panel (N + n0) / PANEL). A second panel past the matrix is zeros (its columns not written). */
static inline __attribute__((always_inline)) void
q_prep_unit(const float *x, const uint8_t *rp, float *y, int64_t M, int64_t N, int64_t K, int64_t u, float *wp,
            const int qtype, const int bytes, const int gated) {
    (void)bytes;
    const int64_t panel = K / QK * q_prep_block(qtype), n0 = u * (gated ? PANEL : 2 * PANEL);
    const int64_t p1 = gated ? (N + n0) / PANEL : n0 / PANEL + 1, panels = ((gated ? 2 * N : N) + PANEL - 1) / PANEL;
    dequant_prep_panel(rp + n0 / PANEL * panel, K, qtype, wp);
    if (p1 < panels) dequant_prep_panel(rp + p1 * panel, K, qtype, wp + K * PANEL);
    else memset(wp + K * PANEL, 0, sizeof(float) * K * PANEL);
    /* The next unit's panels asked for while this one's tiles run: at decode's few dozen rows the tiles are short, and
       a dequantization that waits on memory for its panels ran a fifth slower than one whose panels were in cache. */
    const int64_t q0 = (n0 / PANEL + (gated ? 1 : 2)) * panel, q1 = (p1 + (gated ? 1 : 2)) * panel;
    const int64_t end = (int64_t)panels * panel;
    for (int64_t off = 0; off < panel; off += 64) {
        if (q0 + off < end) __builtin_prefetch(rp + q0 + off, 0, 2);
        if (q1 + off < end) __builtin_prefetch(rp + q1 + off, 0, 2);
    }
    q_panel_rows(x, wp, y, M, N, K, n0, gated);
}

/* y [M, N] = x [M, K] @ w^T from w's panel repack rp (q_prepack_f32 of w [N, K]; gated: of the gate/up projection
   [2N, K]): q_linear_panels' bits at any M. Returns -1 where it does not take the call (a type it does not read,
   K not whole blocks, M < 1, or gated with N not whole panels); -2 where memory for a panel buffer runs out. */
#ifndef Q_PREP_PASS
#define Q_PREP_PASS 128
#endif
int q_linear_prepacked_f32(const float *x, const uint8_t *rp, float *y, int64_t M, int64_t N, int64_t K, int qtype,
                           int gated, int threads) {
    if ((qtype != GGML_Q8_0 && qtype != GGML_Q4_1) || K % QK || M < 1 || (gated && N % PANEL)) return -1;
    const int64_t width = gated ? PANEL : 2 * PANEL, units = (N + width - 1) / width;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *wp = aligned_alloc(64, sizeof(float) * 2 * K * PANEL);
        if (wp == NULL) failed = 1;
        for (int64_t m0 = 0; m0 < M; m0 += Q_PREP_PASS) {
            const int64_t mb = M - m0 < Q_PREP_PASS ? M - m0 : Q_PREP_PASS;
            #pragma omp for schedule(static)
            for (int64_t u = 0; u < units; ++u)
                if (wp != NULL) Q_KIND(q_prep_unit, x + m0 * K, rp, y + m0 * N, mb, N, K, u, wp);
        }
        free(wp);
    }
    return failed ? -2 : 0;
}

/* Rows of x from which the panels over the panel repack beat q_linear_f32's tiles (which run below them), gated or
   not: on SmolLM2's shapes on a 2-core EPYC, the two timed by turns in one process with the weights coming from
   memory, the gate/up product from 8 rows (even there, 1.1-1.3x from 10), the others from 16 (qkv, o and down
   0.9-1.1x at 12-16 rows, 1.0-1.2x from 20; the LM head 1.0x at 16, 1.1x from 20). Fixed here, not chosen by
   bench kernels. */
#ifndef Q_PREP_ROWS
#define Q_PREP_ROWS 16
#endif
#ifndef Q_PREP_GATED_ROWS
#define Q_PREP_GATED_ROWS 8
#endif
int q_prep_rows(int gated) { return gated ? Q_PREP_GATED_ROWS : Q_PREP_ROWS; }

/* Rows of x from which q_linear_f32 tiles (below them, the repack's kernel or qdot_unit). */
int q_tiled_rows(void) { return Q_TILED_ROWS; }

/* out [n, K] = the rows ids[0 .. n - 1] of the table w [V, K / 32 blocks] of ggml type qtype, dequantized
   (dequant_block's values: gguf's, bit for bit): the embedding's lookup, a block of each looked-up row at a time.
   Returns -1 for a type it does not read or a K that is not whole blocks, -2 for an id outside 0 .. V - 1 (nothing
   written). */
static inline __attribute__((always_inline)) void
q_rows(const uint8_t *w, const int64_t *ids, float *out, int64_t n, int64_t K, const int qtype, const int bytes) {
    const int64_t nb = K / QK;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b = 0; b < nb; ++b) {
            vfloat v[QK / VW];
            dequant_block(w + (ids[i] * nb + b) * bytes, qtype, v);
            memcpy(out + i * K + b * QK, v, sizeof v);
        }
}

int q_rows_f32(const uint8_t *w, const int64_t *ids, float *out, int64_t n, int64_t V, int64_t K, int qtype) {
    if ((qtype != GGML_Q8_0 && qtype != GGML_Q4_1) || K % QK) return -1;
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= V) return -2;
    if (qtype == GGML_Q8_0) q_rows(w, ids, out, n, K, GGML_Q8_0, 34);
    else q_rows(w, ids, out, n, K, GGML_Q4_1, 20);
    return 0;
}

