// A standalone self-test of the kernels for the variant it is compiled for (no torch, no Python):
// block_linear (4-, 5- and 8-bit records, K4 and K6), argmax_rows, simd::exp, softmax_exp, rms_norm and a small
// decode_step, each against a plain scalar reference in this file, on deterministic pseudo-random
// data. It is how the variants this machine cannot load into PyTorch are verified (the NEON ones
// under qemu-aarch64: tests/models/test_kernels_selftest.py builds and runs it per variant):
//   g++ -std=c++17 -O2 [the variant's flags] selftest.cpp -o selftest && ./selftest
// One line per check; exit status 0 only if every check passes.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

// blockquant.h's own serial fallback for WAFER_PARALLEL_FOR does not compile (a macro of four
// arguments, given a lambda whose commas split it further), and a serial run would leave the
// threads' merge in argmax_rows untested: this runs at::parallel_for's split into chunks for
// kThreads workers, one chunk after the other, with WAFER_THREAD_NUM() the chunk's worker.
namespace selftest {
constexpr int kThreads = 3;
inline int thread_num = 0;
template <class Fn>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
    if (begin >= end) return;
    if (end - begin < grain) {
        thread_num = 0;
        fn(begin, end);
        return;
    }
    const int64_t tasks = std::min<int64_t>(kThreads, (end - begin + grain - 1) / grain);
    const int64_t chunk = (end - begin + tasks - 1) / tasks;
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t b = begin + t * chunk;
        if (b >= end) break;
        thread_num = static_cast<int>(t);
        fn(b, std::min(end, b + chunk));
    }
    thread_num = 0;
}
}  // namespace selftest
#define WAFER_PARALLEL_FOR(begin, end, grain, ...) selftest::parallel_for((begin), (end), (grain), __VA_ARGS__)
#define WAFER_NUM_THREADS() selftest::kThreads
#define WAFER_THREAD_NUM() selftest::thread_num

#include "decode.h"
#include "sampling.h"

namespace {

int checks = 0, failures = 0;

bool check(bool ok, const char* fmt, ...) {
    ++checks;
    if (!ok) ++failures;
    std::printf("%s ", ok ? "ok  " : "FAIL");
    va_list args;
    va_start(args, fmt);
    std::vprintf(fmt, args);
    va_end(args);
    std::printf("\n");
    std::fflush(stdout);
    return ok;
}

struct Rng {  // splitmix64: the same numbers on every machine and compiler
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed) {}
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
    double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
    double range(double a, double b) { return a + (b - a) * uniform(); }
    double normal() {  // Box-Muller
        const double u = 1.0 - uniform(), v = uniform();
        return std::sqrt(-2.0 * std::log(u)) * std::cos(2.0 * M_PI * v);
    }
};

// ---- float16, independently of simd.h ---------------------------------------------------------------

double half_value(uint16_t h) {
    const int e = (h >> 10) & 0x1F, man = h & 0x3FF;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0x1F) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
    if (e == 0) return sign * std::ldexp(man, -24);
    return sign * std::ldexp(1024 + man, e - 25);
}

// The bits of a value that float16 holds exactly (aborts otherwise: a bug of this program).
uint16_t half_bits(double v) {
    const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
    const double a = std::fabs(v);
    uint16_t bits;
    if (a == 0.0) {
        bits = sign;
    } else if (a < 0x1.0p-14) {
        bits = static_cast<uint16_t>(sign | static_cast<uint16_t>(a * 0x1.0p24));
    } else {
        int e;
        const double f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
        bits = static_cast<uint16_t>(sign | (e - 1 + 15) << 10 | static_cast<int>((2.0 * f - 1.0) * 1024.0));
    }
    if (half_value(bits) != v) {
        std::printf("internal error: %.17g is not a float16\n", v);
        std::exit(2);
    }
    return bits;
}

// A random float16 of exponent in [emin, emax] (unbiased; below -14: subnormal).
uint16_t random_half(Rng& rng, int emin, int emax, bool negative) {
    const int e = emin + rng.below(emax - emin + 1);
    const uint16_t man = static_cast<uint16_t>(rng.below(1024));
    const uint16_t sign = negative ? 0x8000 : 0;
    if (e < -14) return static_cast<uint16_t>(sign | std::max<uint16_t>(1, man));
    return static_cast<uint16_t>(sign | (e + 15) << 10 | man);
}

// ---- block-quantised weights and the scalar reference of block_linear --------------------------------

struct Weights {
    int bits;
    int64_t N, K;
    std::vector<uint8_t> codes;   // [N, K], 0..15, 0..31, 0..63 or 0..255
    std::vector<uint16_t> d, m;   // [N, K/32] float16 bits
    std::vector<uint8_t> packed;  // blockquant.h's records
};

// The layout of blockquant.py's pack_blocks, written out independently.
void pack(Weights& w) {
    const int64_t nb = w.K / 32, G = (w.N + 15) / 16, rec = wafer::record_bytes(w.bits), body = rec - 64;
    w.packed.assign(static_cast<size_t>(G * nb * rec), 0);
    auto code = [&](int64_t n, int64_t k) -> unsigned { return n < w.N ? w.codes[n * w.K + k] : 0; };
    for (int64_t g = 0; g < G; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* r = w.packed.data() + (g * nb + b) * rec;
            for (int c = 0; c < 16; ++c) {
                const int64_t n = 16 * g + c;
                if (w.bits == 8) {
                    for (int j = 0; j < 8; ++j)
                        for (int t = 0; t < 4; ++t) r[(j * 16 + c) * 4 + t] = static_cast<uint8_t>(code(n, 32 * b + 4 * j + t));
                } else {
                    for (int i = 0; i < 4; ++i)
                        for (int t = 0; t < 4; ++t)
                            r[(i * 16 + c) * 4 + t] =
                                static_cast<uint8_t>((code(n, 32 * b + 8 * i + t) & 15) | (code(n, 32 * b + 8 * i + 4 + t) & 15) << 4);
                    if (w.bits == 5)
                        for (int t = 0; t < 4; ++t) {
                            unsigned byte = 0;
                            for (int j = 0; j < 8; ++j) byte |= (code(n, 32 * b + 4 * j + t) >> 4) << j;
                            r[256 + c * 4 + t] = static_cast<uint8_t>(byte);
                        }
                    if (w.bits == 6)  // byte (h, c, t): the top two bits of input 16 h + 4 s + t at bits 2 s
                        for (int h = 0; h < 2; ++h)
                            for (int t = 0; t < 4; ++t) {
                                unsigned byte = 0;
                                for (int q = 0; q < 4; ++q) byte |= (code(n, 32 * b + 16 * h + 4 * q + t) >> 4) << (2 * q);
                                r[256 + h * 64 + c * 4 + t] = static_cast<uint8_t>(byte);
                            }
                }
                const uint16_t d = n < w.N ? w.d[n * nb + b] : 0, m = n < w.N ? w.m[n * nb + b] : 0;
                std::memcpy(r + body + 2 * c, &d, 2);
                std::memcpy(r + body + 32 + 2 * c, &m, 2);
            }
        }
}

// Activations quantised per block of 32 as quantize_rows does: d = amax / 127, codes round half to
// even of x (127 / amax), in float.
struct QuantizedX {
    std::vector<int> q;     // [M, K]
    std::vector<float> d;   // [M, nb]
    std::vector<int> sum;   // [M, nb]
    double closest = 0.5;   // the least distance of x (127 / amax) to a rounding tie (n + 1/2), in code steps
};

