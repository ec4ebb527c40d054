// One step of a Llama-family model for a few tokens: every layer, each token at its own (slot,
// position), whether they are decode steps of different sequences or consecutive tokens of one (a
// draft to verify, a short prompt chunk): all keys are written before any token attends. At 135M
// parameters the Python and dispatch cost of ~40 small torch calls per layer is as large as the
// matrix work; here a step is one call. Matrix products are the block kernels of blockquant.h;
// norms, rotary embedding, the KV-cache write and attention are plain loops over simd.h.
// The Python model (llama.py) stays the reference: tests compare the logits of both.
#pragma once

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "blockquant.h"

namespace wafer {

// y = rms_norm(x) * w, row by row
inline void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * n;
        simd::F acc = simd::zero();
        for (int64_t i = 0; i < n; i += 16) {
            const simd::F v = simd::load_n(xr + i, n - i);
            acc = simd::fma(v, v, acc);
        }
        const simd::F inv = simd::set1(1.0f / std::sqrt(simd::sum(acc) / static_cast<float>(n) + eps));
        float* yr = y + r * n;
        for (int64_t i = 0; i < n; i += 16)
            simd::store_n(yr + i, simd::load_n(xr + i, n - i) * inv * simd::load_n(w + i, n - i), n - i);
    }
}

// y = silu(gate) * up for rows of [gate | up]
inline void silu_mul(const float* gu, float* y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const simd::F gv = simd::load_n(g + i, inter - i);
            const simd::F sig = gv / (simd::set1(1.0f) + simd::exp(simd::zero() - gv));
            simd::store_n(y + r * inter + i, sig * simd::load_n(u + i, inter - i), inter - i);
        }
    }
}

// y = gelu(gate) * up for rows of [gate | up], GELU's tanh form (Gemma's GeGLU):
// 0.5 g (1 + tanh(z)) with z = sqrt(2/pi) (g + 0.044715 g^3), tanh(z) = 1 - 2 / (e^(2z) + 1).
inline void gelu_mul(const float* gu, float* y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const simd::F gv = simd::load_n(g + i, inter - i);
            const simd::F z = simd::set1(0.7978845608028654f) * simd::fma(simd::set1(0.044715f) * gv, gv * gv, gv);
            const simd::F t = simd::set1(1.0f) - simd::set1(2.0f) / (simd::exp(z + z) + simd::set1(1.0f));
            simd::store_n(y + r * inter + i, simd::set1(0.5f) * gv * (simd::set1(1.0f) + t) * simd::load_n(u + i, inter - i),
                          inter - i);
        }
    }
}

// p[0..n) = exp(p - max p); returns their sum
inline float softmax_exp(float* p, int64_t n) {
    simd::F mx = simd::set1(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) mx = simd::max(mx, simd::load_n(p + j, n - j, -INFINITY));
    const simd::F m = simd::set1(simd::hmax(mx));
    simd::F total = simd::zero();
    for (int64_t j = 0; j < n; j += 16) {
        const simd::F e = simd::keep_n(simd::exp(simd::load_n(p + j, n - j) - m), n - j);
        simd::store_n(p + j, e, n - j);
        total = total + e;
    }
    return simd::sum(total);
}

