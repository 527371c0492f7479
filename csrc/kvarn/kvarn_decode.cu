// KVarN fused decode / speculative-verify attention over the paged quantized cache:
// CUDA C++ with a C ABI (no torch headers), loaded by kvarn/decode_cuda.py via ctypes.
//
// Semantics are kvarn/decode.py's `attend_rotated` (the Triton kernel): one CTA per
// (request, KV head, part) serves every query row of the GQA group (row m = query token
// m / HPG, head h * HPG + m % HPG). With one split, the one part reads the fp16 sink and
// tail blocks of the side pool (per-row causal limit) and every record 1..F. With S > 1
// splits there are S + 1 parts: part 0 reads only the side pool, whose fp16 blocks cost
// several records' worth of latency (a split that also read them was every short
// launch's critical path), parts 1..S a range of records each, and a log-sum-exp
// combine merges them. Scores live in the exp2 domain.
//
// Layout of the work. Tokens sit on the MMA's M dimension and query rows on N (so a
// GQA-4 decode wastes half of an n8 tile instead of 3/4 of an m16 one), as in
//   S^T[token, row] = K^T[token, d] Q^T[d, row]   and   O^T[d, row] += V^T[d, t] P^T[t, row].
// Each warp takes 32 tokens of a record (NTS = G / 32 warps per record) and, when its
// accumulator would be too large, a slice of the output channels (DSPLIT). Records
// stream through a shared-memory ring with cp.async; codes go from shared memory into
// MMA fragments with ldmatrix (.trans for the channel-major K codes and the token-major
// V codes), then 0x6400-magic unpacking. Token and channel orders inside a record are
// permuted so that each lane's fragment elements come from one ldmatrix word (see the
// mapping comments at `tok_of` and `v_channel`).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int kMaxStages = 4;
constexpr int kMaxSplits = 1024;  // the combine keeps one weight per part in shared memory

template <int D_, int G_, int VB_, int NT_>
struct Cfg {
  static constexpr int D = D_, G = G_, VB = VB_, NT = NT_;
  static constexpr int NTS = G / 32;                      // token-slice warps per record
  static constexpr int DSPLIT = (NT * D > 256) ? 2 : 1;   // output-channel slices
  static constexpr int NWARPS = NTS * DSPLIT;
  static constexpr int NTHREADS = 32 * NWARPS;
  static constexpr int DW = D / DSPLIT;                   // output channels per warp
  static constexpr int MP = 8 * NT;                       // padded query rows
  static constexpr int CPL = VB == 2 ? 8 : 4;             // channels per lane per V chunk
  static constexpr int NCH = DW * VB / 128;               // 16-byte V chunks per warp row
  static constexpr int NMV = DW / 16;                     // V^T m-tiles per warp
  static constexpr int QS = D + 8;                        // padded fp16 row (conflict-free)
  // record fields, spec order
  static constexpr int KC_BYTES = D * G / 2;
  static constexpr int K_COL = KC_BYTES, K_ZERO = K_COL + 2 * D, K_ROW = K_ZERO + 2 * D;
  static constexpr int V_CODES = K_ROW + 2 * G;
  static constexpr int RB = D * VB / 8;                   // V code bytes per token
  static constexpr int V_COL = V_CODES + G * RB, V_ROW = V_COL + 2 * D, V_ZERO = V_ROW + 2 * G;
  static constexpr int REC = V_ZERO + 2 * G;
  // V swizzle key: log2(max(4 RB, 128)); rows read together are 4 tokens apart (v_swz)
  static constexpr int V_KEY_SHIFT = RB <= 32 ? 7 : (RB == 64 ? 8 : 9);
  static_assert(REC % 128 == 0, "records are 128-byte multiples");
  static_assert(NCH >= 1 && NMV == NCH * CPL / 2, "V chunking");
};

struct Params {
  const void* q;
  const uint8_t* cache;
  const __half* side;
  const int* block_table;
  const int* side_table;
  const int* seq_lens;
  const int* num_flushed;
  float* out;     // [B*Q*HQ, D]
  float* o_part;  // [B*Q*HQ*parts, D] when splits > 1 (parts = splits + 1)
  float* lse;     // [B*Q*HQ*parts]
  long long bt_stride, st_stride;
  int st_width, H, HQ, Q, HPG, splits, parts, nstage, q_dtype;
  float qk_scale;
  int ring_bytes;
};

// ----------------------------------------------------------------------------- PTX

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// wait until at most n of this thread's groups are pending (n is a runtime ring depth)
__device__ __forceinline__ void cp_async_wait(int n) {
  if (n <= 0) asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  else if (n == 1) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  else if (n == 2) asm volatile("cp.async.wait_group 2;\n" ::: "memory");
  else asm volatile("cp.async.wait_group 3;\n" ::: "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ uint32_t movm_t(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// D = A B + C, m16n8k16, fp16 operands, fp32 accumulators
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1, const float (&c)[4]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
// x holds 0x64 in the high byte of each half and a code field below bit 10: the half is
// 1024 + field, exact, so subtracting 1024 leaves the field as an exact fp16.
__device__ __forceinline__ uint32_t magic_sub(uint32_t x) {
  uint32_t y;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(y) : "r"(x), "r"(0x64006400u));
  return y;
}
// the bits m (inside the low byte of each half) of bytes 0 and 2 (hi 0) or 1 and 3 (hi 1)
// of x, 0x64 above: one LOP3 (and a shift) per use, so no spread copy of x stays live
__device__ __forceinline__ uint32_t field_bits(uint32_t x, int hi, uint32_t m) {
  uint32_t y;  // (x & m) | 0x64006400 as one lop3 (LUT 0xEA = (a & b) | c)
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n"
      : "=r"(y) : "r"(hi ? x >> 8 : x), "r"(m), "r"(0x64006400u));
  return y;
}
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float2 h2_to_f2(uint32_t x) {
  return __half22float2(*reinterpret_cast<__half2*>(&x));
}