QuantizedX quantize_ref(const float* x, int64_t M, int64_t K) {
    const int64_t nb = K / 32;
    QuantizedX out{std::vector<int>(M * K), std::vector<float>(M * nb), std::vector<int>(M * nb)};
    for (int64_t r = 0; r < M; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float* p = x + r * K + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(p[i]));
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int s = 0;
            for (int i = 0; i < 32; ++i) {
                const float t = p[i] * id;
                const int q = std::min(127, std::max(-128, static_cast<int>(std::nearbyint(t))));
                const double f = std::fabs(t) - std::floor(std::fabs(t));
                out.closest = std::min(out.closest, std::fabs(f - 0.5));
                out.q[r * K + b * 32 + i] = q;
                s += q;
            }
            out.d[r * nb + b] = amax / 127.0f;
            out.sum[r * nb + b] = s;
        }
    return out;
}

// y [M, N] = sum over blocks of d_w dx sum(code xcode) + m dx sum(xcode), in double.
std::vector<double> linear_ref(const float* x, int64_t M, const Weights& w, double* closest = nullptr) {
    const int64_t K = w.K, nb = K / 32;
    const QuantizedX qx = quantize_ref(x, M, K);
    if (closest) *closest = std::min(*closest, qx.closest);
    std::vector<double> y(M * w.N);
    for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < w.N; ++n) {
            double s = 0.0;
            for (int64_t b = 0; b < nb; ++b) {
                int64_t dot = 0;
                for (int i = 0; i < 32; ++i) dot += static_cast<int64_t>(w.codes[n * K + b * 32 + i]) * qx.q[r * K + b * 32 + i];
                const double dx = qx.d[r * nb + b];
                s += half_value(w.d[n * nb + b]) * dx * static_cast<double>(dot) +
                     half_value(w.m[n * nb + b]) * dx * qx.sum[r * nb + b];
            }
            y[r * w.N + n] = s;
        }
    return y;
}

// Codes [N, K] in 0..top: channels 0, 1, 2 the extremes (all lowest, all highest, alternating),
// channel 3 every code value in order, the rest random.
std::vector<uint8_t> random_codes(Rng& rng, int64_t N, int64_t K, int top) {
    std::vector<uint8_t> codes(N * K);
    for (auto& c : codes) c = static_cast<uint8_t>(rng.below(top + 1));
    for (int64_t k = 0; k < K; ++k) {
        if (N > 0) codes[k] = 0;
        if (N > 1) codes[K + k] = static_cast<uint8_t>(top);
        if (N > 2) codes[2 * K + k] = static_cast<uint8_t>(k % 2 ? top : 0);
    }
    for (int v = 0; v <= top && 3 * K + v < N * K; ++v) codes[3 * K + v] = static_cast<uint8_t>(v);
    return codes;
}

// random_codes with scales d (exponents [de0, de1]) and, below 8 bits, minimums (exponents
// [me0, me1], either sign); 8-bit minimums are -128 d.
Weights make_weights(Rng& rng, int bits, int64_t N, int64_t K, int de0, int de1, int me0, int me1) {
    const int64_t nb = K / 32;
    const int top = (1 << bits) - 1;
    Weights w{bits, N, K, random_codes(rng, N, K, top), std::vector<uint16_t>(N * nb), std::vector<uint16_t>(N * nb), {}};
    for (int64_t i = 0; i < N * nb; ++i) {
        w.d[i] = random_half(rng, de0, de1, false);
        w.m[i] = bits == 8 ? half_bits(-128.0 * half_value(w.d[i])) : random_half(rng, me0, me1, rng.below(4) != 0);
    }
    pack(w);
    return w;
}

// Largest |got - want| over a row, relative to the row's largest |want| (a zero row: absolute).
double row_error(const float* got, const double* want, int64_t rows, int64_t cols) {
    double worst = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
        double scale = 0.0, err = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
            scale = std::max(scale, std::fabs(want[r * cols + c]));
            const double e = std::fabs(static_cast<double>(got[r * cols + c]) - want[r * cols + c]);
            err = std::isnan(e) ? INFINITY : std::max(err, e);
        }
        worst = std::max(worst, scale > 0.0 ? err / scale : err * 1e30);
    }
    return worst;
}

bool untouched(const std::vector<float>& buf, size_t from) {
    for (size_t i = from; i < buf.size(); ++i)
        if (buf[i] != 12345.0f) return false;
    return true;
}

// Activation rows of several kinds: random of varied scale, all +A, all -A, +-A, blocks whose
// largest is exactly 127 with the others on n + 1/2 (ties to even), and all-zero blocks beside
// small ones.
std::vector<float> make_activations(Rng& rng, int64_t M, int64_t K) {
    std::vector<float> x(M * K);
    for (int64_t r = 0; r < M; ++r) {
        float* p = x.data() + r * K;
        const int kind = static_cast<int>((r + M) % 6);
        const float A = static_cast<float>(rng.range(0.1, 10.0));
        const double scale = std::pow(10.0, rng.range(-2.0, 2.0));
        for (int64_t k = 0; k < K; ++k) {
            switch (kind) {
                case 0: p[k] = static_cast<float>(scale * rng.normal()); break;
                case 1: p[k] = A; break;
                case 2: p[k] = -A; break;
                case 3: p[k] = rng.below(2) ? A : -A; break;
                case 4: p[k] = k % 32 == 7 ? (rng.below(2) ? 127.0f : -127.0f) : static_cast<float>(rng.below(253) - 126) + 0.5f; break;
                default: p[k] = (k / 32) % 3 == 0 ? 0.0f : static_cast<float>(1e-3 * rng.normal()); break;
            }
        }
    }
    return x;
}

void test_block_linear() {
    Rng rng(1);
    struct Shape { int64_t N, K; };
    for (int bits : {4, 5, 6, 8})
        for (Shape s : {Shape{37, 64}, Shape{37, 576}, Shape{16, 64}}) {
            const Weights w = bits < 8 ? make_weights(rng, bits, s.N, s.K, -8, -4, -6, -2) : make_weights(rng, 8, s.N, s.K, -12, -6, 0, 0);
            for (int64_t M : {1, 3, 8, 11}) {
                const std::vector<float> x = make_activations(rng, M, s.K);
                std::vector<float> y(M * s.N + 32, 12345.0f);
                wafer::block_linear(x.data(), M, s.K, w.packed.data(), bits, s.N, y.data());
                const double err = row_error(y.data(), linear_ref(x.data(), M, w).data(), M, s.N);
                const bool ok = err <= 1e-5 && untouched(y, M * s.N);
                check(ok, "block_linear %d-bit M=%lld N=%lld K=%lld: max error %.2e of the row's largest (tol 1e-5)%s", bits,
                      static_cast<long long>(M), static_cast<long long>(s.N), static_cast<long long>(s.K), err,
                      untouched(y, M * s.N) ? "" : ", wrote past the output");
            }
        }
    // Subnormal float16 scales (and minimums): only a conversion that handles them gets these right.
    for (int bits : {4, 5, 6, 8}) {
        const int64_t M = 3, N = 20, K = 64;
        const Weights w = make_weights(rng, bits, N, K, -24, -15, -24, -15);
        const std::vector<float> x = make_activations(rng, M, K);
        std::vector<float> y(M * N, 0.0f);
        wafer::block_linear(x.data(), M, K, w.packed.data(), bits, N, y.data());
        const double err = row_error(y.data(), linear_ref(x.data(), M, w).data(), M, N);
        check(err <= 1e-5, "block_linear %d-bit, subnormal float16 scales, M=%lld N=%lld K=%lld: max error %.2e (tol 1e-5)", bits,
              static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), err);
    }
}

