// ampx CUDA kernels for compensated (Kahan) half-weight SGD and Adam/AdamW steps: the math
// of compensated.cpp (and ampx/_reference_compensated.py) with explicit round-to-nearest
// intrinsics (__fadd_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn: never contracted into an FMA;
// the build also passes --fmad=false), in the reference's order, round-to-nearest-even to
// the half dtypes.
//
// Multi-tensor-apply as in kernels_cuda.cu: the host packs up to kMaxTensors tensors (five
// pointers each: w, c, grad, two state lists) and kMaxBlocks (tensor, chunk) pairs into a
// by-value kernel argument; each block updates one chunk of kChunk elements with a
// grid-stride loop. Element types are carried per tensor and dispatched once per block.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "compensated.h"

namespace ampx {
namespace {

constexpr int kMaxTensors = 32;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

struct Meta {
  void* w[kMaxTensors];
  void* c[kMaxTensors];
  const void* g[kMaxTensors];
  void* s1[kMaxTensors];
  void* s2[kMaxTensors];
  int64_t numel[kMaxTensors];
  uint8_t w_kind[kMaxTensors];
  uint8_t g_kind[kMaxTensors];
  uint8_t s_kind[kMaxTensors];
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};
static_assert(sizeof(Meta) < 4000, "Meta must fit in the 4 KiB kernel parameter space");

template <typename T>
__device__ __forceinline__ float ld(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// w = half(x); c = half(x - float(w)).
template <typename W>
__device__ __forceinline__ void write_back(W* __restrict__ w, W* __restrict__ c, int64_t i,
                                           float x) {
  const W high = static_cast<W>(x);  // round to nearest even
  w[i] = high;
  c[i] = static_cast<W>(__fsub_rn(x, static_cast<float>(high)));
}

template <typename W, typename G, typename B>
__device__ void sgd_span(const Meta& m, int t, int64_t begin, int64_t end,
                         const SgdScalars& p) {
  W* __restrict__ w = static_cast<W*>(m.w[t]);
  W* __restrict__ c = static_cast<W*>(m.c[t]);
  const G* __restrict__ g = static_cast<const G*>(m.g[t]);
  B* __restrict__ buf = static_cast<B*>(m.s1[t]);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float x = __fadd_rn(ld(w, i), ld(c, i));
    float gr = ld(g, i);
    if (p.maximize) gr = -gr;
    if (p.decay) gr = __fadd_rn(gr, __fmul_rn(x, p.wd));
    if (p.momentum) {
      const float b = p.first ? gr
                              : __fadd_rn(__fmul_rn(ld(buf, i), p.mu), __fmul_rn(gr, p.keep));
      buf[i] = static_cast<B>(b);
      gr = p.nesterov ? __fadd_rn(gr, __fmul_rn(b, p.mu)) : b;
    }
    x = __fsub_rn(x, __fmul_rn(gr, p.lr));
    write_back(w, c, i, x);
  }
}

template <typename W, typename G, typename S>
__device__ void adam_span(const Meta& m, int t, int64_t begin, int64_t end,
                          const AdamScalars& p) {
  W* __restrict__ w = static_cast<W*>(m.w[t]);
  W* __restrict__ c = static_cast<W*>(m.c[t]);
  const G* __restrict__ g = static_cast<const G*>(m.g[t]);
  S* __restrict__ ms = static_cast<S*>(m.s1[t]);
  S* __restrict__ vs = static_cast<S*>(m.s2[t]);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float x = __fadd_rn(ld(w, i), ld(c, i));
    float gr = ld(g, i);
    if (p.maximize) gr = -gr;
    if (p.decoupled) {
      x = __fmul_rn(x, p.decay);
    } else if (p.coupled_decay) {
      gr = __fadd_rn(gr, __fmul_rn(x, p.wd));
    }
    const float mm = __fadd_rn(__fmul_rn(ld(ms, i), p.b1), __fmul_rn(gr, p.one_b1));
    const float vv =
        __fadd_rn(__fmul_rn(ld(vs, i), p.b2), __fmul_rn(__fmul_rn(gr, gr), p.one_b2));
    ms[i] = static_cast<S>(mm);
    vs[i] = static_cast<S>(vv);
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), p.root2), p.eps);
    x = __fsub_rn(x, __fmul_rn(__fdiv_rn(mm, denom), p.size));
    write_back(w, c, i, x);
  }
}