// ------------------------------------------------------------------- record swizzles

// K codes: D rows (channels) of G/2 bytes. ldmatrix reads 8 consecutive channel rows at
// one 16-byte column; XOR-ing the chunk index inside its 128-byte line with the line
// number puts those 8 rows in 8 different bank groups for G = 64 and 128.
template <class C>
__device__ __forceinline__ int k_swz(int off) {
  const int line = off >> 7;
  return (line << 7) | ((((off >> 4) & 7) ^ (line & 7)) << 4);
}
// V codes: G rows (tokens) of RB bytes, local offset `off`. ldmatrix reads rows 4 tokens
// apart (tok_of below); the key (off >> V_KEY_SHIFT) is constant inside a 128-byte line
// and distinct for those 8 rows, for every RB in 16..128.
template <class C>
__device__ __forceinline__ int v_swz(int off) {
  const int key = (off >> C::V_KEY_SHIFT) & 7;
  return (off & ~0x70) | ((((off >> 4) & 7) ^ key) << 4);
}

// Copy one record (all chunks) into a ring slot: 16-byte cp.async per thread and chunk.
// NTHREADS is a multiple of 64, so a thread's K code chunks are 8k lines apart and share
// one swizzle key: one offset plus constant strides (fewer live registers in the loop).
template <class C>
__device__ __forceinline__ void issue_record(uint32_t dst, const uint8_t* src, int tid) {
  constexpr int KC = C::KC_BYTES / 16, KS = (C::V_CODES - C::K_COL) / 16;
  constexpr int VC = C::G * C::RB / 16, VS = (C::REC - C::V_COL) / 16;
  static_assert(C::NTHREADS % 64 == 0 && KC % C::NTHREADS == 0, "K code chunks per thread");
  const int kdst = k_swz<C>(tid * 16);
#pragma unroll
  for (int j = 0; j < KC / C::NTHREADS; ++j)
    cp_async16(dst + kdst + j * 16 * C::NTHREADS, src + (tid + j * C::NTHREADS) * 16);
  for (int c = tid; c < KS; c += C::NTHREADS)
    cp_async16(dst + C::K_COL + c * 16, src + C::K_COL + c * 16);
#pragma unroll 4
  for (int c = tid; c < VC; c += C::NTHREADS)
    cp_async16(dst + C::V_CODES + v_swz<C>(c * 16), src + C::V_CODES + c * 16);
  for (int c = tid; c < VS; c += C::NTHREADS)
    cp_async16(dst + C::V_COL + c * 16, src + C::V_COL + c * 16);
}

// Ask L2 for `bytes` (a multiple of 128) at src, one 128-byte line per thread and step:
// a later load of them then waits for L2, not DRAM.
template <class C>
__device__ __forceinline__ void prefetch_lines(const void* src, int bytes, int tid) {
  for (int off = tid * 128; off < bytes; off += C::NTHREADS * 128)
    prefetch_l2(static_cast<const uint8_t*>(src) + off);
}

// -------------------------------------------------------------------- fragment maps
//
// S^T m-tile mt (0, 1) of a warp's 32 tokens, row i (0..15) of the tile: token
//   tok_of(mt, i) = 4 * (i & 7) + 2 * mt + (i >> 3)    (+ 32 * token slice).
// Lane g (= lane / 4) thus holds tokens 4g..4g+3: the b16 word g of a 16-byte K code
// chunk (ldmatrix.trans hands lane g exactly that word, for channels 2*tig, 2*tig + 1),
// low nibbles of byte 0 -> (mt 0, i = g), high -> (mt 0, g + 8), byte 1 -> mt 1. The
// O^T product's k index is the same i, with P^T made from S^T by movmatrix.trans.
//
// V^T m-tile mv, row i: channel v_channel(mv, i) (see there). Lane g owns CPL channels
// per 16-byte V chunk: the b16 word g of each token row, unpacked by mask.
template <class C>
__device__ __forceinline__ int v_channel(int dsl, int mv, int upper, int g) {
  const int c = mv / (C::CPL / 2), e = 2 * (mv % (C::CPL / 2)) + upper;
  return dsl * C::DW + c * 8 * C::CPL + C::CPL * g + e;
}
// power-of-two factor a code field carries when unpacked in place (folded out later)
template <class C>
__device__ __forceinline__ constexpr float v_field_scale(int e) {
  return C::VB == 2 ? static_cast<float>(1 << (2 * (e & 3))) : ((e & 1) ? 16.f : 1.f);
}
// field e of the lane's ldmatrix word x (VB = 2: bytes 0/2 carry e 0..3, 1/3 carry 4..7)
template <class C>
__device__ __forceinline__ uint32_t v_field(uint32_t x, int e) {
  if (C::VB == 2) return magic_sub(field_bits(x, e >> 2, 0x00030003u << (2 * (e & 3))));
  return magic_sub(field_bits(x, e >> 1, (e & 1) ? 0x00F000F0u : 0x000F000Fu));
}

// ---------------------------------------------------------------- online softmax

template <int NT>
struct Softmax {
  float m[NT][2], l[NT][2];  // rows 8 nt + 2 tig + e; l is this lane's partial sum
};

// Row max over the lane's 4 tokens and the 8 lanes sharing tig, new running max, alpha;
// turns s into p = exp2(s - max) in place and adds the lane's part of l.
template <int NT>
__device__ __forceinline__ void softmax_step(float (&s)[2][NT][4], Softmax<NT>& st,
                                             float (&alpha)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = fmaxf(fmaxf(s[0][nt][e], s[0][nt][2 + e]), fmaxf(s[1][nt][e], s[1][nt][2 + e]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(st.m[nt][e], mx);
      // a row with nothing visible yet keeps max -inf; exponentiate against 0 then
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[nt][e] = exp2f(st.m[nt][e] - base);
      st.m[nt][e] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const float p = exp2f(s[mt][nt][2 * u + e] - base);
          s[mt][nt][2 * u + e] = p;
          sum += p;
        }
      st.l[nt][e] = st.l[nt][e] * alpha[nt][e] + sum;
    }
}

