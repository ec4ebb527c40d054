// The candidates a sampled row is drawn from (sampler.py): each row's k most probable tokens at its
// temperature, best first, with their probabilities under the whole row's softmax, as torch's
// softmax then topk give them. Two passes that read the row and write nothing of its size: torch's
// way (divide, clean, softmax, top-k, each a pass through memory with a new row-sized result) took
// about 10 ms of a decode step for 16 rows of Qwen's 151,936 logits.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "simd.h"

#ifndef WAFER_PARALLEL_FOR
#define WAFER_PARALLEL_FOR(begin, end, grain, ...) (__VA_ARGS__)((begin), (end))
#endif

namespace wafer {

// x / t for the 16 values from x (those past n: -inf), NaN taken as -inf and +inf as the largest
// float: an infinite logit wins outright, as it would greedily, and a masked one stays masked.
inline simd::F tempered(const float* x, int64_t n, float t) {
    const simd::F y = simd::load_n(x, n, -INFINITY) / simd::set1(t);
    return simd::min(simd::select(simd::is_nan(y), simd::set1(-INFINITY), y), simd::set1(FLT_MAX));
}

// One row x[0..V) at temperature t: probs[0..k) and idx[0..k), k <= V, the k largest values best
// first (equal values: the lower index first). A row with no finite value has NaN probabilities,
// as torch's softmax gives it.
inline void top_candidates_row(const float* x, int64_t V, float t, int64_t k, float* probs, int64_t* idx) {
    simd::F mx = simd::set1(-INFINITY);
    for (int64_t j = 0; j < V; j += 16) mx = simd::max(mx, tempered(x + j, V - j, t));
    const float m = simd::hmax(mx);
    if (!(m > -INFINITY)) {
        for (int64_t i = 0; i < k; ++i) probs[i] = NAN, idx[i] = i;
        return;
    }
    using Entry = std::pair<float, int64_t>;
    auto better = [](const Entry& a, const Entry& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
    // A heap whose front is the worst of the best k so far. Past the first few thousand values few
    // beat it, so 16 lanes are tested against it at once and looked at one by one only when one does.
    std::vector<Entry> heap;
    heap.reserve(static_cast<size_t>(k));
    float worst = -INFINITY;
    simd::F total = simd::zero();
    const simd::F shift = simd::set1(m);
    alignas(64) float ys[16];
    for (int64_t j = 0; j < V; j += 16) {
        const simd::F y = tempered(x + j, V - j, t);
        total = total + simd::keep_n(simd::exp(y - shift), V - j);
        if (static_cast<int64_t>(heap.size()) == k && !simd::any(simd::gt(y, simd::set1(worst)))) continue;
        simd::store(ys, y);
        for (int64_t l = 0; l < std::min<int64_t>(16, V - j); ++l) {
            const Entry e{ys[l], j + l};
            if (static_cast<int64_t>(heap.size()) < k) {
                heap.push_back(e);
                std::push_heap(heap.begin(), heap.end(), better);
            } else if (better(e, heap.front())) {
                std::pop_heap(heap.begin(), heap.end(), better);
                heap.back() = e;
                std::push_heap(heap.begin(), heap.end(), better);
            } else {
                continue;
            }
            if (static_cast<int64_t>(heap.size()) == k) worst = heap.front().first;
        }
    }
    std::sort_heap(heap.begin(), heap.end(), better);  // best first
    const float inv = 1.0f / simd::sum(total);
    for (int64_t i = 0; i < k; ++i) {
        probs[i] = std::exp(heap[i].first - m) * inv;  // exactly 0 for a masked token
        idx[i] = heap[i].second;
    }
}

// Rows r of X [M, V] (rows `stride` apart) at temperatures t[r]: probs and idx [M, k].
inline void top_candidates(const float* X, int64_t M, int64_t V, int64_t stride, const float* t, int64_t k,
                           float* probs, int64_t* idx) {
    WAFER_PARALLEL_FOR(int64_t{0}, M, int64_t{1}, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) top_candidates_row(X + r * stride, V, t[r], k, probs + r * k, idx + r * k);
    });
}

}  // namespace wafer