// ---- dispatch: W in {Half, BFloat16}; G and the state in {float, W} ----
template <typename W, typename G, typename P>
__device__ void run_s(const Meta& m, int t, int64_t b, int64_t e, const P& p) {
  const bool f32 = static_cast<Kind>(m.s_kind[t]) == Kind::F32;
  if constexpr (std::is_same_v<P, SgdScalars>) {
    if (f32) {
      sgd_span<W, G, float>(m, t, b, e, p);
    } else {
      sgd_span<W, G, W>(m, t, b, e, p);
    }
  } else {
    if (f32) {
      adam_span<W, G, float>(m, t, b, e, p);
    } else {
      adam_span<W, G, W>(m, t, b, e, p);
    }
  }
}

template <typename W, typename P>
__device__ void run_g(const Meta& m, int t, int64_t b, int64_t e, const P& p) {
  if (static_cast<Kind>(m.g_kind[t]) == Kind::F32) {
    run_s<W, float>(m, t, b, e, p);
  } else {
    run_s<W, W>(m, t, b, e, p);
  }
}

template <typename P>
__global__ void __launch_bounds__(kThreads) compensated_kernel(Meta m, P p) {
  const int t = m.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(m.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = begin + kChunk < m.numel[t] ? begin + kChunk : m.numel[t];
  if (static_cast<Kind>(m.w_kind[t]) == Kind::F16) {
    run_g<c10::Half>(m, t, begin, end, p);
  } else {
    run_g<c10::BFloat16>(m, t, begin, end, p);
  }
}

// ---- host side ----
// Packs (tensor, chunk) work into Meta and launches the kernel per batch. s1/s2 may be
// null (SGD without momentum: no buffers; SGD: no second state list).
template <typename P>
void launch_all(const TensorList& params, const TensorList& comps, const TensorList& grads,
                const TensorList* s1, const TensorList* s2, const P& p) {
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Meta m;
  int nt = 0;
  int nb = 0;
  auto launch = [&]() {
    compensated_kernel<P><<<nb, kThreads, 0, stream>>>(m, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) {
      continue;
    }
    m.w[nt] = params[i].data_ptr();
    m.c[nt] = comps[i].data_ptr();
    m.g[nt] = grads[i].data_ptr();
    m.s1[nt] = s1 != nullptr ? (*s1)[i].data_ptr() : nullptr;
    m.s2[nt] = s2 != nullptr ? (*s2)[i].data_ptr() : nullptr;
    m.numel[nt] = n;
    m.w_kind[nt] = static_cast<uint8_t>(kind_of(params[i]));
    m.g_kind[nt] = static_cast<uint8_t>(kind_of(grads[i]));
    m.s_kind[nt] = static_cast<uint8_t>(s1 != nullptr ? kind_of((*s1)[i]) : kind_of(params[i]));
    ++nt;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t k = 0; k < chunks; ++k) {
      m.block_tensor[nb] = static_cast<uint8_t>(nt - 1);
      m.block_chunk[nb] = static_cast<int32_t>(k);
      ++nb;
      const bool last = k == chunks - 1;
      if (nb == kMaxBlocks || (nt == kMaxTensors && last)) {
        launch();
        nb = 0;
        if (last) {
          nt = 0;
        } else {  // carry the unfinished tensor over to the next batch
          m.w[0] = m.w[nt - 1];
          m.c[0] = m.c[nt - 1];
          m.g[0] = m.g[nt - 1];
          m.s1[0] = m.s1[nt - 1];
          m.s2[0] = m.s2[nt - 1];
          m.numel[0] = m.numel[nt - 1];
          m.w_kind[0] = m.w_kind[nt - 1];
          m.g_kind[0] = m.g_kind[nt - 1];
          m.s_kind[0] = m.s_kind[nt - 1];
          nt = 1;
        }
      }
    }
  }
  if (nb > 0) {
    launch();
  }
}

}  // namespace

void compensated_sgd_cuda(const TensorList& params, const TensorList& comps,
                          const TensorList& grads, const TensorList& bufs,
                          const SgdScalars& p) {
  launch_all(params, comps, grads, p.momentum ? &bufs : nullptr, nullptr, p);
}

void compensated_adam_cuda(const TensorList& params, const TensorList& comps,
                           const TensorList& grads, const TensorList& exp_avgs,
                           const TensorList& exp_avg_sqs, const AdamScalars& p) {
  launch_all(params, comps, grads, &exp_avgs, &exp_avg_sqs, p);
}

}  // namespace ampx
