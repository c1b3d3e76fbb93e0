// The CPU FP4 quantizer of nemofp4.kernels.native: the quantization program of
// nemofp4/kernels/program.py (_quantize_core) for float32 operands in 1-D blocks of 16 along their
// rows, in 16x16 tiles, or down the columns of a token-major tensor (the wgrad operands), with
// E4M3/UE5M3 block scales and RNE, sr or sr8 rounding. Every float operation is the program's, in its order and in
// float32 (built with -ffp-contract=off, no fast-math), so the results are bit for bit the
// program's; tests/unit/test_kernels_native.py holds them to it.
//
// It is written with GCC/Clang vector extensions, 16 float32 lanes: a block of 16 elements is one
// vector along the rows, and 16 features' blocks are one vector down the columns. The block scales
// of 16 blocks are computed together in one vector.

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>

#define NF4_INLINE inline __attribute__((always_inline))

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int64_t vl __attribute__((vector_size(64)));
typedef uint8_t vb8 __attribute__((vector_size(8)));
typedef uint8_t vb16 __attribute__((vector_size(16)));

constexpr int kBlock = 16;
constexpr int32_t kAbsMask = 0x7FFFFFFF;

enum Rounding : int32_t { kRNE = 0, kSR = 1, kSR8 = 2 };

}  // namespace

extern "C" {

// A block-scale format (nemofp4.formats.scaling.ScaleGrid plus the table's zero rule), and the
// stochastic-rounding hash's constants (nemofp4.formats.minifloat).
struct nf4_grid {
    int32_t mantissa_bits;
    int32_t bias;
    int32_t zero_code_to_one;
    float min_normal;
    float min_subnormal;
    float max_finite;
    float subnormal_magic;  // 1.5 * 2^(23 + log2(min_subnormal)): round_scale_rne's subnormal addend
    uint32_t hash_multiplier;
    int32_t hash_rounds;
};

}  // extern "C"

