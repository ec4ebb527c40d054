// Block-quantised matrix products and the greedy pick, written once against simd.h.
//
// Weights are llama.cpp's block formats, 32 input elements per block, each block w = d * q + m:
//   4 bits: codes q in 0..15 with a scale d and a minimum m (GGUF Q4_1)
//   5 bits: codes q in 0..31, likewise (GGUF Q5_1; Q5_0 with m = -16 d)
//   6 bits: codes q in 0..63, likewise (an output head requantised from 8 bits: 448 bytes a record, not 576)
//   8 bits: codes q + 128 in 0..255 with m = -128 d, which is GGUF Q8_0 (w = d * q) made unsigned
// Activations are quantised per block of 32 to int8 with one scale dx (as llama.cpp's Q8_1), so
//   sum over a block of w x = d dx (sum of codes * x codes) + m (dx * sum of x codes)
// and the first sum is exact integer work.
//
// Layout (blockquant.py, pack_blocks): output channels in groups of 16, and for each group and
// block one record: the 16 channels' 32 codes, then d[16] and m[16] as float16. The codes are
// ordered so that each 64 bytes hold four consecutive inputs of all 16 channels (5 bits: the 4-bit
// body, then 64 bytes whose byte (c, t) holds at bit j the fifth bit of input 4 j + t; 6 bits: the 4-bit
// body, then K6's 128 bytes of top bits, byte (h, c, t) holding those of inputs 16 h + 4 s + t at bits
// 2 s): a dot product of
// those bytes against four of x's bytes broadcast gives 16 outputs' partial sums at once. Every
// result lane is an output channel, so no horizontal sums are needed, a record is unpacked once for
// up to eight rows of x, and each thread reads one contiguous run of records.
//
// Two more formats hold llama.cpp's K-quants exactly, in their own size, with a record per group and
// super-block of 256 inputs (8 blocks of 32, the bodies first, then the block scales, then the
// super-block's float16 factors):
//   K4 (Q4_K, 4.625 bits a weight): bodies as the 4-bit records', then sc[8][16] and mn[8][16] (6-bit,
//      unsigned, a byte each), then D[16] and Dmin[16]: block b of channel c is
//      w = D sc[b][c] q - Dmin mn[b][c].
//   K6 (Q6_K, 6.5625 bits a weight): bodies of 384 bytes: the codes' low nibbles laid out as a 4-bit
//      body, then 128 bytes of their top two bits, byte (h, c, t) holding those of inputs
//      16 h + 4 s + t at bits 2 s (s = 0..3); then sc[8][2][16] (int8, a scale per 16 inputs), then
//      D[16]: w = D sc (q - 32) with q in 0..63.
//
// Parallel loops go through WAFER_PARALLEL_FOR (PyTorch's at::parallel_for in the extension, so that
// they run on PyTorch's own OpenMP workers); without it they run serially.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

#ifndef WAFER_PARALLEL_FOR
#define WAFER_PARALLEL_FOR(begin, end, grain, ...) (__VA_ARGS__)((begin), (end))
#define WAFER_NUM_THREADS() 1
#define WAFER_THREAD_NUM() 0
#endif