__device__ __forceinline__ float quad_cols_sum(float x) {  // over the 8 lanes sharing tig
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  x += __shfl_xor_sync(0xffffffffu, x, 16);
  return x;
}

// ------------------------------------------------------------------ the kernel

// Register budget from the warps an SM is expected to hold: 16 (<= 128 registers: 4 CTAs
// of 4 warps) for one row tile at D <= 128; 12 for two row tiles at D <= 128; 8 at D = 256,
// whose ring of 3+ records holds 2 CTAs per SM (more registers would not buy a third).
template <int D, int G, int VB, int NT>
constexpr int min_blocks() {
  constexpr int want = (D == 256 ? 256 : NT == 1 ? 512 : 384) / Cfg<D, G, VB, NT>::NTHREADS;
  return want > 0 ? want : 1;
}

template <int D, int G, int VB, int NT>
__global__ void __launch_bounds__(Cfg<D, G, VB, NT>::NTHREADS, min_blocks<D, G, VB, NT>())
kvarn_decode_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using C = Cfg<D, G, VB, NT>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int part = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int ts = warp % C::NTS, dsl = warp / C::NTS;
  const int L = p.seq_lens[b], F = p.num_flushed[b];
  const int M = p.Q * p.HPG;

  uint8_t* ring = smem;
  float* qf = reinterpret_cast<float*>(smem + p.ring_bytes);           // [MP][D] fp32 q
  // [MP][QS] fp16 MMA operand: the permuted q of the side pool first, then q * kcol per
  // record (the records loop's first barrier comes after every warp's side-pool work)
  __half* qa = reinterpret_cast<__half*>(qf + C::MP * D);
  __half* q16 = qa;
  float* bias = reinterpret_cast<float*>(qa + C::MP * C::QS);          // [MP] q . kzero
  float* mls = bias + C::MP;                                           // [NTS][MP][2]

  // this part's range of quantized logical blocks 1..F (indices 0..F-1 here): with one
  // split, part 0 reads them all; with more, part 0 none and part k split k - 1's share
  const bool reads_side = part == 0;
  int lo = 0, n = 0;
  if (p.splits == 1 || part > 0) {
    const int per = (F + p.splits - 1) / p.splits;
    lo = (p.splits == 1 ? 0 : part - 1) * per;
    n = max(min(lo + per, F) - lo, 0);
  }
  const int* bt_row = p.block_table + b * p.bt_stride + 1 + lo;
  auto record_src = [&](int i) {
    const long long blk = bt_row[i];
    return p.cache + (blk * p.H + h) * static_cast<long long>(C::REC);
  };
  // ring prologue first, so the first records stream in during the setup and the side pool
  for (int k = 0; k < p.nstage - 1; ++k) {
    if (k < n) issue_record<C>(smem_addr(ring + k * C::REC), record_src(k), tid);
    cp_async_commit();
  }
  // the side pool's fp16 blocks go to L2 now: they are read with plain loads, a dozen
  // dependent rounds per block, which then wait for L2 rather than DRAM
  const int n_fp = reads_side ? min((L + G - 1) / G - F, p.st_width) : 0;
  for (int j = 0; j < n_fp; ++j) {
    const long long sid = p.side_table[b * p.st_stride + j];
    const __half* kb = p.side + ((sid * 2) * p.H + h) * static_cast<long long>(G * D);
    prefetch_lines<C>(kb, G * D * 2, tid);
    prefetch_lines<C>(kb + static_cast<long long>(p.H) * G * D, G * D * 2, tid);
  }

  // q (any of fp32 / fp16 / bf16) -> fp32 rows; padded rows are zero
  for (int idx = tid; idx < C::MP * D; idx += C::NTHREADS) {
    const int m = idx / D, d = idx % D;
    float v = 0.f;
    if (m < M) {
      const long long off =
          ((static_cast<long long>(b) * p.Q + m / p.HPG) * p.HQ + h * p.HPG + m % p.HPG) * D + d;
      if (p.q_dtype == 0) v = static_cast<const float*>(p.q)[off];
      else if (p.q_dtype == 1) v = __half2float(static_cast<const __half*>(p.q)[off]);
      else v = __bfloat162float(static_cast<const __nv_bfloat16*>(p.q)[off]);
    }
    qf[idx] = v;
  }
  __syncthreads();
  // fp16 q for the side pool, channel-permuted so a lane's K^T fragments for two k-steps
  // are one 16-byte load: position 16 ks + k holds channel
  // 32 (ks / 2) + 8 ((k & 7) / 2) + 4 (ks & 1) + 2 (k / 8) + (k & 1).
  for (int idx = tid; idx < C::MP * D; idx += C::NTHREADS) {
    const int m = idx / D, pos = idx % D, ks = pos >> 4, k = pos & 15;
    const int ch = 32 * (ks >> 1) + 8 * ((k & 7) >> 1) + 4 * (ks & 1) + 2 * (k >> 3) + (k & 1);
    q16[m * C::QS + pos] = __float2half_rn(qf[m * D + ch]);
  }

  // per-lane rows 8 nt + 2 tig + e: causal limit (positions < limit are visible)
  int limit[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * nt + 2 * tig + e;
      limit[nt][e] = row < M ? L - p.Q + row / p.HPG + 1 : L;
    }

  Softmax<NT> st;
  float acc[C::NMV][NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) { st.m[nt][e] = -INFINITY; st.l[nt][e] = 0.f; }