// Rotate-half RoPE of one head vector in place; cos/sin rows hold [freqs, freqs].
inline void rope(float* v, const float* c, const float* s, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

// The KV cache's element types. A row holds one KV head's vector at one position; an int8 row is
// followed by its float32 scale (max |x| / 127, one per position and head), so that codes and scale
// are written and read together (kv_cache.py lays the pools out the same way).
struct Bf16 {
    uint16_t bits;
};
inline simd::F load_kv(const float* p) { return simd::load(p); }
inline simd::F load_kv(const Bf16* p) { return simd::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline simd::F load_kv(const int8_t* p) { return simd::load_i8(p); }
inline float kv_value(float x) { return x; }
inline float kv_value(Bf16 x) { return simd::bf16_to_float(x.bits); }
inline float kv_value(int8_t x) { return static_cast<float>(x); }
template <class T>
constexpr int64_t kv_row(int64_t d) { return std::is_same<T, int8_t>::value ? d + 4 : d; }
template <class T>
inline float kv_scale(const T* row, int64_t d) {
    if constexpr (std::is_same<T, int8_t>::value) {
        float s;
        std::memcpy(&s, row + d, 4);
        return s;
    } else {
        return 1.0f;
    }
}
// Round x[0..d) into a row of T (bfloat16: to nearest even; int8: codes of x / scale, then the scale).
template <class T>
inline void kv_store(T* row, const float* x, int64_t d) {
    if constexpr (std::is_same<T, float>::value) {
        std::memcpy(row, x, d * sizeof(float));
    } else if constexpr (std::is_same<T, Bf16>::value) {
        for (int64_t e = 0; e < d; ++e) {
            uint32_t bits;
            std::memcpy(&bits, x + e, 4);
            row[e].bits = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
        }
    } else {
        float amax = 0.0f;
        for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(x[e]));
        const float scale = amax / 127.0f;
        for (int64_t e = 0; e < d; ++e)
            row[e] = scale > 0.0f ? static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(x[e] / scale))))
                                  : int8_t{0};
        std::memcpy(row + d, &scale, 4);
    }
}

// q . k over one head (without k's row scale); 16 lanes at a time when the head size allows (it
// is 64, 128 or 256 in practice).
template <class T>
inline float dot(const float* q, const T* k, int64_t n) {
    if (n % 16 == 0) {
        simd::F acc = simd::zero();
        for (int64_t e = 0; e < n; e += 16) acc = simd::fma(simd::load(q + e), load_kv(k + e), acc);
        return simd::sum(acc);
    }
    float s = 0.0f;
    for (int64_t e = 0; e < n; ++e) s += q[e] * kv_value(k[e]);
    return s;
}

// The rows of the next block while this one is read: a block of one KV head is a few KB of its
// own, and the hardware's stream prefetcher starts again at every one.
template <class T>
inline void prefetch_rows(const T* p, int64_t elements) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t b = 0; b < elements * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(c + b);
}

// The rows of position j's block from j on, up to `end` (none where j >= end).
template <class Row>
inline void prefetch_block(Row row, int64_t j, int64_t end, int shift, int64_t R) {
    const int64_t B = int64_t{1} << shift;
    if (j < end) prefetch_rows(row(j), std::min(B - (j & (B - 1)), end - j) * R);
}

// Where the run of rows that starts at position j0 ends: its block's end (or `end`), and `split`,
// from which on each position's row lies on its own (a draft tree's path: draft_tree.py).
inline int64_t run_end(int64_t j0, int64_t end, int shift, int64_t split) {
    if (j0 >= split) return j0 + 1;
    return std::min(std::min(end, split), ((j0 >> shift) + 1) << shift);
}
constexpr int64_t kNoSplit = INT64_MAX;

// o[0..n) = scale * sum_j p[j] v_j over positions j in [start, end), whose rows lie in blocks of
// 2^shift positions: row(j0) is the row of j0, and the rows after it up to its run's end follow
// it (rows of kv_row<T>(n) elements, each times its own scale; run_end).
template <class Row>
inline void weighted_sum(const float* p, int64_t start, int64_t end, int shift, Row row, float scale, float* o,
                         int64_t n, int64_t split = kNoSplit) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(row(start))>>;
    const int64_t R = kv_row<T>(n);
    if (n == 64) {  // four vectors hold the whole output row
        simd::F a0 = simd::zero(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j0 = start; j0 < end;) {
            const int64_t stop = run_end(j0, end, shift, split);
            const T* r = row(j0);
            prefetch_block(row, stop, end, shift, R);
            for (int64_t j = j0; j < stop; ++j, r += R) {
                const simd::F w = simd::set1(p[j] * kv_scale(r, n));
                a0 = simd::fma(w, load_kv(r), a0);
                a1 = simd::fma(w, load_kv(r + 16), a1);
                a2 = simd::fma(w, load_kv(r + 32), a2);
                a3 = simd::fma(w, load_kv(r + 48), a3);
            }
            j0 = stop;
        }
        const simd::F s = simd::set1(scale);
        simd::store(o, a0 * s);
        simd::store(o + 16, a1 * s);
        simd::store(o + 32, a2 * s);
        simd::store(o + 48, a3 * s);
        return;
    }
    for (int64_t e = 0; e < n; ++e) o[e] = 0.0f;
    for (int64_t j0 = start; j0 < end;) {
        const int64_t stop = run_end(j0, end, shift, split);
        const T* r = row(j0);
        for (int64_t j = j0; j < stop; ++j, r += R) {
            const float w = p[j] * kv_scale(r, n);
            if (n % 16 == 0)
                for (int64_t e = 0; e < n; e += 16)
                    simd::store(o + e, simd::fma(simd::set1(w), load_kv(r + e), simd::load(o + e)));
            else
                for (int64_t e = 0; e < n; ++e) o[e] += w * kv_value(r[e]);
        }
        j0 = stop;
    }
    for (int64_t e = 0; e < n; ++e) o[e] *= scale;
}