namespace wafer {

constexpr int QK = 32;
constexpr int QK_K = 256;  // inputs of a K4 or K6 record
constexpr int TILE = 8;  // rows of x that share one unpacking of a record

// A weight format is named by its record's size, which is how kernels.cpp tells them apart.
enum Format : int { Q4 = 4, Q5 = 5, Q6 = 6, Q8 = 8, K4 = 44, K6 = 66 };

inline int64_t record_bytes(int fmt) {
    switch (fmt) {
        case Q4: return 256 + 64;
        case Q5: return 256 + 64 + 64;
        case Q6: return 256 + 128 + 64;
        case Q8: return 512 + 64;
        case K4: return 8 * 256 + 2 * 128 + 64;
        default: return 8 * 384 + 256 + 32;
    }
}
inline int64_t record_inputs(int fmt) { return fmt == K4 || fmt == K6 ? QK_K : QK; }

struct QuantizedRows {  // x quantised per block of 32, as the kernels read it
    const int8_t* q;
    const float* d;    // [rows, nb] scales
    const float* s;    // [rows, nb] scale * sum of the block's codes
    const int32_t* n;  // [rows, nb] sum of the block's codes
    const float* h;    // [rows, nb, 2] scale * sum of each half's codes (K6's scales change at 16; else null)
    int64_t K, nb;
};

// x [M, K] -> int8 codes (round to nearest even of x / (max|x| / 127)) with the scales and sums above
// (the halves' only where hx is not null).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx, int32_t* nx, float* hx) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* p = x + r * K + b * QK;
            const simd::F a = simd::load(p), c = simd::load(p + 16);
            const float amax = simd::hmax(simd::max(simd::abs(a), simd::abs(c)));
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const simd::I qa = simd::to_int(a * simd::set1(id)), qc = simd::to_int(c * simd::set1(id));
            simd::store_i8(qx + r * K + b * QK, qa);
            simd::store_i8(qx + r * K + b * QK + 16, qc);
            const int32_t n = simd::isum(qa + qc);
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * static_cast<float>(n);
            nx[r * nb + b] = n;
            if (hx) {
                const int32_t na = simd::isum(qa);
                hx[2 * (r * nb + b)] = d * static_cast<float>(na);
                hx[2 * (r * nb + b) + 1] = d * static_cast<float>(n - na);
            }
        }
    }
}

// The locality hint of the weights' prefetches: none. A step reads each weight once, and the model is
// larger than the last-level cache, so kept weights only push out what is used again: the KV cache,
// the activations, and the interpreter's code and data between steps (whose misses after a step
// cost more than the Python work itself).
constexpr int kNoReuse = 0;

// How far ahead of the record being read a thread's weight stream is prefetched, in bytes (0: not at
// all, the hardware's prefetchers alone). Cores differ in how many lines they keep in flight and how
// their own prefetchers follow a stream, so the best distance is measured, per linear shape, by the
// tuner (kernels/tuner.py) on the machine that runs it; a shape it has not timed is prefetched one
// group's row ahead (the same block of the next 16 channels).
inline int64_t group_row_bytes(int fmt, int64_t K) { return K / record_inputs(fmt) * record_bytes(fmt); }

class PrefetchTable {
  public:
    // The distance for a linear of this format, output size N and input size K.
    int64_t ahead(int fmt, int64_t N, int64_t K) {
        std::lock_guard<std::mutex> hold(mu_);
        const auto it = by_shape_.find(std::make_tuple(fmt, N, K));
        return it == by_shape_.end() ? group_row_bytes(fmt, K) : it->second;
    }
    void replace(std::map<std::tuple<int, int64_t, int64_t>, int64_t> by_shape) {
        std::lock_guard<std::mutex> hold(mu_);
        by_shape_ = std::move(by_shape);
    }

  private:
    std::mutex mu_;
    std::map<std::tuple<int, int64_t, int64_t>, int64_t> by_shape_;
};
inline PrefetchTable& prefetch_table() {
    static PrefetchTable table;
    return table;
}

// 6-bit codes (Q6, K6): w[0..8)'s low nibbles joined by their top two bits, from the 128 bytes
// that follow the 4-bit body, byte (h, c, t) holding those of inputs 16 h + 4 s + t at bits 2 s.
inline void add_top2(simd::W* w, const uint8_t* planes) {
    for (int h = 0; h < 2; ++h) {
        const simd::W top = simd::wload(planes + 64 * h);
        w[4 * h] = simd::top_bits<0, 0x30>(w[4 * h], top);
        w[4 * h + 1] = simd::top_bits<2, 0x30>(w[4 * h + 1], top);
        w[4 * h + 2] = simd::top_bits<4, 0x30>(w[4 * h + 2], top);
        w[4 * h + 3] = simd::top_bits<6, 0x30>(w[4 * h + 3], top);
    }
}

