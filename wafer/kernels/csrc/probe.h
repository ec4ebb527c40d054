// Two figures of the machine that the kernels' speed is read against, measured by the same code that
// runs on it (kernels/tuner.py keeps them; `wafer info` and bench/kernel_roofline.py print them):
// - read_pass: one read of a buffer larger than the caches, each thread its own contiguous part, as a
//   decode step's threads read the weights, prefetching `ahead` bytes on as the kernels may: bytes over
//   its time, at its best distance, is the read bandwidth they can have.
// - int8_peak: the variant's int8 dot product (simd::dot_block) on weights in registers and inputs in
//   L1, several independent chains at once: the multiply-adds a second that the block kernels' inner
//   loop could reach were memory free.
#pragma once

#include <chrono>
#include <cstdint>

#include "blockquant.h"

namespace wafer {

inline double seconds_now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Seconds of one read of `bytes` bytes at p (64-byte aligned, a multiple of 256 bytes), split evenly
// among the threads, each prefetching `ahead` bytes on (0: none); *sink receives a value that depends on
// every byte, so that no read is elided.
inline double read_pass(const float* p, int64_t bytes, int64_t ahead, float* sink) {
    const int64_t floats = bytes / 4, T = WAFER_NUM_THREADS();
    const int64_t part = (floats / T) / 64 * 64;
    std::vector<float> sums(static_cast<size_t>(T), 0.0f);
    const double t0 = seconds_now();
    WAFER_PARALLEL_FOR(int64_t{0}, T, int64_t{1}, [&](int64_t t0_, int64_t t1_) {
        for (int64_t t = t0_; t < t1_; ++t) {
            const float* q = p + t * part;
            simd::F a = simd::zero(), b = a, c = a, d = a;
            const char* fetch = reinterpret_cast<const char*>(q) + ahead;
            for (int64_t i = 0; i < part; i += 64) {
                if (ahead)
                    for (int64_t line = 0; line < 256; line += 64) __builtin_prefetch(fetch + 4 * i + line, 0, kNoReuse);
                a = a + simd::load(q + i);
                b = b + simd::load(q + i + 16);
                c = c + simd::load(q + i + 32);
                d = d + simd::load(q + i + 48);
            }
            sums[static_cast<size_t>(t)] = simd::sum((a + b) + (c + d));
        }
    });
    const double took = seconds_now() - t0;
    float total = 0.0f;
    for (float s : sums) total += s;
    *sink = total;
    return took;
}

// int8 multiply-adds a second (two operations each) of `iterations` rounds of eight independent
// dot_block<8> calls on every thread.
inline double int8_peak(int64_t iterations) {
    const int64_t T = WAFER_NUM_THREADS();
    std::vector<int32_t> sink(static_cast<size_t>(T) * 16, 0);
    const double t0 = seconds_now();
    WAFER_PARALLEL_FOR(int64_t{0}, T, int64_t{1}, [&](int64_t t0_, int64_t t1_) {
        for (int64_t t = t0_; t < t1_; ++t) {
            alignas(64) uint8_t wbytes[8 * 64];
            alignas(64) int32_t xs[8 * 8];
            for (int i = 0; i < 8 * 64; ++i) wbytes[i] = static_cast<uint8_t>((i * 37 + t) & 0x7F);
            for (int i = 0; i < 64; ++i) xs[i] = 0x01010101 * ((i + static_cast<int>(t)) & 3);
            simd::W w[8];
            for (int j = 0; j < 8; ++j) w[j] = simd::wload(wbytes + 64 * j);
            simd::I acc[8];
            for (int c = 0; c < 8; ++c) acc[c] = simd::iset1(0);
            for (int64_t it = 0; it < iterations; ++it) {
                // The inputs are read again each round (as the kernels read x), so no round's products
                // can be computed once and reused.
                asm volatile("" ::: "memory");
                for (int c = 0; c < 8; ++c) acc[c] = acc[c] + simd::dot_block<8>(w, xs + 8 * c, 0);
            }
            simd::I all = acc[0];
            for (int c = 1; c < 8; ++c) all = all + acc[c];
            simd::istore(sink.data() + 16 * t, all);
        }
    });
    const double took = seconds_now() - t0;
    // A dot_block is 16 channels times 32 inputs.
    return static_cast<double>(T) * static_cast<double>(iterations) * 8.0 * 16.0 * 32.0 * 2.0 / took;
}

}  // namespace wafer