constexpr int64_t kMaxHeads = 4;  // query heads that one pass over a KV head's rows serves
constexpr int64_t kAhead = 6;    // blocks of keys fetched ahead of the one being read: as many as
                                 // cover memory's latency at contexts of thousands (measured)

// p[h][g] = scale * (q_h . k_g) * k_g's scale for H query heads (q, H rows of n) and the c <= 16 key
// rows k_g that follow k, R elements apart. Each (head, key) product is summed over 16-element pieces
// into one vector, and the 16 keys' vectors of a head are reduced together, a key a lane (sums16):
// a horizontal sum per product cost more than the products themselves.
template <int H, class T>
inline void scores(const float* q, const T* k, int64_t R, int64_t c, int64_t n, float scale, float* p, int64_t stride) {
    simd::F acc[H][16];
    alignas(64) float ks[16];
    for (int64_t g = 0; g < 16; ++g) {
        for (int h = 0; h < H; ++h) acc[h][g] = simd::zero();
        ks[g] = 0.0f;
        if (g >= c) continue;
        const T* kg = k + g * R;
        for (int64_t e = 0; e < n; e += 16) {
            const simd::F kv = load_kv(kg + e);
            for (int h = 0; h < H; ++h) acc[h][g] = simd::fma(simd::load(q + h * n + e), kv, acc[h][g]);
        }
        ks[g] = kv_scale(kg, n) * scale;
    }
    const simd::F kscale = simd::load(ks);
    for (int h = 0; h < H; ++h) simd::store_n(p + h * stride, simd::sums16(acc[h]) * kscale, c);
}

// o[h] += sum_j p[h][j] v_j for H heads over the rows of positions [j0, j1), which follow r, 16 G
// elements of the output at a time. Each of the H G accumulators is its own chain of FMAs over j (a
// chain waits out the FMA's latency at every row, so more of them keep the units busy).
template <int H, int G, class T>
inline void accumulate_block(const float* p, int64_t stride, int64_t j0, int64_t j1, const T* r, float* o, int64_t n) {
    const int64_t R = kv_row<T>(n);
    for (int64_t e = 0; e < n; e += 16 * G) {
        simd::F acc[H][G];
        for (int h = 0; h < H; ++h)
            for (int g = 0; g < G; ++g) acc[h][g] = simd::load(o + h * n + e + 16 * g);
        const T* row = r;
        for (int64_t j = j0; j < j1; ++j, row += R) {
            const float sc = kv_scale(row, n);
            simd::F w[H];
            for (int h = 0; h < H; ++h) w[h] = simd::set1(p[h * stride + j] * sc);
            for (int g = 0; g < G; ++g) {
                const simd::F v = load_kv(row + e + 16 * g);
                for (int h = 0; h < H; ++h) acc[h][g] = simd::fma(w[h], v, acc[h][g]);
            }
        }
        for (int h = 0; h < H; ++h)
            for (int g = 0; g < G; ++g) simd::store(o + h * n + e + 16 * g, acc[h][g]);
    }
}