// ---- K4 and K6 records (llama.cpp's Q4_K and Q6_K, exactly) ------------------------------------------

struct KWeights {
    bool six;
    int64_t N, K;
    std::vector<uint8_t> codes;  // [N, K], 0..15 (K4) or 0..63 (K6)
    std::vector<int> sc;         // K4: [N, K/32] 0..63; K6: [N, K/16] -128..127
    std::vector<int> mn;         // K4: [N, K/32] 0..63
    std::vector<uint16_t> D, Dmin;  // [N, K/256] float16 bits
    std::vector<uint8_t> packed;
};

// The layouts blockquant.h describes, written out independently.
void pack_k(KWeights& w) {
    const int64_t nsb = w.K / 256, G = (w.N + 15) / 16, fmt = w.six ? wafer::K6 : wafer::K4;
    const int64_t rec = wafer::record_bytes(static_cast<int>(fmt)), body = w.six ? 384 : 256;
    w.packed.assign(static_cast<size_t>(G * nsb * rec), 0);
    auto code = [&](int64_t n, int64_t k) -> unsigned { return n < w.N ? w.codes[n * w.K + k] : 0; };
    for (int64_t g = 0; g < G; ++g)
        for (int64_t s = 0; s < nsb; ++s) {
            uint8_t* r = w.packed.data() + (g * nsb + s) * rec;
            uint8_t* tail = r + 8 * body;
            for (int c = 0; c < 16; ++c) {
                const int64_t n = 16 * g + c;
                for (int b = 0; b < 8; ++b) {
                    const int64_t k0 = 256 * s + 32 * b;
                    for (int i = 0; i < 4; ++i)
                        for (int t = 0; t < 4; ++t)
                            r[b * body + (i * 16 + c) * 4 + t] =
                                static_cast<uint8_t>((code(n, k0 + 8 * i + t) & 15) | (code(n, k0 + 8 * i + 4 + t) & 15) << 4);
                    if (w.six)
                        for (int h = 0; h < 2; ++h)
                            for (int t = 0; t < 4; ++t) {
                                unsigned byte = 0;
                                for (int q = 0; q < 4; ++q) byte |= (code(n, k0 + 16 * h + 4 * q + t) >> 4) << (2 * q);
                                r[b * body + 256 + (h * 16 + c) * 4 + t] = static_cast<uint8_t>(byte);
                            }
                    if (n >= w.N) continue;
                    if (w.six) {
                        tail[32 * b + c] = static_cast<uint8_t>(static_cast<int8_t>(w.sc[n * (w.K / 16) + 16 * s + 2 * b]));
                        tail[32 * b + 16 + c] = static_cast<uint8_t>(static_cast<int8_t>(w.sc[n * (w.K / 16) + 16 * s + 2 * b + 1]));
                    } else {
                        tail[16 * b + c] = static_cast<uint8_t>(w.sc[n * (w.K / 32) + 8 * s + b]);
                        tail[128 + 16 * b + c] = static_cast<uint8_t>(w.mn[n * (w.K / 32) + 8 * s + b]);
                    }
                }
                const uint16_t d = n < w.N ? w.D[n * nsb + s] : 0, dm = n < w.N && !w.six ? w.Dmin[n * nsb + s] : 0;
                std::memcpy(tail + 256 + 2 * c, &d, 2);
                if (!w.six) std::memcpy(tail + 288 + 2 * c, &dm, 2);
            }
        }
}

double k_value(const KWeights& w, int64_t n, int64_t k) {
    const double D = half_value(w.D[n * (w.K / 256) + k / 256]);
    const double q = w.codes[n * w.K + k];
    if (w.six) return D * w.sc[n * (w.K / 16) + k / 16] * (q - 32.0);
    return D * w.sc[n * (w.K / 32) + k / 32] * q - half_value(w.Dmin[n * (w.K / 256) + k / 256]) * w.mn[n * (w.K / 32) + k / 32];
}

// random_codes; channels 0, 1, 2 with the extreme scales, the rest random, with factors of
// exponents [e0, e1].
KWeights make_k_weights(Rng& rng, bool six, int64_t N, int64_t K, int e0, int e1) {
    const int top = six ? 63 : 15;
    KWeights w{six, N, K, random_codes(rng, N, K, top), std::vector<int>(N * K / (six ? 16 : 32)),
               std::vector<int>(six ? 0 : N * K / 32), std::vector<uint16_t>(N * K / 256), std::vector<uint16_t>(N * K / 256), {}};
    const int64_t per = static_cast<int64_t>(w.sc.size()) / N;
    for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < per; ++i) {
            int v = six ? rng.below(256) - 128 : rng.below(64);
            if (n < 3) v = six ? (i % 2 ? 127 : -128) : 63;
            w.sc[n * per + i] = v;
            if (!six) w.mn[n * per + i] = n < 3 ? 63 : rng.below(64);
        }
    for (auto& d : w.D) d = random_half(rng, e0, e1, six && rng.below(4) == 0);
    for (auto& d : w.Dmin) d = random_half(rng, e0, e1, rng.below(4) == 0);
    pack_k(w);
    return w;
}

// y [M, N] = sum over blocks of 32 of dx times sum(w xcode), in double.
std::vector<double> k_linear_ref(const float* x, int64_t M, const KWeights& w) {
    const int64_t K = w.K, nb = K / 32;
    const QuantizedX qx = quantize_ref(x, M, K);
    std::vector<double> y(M * w.N);
    for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < w.N; ++n) {
            double s = 0.0;
            for (int64_t b = 0; b < nb; ++b) {
                double dot = 0.0;
                for (int i = 0; i < 32; ++i) dot += k_value(w, n, 32 * b + i) * qx.q[r * K + 32 * b + i];
                s += qx.d[r * nb + b] * dot;
            }
            y[r * w.N + n] = s;
        }
    return y;
}