// Y[r, channel groups g0..g1) for R rows of x.
template <int BITS, int R>
void tile(const uint8_t* P, int64_t nb, const QuantizedRows& x, float* Y, int64_t N, int64_t g0, int64_t g1, int64_t ahead) {
    const int64_t rec = record_bytes(BITS);
    for (int64_t g = g0; g < g1; ++g) {
        simd::F acc[R];
        for (int r = 0; r < R; ++r) acc[r] = simd::zero();
        const uint8_t* p = P + g * nb * rec;
#pragma GCC unroll 1
        for (int64_t b = 0; b < nb; ++b, p += rec) {
            // The record `ahead` bytes on, fetched while this one computes, as non-temporal (kNoReuse) data.
            if (ahead)
                for (int64_t line = 0; line < rec; line += 64) __builtin_prefetch(p + ahead + line, 0, kNoReuse);
            simd::W w[8];
            if constexpr (BITS == 4 || BITS == 5 || BITS == 6) {
                for (int i = 0; i < 4; ++i) {
                    const simd::W v = simd::wload(p + 64 * i);
                    w[2 * i] = simd::low_nibbles(v);
                    w[2 * i + 1] = simd::high_nibbles(v);
                }
                if constexpr (BITS == 5) {
                    const simd::W top = simd::wload(p + 256);
                    w[0] = simd::top_bits<0, 0x10>(w[0], top);
                    w[1] = simd::top_bits<1, 0x10>(w[1], top);
                    w[2] = simd::top_bits<2, 0x10>(w[2], top);
                    w[3] = simd::top_bits<3, 0x10>(w[3], top);
                    w[4] = simd::top_bits<4, 0x10>(w[4], top);
                    w[5] = simd::top_bits<5, 0x10>(w[5], top);
                    w[6] = simd::top_bits<6, 0x10>(w[6], top);
                    w[7] = simd::top_bits<7, 0x10>(w[7], top);
                }
                if constexpr (BITS == 6) add_top2(w, p + 256);
            } else {
                for (int j = 0; j < 8; ++j) w[j] = simd::wload(p + 64 * j);
            }
            const uint16_t* sc = reinterpret_cast<const uint16_t*>(p + rec - 64);
            const simd::F d = simd::load_half(sc), m = simd::load_half(sc + 16);
            // Unrolled, so that the accumulators live in registers.
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const int64_t at = r * nb + b;
                const int32_t* xi = reinterpret_cast<const int32_t*>(x.q + r * x.K + b * QK);
                const simd::F dot = simd::to_float(simd::dot_block<BITS>(w, xi, x.n[at]));
                acc[r] = simd::fma(dot, d * simd::set1(x.d[at]), acc[r]);
                acc[r] = simd::fma(m, simd::set1(x.s[at]), acc[r]);
            }
        }
        const int64_t n0 = g * 16;
        for (int r = 0; r < R; ++r) simd::store_n(Y + r * N + n0, acc[r], N - n0);
    }
}