#pragma unroll
  for (int mv = 0; mv < C::NMV; ++mv)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mv][nt][j] = 0.f;

  const int tok0 = 32 * ts + 4 * g;  // this lane's 4 tokens in S^T (see tok_of)
  __syncthreads();  // q16 ready

  // ------------------------------------------- fp16 blocks: sink (0) and tail (F+1..)
  if (reads_side) {
    for (int j = 0; j < n_fp; ++j) {
      const int logical = j == 0 ? 0 : F + j;
      const long long sid = p.side_table[b * p.st_stride + j];
      const __half* kb = p.side + ((sid * 2) * p.H + h) * static_cast<long long>(G * D);
      const __half* vb = kb + static_cast<long long>(p.H) * G * D;
      float sc[2][NT][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int u = 0; u < 4; ++u) sc[mt][nt][u] = 0.f;
#pragma unroll 1  // one k-step of side K words live at a time (their loads would be hoisted)
      for (int kp = 0; kp < D / 32; ++kp) {
        uint4 kw[4];  // tokens tok0 + 0..3, channels 32 kp + 8 tig .. + 8
#pragma unroll
        for (int t = 0; t < 4; ++t)
          kw[t] = *reinterpret_cast<const uint4*>(kb + (tok0 + t) * D + 32 * kp + 8 * tig);
        uint32_t bq[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          ldsm_x4(smem_addr(q16 + (8 * nt + (lane & 7)) * C::QS + 32 * kp + 8 * (lane >> 3)),
                  bq[nt]);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
          const uint32_t w_lo[4] = {sub ? kw[0].z : kw[0].x, sub ? kw[1].z : kw[1].x,
                                    sub ? kw[2].z : kw[2].x, sub ? kw[3].z : kw[3].x};
          const uint32_t w_hi[4] = {sub ? kw[0].w : kw[0].y, sub ? kw[1].w : kw[1].y,
                                    sub ? kw[2].w : kw[2].y, sub ? kw[3].w : kw[3].y};
          const uint32_t a0[4] = {w_lo[0], w_lo[1], w_hi[0], w_hi[1]};  // tokens 4g, 4g+1
          const uint32_t a1[4] = {w_lo[2], w_lo[3], w_hi[2], w_hi[3]};  // tokens 4g+2, 4g+3
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            mma(sc[0][nt], a0, bq[nt][2 * sub], bq[nt][2 * sub + 1], sc[0][nt]);
            mma(sc[1][nt], a1, bq[nt][2 * sub], bq[nt][2 * sub + 1], sc[1][nt]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int pos = logical * G + tok0 + 2 * mt + (u >> 1);
            const float v = sc[mt][nt][u] * p.qk_scale;
            sc[mt][nt][u] = pos < limit[nt][u & 1] ? v : -INFINITY;
          }
      float alpha[NT][2];
      softmax_step<NT>(sc, st, alpha);
      uint32_t bp[2][NT][2];  // P^T fragments, k-step kk = S^T m-tile
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          bp[kk][nt][0] = movm_t(pack_h2(sc[kk][nt][0], sc[kk][nt][1]));
          bp[kk][nt][1] = movm_t(pack_h2(sc[kk][nt][2], sc[kk][nt][3]));
        }
#pragma unroll
      for (int c = 0; c < C::NCH; ++c) {
        const int cb = dsl * C::DW + c * 8 * C::CPL + C::CPL * g;  // lane's channels
#pragma unroll
        for (int mvl = 0; mvl < C::CPL / 2; ++mvl) {
          const int mv = c * (C::CPL / 2) + mvl;
          // O^T k index 2 tig + {0,1} (+8): tokens 8 tig + 2 kk + {0, 4} (+1); the lane's
          // channel pair 2 mvl of each, loaded per m-tile so few side words are live at once
          uint32_t w[2][4];
#pragma unroll
          for (int kk = 0; kk < 2; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int tok = 32 * ts + 8 * tig + 2 * kk + 4 * (r & 1) + (r >> 1);
              w[kk][r] = *reinterpret_cast<const uint32_t*>(vb + tok * D + cb + 2 * mvl);
            }
          float pv[NT][4];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int u = 0; u < 4; ++u) pv[nt][u] = 0.f;
#pragma unroll
          for (int kk = 0; kk < 2; ++kk) {
            // a0: (channel e even, tokens r 0,1), a1: (e odd, same), a2/a3: tokens r 2,3
            const uint32_t a[4] = {__byte_perm(w[kk][0], w[kk][1], 0x5410),
                                   __byte_perm(w[kk][0], w[kk][1], 0x7632),
                                   __byte_perm(w[kk][2], w[kk][3], 0x5410),
                                   __byte_perm(w[kk][2], w[kk][3], 0x7632)};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma(pv[nt], a, bp[kk][nt][0], bp[kk][nt][1], pv[nt]);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int u = 0; u < 4; ++u)
              acc[mv][nt][u] = acc[mv][nt][u] * alpha[nt][u & 1] + pv[nt][u];
        }
      }
    }
  }

  // ---------------------------------------------------------------- records
  int slot = 0;  // it % nstage, kept by increments (no runtime division in the loop)
  for (int it = 0; it < n; ++it) {
    cp_async_wait(p.nstage - 2);  // this thread's copies of record `it` have landed
    __syncthreads();              // everyone's have; and slot (it - 1) is free again
    {
      const int nxt = it + p.nstage - 1;  // its slot, (it - 1) % nstage, is the one before
      if (nxt < n)
        issue_record<C>(smem_addr(ring + (slot == 0 ? p.nstage - 1 : slot - 1) * C::REC),
                        record_src(nxt), tid);
      cp_async_commit();
    }
    const uint8_t* rec = ring + slot * C::REC;
    slot = slot + 1 == p.nstage ? 0 : slot + 1;
    // q * kcol (fp16, the MMA operand) and q . kzero, shared by all warps of the record
    {
      constexpr int CPT = D / 32;
      const __half* kcol = reinterpret_cast<const __half*>(rec + C::K_COL);
      const __half* kzer = reinterpret_cast<const __half*>(rec + C::K_ZERO);
      for (int r = warp; r < C::MP; r += C::NWARPS) {
        float part = 0.f;
#pragma unroll
        for (int j = 0; j < CPT; j += 2) {
          const int ch = lane * CPT + j;
          const float2 kc = h2_to_f2(*reinterpret_cast<const uint32_t*>(kcol + ch));
          const float2 kz = h2_to_f2(*reinterpret_cast<const uint32_t*>(kzer + ch));
          const float2 qv = *reinterpret_cast<const float2*>(qf + r * D + ch);
          *reinterpret_cast<uint32_t*>(qa + r * C::QS + ch) = pack_h2(qv.x * kc.x, qv.y * kc.y);
          part = fmaf(qv.x, kz.x, part);
          part = fmaf(qv.y, kz.y, part);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
        if (lane == 0) bias[r] = part;
      }
    }
    __syncthreads();

    const uint32_t rec_s = smem_addr(rec);
    // channel rows 32 kp + lane lie 8k swizzle lines past those of kp = 0: same XOR key
    const uint32_t k_lane = rec_s + k_swz<C>(lane * (G / 2) + 16 * ts);
    float sc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int u = 0; u < 4; ++u) sc[mt][nt][u] = 0.f;
#pragma unroll
    for (int kp = 0; kp < D / 32; ++kp) {
      // K^T: lane supplies channel row 32 kp + lane at this warp's 16-byte token column;
      // matrices 0..3 = channels 32kp + 0-7, 8-15, 16-23, 24-31
      uint32_t r[4];
      ldsm_x4_t(k_lane + kp * 16 * G, r);
      uint32_t bq[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        ldsm_x4(smem_addr(qa + (8 * nt + (lane & 7)) * C::QS + 32 * kp + 8 * (lane >> 3)),
                bq[nt]);
#pragma unroll
      for (int sub = 0; sub < 2; ++sub) {
        const uint32_t x = r[2 * sub], y = r[2 * sub + 1];
        // bytes 0/2 feed m-tile 0, bytes 1/3 m-tile 1; rows i >= 8 of each m-tile carry
        // 16 x code (high nibble in place)
        constexpr uint32_t LO = 0x000F000Fu, HI = 0x00F000F0u;
        const uint32_t a0[4] = {magic_sub(field_bits(x, 0, LO)), magic_sub(field_bits(x, 0, HI)),
                                magic_sub(field_bits(y, 0, LO)), magic_sub(field_bits(y, 0, HI))};
        const uint32_t a1[4] = {magic_sub(field_bits(x, 1, LO)), magic_sub(field_bits(x, 1, HI)),
                                magic_sub(field_bits(y, 1, LO)), magic_sub(field_bits(y, 1, HI))};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          mma(sc[0][nt], a0, bq[nt][2 * sub], bq[nt][2 * sub + 1], sc[0][nt]);
          mma(sc[1][nt], a1, bq[nt][2 * sub], bq[nt][2 * sub + 1], sc[1][nt]);
        }
      }
    }
    // per-token scales of the lane's tokens tok0 + 0..3
    const uint2 kr_raw = *reinterpret_cast<const uint2*>(rec + C::K_ROW + 2 * tok0);
    const uint2 vr_raw = *reinterpret_cast<const uint2*>(rec + C::V_ROW + 2 * tok0);
    const uint2 vz_raw = *reinterpret_cast<const uint2*>(rec + C::V_ZERO + 2 * tok0);
    const float2 kr01 = h2_to_f2(kr_raw.x), kr23 = h2_to_f2(kr_raw.y);
    const float2 vr01 = h2_to_f2(vr_raw.x), vr23 = h2_to_f2(vr_raw.y);
    const float2 vz01 = h2_to_f2(vz_raw.x), vz23 = h2_to_f2(vz_raw.y);
    // token t = tok0 + 2 mt + odd; odd tokens are high nibbles: 16 x code
    const float kr[4] = {kr01.x * p.qk_scale, kr01.y * (p.qk_scale * 0.0625f),
                         kr23.x * p.qk_scale, kr23.y * (p.qk_scale * 0.0625f)};
    const float vr[4] = {vr01.x, vr01.y, vr23.x, vr23.y};
    const float vz[4] = {vz01.x, vz01.y, vz23.x, vz23.y};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 bs = *reinterpret_cast<const float2*>(bias + 8 * nt + 2 * tig);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        sc[mt][nt][0] = (sc[mt][nt][0] + bs.x) * kr[2 * mt];
        sc[mt][nt][1] = (sc[mt][nt][1] + bs.y) * kr[2 * mt];
        sc[mt][nt][2] = (sc[mt][nt][2] + 16.f * bs.x) * kr[2 * mt + 1];
        sc[mt][nt][3] = (sc[mt][nt][3] + 16.f * bs.y) * kr[2 * mt + 1];
      }
    }
    float alpha[NT][2];
    softmax_step<NT>(sc, st, alpha);
    // p . vzero per row (all 32 tokens), and P^T fragments of p * vrow
    float pb[NT][2];
    uint32_t bp[2][NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float z = 0.f;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          z = fmaf(sc[mt][nt][e], vz[2 * mt], z);
          z = fmaf(sc[mt][nt][2 + e], vz[2 * mt + 1], z);
        }
        pb[nt][e] = quad_cols_sum(z);
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        bp[kk][nt][0] = movm_t(pack_h2(sc[kk][nt][0] * vr[2 * kk], sc[kk][nt][1] * vr[2 * kk]));
        bp[kk][nt][1] =
            movm_t(pack_h2(sc[kk][nt][2] * vr[2 * kk + 1], sc[kk][nt][3] * vr[2 * kk + 1]));
      }
    }
    // O^T: per 16-byte V chunk, ldmatrix.trans rows = tokens 4 r + mi of the warp's 32
    // (matrix mi: kk = mi / 2, k half = mi % 2, see tok_of), column = this warp's chunk
    const uint32_t vbase = rec_s + C::V_CODES;
    const int vtok = 32 * ts + 4 * (lane & 7) + (lane >> 3);