// o[h] = sum_j p[h][j] v_j / total[h] for H heads over positions [start, end) (rows as in
// weighted_sum). A block's rows are read from memory once for all H heads, then from cache, as many
// 16-element pieces of the output at a time as the registers hold accumulators for. Every element's
// sum runs over j in order, however many pieces are taken at once: the bits do not depend on it.
template <int H, class Row>
inline void weighted_sums(const float* p, int64_t stride, int64_t start, int64_t end, int shift, Row row,
                          const float* total, float* o, int64_t n, int64_t split) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(row(start))>>;
    const int64_t R = kv_row<T>(n);
    // Four pieces at once where their accumulators, the H weights and a row's piece fit in registers.
    constexpr int kWide = H * 4 + H + 1 <= simd::kRegisters ? 4 : 1;
    for (int64_t i = 0; i < H * n; ++i) o[i] = 0.0f;
    for (int64_t j0 = start; j0 < end;) {
        const int64_t stop = run_end(j0, end, shift, split);
        prefetch_block(row, stop, end, shift, R);
        if (n % (16 * kWide) == 0)
            accumulate_block<H, kWide>(p, stride, j0, stop, row(j0), o, n);
        else
            accumulate_block<H, 1>(p, stride, j0, stop, row(j0), o, n);
        j0 = stop;
    }
    for (int h = 0; h < H; ++h) {
        const float inv = 1.0f / total[h];
        for (int64_t e = 0; e < n; ++e) o[h * n + e] *= inv;
    }
}

template <int H, class KRow, class VRow>
inline void attend_n(const float* q, int64_t n, int64_t start, int64_t end, int shift, float scale, KRow krow, VRow vrow,
                     float* p, int64_t stride, float* o, int64_t split) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(krow(start))>>;
    const int64_t R = kv_row<T>(n);
    // The keys kAhead blocks ahead, and each block's values while its keys are read (they are read
    // after the softmax): a block is a few KB of its own, one block ahead is less than a miss's
    // latency, and the hardware's stream prefetcher starts again at every block.
    prefetch_block(krow, start, end, shift, R);
    for (int64_t a = 1; a < kAhead; ++a) prefetch_block(krow, ((start >> shift) + a) << shift, end, shift, R);
    for (int64_t j0 = start; j0 < end;) {
        const T* K = krow(j0);
        const int64_t stop = run_end(j0, end, shift, split);
        prefetch_block(krow, ((j0 >> shift) + kAhead) << shift, end, shift, R);
        prefetch_block(vrow, j0, end, shift, R);
        for (int64_t j = j0; j < stop; j += 16, K += 16 * R)
            scores<H>(q, K, R, std::min<int64_t>(16, stop - j), n, scale, p + j, stride);
        j0 = stop;
    }
    float total[H];
    for (int h = 0; h < H; ++h) total[h] = softmax_exp(p + h * stride + start, end - start);
    if constexpr (H == 1)  // one pass over the rows, the whole output row in registers where it fits
        weighted_sum(p, start, end, shift, vrow, 1.0f / total[0], o, n, split);
    else
        weighted_sums<H>(p, stride, start, end, shift, vrow, total, o, n, split);
}

// Attention of H (at most kMaxHeads) consecutive query heads q [H, n] that share one KV head, over
// its positions [start, end): o [H, n]. p is scratch of H rows of `stride` floats. Rows of positions
// from `split` on are read one by one (run_end): each position's score and weight are its own, and
// the sums run over positions in order, so their bits are those of rows laid out in place.
template <class KRow, class VRow>
inline void attend_heads(const float* q, int64_t H, int64_t n, int64_t start, int64_t end, int shift, float scale,
                         KRow krow, VRow vrow, float* p, int64_t stride, float* o, int64_t split = kNoSplit) {
    if (n % 16 != 0) {  // no head size of a supported model; plain loops, a head at a time
        for (int64_t h = 0; h < H; ++h) {
            float* ph = p + h * stride;
            for (int64_t j = start; j < end; ++j) ph[j] = dot(q + h * n, krow(j), n) * kv_scale(krow(j), n) * scale;
            const float total = softmax_exp(ph + start, end - start);
            weighted_sum(ph, start, end, shift, vrow, 1.0f / total, o + h * n, n, split);
        }
        return;
    }
    switch (H) {
        case 1: return attend_n<1>(q, n, start, end, shift, scale, krow, vrow, p, stride, o, split);
        case 2: return attend_n<2>(q, n, start, end, shift, scale, krow, vrow, p, stride, o, split);
        case 3: return attend_n<3>(q, n, start, end, shift, scale, krow, vrow, p, stride, o, split);
        default: return attend_n<4>(q, n, start, end, shift, scale, krow, vrow, p, stride, o, split);
    }
}