// The same for K4 and K6 records (SIX), nsb super-blocks a row.
template <bool SIX, int R>
void tile_k(const uint8_t* P, int64_t nsb, const QuantizedRows& x, float* Y, int64_t N, int64_t g0, int64_t g1, int64_t ahead) {
    const int64_t rec = record_bytes(SIX ? K6 : K4), body = SIX ? 384 : 256;
    for (int64_t g = g0; g < g1; ++g) {
        simd::F acc[R];
        for (int r = 0; r < R; ++r) acc[r] = simd::zero();
        const uint8_t* ps = P + g * nsb * rec;
#pragma GCC unroll 1
        for (int64_t s = 0; s < nsb; ++s, ps += rec) {
            const uint8_t* tail = ps + 8 * body;
            const simd::F D = simd::load_half(reinterpret_cast<const uint16_t*>(tail + 256));
            const simd::F Dmin = SIX ? simd::zero() : simd::load_half(reinterpret_cast<const uint16_t*>(tail + 288));
#pragma GCC unroll 1
            for (int b = 0; b < 8; ++b) {
                // An eighth of the record `ahead` bytes on, fetched while this one computes.
                if (ahead)
                    for (int64_t line = b * rec / 8; line < (b + 1) * rec / 8; line += 64)
                        __builtin_prefetch(ps + ahead + line, 0, kNoReuse);
                const uint8_t* p = ps + b * body;
                simd::W w[8];
                for (int i = 0; i < 4; ++i) {
                    const simd::W v = simd::wload(p + 64 * i);
                    w[2 * i] = simd::low_nibbles(v);
                    w[2 * i + 1] = simd::high_nibbles(v);
                }
                const int64_t blk = s * 8 + b;
                if constexpr (SIX) {
                    add_top2(w, p + 256);
                    const int8_t* sc = reinterpret_cast<const int8_t*>(tail + 32 * b);
                    const simd::I s0 = simd::scales16(sc), s1 = simd::scales16(sc + 16);
                    // The codes' offset of 32, per half: -32 D sc times the half's sum of x.
                    const simd::F o0 = D * simd::load_i8(sc) * simd::set1(-32.0f);
                    const simd::F o1 = D * simd::load_i8(sc + 16) * simd::set1(-32.0f);
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) {
                        const int64_t at = r * x.nb + blk;
                        const int32_t* xi = reinterpret_cast<const int32_t*>(x.q + r * x.K + blk * QK);
                        const simd::F dot = simd::to_float(simd::dot_block6(w, xi, s0, s1));
                        acc[r] = simd::fma(dot, D * simd::set1(x.d[at]), acc[r]);
                        acc[r] = simd::fma(o0, simd::set1(x.h[2 * at]), acc[r]);
                        acc[r] = simd::fma(o1, simd::set1(x.h[2 * at + 1]), acc[r]);
                    }
                } else {
                    const simd::F d = D * simd::load_i8(reinterpret_cast<const int8_t*>(tail + 16 * b));
                    const simd::F m = Dmin * simd::load_i8(reinterpret_cast<const int8_t*>(tail + 128 + 16 * b));
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) {
                        const int64_t at = r * x.nb + blk;
                        const int32_t* xi = reinterpret_cast<const int32_t*>(x.q + r * x.K + blk * QK);
                        const simd::F dot = simd::to_float(simd::dot_block<4>(w, xi, x.n[at]));
                        acc[r] = simd::fma(dot, d * simd::set1(x.d[at]), acc[r]);
                        acc[r] = simd::fnma(m, simd::set1(x.s[at]), acc[r]);
                    }
                }
            }
        }
        const int64_t n0 = g * 16;
        for (int r = 0; r < R; ++r) simd::store_n(Y + r * N + n0, acc[r], N - n0);
    }
}

// fn(std::integral_constant<int, R>) for R = rows (1..TILE): the tiles' row count as a template argument,
// so that their accumulators are registers.
template <class Fn>
void with_rows(int rows, const Fn& fn) {
    switch (rows) {
        case 1: return fn(std::integral_constant<int, 1>{});
        case 2: return fn(std::integral_constant<int, 2>{});
        case 3: return fn(std::integral_constant<int, 3>{});
        case 4: return fn(std::integral_constant<int, 4>{});
        case 5: return fn(std::integral_constant<int, 5>{});
        case 6: return fn(std::integral_constant<int, 6>{});
        case 7: return fn(std::integral_constant<int, 7>{});
        default: return fn(std::integral_constant<int, TILE>{});
    }
}

// Y [M, N] = x [M, K] @ W.T for W packed as [ceil(N/16), K / record_inputs(fmt), record_bytes(fmt)], the weights
// prefetched `ahead` bytes on (the prefetch table's distance for this shape where it is negative).
inline void block_linear(const float* x, int64_t M, int64_t K, const uint8_t* P, int fmt, int64_t N, float* Y,
                         int64_t ahead = -1) {
    if (ahead < 0) ahead = prefetch_table().ahead(fmt, N, K);
    const int64_t nb = K / QK, G = (N + 15) / 16, nrec = K / record_inputs(fmt);
    // Scratch for x's codes, reused across calls (the engine steps from one thread).
    thread_local std::vector<int8_t> qbuf;
    thread_local std::vector<float> dbuf, sbuf, hbuf;
    thread_local std::vector<int32_t> nbuf;
    if (static_cast<int64_t>(qbuf.size()) < M * K) qbuf.resize(M * K);
    if (static_cast<int64_t>(dbuf.size()) < M * nb) dbuf.resize(M * nb), sbuf.resize(M * nb), nbuf.resize(M * nb), hbuf.resize(2 * M * nb);
    quantize_rows(x, M, K, qbuf.data(), dbuf.data(), sbuf.data(), nbuf.data(), fmt == K6 ? hbuf.data() : nullptr);
    // Taken here: inside the loop the names would be other threads' own (empty) buffers.
    const int8_t* Q = qbuf.data();
    const float *D = dbuf.data(), *S = sbuf.data(), *H = hbuf.data();
    const int32_t* Nx = nbuf.data();
    WAFER_PARALLEL_FOR(int64_t{0}, G, int64_t{4}, [&](int64_t g0, int64_t g1) {
        // Every tile of rows over this thread's groups, group by group, so that a group's records
        // come from memory once and from cache for the other tiles.
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t r0 = 0; r0 < M; r0 += TILE) {
                const QuantizedRows xr{Q + r0 * K, D + r0 * nb, S + r0 * nb, Nx + r0 * nb, fmt == K6 ? H + 2 * r0 * nb : nullptr, K, nb};
                const int rows = static_cast<int>(std::min<int64_t>(TILE, M - r0));
                float* y = Y + r0 * N;
                with_rows(rows, [&](auto R) {
                    switch (fmt) {
                        case Q4: return tile<4, R>(P, nrec, xr, y, N, g, g + 1, ahead);
                        case Q5: return tile<5, R>(P, nrec, xr, y, N, g, g + 1, ahead);
                        case Q6: return tile<6, R>(P, nrec, xr, y, N, g, g + 1, ahead);
                        case Q8: return tile<8, R>(P, nrec, xr, y, N, g, g + 1, ahead);
                        case K4: return tile_k<false, R>(P, nrec, xr, y, N, g, g + 1, ahead);
                        default: return tile_k<true, R>(P, nrec, xr, y, N, g, g + 1, ahead);
                    }
                });
            }
    });
}