void test_block_linear_k() {
    Rng rng(11);
    struct Shape { int64_t N, K; };
    for (bool six : {false, true})
        for (Shape sh : {Shape{37, 256}, Shape{21, 768}, Shape{16, 512}}) {
            const KWeights w = make_k_weights(rng, six, sh.N, sh.K, -12, -6);
            for (int64_t M : {1, 3, 8, 11}) {
                const std::vector<float> x = make_activations(rng, M, sh.K);
                std::vector<float> y(M * sh.N + 32, 12345.0f);
                wafer::block_linear(x.data(), M, sh.K, w.packed.data(), six ? wafer::K6 : wafer::K4, sh.N, y.data());
                const double err = row_error(y.data(), k_linear_ref(x.data(), M, w).data(), M, sh.N);
                const bool ok = err <= 1e-5 && untouched(y, M * sh.N);
                check(ok, "block_linear %s M=%lld N=%lld K=%lld: max error %.2e of the row's largest (tol 1e-5)%s", six ? "K6" : "K4",
                      static_cast<long long>(M), static_cast<long long>(sh.N), static_cast<long long>(sh.K), err,
                      untouched(y, M * sh.N) ? "" : ", wrote past the output");
            }
        }
    for (bool six : {false, true}) {  // subnormal float16 factors
        const int64_t M = 3, N = 20, K = 256;
        const KWeights w = make_k_weights(rng, six, N, K, -24, -15);
        const std::vector<float> x = make_activations(rng, M, K);
        std::vector<float> y(M * N, 0.0f);
        wafer::block_linear(x.data(), M, K, w.packed.data(), six ? wafer::K6 : wafer::K4, N, y.data());
        const double err = row_error(y.data(), k_linear_ref(x.data(), M, w).data(), M, N);
        check(err <= 1e-5, "block_linear %s, subnormal float16 factors, M=%lld N=%lld K=%lld: max error %.2e (tol 1e-5)",
              six ? "K6" : "K4", static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), err);
    }
}

// ---- argmax_rows -------------------------------------------------------------------------------------

int64_t first_max(const float* x, int64_t n) {  // ties: the first; a NaN: the first NaN
    int64_t at = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(x[i])) return i;
        if (x[i] > x[at]) at = i;
    }
    return at;
}

void test_argmax() {
    Rng rng(2);
    const float inf = INFINITY, nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t V : {1, 15, 17, 1000}) {
        const int kinds = 10;
        const int64_t stride = V + 5;
        std::vector<float> X(kinds * stride, nan);  // the gap between rows is NaN: never to be read
        for (int r = 0; r < kinds; ++r) {
            float* p = X.data() + r * stride;
            for (int64_t i = 0; i < V; ++i) p[i] = static_cast<float>(rng.normal());
            auto at = [&](int64_t i) -> float& { return p[std::min(V - 1, i)]; };
            switch (r) {
                case 0: break;                                                                // random
                case 1: at(V / 3) = 9.0f; at(V / 2) = 9.0f; at(V - 1) = 9.0f; break;          // ties
                case 2: for (int64_t i = 0; i < V; ++i) p[i] = 1.5f; break;                  // all equal
                case 3: at(V - 1) = 50.0f; break;                                             // last
                case 4: at(V / 2) = nan; at(V - 1) = nan; at(0) = inf; break;                 // NaN after +inf
                case 5: for (int64_t i = 0; i < V; ++i) p[i] = -inf; break;                  // all -inf
                case 6: at(V / 4) = inf; at(V / 2) = inf; break;                             // +inf, twice
                case 7: for (int64_t i = 0; i < V; ++i) p[i] = (i % 3) ? 0.0f : -0.0f; at(V - 1) = -1.0f; break;
                case 8: at(V - 1) = nan; break;                                              // NaN last
                default: for (int64_t i = 0; i < V; ++i) p[i] = static_cast<float>(i % 16); break;  // a tie per lane
            }
        }
        std::vector<int64_t> out(kinds, -7);
        wafer::argmax_rows(X.data(), kinds, V, stride, out.data());
        int wrong = 0;
        for (int r = 0; r < kinds; ++r)
            if (out[r] != first_max(X.data() + r * stride, V)) {
                ++wrong;
                std::printf("     row %d: got %lld, want %lld\n", r, static_cast<long long>(out[r]),
                            static_cast<long long>(first_max(X.data() + r * stride, V)));
            }
        check(wrong == 0, "argmax_rows V=%lld (random, ties, NaN, -inf, +inf, signed zeros): %d of %d rows wrong",
              static_cast<long long>(V), wrong, kinds);
    }
}

// top_candidates against a plain reference: tempered values in double, sorted best first (equal
// values: the lower index first), probabilities exp(v - max) / sum.
void test_top_candidates() {
    Rng rng(5);
    const float inf = INFINITY, nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t V : {1, 17, 300, 5000}) {
        const int kinds = 6;
        const int64_t stride = V + 3, k = std::min<int64_t>(V, 64);
        std::vector<float> X(kinds * stride, nan), t(kinds);
        for (int r = 0; r < kinds; ++r) {
            float* p = X.data() + r * stride;
            for (int64_t i = 0; i < V; ++i) p[i] = static_cast<float>(3.0 * rng.normal());
            t[r] = r % 2 ? 0.7f : 1.3f;
            auto at = [&](int64_t i) -> float& { return p[std::min(V - 1, i)]; };
            switch (r) {
                case 1: for (int64_t i = 0; i < V; ++i) p[i] = static_cast<float>(i % 5); break;  // ties
                case 2: at(V / 2) = inf; at(0) = nan; break;                                       // +inf wins
                case 3: for (int64_t i = 0; i < V; ++i) p[i] = (i % 4) ? -inf : p[i]; break;      // mostly masked
                case 4: for (int64_t i = 0; i < V; ++i) p[i] = -inf; break;                       // nothing left
                default: break;
            }
        }
        std::vector<float> probs(kinds * k, -1.0f);
        std::vector<int64_t> idx(kinds * k, -1);
        wafer::top_candidates(X.data(), kinds, V, stride, t.data(), k, probs.data(), idx.data());
        int wrong = 0;
        for (int r = 0; r < kinds; ++r) {
            const float* p = X.data() + r * stride;
            std::vector<std::pair<double, int64_t>> ref;
            for (int64_t i = 0; i < V; ++i) {
                float y = p[i] / t[r];
                y = std::isnan(y) ? -inf : std::min(y, FLT_MAX);
                ref.push_back({y, i});
            }
            std::stable_sort(ref.begin(), ref.end(), [](auto& a, auto& b) { return a.first > b.first; });
            const double m = ref[0].first;
            double total = 0.0;
            for (auto& e : ref) total += std::exp(e.first - m);
            for (int64_t j = 0; j < k; ++j) {
                const float got = probs[r * k + j];
                const bool none = !(m > -inf);  // nothing left: NaN probabilities, as softmax gives
                const double want = none ? 0.0 : std::exp(ref[j].first - m) / total;
                const bool ok = none ? std::isnan(got) : idx[r * k + j] == ref[j].second && std::fabs(got - want) <= 1e-6 * std::max(1.0, want) + 1e-7;
                if (!ok) {
                    ++wrong;
                    std::printf("     V=%lld row %d, candidate %lld: got %lld (%g), want %lld (%g)\n", static_cast<long long>(V), r,
                                static_cast<long long>(j), static_cast<long long>(idx[r * k + j]), got,
                                static_cast<long long>(ref[j].second), want);
                    break;
                }
            }
        }
        check(wrong == 0, "top_candidates V=%lld k=%lld (random, ties, +inf and NaN, masked, nothing left): %d of %d rows wrong",
              static_cast<long long>(V), static_cast<long long>(k), wrong, kinds);
    }
}

// ---- exp, softmax_exp, rms_norm -------------------------------------------------------------------------