#pragma unroll
    for (int c = 0; c < C::NCH; ++c) {
      uint32_t r[4];
      ldsm_x4_t(vbase + v_swz<C>(vtok * C::RB + 16 * (dsl * C::NCH + c)), r);
      const __half* vcol = reinterpret_cast<const __half*>(rec + C::V_COL) +
                           dsl * C::DW + c * 8 * C::CPL + C::CPL * g;
#pragma unroll
      for (int mvl = 0; mvl < C::CPL / 2; ++mvl) {
        const int mv = c * (C::CPL / 2) + mvl, e0 = 2 * mvl, e1 = 2 * mvl + 1;
        // column scales of this m-tile's two channels, each over its field factor
        const float2 v2 = h2_to_f2(*reinterpret_cast<const uint32_t*>(vcol + e0));
        const float cf0 = v2.x / v_field_scale<C>(e0), cf1 = v2.y / v_field_scale<C>(e1);
        // the zero-point term rides in as the MMA's C: field factor x (p . vzero)
        float pv[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          pv[nt][0] = pb[nt][0] * v_field_scale<C>(e0);
          pv[nt][1] = pb[nt][1] * v_field_scale<C>(e0);
          pv[nt][2] = pb[nt][0] * v_field_scale<C>(e1);
          pv[nt][3] = pb[nt][1] * v_field_scale<C>(e1);
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const uint32_t a[4] = {v_field<C>(r[2 * kk], e0), v_field<C>(r[2 * kk], e1),
                                 v_field<C>(r[2 * kk + 1], e0), v_field<C>(r[2 * kk + 1], e1)};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma(pv[nt], a, bp[kk][nt][0], bp[kk][nt][1], pv[nt]);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int u = 0; u < 4; ++u)
            acc[mv][nt][u] =
                fmaf(acc[mv][nt][u], alpha[nt][u & 1], pv[nt][u] * (u < 2 ? cf0 : cf1));
      }
    }
  }

  // ------------------------------------------- merge the token-slice warps, write out
  cp_async_wait(0);
  __syncthreads();  // the ring is free: reuse it for the partial accumulators
  float* macc = reinterpret_cast<float*>(ring);  // [NTS][MP][D]
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) st.l[nt][e] = quad_cols_sum(st.l[nt][e]);
  if (dsl == 0 && g == 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = 8 * nt + 2 * tig + e;
        mls[(ts * C::MP + row) * 2] = st.m[nt][e];
        mls[(ts * C::MP + row) * 2 + 1] = st.l[nt][e];
      }
  }