struct Top {
    int64_t at;  // -1: the range is empty
    float value;
    bool nan;
};

// The first largest value of x[c0, c1) and its index, or the first NaN there (as torch.max treats one).
inline Top argmax_range(const float* x, int64_t c0, int64_t c1) {
    if (c1 <= c0) return {-1, -INFINITY, false};
    const float neg_inf = -INFINITY;
    simd::F best = simd::set1(neg_inf);
    simd::I best_at = simd::iset1(static_cast<int32_t>(c0));
    for (int64_t i = c0; i < c1; i += 16) {
        const simd::F v = simd::load_n(x + i, c1 - i, neg_inf);
        if (simd::any(simd::is_nan(v)))
            for (int64_t j = i; j < std::min(c1, i + 16); ++j)
                if (std::isnan(x[j])) return {j, NAN, true};
        // Strictly greater: each lane keeps its first maximum.
        const simd::Mask gt = simd::gt(v, best);
        best = simd::select(gt, v, best);
        best_at = simd::select(gt, simd::iota(static_cast<int32_t>(i)), best_at);
    }
    float vals[16];
    int32_t idx[16];
    simd::store(vals, best);
    simd::istore(idx, best_at);
    Top top{idx[0], vals[0], false};
    for (int l = 1; l < 16; ++l)
        if (vals[l] > top.value || (vals[l] == top.value && idx[l] < top.at)) top = {idx[l], vals[l], false};
    return top;
}

// The greedy token of each row of logits [M, V] (row stride `stride`). The columns are split among
// the threads exactly as block_linear split the vocabulary when it computed them (the same range of
// 16-column groups, the same grain), so each thread reads the part its own cache holds.
inline void argmax_rows(const float* X, int64_t M, int64_t V, int64_t stride, int64_t* out) {
    const int64_t G = (V + 15) / 16;
    const int T = WAFER_NUM_THREADS();
    std::vector<Top> parts(static_cast<size_t>(T) * M, Top{-1, -INFINITY, false});
    WAFER_PARALLEL_FOR(int64_t{0}, G, int64_t{4}, [&](int64_t g0, int64_t g1) {
        Top* mine = parts.data() + static_cast<int64_t>(WAFER_THREAD_NUM()) * M;
        for (int64_t r = 0; r < M; ++r) mine[r] = argmax_range(X + r * stride, 16 * g0, std::min(V, 16 * g1));
    });
    for (int64_t r = 0; r < M; ++r) {
        // Threads hold consecutive column ranges in thread order: the first NaN, else the first maximum.
        Top best{-1, -INFINITY, false};
        for (int t = 0; t < T; ++t) {
            const Top& p = parts[static_cast<size_t>(t) * M + r];
            if (p.at < 0) continue;
            if (p.nan) { best = p; break; }
            if (best.at < 0 || p.value > best.value) best = p;
        }
        out[r] = best.at;
    }
}

}  // namespace wafer