void test_exp() {
    std::vector<float> xs;
    const int n = 180000;
    for (int i = 0; i <= n; ++i) xs.push_back(static_cast<float>(-90.0 + 180.0 * i / n));
    for (float v : {0.0f, -0.0f, 88.0f, -88.0f, 87.9999f, -87.3365f, 1e-8f, -1e-8f, 0.34657359f, -0.34657359f, 0.6931472f})
        xs.push_back(v);
    for (int k = -126; k <= 126; ++k) xs.push_back(static_cast<float>(k * 0.69314718055994530942));  // on ln 2 steps
    while (xs.size() % 16) xs.push_back(0.0f);
    std::vector<float> ys(xs.size());
    for (size_t i = 0; i < xs.size(); i += 16) simd::store(ys.data() + i, simd::exp(simd::load(xs.data() + i)));
    float at88[16], at87[16];
    simd::store(at88, simd::exp(simd::set1(88.0f)));
    simd::store(at87, simd::exp(simd::set1(-87.0f)));
    double worst = 0.0, worst_x = 0.0;
    int bad_clamp = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
        const double x = xs[i], want = std::exp(x), got = ys[i];
        if (x > 88.0) {  // exp saturates at e^88 (simd.h clamps its argument to [-87, 88])
            if (!(got == at88[0] && std::isfinite(got))) ++bad_clamp;
        } else if (x < -87.0) {  // and stops at e^-87, never subnormal (subnormal arithmetic is slow)
            if (!(got == at87[0])) ++bad_clamp;
        } else {
            const double rel = std::fabs(got - want) / want;
            if (!(rel <= worst)) worst = std::isnan(rel) ? INFINITY : rel, worst_x = x;
        }
    }
    check(worst < 1e-6 && bad_clamp == 0 && at87[0] >= FLT_MIN && std::fabs(at87[0] - std::exp(-87.0)) < 1e-6 * std::exp(-87.0),
          "simd::exp on [-90, 90] (%zu points): max relative error %.2e at %.4f on [-87, 88] (tol 1e-6), "
          "%d outside it not e^-87 or e^88",
          xs.size(), worst, worst_x, bad_clamp);
}

void test_softmax() {
    Rng rng(3);
    for (int64_t n : {1, 5, 16, 17, 37, 100}) {
        std::vector<float> p(n + 16, 12345.0f);
        for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(rng.range(-30.0, 30.0));
        if (n > 2) p[n / 2] = -INFINITY;  // a masked score
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
        std::vector<double> want(n);
        double total = 0.0;
        for (int64_t j = 0; j < n; ++j) total += want[j] = std::exp(static_cast<double>(p[j] - mx));  // p - max in float, as the kernel
        const float got_total = wafer::softmax_exp(p.data(), n);
        double worst = 0.0;
        for (int64_t j = 0; j < n; ++j) {  // relative, or absolute (1e-30) for the masked score's
            const double e = std::fabs(p[j] - want[j]) / std::max(want[j], 1e-30);
            worst = std::isnan(e) ? INFINITY : std::max(worst, e);
        }
        const double total_err = std::fabs(got_total - total) / total;
        const bool tail = untouched(p, n);
        check(worst < 2e-6 && total_err < 1e-5 && tail, "softmax_exp n=%lld: max relative error %.2e (tol 2e-6), sum's %.2e (tol 1e-5)%s",
              static_cast<long long>(n), worst, total_err, tail ? "" : ", wrote past n");
    }
}

void test_rms_norm() {
    Rng rng(4);
    for (int64_t n : {1, 37, 64, 100}) {
        const int64_t rows = 3;
        const float eps = 1e-5f;
        std::vector<float> x(rows * n), w(n), y(rows * n + 16, 12345.0f);
        for (auto& v : x) v = static_cast<float>(3.0 * rng.normal());
        for (auto& v : w) v = static_cast<float>(rng.range(0.5, 1.5));
        wafer::rms_norm(x.data(), w.data(), y.data(), rows, n, eps);
        std::vector<double> want(rows * n);
        for (int64_t r = 0; r < rows; ++r) {
            double ss = 0.0;
            for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[r * n + i]) * x[r * n + i];
            const double inv = 1.0 / std::sqrt(ss / n + eps);
            for (int64_t i = 0; i < n; ++i) want[r * n + i] = x[r * n + i] * inv * w[i];
        }
        const double err = row_error(y.data(), want.data(), rows, n);
        const bool tail = untouched(y, rows * n);
        check(err < 1e-5 && tail, "rms_norm n=%lld: max error %.2e of the row's largest (tol 1e-5)%s", static_cast<long long>(n), err,
              tail ? "" : ", wrote past the rows");
    }
}

void test_silu_mul() {
    Rng rng(7);
    for (int64_t inter : {37, 128}) {
        const int64_t rows = 2;
        std::vector<float> gu(rows * 2 * inter), y(rows * inter + 16, 12345.0f);
        for (auto& a : gu) a = static_cast<float>(4.0 * rng.normal());
        gu[0] = -100.0f, gu[1] = 100.0f;  // exp's argument beyond its clamp
        wafer::silu_mul(gu.data(), y.data(), rows, inter);
        std::vector<double> want(rows * inter);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < inter; ++i) {
                const double g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
                want[r * inter + i] = g / (1.0 + std::exp(-g)) * u;
            }
        const double err = row_error(y.data(), want.data(), rows, inter);
        const bool tail = untouched(y, rows * inter);
        check(err < 1e-6 && tail, "silu_mul inter=%lld: max error %.2e of the row's largest (tol 1e-6)%s", static_cast<long long>(inter), err,
              tail ? "" : ", wrote past the rows");
    }
}

// dot and weighted_sum, each of which has a vector path for some head sizes (16k, and 64) and a
// scalar one for the others; the decode_step below has head_dim 16.
void test_attention_parts() {
    Rng rng(6);
    for (int64_t n : {16, 24, 64, 128}) {
        const int64_t count = 7;
        std::vector<float> q(n), v(count * n), p(count), o(n + 16, 12345.0f);
        for (auto& a : q) a = static_cast<float>(rng.normal());
        for (auto& a : v) a = static_cast<float>(rng.normal());
        for (auto& a : p) a = static_cast<float>(rng.uniform());
        double dot_err = 0.0;
        for (int64_t j = 0; j < count; ++j) {
            double want = 0.0, size = 0.0;
            for (int64_t e = 0; e < n; ++e) want += static_cast<double>(q[e]) * v[j * n + e], size += std::fabs(q[e] * v[j * n + e]);
            dot_err = std::max(dot_err, std::fabs(wafer::dot(q.data(), v.data() + j * n, n) - want) / size);
        }
        const float scale = 0.37f;
        // The rows in blocks of 2, stored in reverse block order: the sum must follow the blocks.
        const int64_t B = 2, nb = (count + B - 1) / B;
        std::vector<float> blocks(nb * B * n);
        auto row = [&](int64_t j) { return blocks.data() + ((nb - 1 - j / B) * B + j % B) * n; };
        for (int64_t j = 0; j < count; ++j) std::copy(v.begin() + j * n, v.begin() + (j + 1) * n, row(j));
        wafer::weighted_sum(p.data(), 0, count, 1, row, scale, o.data(), n);
        double ws_err = 0.0;
        for (int64_t e = 0; e < n; ++e) {
            double want = 0.0, size = 0.0;
            for (int64_t j = 0; j < count; ++j) want += static_cast<double>(p[j]) * v[j * n + e] * scale, size += std::fabs(p[j] * v[j * n + e] * scale);
            const double err = std::fabs(o[e] - want) / size;
            ws_err = std::isnan(err) ? INFINITY : std::max(ws_err, err);
        }
        const bool tail = untouched(o, n);
        check(dot_err < 1e-6 && ws_err < 1e-6 && tail,
              "dot, weighted_sum n=%lld: max error %.2e, %.2e of the sum of |terms| (tol 1e-6)%s", static_cast<long long>(n), dot_err,
              ws_err, tail ? "" : ", wrote past n");
    }
}