namespace {

inline vf splat(float v) { return vf{} + v; }
inline vf bits_to_float(vi v) { return (vf)v; }
inline vi float_bits(vf v) { return (vi)v; }

inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// min(a, b) for a non-NaN b that returns a NaN a (torch.clamp(max=b) propagates NaN): one compare.
inline vf min_nan(vf a, vf b) { return b < a ? b : a; }

inline float min_nan(float a, float b) { return b < a ? b : a; }

// The largest of 16 lanes: a float32 |x|'s bits order as its magnitude, a NaN above infinity.
NF4_INLINE int32_t max_lane(vi v) {
    vi s = __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v = v > s ? v : s;
    s = __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v = v > s ? v : s;
    s = __builtin_shuffle(v, vi{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v = v > s ? v : s;
    s = __builtin_shuffle(v, vi{1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    v = v > s ? v : s;
    return v[0];
}

// program.global_scales: (tensor scale 1/G, code multiplier G / 6) from the tensor reference g.
void global_scales(const nf4_grid& grid, float g, float target, float* tensor_scale, float* code_multiplier) {
    float multiplier = min_nan(target / g, FLT_MAX);
    if (grid.zero_code_to_one) {
        multiplier = g == 0.0f ? 1.0f : multiplier;
    } else {
        multiplier = multiplier == 0.0f ? 1.0f : multiplier;
    }
    *tensor_scale = 1.0f / multiplier;
    *code_multiplier = multiplier * static_cast<float>(1.0 / 6.0);
}

// The block scales of 16 blocks (lanes) from their amaxes: program._quantize_core's scale step,
// formats.scaling.round_scale_rne and encode_scales.
struct Scales {
    vf block_scale;
    vf encode;
    vi codes;
    vi saturated, underflow, zero;  // -1 where true
};

NF4_INLINE Scales block_scales(const nf4_grid& grid, vf block_amax, float code_multiplier, float tensor_scale) {
    Scales s;
    vf ideal = min_nan(block_amax * code_multiplier, splat(FLT_MAX));
    vf v = min_nan(ideal, splat(grid.max_finite));
    const int drop = 23 - grid.mantissa_bits;
    vi bits = float_bits(v);
    vi normal = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1);
    vf subnormal = (v + grid.subnormal_magic) - grid.subnormal_magic;
    vf rounded = v < grid.min_normal ? subnormal : bits_to_float(normal);
    vi is_zero = rounded == 0.0f;
    s.block_scale = grid.zero_code_to_one ? rounded + (is_zero ? splat(1.0f) : splat(0.0f)) : rounded;
    s.encode = min_nan(1.0f / (s.block_scale * tensor_scale), splat(FLT_MAX));
    s.saturated = ideal > grid.max_finite;
    s.underflow = is_zero & (block_amax > 0.0f);
    s.zero = block_amax == 0.0f;
    const int m = grid.mantissa_bits;
    vi scale_bits = float_bits(s.block_scale);
    vi exponent = ((scale_bits >> 23) & 0xFF) - 127 + grid.bias;
    vi normal_code = (exponent << m) | ((scale_bits >> (23 - m)) & ((1 << m) - 1));
    vi subnormal_code = __builtin_convertvector(s.block_scale * (1.0f / grid.min_subnormal), vi);
    s.codes = s.block_scale < grid.min_normal ? subnormal_code : normal_code;
    return s;
}

// The 8-bit draws at 16 element indices (formats.minifloat.sr8_bytes_at), as float32 0..255.
NF4_INLINE vf random_bytes(const nf4_grid& grid, vu index, uint32_t key) {
    vu x = index ^ key;
    for (int i = 0; i < grid.hash_rounds; i++) {
        x ^= x >> 16;
        x *= grid.hash_multiplier;
    }
    return __builtin_convertvector((vi)(x >> 24), vf);
}

// 16 elements rounded onto the E2M1 grid: their scaled values (copysign(rounded, x) * block_scale)
// and E2M1 codes, as program._quantize_core computes them (each only when asked for).
struct Rounded {
    vf values;
    vi codes;
};

template <int32_t kRounding, bool kValues, bool kCodes>
NF4_INLINE Rounded round_elements(const nf4_grid& grid, vf x, vf encode, vf block_scale, vu index, uint32_t key) {
    vi sign = float_bits(x) & ~kAbsMask;
    vf magnitude = min_nan(bits_to_float(float_bits(x) & kAbsMask) * encode, splat(6.0f));
    vi upper = magnitude >= 4.0f, middle = magnitude >= 2.0f;
    vf rounded;
    if (kRounding == kRNE) {
        vf magic = upper ? splat(25165824.0f) : (middle ? splat(12582912.0f) : splat(6291456.0f));
        rounded = (magnitude + magic) - magic;
    } else {
        vf scaled_grid = magnitude * (upper ? splat(0.5f) : (middle ? splat(1.0f) : splat(2.0f)));
        vf lower = __builtin_convertvector(__builtin_convertvector(scaled_grid, vi), vf);  // floor: >= 0
        lower = scaled_grid == scaled_grid ? lower : scaled_grid;                           // NaN stays NaN
        vf frac = scaled_grid - lower;
        vf r = random_bytes(grid, index, key);
        vi away = kRounding == kSR ? frac * 256.0f >= 256.0f - r : frac + (r * (2.0f / 512) + (1.0f / 512)) >= 1.0f;
        rounded = (away ? lower + 1.0f : lower) * (upper ? splat(2.0f) : (middle ? splat(1.0f) : splat(0.5f)));
    }
    Rounded out;
    if (kValues) out.values = bits_to_float(float_bits(rounded) | sign) * block_scale;
    if (kCodes) {
        // The E2M1 code of a grid value r (the program's sign * 8 + binade offset + steps), from its
        // bits: r >= 1 has exponent and one mantissa bit, code (bits >> 22) - 252; 0.5 is code 1 and 0
        // code 0. A NaN element gets code 0, as the program's float-to-uint8 conversion gives it here.
        vi magnitude_code = (float_bits(rounded) >> 22) - 252 - (rounded < 1.0f);
        magnitude_code = magnitude_code > 0 ? magnitude_code : vi{};
        out.codes = rounded == rounded ? magnitude_code | (vi)(((vu)sign >> 28) & 8) : vi{};
    }
    return out;
}

// Two codes a byte, the first in the low nibble: 16 codes to 8 bytes.
NF4_INLINE vb8 pack_pairs(vi codes) {
    vl pairs = (vl)codes;
    return __builtin_convertvector((pairs & 0xF) | ((pairs >> 32) << 4), vb8);
}

const vu kLanes = vu{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

struct Counts {
    vi saturated = vi{}, underflow = vi{}, zero = vi{};

    NF4_INLINE void add(const Scales& s, vi valid) {
        saturated -= s.saturated & valid;
        underflow -= s.underflow & valid;
        zero -= s.zero & valid;
    }

    void write(int64_t* counts) const {
        counts[0] = counts[1] = counts[2] = 0;
        for (int j = 0; j < kBlock; j++) counts[0] += saturated[j], counts[1] += underflow[j], counts[2] += zero[j];
    }

    void merge(const Counts& other) {
        saturated += other.saturated;
        underflow += other.underflow;
        zero += other.zero;
    }
};

// One quantization's arguments, shared by the threads that split it.
struct Job {
    const float* x;
    int64_t rows, cols;  // [tokens, features] down the columns
    nf4_grid grid;
    uint32_t key;
    float tensor_scale, code_multiplier;
    float* values;
    uint8_t* packed;
    uint8_t* scale_codes;
};

// Each thread takes at least this much of an operand (a smaller one runs on the caller's alone).
constexpr int64_t kMinElementsPerThread = int64_t{1} << 15;

// fn(part, begin, end) over units [0, units) of elements_per_unit elements each, in contiguous parts
// on up to `threads` OpenMP threads; each unit's result does not depend on the split. The library
// links the libgomp that torch has loaded, so its threads are the team torch's own kernels use.
template <typename Fn>
void parallel_for(int64_t units, int64_t elements_per_unit, int threads, Fn fn) {
    const int64_t per_thread = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, elements_per_unit));
    const int n = static_cast<int>(std::min<int64_t>(std::max(threads, 1), (units + per_thread - 1) / per_thread));
    if (n <= 1) {
        fn(0, 0, units);
        return;
    }
    const int64_t step = (units + n - 1) / n;
#pragma omp parallel for num_threads(n) schedule(static, 1)
    for (int part = 0; part < n; part++) fn(part, std::min(units, part * step), std::min(units, (part + 1) * step));
}

// body(job, begin, end, counts) over the units of an operand, each part counting its own blocks.
template <typename Body>
void run(const Job& job, int64_t units, int64_t elements_per_unit, int threads, Body body, Counts& totals) {
    std::vector<Counts> parts(std::max(threads, 1));
    parallel_for(units, elements_per_unit, threads,
                 [&](int part, int64_t begin, int64_t end) { body(job, begin, end, parts[part]); });
    for (const Counts& part : parts) totals.merge(part);
}

// The largest |x| of n float32 as bits (a NaN above infinity).
int32_t max_magnitude_bits(const float* x, int64_t n) {
    vi acc = vi{};
    int64_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
        vi a = float_bits(load(x + i)) & kAbsMask;
        acc = a > acc ? a : acc;
    }
    int32_t best = max_lane(acc);
    for (; i < n; i++) {
        int32_t a;
        std::memcpy(&a, x + i, sizeof a);
        a &= kAbsMask;
        best = a > best ? a : best;
    }
    return best;
}

// The scales of up to 16 blocks along the rows from their amaxes' bits (lanes past `count` are not
// blocks: not counted), each block's encode and scale also as a float array to broadcast from.
NF4_INLINE Scales counted_scales(const Job& job, const int32_t (&amax_bits)[kBlock], int count, Counts& totals,
                                 float (&encode)[kBlock], float (&block_scale)[kBlock]) {
    vi amax;
    std::memcpy(&amax, amax_bits, sizeof amax);
    const Scales s = block_scales(job.grid, bits_to_float(amax), job.code_multiplier, job.tensor_scale);
    totals.add(s, (vi)kLanes < count);
    std::memcpy(encode, &s.encode, sizeof encode);
    std::memcpy(block_scale, &s.block_scale, sizeof block_scale);
    return s;
}

// Blocks of 16 along the rows; a unit is 16 consecutive blocks, whose scales are one vector.
template <int32_t kRounding, bool kValues, bool kPacked>
void rows_part(const Job& job, int64_t begin, int64_t end, Counts& totals) {
    const nf4_grid grid = job.grid;
    const int64_t nblocks = job.rows * job.cols / kBlock;
    for (int64_t first = begin * kBlock; first < std::min(nblocks, end * kBlock); first += kBlock) {
        const int count = nblocks - first < kBlock ? static_cast<int>(nblocks - first) : kBlock;
        const float* xs = job.x + first * kBlock;
        alignas(64) int32_t amax_bits[kBlock] = {};
        for (int j = 0; j < count; j++) amax_bits[j] = max_lane(float_bits(load(xs + j * kBlock)) & kAbsMask);
        alignas(64) float encode[kBlock], block_scale[kBlock];
        const Scales s = counted_scales(job, amax_bits, count, totals, encode, block_scale);
        for (int j = 0; j < count; j++) {
            const int64_t block = first + j;
            job.scale_codes[block] = static_cast<uint8_t>(s.codes[j]);
            const vu index = kLanes + static_cast<uint32_t>(block * kBlock);
            const Rounded r = round_elements<kRounding, kValues, kPacked>(grid, load(xs + j * kBlock), splat(encode[j]),
                                                                           splat(block_scale[j]), index, job.key);
            if (kValues) store(job.values + block * kBlock, r.values);
            if (kPacked) {
                const vb8 bytes = pack_pairs(r.codes);
                std::memcpy(job.packed + block * (kBlock / 2), &bytes, sizeof bytes);
            }
        }
    }
}

// 16x16 tiles: a tile's amax is the elementwise maximum of its 16 row segments, then across their
// lanes; a unit is one row of tiles, 16 tiles along the columns sharing one scale vector.
template <int32_t kRounding, bool kValues, bool kPacked>
void tiles_part(const Job& job, int64_t begin, int64_t end, Counts& totals) {
    const nf4_grid grid = job.grid;
    const int64_t cols = job.cols, tile_cols = cols / kBlock;
    for (int64_t r0 = begin * kBlock; r0 < end * kBlock; r0 += kBlock) {
        for (int64_t first = 0; first < tile_cols; first += kBlock) {
            const int count = tile_cols - first < kBlock ? static_cast<int>(tile_cols - first) : kBlock;
            alignas(64) int32_t amax_bits[kBlock] = {};
            for (int j = 0; j < count; j++) {
                const float* tile = job.x + r0 * cols + (first + j) * kBlock;
                vi a = vi{};
                for (int r = 0; r < kBlock; r++) {
                    const vi b = float_bits(load(tile + r * cols)) & kAbsMask;
                    a = b > a ? b : a;
                }
                amax_bits[j] = max_lane(a);
            }
            alignas(64) float encode[kBlock], block_scale[kBlock];
            const Scales s = counted_scales(job, amax_bits, count, totals, encode, block_scale);
            for (int j = 0; j < count; j++) {
                job.scale_codes[(r0 / kBlock) * tile_cols + first + j] = static_cast<uint8_t>(s.codes[j]);
            }
            for (int r = 0; r < kBlock; r++) {  // row by row: each row's writes are one contiguous run
                for (int j = 0; j < count; j++) {
                    const int64_t at = (r0 + r) * cols + (first + j) * kBlock;
                    const vu index = kLanes + static_cast<uint32_t>(at);
                    const Rounded out = round_elements<kRounding, kValues, kPacked>(
                        grid, load(job.x + at), splat(encode[j]), splat(block_scale[j]), index, job.key);
                    if (kValues) store(job.values + at, out.values);
                    if (kPacked) {
                        const vb8 bytes = pack_pairs(out.codes);
                        std::memcpy(job.packed + at / 2, &bytes, sizeof bytes);
                    }
                }
            }
        }
    }
}

// Blocks of 16 tokens down the columns of a token-major x [tokens, features]: 16 features' blocks
// are one vector; a unit is 16 features (the last may be narrower: its lanes are zero-padded).
template <int32_t kRounding, bool kValues, bool kPacked>
void columns_part(const Job& job, int64_t begin, int64_t end, Counts& totals) {
    const nf4_grid grid = job.grid;
    const int64_t tokens = job.rows, features = job.cols, token_blocks = tokens / kBlock;
    alignas(64) float tile[kBlock][kBlock];
    for (int64_t d0 = begin * kBlock; d0 < std::min(features, end * kBlock); d0 += kBlock) {
        const int width = features - d0 < kBlock ? static_cast<int>(features - d0) : kBlock;
        const vi valid = (vi)kLanes < width;
        const vu index_base = (kLanes + static_cast<uint32_t>(d0)) * static_cast<uint32_t>(tokens);
        for (int64_t tb = 0; tb < token_blocks; tb++) {
            const float* xs = job.x + tb * kBlock * features + d0;
            vf rows_in[kBlock];
            vi amax = vi{};
            for (int t = 0; t < kBlock; t++) {
                if (width == kBlock) {
                    rows_in[t] = load(xs + t * features);
                } else {
                    std::memset(tile[t], 0, sizeof tile[t]);
                    std::memcpy(tile[t], xs + t * features, width * sizeof(float));
                    rows_in[t] = load(tile[t]);
                }
                const vi a = float_bits(rows_in[t]) & kAbsMask;
                amax = a > amax ? a : amax;
            }
            const Scales s = block_scales(grid, bits_to_float(amax), job.code_multiplier, job.tensor_scale);
            totals.add(s, valid);
            for (int f = 0; f < width; f++) job.scale_codes[(d0 + f) * token_blocks + tb] = static_cast<uint8_t>(s.codes[f]);
            alignas(64) uint8_t pair_bytes[kBlock / 2][kBlock];
            for (int t = 0; t < kBlock; t += 2) {
                const uint32_t token = static_cast<uint32_t>(tb * kBlock + t);
                const Rounded a = round_elements<kRounding, kValues, kPacked>(grid, rows_in[t], s.encode, s.block_scale,
                                                                               index_base + token, job.key);
                const Rounded b = round_elements<kRounding, kValues, kPacked>(grid, rows_in[t + 1], s.encode,
                                                                               s.block_scale, index_base + (token + 1),
                                                                               job.key);
                if (kValues) {
                    float* out = job.values + (tb * kBlock + t) * features + d0;
                    if (width == kBlock) {
                        store(out, a.values);
                        store(out + features, b.values);
                    } else {
                        alignas(64) float lanes[2][kBlock];
                        store(lanes[0], a.values);
                        store(lanes[1], b.values);
                        std::memcpy(out, lanes[0], width * sizeof(float));
                        std::memcpy(out + features, lanes[1], width * sizeof(float));
                    }
                }
                if (kPacked) {
                    const vb16 bytes = __builtin_convertvector((a.codes & 0xF) | ((b.codes & 0xF) << 4), vb16);
                    std::memcpy(pair_bytes[t / 2], &bytes, sizeof bytes);
                }
            }
            if (kPacked) {
                for (int f = 0; f < width; f++) {
                    uint8_t* out = job.packed + (d0 + f) * (tokens / 2) + tb * (kBlock / 2);
                    for (int p = 0; p < kBlock / 2; p++) out[p] = pair_bytes[p][f];
                }
            }
        }
    }
}

enum Layout { kRows, kTiles, kColumns };

template <Layout kLayout, int32_t kRounding, bool kValues, bool kPacked>
void quantize(const Job& job, int threads, int64_t* counts) {
    Counts totals;
    if (kLayout == kRows) {
        const int64_t nblocks = job.rows * job.cols / kBlock;
        run(job, (nblocks + kBlock - 1) / kBlock, kBlock * kBlock, threads, rows_part<kRounding, kValues, kPacked>, totals);
    } else if (kLayout == kTiles) {
        run(job, job.rows / kBlock, kBlock * job.cols, threads, tiles_part<kRounding, kValues, kPacked>, totals);
    } else {
        run(job, (job.cols + kBlock - 1) / kBlock, kBlock * job.rows, threads, columns_part<kRounding, kValues, kPacked>,
            totals);
    }
    totals.write(counts);
}

using Kernel = void (*)(const Job&, int, int64_t*);

template <Layout kLayout, int32_t kRounding>
Kernel kernel(bool has_values, bool has_packed) {
    return has_values ? (has_packed ? quantize<kLayout, kRounding, true, true> : quantize<kLayout, kRounding, true, false>)
                      : quantize<kLayout, kRounding, false, true>;
}

template <Layout kLayout>
void quantize(const float* x, int64_t rows, int64_t cols, const nf4_grid* grid, int32_t rounding, uint32_t key,
              float g, float target, float* values, uint8_t* packed, uint8_t* scale_codes, int64_t* counts,
              float* tensor_scale_out, int32_t threads) {
    Job job{x, rows, cols, *grid, key, 0.0f, 0.0f, values, packed, scale_codes};
    global_scales(*grid, g, target, &job.tensor_scale, &job.code_multiplier);
    const bool has_values = values != nullptr, has_packed = packed != nullptr;
    const Kernel run_kernel = rounding == kSR    ? kernel<kLayout, kSR>(has_values, has_packed)
                              : rounding == kSR8 ? kernel<kLayout, kSR8>(has_values, has_packed)
                                                 : kernel<kLayout, kRNE>(has_values, has_packed);
    run_kernel(job, threads, counts);
    *tensor_scale_out = job.tensor_scale;
}

}  // namespace

extern "C" {

// max |x| over n float32 (a NaN wins), on up to `threads` threads: the measured tensor reference.
float nf4_amax(const float* x, int64_t n, int32_t threads) {
    constexpr int64_t kChunk = 4096;
    std::vector<int32_t> best(std::max(threads, 1), 0);
    parallel_for((n + kChunk - 1) / kChunk, kChunk, threads, [&](int part, int64_t begin, int64_t end) {
        best[part] = max_magnitude_bits(x + begin * kChunk, std::min(n, end * kChunk) - begin * kChunk);
    });
    const int32_t bits = *std::max_element(best.begin(), best.end());
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

// x [rows, cols] (cols a multiple of 16, contiguous) in blocks of 16 along its rows. values (float32,
// like x) and packed (two codes a byte, [rows, cols / 2]) may be null, not both; scale_codes
// [rows, cols / 16]; counts: saturated, underflowed and zero blocks; tensor_scale_out: 1 / G.
void nf4_quantize_rows(const float* x, int64_t rows, int64_t cols, const nf4_grid* grid, int32_t rounding,
                       uint32_t key, float g, float target, float* values, uint8_t* packed, uint8_t* scale_codes,
                       int64_t* counts, float* tensor_scale_out, int32_t threads) {
    quantize<kRows>(x, rows, cols, grid, rounding, key, g, target, values, packed, scale_codes, counts, tensor_scale_out,
                    threads);
}

// x [rows, cols] (both multiples of 16, contiguous) in 16x16 tiles (a weight's 2-D blocks): scale_codes
// [rows / 16, cols / 16]; otherwise as nf4_quantize_rows.
void nf4_quantize_tiles(const float* x, int64_t rows, int64_t cols, const nf4_grid* grid, int32_t rounding,
                        uint32_t key, float g, float target, float* values, uint8_t* packed, uint8_t* scale_codes,
                        int64_t* counts, float* tensor_scale_out, int32_t threads) {
    quantize<kTiles>(x, rows, cols, grid, rounding, key, g, target, values, packed, scale_codes, counts, tensor_scale_out,
                     threads);
}

// The wgrad operand of a token-major x [tokens, features] (tokens a multiple of 16, contiguous): its
// transpose quantized in blocks of 16 tokens, read down x's columns. values [tokens, features] (the
// transpose's values, token-major), packed [features, tokens / 2], scale_codes [features, tokens / 16];
// element (t, d)'s random byte is that of index d * tokens + t. Otherwise as nf4_quantize_rows.
void nf4_quantize_columns(const float* x, int64_t tokens, int64_t features, const nf4_grid* grid, int32_t rounding,
                          uint32_t key, float g, float target, float* values, uint8_t* packed, uint8_t* scale_codes,
                          int64_t* counts, float* tensor_scale_out, int32_t threads) {
    quantize<kColumns>(x, tokens, features, grid, rounding, key, g, target, values, packed, scale_codes, counts,
                       tensor_scale_out, threads);
}

}  // extern "C"