struct Linear {
    const uint8_t* packed;  // blockquant.h's records
    int format;
    const float* bias;  // nullptr: none
    int64_t in, out;
    int64_t ahead = -1;  // block_linear's prefetch distance (negative: the prefetch table's, looked up per call)
    // y [M, out] = x [M, in] @ W.T (+ bias)
    void operator()(const float* x, int64_t M, float* y) const {
        block_linear(x, M, in, packed, format, out, y, ahead);
        if (bias)
            for (int64_t r = 0; r < M; ++r)
                for (int64_t j = 0; j < out; ++j) y[r * out + j] += bias[j];
    }
};

struct Layer {
    const float *input_norm, *post_norm;  // before attention, before the MLP
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;  // pools of blocks: [kv_heads, blocks, block, row] of Dims::kv_type rows
    // Gemma 3's block has these too (nullptr: the Llama block): an RMSNorm over each query and key
    // head before RoPE, and one over the attention's and the MLP's outputs before the residual add.
    const float *q_norm = nullptr, *k_norm = nullptr, *attn_out_norm = nullptr, *mlp_out_norm = nullptr;
    int64_t window = 0;      // this layer's attention window (0: Dims::window)
    bool local_rope = false;  // RoPE from Rope's second tables (Gemma 3's windowed layers)
    // This layer's group's tables and pool size where they are not Tables' (windowed layers hold
    // only their window, in pools of their own; kv_cache.py): nullptr, 0 for Tables'.
    const int64_t* table = nullptr;
    int64_t blocks = 0;
};

// Where each token's rotary angles lie: the tables' row of its position, or (`row`) a row of its
// own, for tables made per step; and a second pair of tables for the layers of a second base.
struct Rope {
    const float *cos_local = nullptr, *sin_local = nullptr;
    const int64_t* row = nullptr;  // nullptr: a token's row is its position
};

// Draft trees (draft_tree.py): token m's positions from rows[m * width] on lie elsewhere than their
// number says, at the positions rows[m * width + 1 + (p - base)] (its own among them: where it is
// written). rows nullptr: every position is where its number says.
struct Tree {
    const int64_t* rows = nullptr;
    int64_t width = 0;
    int64_t base(int64_t m) const { return rows != nullptr ? rows[m * width] : kNoSplit; }
    int64_t place(int64_t m, int64_t p) const {
        const int64_t b = base(m);
        return p < b ? p : rows[m * width + 1 + (p - b)];
    }
};

// Where a sequence's positions lie in the pools: position p of the sequence whose table row is
// `row` is in block row[p / block], at p % block.
struct Tables {
    const int64_t* rows;  // [slots, stride]: each slot's blocks in position order
    int64_t stride, block;
    int64_t blocks;  // in each pool: a KV head's blocks lie together, so that one sequence's
                     // consecutive blocks of a head are one run of memory, as a contiguous cache's are
};

enum class KVType { f32, bf16, i8 };

struct Dims {
    int64_t hidden, n_heads, n_kv, head_dim, window;  // window 0: none
    float eps;
    KVType kv_type = KVType::f32;
    bool gelu = false;        // the MLP's gate: GELU (tanh form), else SiLU
    float attn_scale = 0.0f;  // queries' scale (0: 1 / sqrt(head_dim))
};