// sums16 (lane k: the sum of vector k's lanes) and the attention scores of 3 query heads over up
// to 16 key rows R apart, against double sums; lanes past c stay unwritten.
void test_scores() {
    Rng rng(11);
    simd::F v[16];
    alignas(64) float lanes[16][16], got[16];
    double sum_err = 0.0;
    for (int k = 0; k < 16; ++k) {
        for (int i = 0; i < 16; ++i) lanes[k][i] = static_cast<float>(rng.normal()) * (k + 1);
        v[k] = simd::load(lanes[k]);
    }
    simd::store(got, simd::sums16(v));
    for (int k = 0; k < 16; ++k) {
        double want = 0.0, size = 0.0;
        for (int i = 0; i < 16; ++i) want += lanes[k][i], size += std::fabs(lanes[k][i]);
        sum_err = std::max(sum_err, std::fabs(got[k] - want) / size);
    }
    check(sum_err < 1e-6, "sums16: max error %.2e of the sum of |lanes| (tol 1e-6)", sum_err);
    for (int64_t n : {64, 128}) {
        for (int64_t c : {16, 5, 1}) {
            constexpr int H = 3;
            const int64_t R = n + 8, stride = 40;
            std::vector<float> q(H * n), k(16 * R), p(H * stride, 12345.0f);
            for (auto& a : q) a = static_cast<float>(rng.normal());
            for (auto& a : k) a = static_cast<float>(rng.normal());
            const float scale = 0.125f;
            wafer::scores<H>(q.data(), k.data(), R, c, n, scale, p.data() + 3, stride);
            double err = 0.0;
            bool tail = true;
            for (int h = 0; h < H; ++h) {
                for (int64_t g = 0; g < c; ++g) {
                    double want = 0.0, size = 0.0;
                    for (int64_t e = 0; e < n; ++e) {
                        const double t = static_cast<double>(q[h * n + e]) * k[g * R + e] * scale;
                        want += t, size += std::fabs(t);
                    }
                    err = std::max(err, std::fabs(p[h * stride + 3 + g] - want) / size);
                }
                for (int64_t j = 0; j < stride; ++j)
                    if ((j < 3 || j >= 3 + c) && p[h * stride + j] != 12345.0f) tail = false;
            }
            check(err < 1e-6 && tail, "scores H=3 n=%lld c=%lld: max error %.2e of the sum of |terms| (tol 1e-6)%s",
                  static_cast<long long>(n), static_cast<long long>(c), err, tail ? "" : ", wrote outside its keys");
        }
    }
}

// KV rows in bfloat16 and int8: stored rounded as the format says, and read back by dot and
// weighted_sum (with each int8 row's scale) as a scalar loop over the stored values reads them.
template <class T>
void test_kv_rows(const char* name) {
    Rng rng(7);
    for (int64_t n : {24, 64, 256}) {
        const int64_t count = 7, R = wafer::kv_row<T>(n), B = 2;
        std::vector<float> x(count * n), q(n), p(count), o(n + 16, 12345.0f);
        for (auto& a : x) a = static_cast<float>(3.0 * rng.normal());
        for (auto& a : q) a = static_cast<float>(rng.normal());
        for (auto& a : p) a = static_cast<float>(rng.uniform());
        std::vector<T> rows(count * R);
        double store_err = 0.0;  // of the rounding, in units of what the format allows
        std::vector<double> back(count * n);
        for (int64_t j = 0; j < count; ++j) {
            const T* r = rows.data() + j * R;
            wafer::kv_store(rows.data() + j * R, x.data() + j * n, n);
            float amax = 0.0f;
            for (int64_t e = 0; e < n; ++e) amax = std::max(amax, std::fabs(x[j * n + e]));
            for (int64_t e = 0; e < n; ++e) {
                const double v = static_cast<double>(wafer::kv_value(r[e])) * wafer::kv_scale(r, n), want = x[j * n + e];
                back[j * n + e] = v;
                const double allowed = std::is_same<T, int8_t>::value ? amax / 127.0 / 2 : std::fabs(want) / 256.0;
                store_err = std::max(store_err, std::fabs(v - want) / (allowed * (1 + 1e-6) + 1e-30));
            }
        }
        double dot_err = 0.0, ws_err = 0.0;
        for (int64_t j = 0; j < count; ++j) {
            const T* r = rows.data() + j * R;
            double want = 0.0, size = 0.0;
            for (int64_t e = 0; e < n; ++e) want += q[e] * back[j * n + e], size += std::fabs(q[e] * back[j * n + e]);
            dot_err = std::max(dot_err, std::fabs(wafer::dot(q.data(), r, n) * wafer::kv_scale(r, n) - want) / size);
        }
        // The rows in blocks of 2, in reverse block order, as the cache's tables scatter them.
        const int64_t nb = (count + B - 1) / B;
        std::vector<T> blocks(nb * B * R);
        auto row = [&](int64_t j) -> const T* { return blocks.data() + ((nb - 1 - j / B) * B + j % B) * R; };
        for (int64_t j = 0; j < count; ++j)
            std::copy(rows.begin() + j * R, rows.begin() + (j + 1) * R, blocks.begin() + ((nb - 1 - j / B) * B + j % B) * R);
        wafer::weighted_sum(p.data(), 0, count, 1, row, 0.37f, o.data(), n);
        for (int64_t e = 0; e < n; ++e) {
            double want = 0.0, size = 0.0;
            for (int64_t j = 0; j < count; ++j) want += p[j] * back[j * n + e] * 0.37, size += std::fabs(p[j] * back[j * n + e] * 0.37);
            const double err = std::fabs(o[e] - want) / size;
            ws_err = std::isnan(err) ? INFINITY : std::max(ws_err, err);
        }
        const bool tail = untouched(o, n);
        check(store_err <= 1.0 && dot_err < 1e-6 && ws_err < 1e-6 && tail,
              "%s KV rows n=%lld: rounding %.3f of the format's half step (<= 1), dot %.2e, weighted_sum %.2e (tol 1e-6)%s",
              name, static_cast<long long>(n), store_err, dot_err, ws_err, tail ? "" : ", wrote past n");
    }
}

// ---- decode_step against a scalar model ---------------------------------------------------------------

struct Model {
    // 6 query heads a KV head: decode_step's attention takes them 4 and 2 at a time (one at a time in
    // steps of too few tokens to share among the threads otherwise)
    static constexpr int64_t hidden = 64, n_heads = 12, n_kv = 2, head_dim = 16, inter = 128, vocab = 50, n_layers = 2;
    static constexpr int64_t slots = 3, max_len = 16, max_pos = 16, block = 4, blocks = slots * max_len / block;
    static constexpr int64_t q_dim = n_heads * head_dim, kv_dim = n_kv * head_dim, row = q_dim + 2 * kv_dim;
    static constexpr float eps = 1e-5f;
    struct LayerW {
        std::vector<float> input_norm, post_norm, qkv_bias;
        Weights qkv, o, gate_up, down;
    };
    std::vector<LayerW> layers;
    std::vector<float> final_norm, cos, sin;  // cos, sin [max_pos, head_dim]: [freqs, freqs]
    Weights head;
};