#pragma unroll
  for (int mv = 0; mv < C::NMV; ++mv)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int row = 8 * nt + 2 * tig + (u & 1);
        const int ch = v_channel<C>(dsl, mv, u >> 1, g);
        macc[(ts * C::MP + row) * D + ch] = acc[mv][nt][u];
      }
  __syncthreads();
  for (int idx = tid; idx < M * D; idx += C::NTHREADS) {
    const int row = idx / D, ch = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int t = 0; t < C::NTS; ++t) mx = fmaxf(mx, mls[(t * C::MP + row) * 2]);
    float lsum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int t = 0; t < C::NTS; ++t) {
        const float w = exp2f(mls[(t * C::MP + row) * 2] - mx);
        lsum = fmaf(w, mls[(t * C::MP + row) * 2 + 1], lsum);
        o = fmaf(w, macc[(t * C::MP + row) * D + ch], o);
      }
    }
    const float inv = lsum == 0.f ? 1.f : 1.f / lsum;  // an empty split writes zeros
    const long long q_off =
        (static_cast<long long>(b) * p.Q + row / p.HPG) * p.HQ + h * p.HPG + row % p.HPG;
    if (p.parts == 1) {
      p.out[q_off * D + ch] = o * inv;
    } else {
      const long long slot_id = q_off * p.parts + part;
      p.o_part[slot_id * D + ch] = o * inv;
      if (ch == 0) p.lse[slot_id] = lsum == 0.f ? -INFINITY : mx + log2f(lsum);
    }
  }
#endif
}

// Log-sum-exp merge of the parts' partials (exp2 domain), one CTA of COMBINE_THREADS per
// query row, in two rounds of global loads: the parts' lse (their max and weight sum are
// block reductions), then every partial row at once, each group of D/4 threads summing
// every ngrp-th part with float4 loads that do not wait on one another. A part that saw
// nothing has lse -inf, weight 0 and a zero row (the kernel writes one).
constexpr int COMBINE_THREADS = 128;
__host__ __device__ constexpr int combine_weight_slots(int parts) { return (parts + 3) & ~3; }

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x >> 5;
  __syncthreads();  // red is free (an earlier reduction's readers are done)
  if ((threadIdx.x & 31) == 0) red[warp] = x;
  __syncthreads();
  x = red[0];
#pragma unroll
  for (int w = 1; w < COMBINE_THREADS / 32; ++w) x = is_max ? fmaxf(x, red[w]) : x + red[w];
  return x;
}

__global__ void __launch_bounds__(COMBINE_THREADS)
kvarn_combine_kernel(const float* __restrict__ o_part, const float* __restrict__ lse,
                     float* __restrict__ out, int parts, int D) {
  extern __shared__ float4 csm4[];  // [parts] weights (padded to 4), then [ngrp][D] sums
  float* csm = reinterpret_cast<float*>(csm4);
  __shared__ float red[COMBINE_THREADS / 32];
  const long long row = blockIdx.x;
  const int tid = threadIdx.x;
  const float* l = lse + row * parts;
  float mx = -INFINITY;
  for (int s = tid; s < parts; s += COMBINE_THREADS) {
    csm[s] = l[s];
    mx = fmaxf(mx, csm[s]);
  }
  mx = block_reduce(mx, true, red);
  float wsum = 0.f;
  for (int s = tid; s < parts; s += COMBINE_THREADS) {
    const float w = csm[s] == -INFINITY ? 0.f : exp2f(csm[s] - mx);
    csm[s] = w;
    wsum += w;
  }
  wsum = block_reduce(wsum, false, red);  // its barriers also publish the weights
  const int c4 = D / 4, ngrp = COMBINE_THREADS / c4, grp = tid / c4, col = tid % c4;
  float* gsum = csm + combine_weight_slots(parts);  // 16-byte aligned for float4 stores
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* src = reinterpret_cast<const float4*>(o_part + row * parts * D) + col;
#pragma unroll 8
  for (int s = grp; s < parts; s += ngrp) {
    const float w = csm[s];
    const float4 v = src[static_cast<long long>(s) * c4];
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
  }
  reinterpret_cast<float4*>(gsum + grp * D)[col] = acc;
  __syncthreads();
  const float inv = wsum == 0.f ? 0.f : 1.f / wsum;  // no part saw a position: zeros
  for (int d = tid; d < D; d += COMBINE_THREADS) {
    float o = 0.f;
    for (int gi = 0; gi < ngrp; ++gi) o += gsum[gi * D + d];
    out[row * D + d] = o * inv;
  }
}