// x [M, hidden]: the tokens' embeddings, at positions pos[M] of slots slot[M]; cos, sin
// [rows, head_dim], a token's row its position (or rope.row's). Writes logits [n_out, head.out]
// for the rows out[0..n_out) (a prompt chunk samples from its last token only, and the head is a
// fifth of a small model's weights). Without a head (head.packed null: a pipeline stage before the
// last) it writes every row's hidden state [M, hidden] instead, unnormed, for the next stage.
template <class T>
inline void decode_step_t(const float* x, int64_t M, const int64_t* pos, const int64_t* slot, const Tables& tables,
                          const float* C, const float* S, const std::vector<Layer>& layers, const float* final_norm,
                          const Linear& head, const Dims& dims, const int64_t* out, int64_t n_out, float* logits,
                          const Rope& rope, const Tree& tree) {
    const int64_t hidden = dims.hidden, n_heads = dims.n_heads, n_kv = dims.n_kv, head_dim = dims.head_dim;
    const int64_t group = n_heads / n_kv, q_dim = n_heads * head_dim, kv_dim = n_kv * head_dim;
    const int64_t row = q_dim + 2 * kv_dim;
    const float scale = dims.attn_scale > 0.0f ? dims.attn_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<float> h(x, x + M * hidden), xn(M * hidden), attn(M * q_dim), tmp(M * hidden);
    std::vector<float> qkv, gu, act;
    int64_t max_ctx = 0;
    for (int64_t m = 0; m < M; ++m) max_ctx = std::max(max_ctx, pos[m] + 1);
    auto add_into_h = [&](const float* y) {
        for (int64_t i = 0; i < M * hidden; ++i) h[i] += y[i];
    };
    // Blocks are a power of two of positions (kernels.cpp checks), so that finding a position's
    // block is a shift, not a division, in the attention's inner loops.
    const int64_t B = tables.block, R = kv_row<T>(head_dim);
    int shift = 0;
    while ((int64_t{1} << shift) < B) ++shift;
    for (const Layer& L : layers) {
        const int64_t* const rows = L.table != nullptr ? L.table : tables.rows;
        const int64_t blocks = L.blocks > 0 ? L.blocks : tables.blocks;
        // Offset in a pool of the key (or value) row of KV head kh at position p of token m's sequence.
        auto at = [&](int64_t m, int64_t kh, int64_t p) {
            return ((kh * blocks + rows[slot[m] * tables.stride + (p >> shift)]) * B + (p & (B - 1))) * R;
        };
        T* const Kc = static_cast<T*>(L.k_cache);
        T* const Vc = static_cast<T*>(L.v_cache);
        rms_norm(h.data(), L.input_norm, xn.data(), M, hidden, dims.eps);
        qkv.resize(M * row);
        L.qkv(xn.data(), M, qkv.data());
        const bool local = L.local_rope && rope.cos_local != nullptr;
        const int64_t window = L.window > 0 ? L.window : dims.window;
        for (int64_t m = 0; m < M; ++m) {
            float* r = qkv.data() + m * row;
            if (L.q_norm != nullptr) {
                rms_norm(r, L.q_norm, r, n_heads, head_dim, dims.eps);
                rms_norm(r + q_dim, L.k_norm, r + q_dim, n_kv, head_dim, dims.eps);
            }
            const int64_t at_row = rope.row != nullptr ? rope.row[m] : pos[m];
            const float* c = (local ? rope.cos_local : C) + at_row * head_dim;
            const float* s = (local ? rope.sin_local : S) + at_row * head_dim;
            for (int64_t hd = 0; hd < n_heads + n_kv; ++hd) wafer::rope(r + hd * head_dim, c, s, head_dim);
            for (int64_t kh = 0; kh < n_kv; ++kh) {
                const int64_t o = at(m, kh, tree.place(m, pos[m]));
                kv_store(Kc + o, r + q_dim + kh * head_dim, head_dim);
                kv_store(Vc + o, r + q_dim + kv_dim + kh * head_dim, head_dim);
            }
        }
        const float* QKV = qkv.data();
        float* A = attn.data();
        // A unit of work is a few query heads of one KV head for one token: they share every key
        // and value row it reads (and its conversion to float). One head a unit where there are
        // too few units to keep the threads busy otherwise (a single decode stream).
        const int64_t per = M * n_kv >= 2 * WAFER_NUM_THREADS() ? std::min<int64_t>(group, kMaxHeads) : 1;
        const int64_t chunks = (group + per - 1) / per;
        WAFER_PARALLEL_FOR(int64_t{0}, M * n_kv * chunks, int64_t{1}, [&](int64_t i0, int64_t i1) {
            std::vector<float> p(per * max_ctx);
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t m = i / (n_kv * chunks), kh = i / chunks % n_kv, h0 = kh * group + i % chunks * per;
                const int64_t H = std::min(per, (kh + 1) * group - h0);
                const int64_t end = pos[m] + 1, start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
                const int64_t split = tree.base(m);
                if (split > pos[m])  // every row in place
                    attend_heads(QKV + m * row + h0 * head_dim, H, head_dim, start, end, shift, scale,
                                 [&](int64_t j) -> const T* { return Kc + at(m, kh, j); },
                                 [&](int64_t j) -> const T* { return Vc + at(m, kh, j); }, p.data(), max_ctx,
                                 A + m * q_dim + h0 * head_dim);
                else
                    attend_heads(QKV + m * row + h0 * head_dim, H, head_dim, start, end, shift, scale,
                                 [&](int64_t j) -> const T* { return Kc + at(m, kh, tree.place(m, j)); },
                                 [&](int64_t j) -> const T* { return Vc + at(m, kh, tree.place(m, j)); }, p.data(),
                                 max_ctx, A + m * q_dim + h0 * head_dim, split);
            }
        });
        L.o(attn.data(), M, tmp.data());
        if (L.attn_out_norm != nullptr) rms_norm(tmp.data(), L.attn_out_norm, tmp.data(), M, hidden, dims.eps);
        add_into_h(tmp.data());
        rms_norm(h.data(), L.post_norm, xn.data(), M, hidden, dims.eps);
        const int64_t inter = L.gate_up.out / 2;
        gu.resize(M * 2 * inter);
        act.resize(M * inter);
        L.gate_up(xn.data(), M, gu.data());  // [M, 2 inter]: gate then up
        if (dims.gelu)
            gelu_mul(gu.data(), act.data(), M, inter);
        else
            silu_mul(gu.data(), act.data(), M, inter);
        L.down(act.data(), M, tmp.data());
        if (L.mlp_out_norm != nullptr) rms_norm(tmp.data(), L.mlp_out_norm, tmp.data(), M, hidden, dims.eps);
        add_into_h(tmp.data());
    }
    if (head.packed == nullptr) {
        std::copy(h.begin(), h.end(), logits);
        return;
    }
    for (int64_t i = 0; i < n_out; ++i)
        rms_norm(h.data() + out[i] * hidden, final_norm, xn.data() + i * hidden, 1, hidden, dims.eps);
    head(xn.data(), n_out, logits);
}

// The step on caches of dims.kv_type.
inline void decode_step(const float* x, int64_t M, const int64_t* pos, const int64_t* slot, const Tables& tables,
                        const float* C, const float* S, const std::vector<Layer>& layers, const float* final_norm,
                        const Linear& head, const Dims& dims, const int64_t* out, int64_t n_out, float* logits,
                        const Rope& rope = Rope{}, const Tree& tree = Tree{}) {
    switch (dims.kv_type) {
        case KVType::f32:
            return decode_step_t<float>(x, M, pos, slot, tables, C, S, layers, final_norm, head, dims, out, n_out, logits, rope, tree);
        case KVType::bf16:
            return decode_step_t<Bf16>(x, M, pos, slot, tables, C, S, layers, final_norm, head, dims, out, n_out, logits, rope, tree);
        case KVType::i8:
            return decode_step_t<int8_t>(x, M, pos, slot, tables, C, S, layers, final_norm, head, dims, out, n_out, logits, rope, tree);
    }
}

}  // namespace wafer