Model make_model(Rng& rng) {
    Model md;
    auto norm_w = [&](int64_t n) {
        std::vector<float> w(n);
        for (auto& v : w) v = static_cast<float>(rng.range(0.7, 1.3));
        return w;
    };
    auto w4 = [&](int64_t N, int64_t K) { return make_weights(rng, 4, N, K, -7, -6, -4, -4); };
    auto w8 = [&](int64_t N, int64_t K) { return make_weights(rng, 8, N, K, -11, -10, 0, 0); };
    for (int l = 0; l < Model::n_layers; ++l) {
        Model::LayerW L;
        L.input_norm = norm_w(Model::hidden);
        L.post_norm = norm_w(Model::hidden);
        L.qkv_bias.resize(Model::row);
        for (auto& v : L.qkv_bias) v = static_cast<float>(0.1 * rng.normal());
        // 4-bit and 8-bit, each way round in the two layers
        L.qkv = l == 0 ? w4(Model::row, Model::hidden) : w8(Model::row, Model::hidden);
        L.o = l == 0 ? w8(Model::hidden, Model::q_dim) : w4(Model::hidden, Model::q_dim);
        L.gate_up = l == 0 ? w4(2 * Model::inter, Model::hidden) : w8(2 * Model::inter, Model::hidden);
        L.down = l == 0 ? w8(Model::hidden, Model::inter) : w4(Model::hidden, Model::inter);
        md.layers.push_back(std::move(L));
    }
    md.final_norm = norm_w(Model::hidden);
    md.head = w8(Model::vocab, Model::hidden);
    md.cos.resize(Model::max_pos * Model::head_dim);
    md.sin.resize(Model::max_pos * Model::head_dim);
    const int64_t half = Model::head_dim / 2;
    for (int64_t p = 0; p < Model::max_pos; ++p)
        for (int64_t i = 0; i < Model::head_dim; ++i) {
            const double f = std::pow(10000.0, -2.0 * static_cast<double>(i % half) / Model::head_dim);
            md.cos[p * Model::head_dim + i] = static_cast<float>(std::cos(p * f));
            md.sin[p * Model::head_dim + i] = static_cast<float>(std::sin(p * f));
        }
    return md;
}

struct Step {
    std::vector<int64_t> pos, slot;
    std::vector<int64_t> out;  // the rows whose logits are asked for
};

// decode_step writes the logits of the rows out[0..n_out) only; the decode.h before that change wrote
// every row's, which this falls back to (returning false) so that the test builds against either.
template <class... A>
auto decode_rows(int, const int64_t* out, int64_t n_out, float* logits, A... a)
    -> decltype(wafer::decode_step(a..., out, n_out, logits), true) {
    wafer::decode_step(a..., out, n_out, logits);
    return true;
}
template <class... A>
bool decode_rows(long, const int64_t*, int64_t, float* logits, A... a) {
    wafer::decode_step(a..., logits);
    return false;
}

// The scalar model: caches [layer][slot][kv head][position][head_dim] in double.
struct Reference {
    const Model* md;
    int64_t window;
    std::vector<std::vector<double>> k, v;
    double closest = 0.5;  // over the last step's activations: see quantize_ref
    Reference(const Model& m, int64_t w) : md(&m), window(w) {
        const size_t n = static_cast<size_t>(Model::slots * Model::n_kv * Model::max_len * Model::head_dim);
        k.assign(Model::n_layers, std::vector<double>(n, NAN));
        v.assign(Model::n_layers, std::vector<double>(n, NAN));
    }
    static std::vector<float> to_float(const std::vector<double>& a) { return std::vector<float>(a.begin(), a.end()); }
    static std::vector<double> norm(const std::vector<double>& h, const std::vector<float>& w, int64_t M) {
        const int64_t n = Model::hidden;
        std::vector<double> y(M * n);
        for (int64_t r = 0; r < M; ++r) {
            double ss = 0.0;
            for (int64_t i = 0; i < n; ++i) ss += h[r * n + i] * h[r * n + i];
            const double inv = 1.0 / std::sqrt(ss / n + Model::eps);
            for (int64_t i = 0; i < n; ++i) y[r * n + i] = h[r * n + i] * inv * w[i];
        }
        return y;
    }
    std::vector<double> linear(const std::vector<double>& x, int64_t M, const Weights& w) {
        return linear_ref(to_float(x).data(), M, w, &closest);
    }
    size_t at(int64_t slot, int64_t kh, int64_t p) const {
        return static_cast<size_t>(((slot * Model::n_kv + kh) * Model::max_len + p) * Model::head_dim);
    }
    std::vector<double> step(const std::vector<float>& x, const Step& s) {
        const int64_t M = static_cast<int64_t>(s.pos.size()), D = Model::head_dim, half = D / 2;
        const int64_t group = Model::n_heads / Model::n_kv;
        closest = 0.5;
        std::vector<double> h(x.begin(), x.end());
        for (int64_t l = 0; l < Model::n_layers; ++l) {
            const Model::LayerW& L = md->layers[l];
            std::vector<double> qkv = linear(norm(h, L.input_norm, M), M, L.qkv);
            for (int64_t m = 0; m < M; ++m) {
                double* r = qkv.data() + m * Model::row;
                for (int64_t i = 0; i < Model::row; ++i) r[i] += L.qkv_bias[i];
                const float* c = md->cos.data() + s.pos[m] * D;
                const float* sn = md->sin.data() + s.pos[m] * D;
                for (int64_t hd = 0; hd < Model::n_heads + Model::n_kv; ++hd) {  // q heads, then k heads
                    double* u = r + hd * D;
                    std::vector<double> rot(D);  // rotate_half: [-u2, u1]
                    for (int64_t i = 0; i < half; ++i) rot[i] = -u[i + half], rot[i + half] = u[i];
                    for (int64_t i = 0; i < D; ++i) u[i] = u[i] * c[i] + rot[i] * sn[i];
                }
                for (int64_t kh = 0; kh < Model::n_kv; ++kh)  // every key of the step before any query
                    for (int64_t i = 0; i < D; ++i) {
                        k[l][at(s.slot[m], kh, s.pos[m]) + i] = r[Model::q_dim + kh * D + i];
                        v[l][at(s.slot[m], kh, s.pos[m]) + i] = r[Model::q_dim + Model::kv_dim + kh * D + i];
                    }
            }
            std::vector<double> attn(M * Model::q_dim);
            for (int64_t m = 0; m < M; ++m)
                for (int64_t hq = 0; hq < Model::n_heads; ++hq) {
                    const int64_t kh = hq / group, end = s.pos[m] + 1;
                    const int64_t start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
                    const double* q = qkv.data() + m * Model::row + hq * D;
                    std::vector<double> score;
                    double mx = -INFINITY;
                    for (int64_t j = start; j < end; ++j) {
                        double d = 0.0;
                        for (int64_t i = 0; i < D; ++i) d += q[i] * k[l][at(s.slot[m], kh, j) + i];
                        score.push_back(d / std::sqrt(static_cast<double>(D)));
                        mx = std::max(mx, score.back());
                    }
                    double total = 0.0;
                    for (double& e : score) total += e = std::exp(e - mx);
                    double* o = attn.data() + m * Model::q_dim + hq * D;
                    for (int64_t j = start; j < end; ++j)
                        for (int64_t i = 0; i < D; ++i) o[i] += score[j - start] / total * v[l][at(s.slot[m], kh, j) + i];
                }
            std::vector<double> y = linear(attn, M, L.o);
            for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
            const std::vector<double> gu = linear(norm(h, L.post_norm, M), M, L.gate_up);
            std::vector<double> act(M * Model::inter);
            for (int64_t m = 0; m < M; ++m)
                for (int64_t i = 0; i < Model::inter; ++i) {
                    const double g = gu[m * 2 * Model::inter + i], u = gu[m * 2 * Model::inter + Model::inter + i];
                    act[m * Model::inter + i] = g / (1.0 + std::exp(-g)) * u;
                }
            y = linear(act, M, L.down);
            for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
        }
        return linear(norm(h, md->final_norm, M), M, md->head);
    }
};