// One warp checks the PTX primitives' fragment layouts that the kernel relies on, so a
// failing GPU run says at once whether a layout assumption or the kernel's use of it
// is wrong. Bit 0: ldmatrix, 1: ldmatrix.trans, 2: movmatrix.trans, 3: mma.m16n8k16.
__global__ void kvarn_selftest_kernel(int* flags) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ __align__(16) uint16_t mat[4][8][8];
  const int lane = threadIdx.x, g = lane >> 2, tig = lane & 3;
  for (int i = lane; i < 256; i += 32) (&mat[0][0][0])[i] = static_cast<uint16_t>(i);
  __syncwarp();
  auto elem = [&](int m, int r, int c) { return static_cast<uint32_t>(m * 64 + r * 8 + c); };
  int bad = 0;
  uint32_t r[4], t[4];
  ldsm_x4(smem_addr(&mat[lane >> 3][lane & 7][0]), r);
  ldsm_x4_t(smem_addr(&mat[lane >> 3][lane & 7][0]), t);
  for (int m = 0; m < 4; ++m) {
    // row g, columns 2 tig, 2 tig + 1 (low half first); .trans: column g, rows 2 tig, +1
    if (r[m] != (elem(m, g, 2 * tig) | elem(m, g, 2 * tig + 1) << 16)) bad |= 1;
    if (t[m] != (elem(m, 2 * tig, g) | elem(m, 2 * tig + 1, g) << 16)) bad |= 2;
    if (movm_t(r[m]) != t[m]) bad |= 4;
  }
  // A[i][k] = (i + 2k) % 7 - 3, B[k][n] = (3k + n) % 5 - 2: small integers, exact in fp16
  auto A = [](int i, int k) { return static_cast<float>((i + 2 * k) % 7 - 3); };
  auto B = [](int k, int n) { return static_cast<float>((3 * k + n) % 5 - 2); };
  const uint32_t a[4] = {pack_h2(A(g, 2 * tig), A(g, 2 * tig + 1)),
                         pack_h2(A(g + 8, 2 * tig), A(g + 8, 2 * tig + 1)),
                         pack_h2(A(g, 2 * tig + 8), A(g, 2 * tig + 9)),
                         pack_h2(A(g + 8, 2 * tig + 8), A(g + 8, 2 * tig + 9))};
  const uint32_t b0 = pack_h2(B(2 * tig, g), B(2 * tig + 1, g));
  const uint32_t b1 = pack_h2(B(2 * tig + 8, g), B(2 * tig + 9, g));
  const float c[4] = {0.f, 0.f, 0.f, 0.f};
  float d[4];
  mma(d, a, b0, b1, c);
  for (int j = 0; j < 4; ++j) {
    const int i = g + 8 * (j >> 1), n = 2 * tig + (j & 1);
    float want = 0.f;
    for (int k = 0; k < 16; ++k) want += A(i, k) * B(k, n);
    if (d[j] != want) bad |= 8;
  }
  atomicOr(flags, bad);
#else
  if (threadIdx.x == 0) *flags = -1;
#endif
}

// ------------------------------------------------------------------ host side

template <int D, int G, int VB, int NT>
size_t smem_bytes(int nstage, int* ring_bytes) {
  using C = Cfg<D, G, VB, NT>;
  const size_t ring = static_cast<size_t>(nstage) * C::REC;
  const size_t merge = static_cast<size_t>(C::NTS) * C::MP * D * 4;
  const size_t r = ((ring > merge ? ring : merge) + 127) / 128 * 128;
  *ring_bytes = static_cast<int>(r);
  return r + C::MP * D * 4 + C::MP * C::QS * 2 + C::MP * 4 + C::NTS * C::MP * 2 * 4;
}

struct DeviceSmem {
  int per_block_optin = 0;
};

cudaError_t device_smem(int dev, DeviceSmem* out) {
  static DeviceSmem cache[64];
  if (dev < 0 || dev >= 64) return cudaErrorInvalidDevice;
  if (cache[dev].per_block_optin == 0) {
    const cudaError_t e = cudaDeviceGetAttribute(&cache[dev].per_block_optin,
                                                 cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return e;
  }
  *out = cache[dev];
  return cudaSuccess;
}

template <int D, int G, int VB, int NT>
cudaError_t launch_instance(Params p, int batch, int dev, cudaStream_t stream) {
  using C = Cfg<D, G, VB, NT>;
  DeviceSmem sm;
  cudaError_t e = device_smem(dev, &sm);
  if (e != cudaSuccess) return e;
  // ring depth, chosen once per device from the occupancy calculator (registers and shared
  // memory): the most records in flight per SM, counting at most 2 per CTA (beyond that
  // more warps help more than a deeper ring), then the most CTAs, then the deeper ring
  static int depth[64] = {};
  auto kernel = kvarn_decode_kernel<D, G, VB, NT>;
  int ring = 0;
  if (!depth[dev]) {
    int top = 0;
    for (int ns = kMaxStages; ns >= 2 && !top; --ns)
      if (smem_bytes<D, G, VB, NT>(ns, &ring) <= static_cast<size_t>(sm.per_block_optin)) top = ns;
    if (!top) return cudaErrorInvalidConfiguration;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem_bytes<D, G, VB, NT>(top, &ring)));
    if (e != cudaSuccess) return e;
    int best = 2, best_score = -1, best_ctas = -1;
    for (int ns = 2; ns <= top; ++ns) {
      int ctas = 0;
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, C::NTHREADS,
                                                        smem_bytes<D, G, VB, NT>(ns, &ring));
      if (e != cudaSuccess) return e;
      const int score = ctas * (ns - 1 < 2 ? ns - 1 : 2);
      if (score > best_score || (score == best_score && ctas >= best_ctas))
        best = ns, best_score = score, best_ctas = ctas;
    }
    depth[dev] = best;
  }
  const int nstage = depth[dev];
  const size_t bytes = smem_bytes<D, G, VB, NT>(nstage, &ring);
  p.nstage = nstage;
  p.ring_bytes = ring;
  const dim3 grid(p.parts, p.H, batch);
  kernel<<<grid, C::NTHREADS, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <int D, int G, int VB>