void test_decode_step() {
    Rng model_rng(5);
    const Model md = make_model(model_rng);
    // A prompt chunk (its last token's logits), then steps that mix slots, two tokens of one slot in
    // one step (two rows' logits, out of order), a new sequence.
    const std::vector<Step> steps = {
        {{0, 1, 2, 3, 4}, {0, 0, 0, 0, 0}, {4}},
        {{0, 1, 5}, {1, 1, 0}, {0, 1, 2}},
        {{6, 2, 0, 7}, {0, 1, 2, 0}, {3, 1}},
        {{1}, {2}, {0}},
        {{3, 2, 8}, {1, 2, 0}, {0, 1, 2}},
    };
    // Activations are rounded to int8 codes before every matrix product, and the kernel's float
    // arithmetic differs from this double reference by ~1e-7 relative: a value within that of a
    // rounding tie can round the other way (one code step), which moves the logits by ~1e-2 after
    // two layers. So each step's token embeddings are drawn again until, in the reference, every
    // quantised activation is at least kClear code steps from a tie (~100x the float noise); then
    // both sides round alike and the logits agree to float precision.
    constexpr double kClear = 2e-4;
    const double tol = 1e-4;
    for (int64_t window : {0, 3}) {
        Rng rng(100 + window);
        const int64_t other = window == 0 ? 3 : 4;  // a wrong window: the check must tell it apart
        const size_t cache = static_cast<size_t>(Model::blocks * Model::n_kv * Model::block * Model::head_dim);
        // Each slot's blocks scattered over the pool (slot s, block i -> (5 (s * 4 + i) + 3) mod 12).
        std::vector<int64_t> table(Model::blocks);
        for (int64_t i = 0; i < Model::blocks; ++i) table[i] = (5 * i + 3) % Model::blocks;
        const wafer::Tables tables{table.data(), Model::max_len / Model::block, Model::block, Model::blocks};
        std::vector<std::vector<float>> kc(Model::n_layers, std::vector<float>(cache, NAN)), vc = kc;  // NaN: never written
        std::vector<wafer::Layer> layers;
        for (int64_t l = 0; l < Model::n_layers; ++l) {
            const Model::LayerW& L = md.layers[l];
            auto lin = [](const Weights& w, const float* bias) { return wafer::Linear{w.packed.data(), w.bits, bias, w.K, w.N}; };
            layers.push_back({L.input_norm.data(), L.post_norm.data(), lin(L.qkv, L.qkv_bias.data()), lin(L.o, nullptr),
                              lin(L.gate_up, nullptr), lin(L.down, nullptr), kc[l].data(), vc[l].data()});
        }
        const wafer::Linear head{md.head.packed.data(), 8, nullptr, Model::hidden, Model::vocab};
        const wafer::Dims dims{Model::hidden, Model::n_heads, Model::n_kv, Model::head_dim, window, Model::eps};
        Reference ref(md, window), wrong(md, other);
        double worst = 0.0, wrong_least = INFINITY;
        int redrawn = 0;
        bool clear = true, rows_api = false;
        for (const Step& s : steps) {
            const int64_t M = static_cast<int64_t>(s.pos.size());
            std::vector<float> x(M * Model::hidden);
            std::vector<double> want;
            for (int tries = 0;; ++tries) {
                for (auto& v : x) v = static_cast<float>(rng.normal());
                Reference trial = ref;
                want = trial.step(x, s);
                if (trial.closest >= kClear || tries == 1000) {
                    clear = clear && trial.closest >= kClear;
                    ref = std::move(trial);
                    break;
                }
                ++redrawn;
            }
            const int64_t n_out = static_cast<int64_t>(s.out.size());
            std::vector<float> logits(M * Model::vocab + 16, 12345.0f);
            const bool selected = decode_rows(0, s.out.data(), n_out, logits.data(), x.data(), M, s.pos.data(), s.slot.data(),
                                              tables, md.cos.data(), md.sin.data(), layers, md.final_norm.data(), head, dims);
            rows_api = selected;
            if (!untouched(logits, (selected ? n_out : M) * Model::vocab)) worst = INFINITY;
            const std::vector<double> other_want = wrong.step(x, s);
            double scale = 0.0, err = 0.0, err_other = 0.0;
            bool differs = false;  // an asked-for token that sees more than 3 positions: the windows differ
            for (int64_t i = 0; i < n_out; ++i) {
                const int64_t m = s.out[i];
                differs = differs || s.pos[m] + 1 > 3;
                const float* got = logits.data() + (selected ? i : m) * Model::vocab;
                for (int64_t j = 0; j < Model::vocab; ++j) {
                    const double w = want[m * Model::vocab + j];
                    scale = std::max(scale, std::fabs(w));
                    const double e = std::fabs(got[j] - w);
                    err = std::isnan(e) ? INFINITY : std::max(err, e);
                    err_other = std::max(err_other, std::fabs(got[j] - other_want[m * Model::vocab + j]));
                }
            }
            worst = std::max(worst, err / scale);
            if (differs) wrong_least = std::min(wrong_least, err_other / scale);
        }
        check(clear && worst <= tol && wrong_least > 100 * tol,
              "decode_step window=%lld (2 layers, 5 steps of 1-5 tokens over 3 slots, %s): max logit error %.2e of the largest "
              "(tol %.0e); window %lld would give %.2e; embeddings redrawn %d times for activations %.0e code steps from a tie%s",
              static_cast<long long>(window), rows_api ? "logits of chosen rows" : "logits of every row", worst, tol,
              static_cast<long long>(other), wrong_least, redrawn, kClear, clear ? "" : " (NOT reached)");
    }
}

}  // namespace

int main() {
    std::printf("variant %s\n", simd::kVariant);
    test_block_linear();
    test_block_linear_k();
    test_argmax();
    test_top_candidates();
    test_exp();
    test_softmax();
    test_rms_norm();
    test_silu_mul();
    test_attention_parts();
    test_scores();
    test_kv_rows<wafer::Bf16>("bfloat16");
    test_kv_rows<int8_t>("int8");
    test_decode_step();
    if (failures) std::printf("FAILED: %d of %d checks (%s)\n", failures, checks, simd::kVariant);
    else std::printf("passed: all %d checks (%s)\n", checks, simd::kVariant);
    return failures ? 1 : 0;
}