cudaError_t launch_rows(Params p, int batch, int dev, cudaStream_t stream) {
  return p.Q * p.HPG <= 8 ? launch_instance<D, G, VB, 1>(p, batch, dev, stream)
                          : launch_instance<D, G, VB, 2>(p, batch, dev, stream);
}

template <int D>
cudaError_t launch_preset(Params p, int batch, int group, int value_bits, int dev,
                          cudaStream_t stream) {
  if (group == 128)
    return value_bits == 2 ? launch_rows<D, 128, 2>(p, batch, dev, stream)
                           : launch_rows<D, 128, 4>(p, batch, dev, stream);
  return value_bits == 2 ? launch_rows<D, 64, 2>(p, batch, dev, stream)
                         : launch_rows<D, 64, 4>(p, batch, dev, stream);
}

}  // namespace

extern "C" {

// Partial rows per query row that a launch with `splits` needs in o_part and lse: 0 for
// one split (no combine), else splits + 1 (part 0 holds the side pool's). Callers size
// their buffers from this, so a library and a caller of different layouts cannot meet.
int kvarn_decode_partials(int splits) { return splits > 1 ? splits + 1 : 0; }

// 1 when the kernel has an instance for this shape (keys are always 4-bit).
int kvarn_decode_supported(int head_dim, int group, int value_bits, int rows) {
  return (head_dim == 64 || head_dim == 128 || head_dim == 256) && (group == 64 || group == 128) &&
         (value_bits == 2 || value_bits == 4) && rows >= 1 && rows <= 16;
}

// Runs kvarn_selftest_kernel on `stream`; *flags (device int, zeroed by the caller) gets
// the bits of the primitives whose layout differs from the kernel's assumptions.
int kvarn_decode_selftest(int* flags, void* stream) {
  kvarn_selftest_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(flags);
  return cudaGetLastError();
}

const char* kvarn_decode_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Launch the fused kernel (and the combine when splits > 1) on `stream`. Shapes only:
// no host syncs and no allocation, so it can be captured in a CUDA graph. q_dtype:
// 0 fp32, 1 fp16, 2 bf16; q is contiguous [B, Q, HQ, D]. Returns a cudaError_t.
int kvarn_decode_launch(const void* q, int q_dtype, const void* cache, const void* side,
                        const int* block_table, long long bt_stride, const int* side_table,
                        long long st_stride, int st_width, const int* seq_lens,
                        const int* num_flushed, float* out, float* o_part, float* lse,
                        int batch, int q_len, int num_q_heads, int num_kv_heads, int head_dim,
                        int group, int value_bits, int splits, float qk_scale, int device,
                        void* stream) {
  if (!kvarn_decode_supported(head_dim, group, value_bits, q_len * (num_q_heads / num_kv_heads)) ||
      num_q_heads % num_kv_heads || splits < 1 || splits > kMaxSplits || batch < 1 ||
      q_dtype < 0 || q_dtype > 2 || (splits > 1 && (!o_part || !lse)))
    return cudaErrorInvalidValue;
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e != cudaSuccess) return e;
  if (cur != device && (e = cudaSetDevice(device)) != cudaSuccess) return e;
  Params p;
  p.q = q;
  p.cache = static_cast<const uint8_t*>(cache);
  p.side = static_cast<const __half*>(side);
  p.block_table = block_table;
  p.side_table = side_table;
  p.seq_lens = seq_lens;
  p.num_flushed = num_flushed;
  p.out = out;
  p.o_part = o_part;
  p.lse = lse;
  p.bt_stride = bt_stride;
  p.st_stride = st_stride;
  p.st_width = st_width;
  p.H = num_kv_heads;
  p.HQ = num_q_heads;
  p.Q = q_len;
  p.HPG = num_q_heads / num_kv_heads;
  p.splits = splits;
  p.parts = max(1, kvarn_decode_partials(splits));  // the layout callers size buffers by
  p.q_dtype = q_dtype;
  p.qk_scale = qk_scale;
  p.nstage = 0;
  p.ring_bytes = 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (head_dim) {
    case 64: e = launch_preset<64>(p, batch, group, value_bits, device, st); break;
    case 128: e = launch_preset<128>(p, batch, group, value_bits, device, st); break;
    default: e = launch_preset<256>(p, batch, group, value_bits, device, st); break;
  }
  if (e != cudaSuccess || splits == 1) return e;
  const int rows = batch * q_len * num_q_heads;
  const size_t csmem = (combine_weight_slots(p.parts) +
                        static_cast<size_t>(COMBINE_THREADS / (head_dim / 4)) * head_dim) *
                       sizeof(float);
  kvarn_combine_kernel<<<rows, COMBINE_THREADS, csmem, st>>>(o_part, lse, out, p.parts, head_dim);
  return cudaGetLastError();
}

}  // extern "C"
