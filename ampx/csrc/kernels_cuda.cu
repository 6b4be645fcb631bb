// ampx CUDA kernels: the contract of ampx/_reference.py in multi-tensor-apply style.
//
// The host walks the list once and packs, per launch, up to kMaxTensors tensor
// descriptors and kMaxBlocks (tensor, chunk) pairs into a by-value kernel argument
// (Meta, < 4 KiB). Each block handles one chunk of kChunk elements of one tensor;
// the element types are carried per tensor and dispatched once per block, so a list
// that mixes float32/float16/bfloat16 needs no host-side grouping. Flags are raised
// with __syncthreads_or by one thread per block (all writers store 1.0f).
//
// Bandwidth: each thread moves a 16-byte pack per iteration (4 float32 or 8
// float16/bfloat16 elements) when the block's pointers are aligned for it (checked
// per block, at run time: views with odd offsets take the scalar loop), src and dst
// are __restrict__ (the contract forbids aliasing), and the scalar loop only
// handles the unaligned case and the last few elements of a tensor.
//
// Numerics match the CPU kernels: float32 multiply and add with explicit
// round-to-nearest intrinsics (__fmul_rn/__fadd_rn: never contracted into an FMA),
// round-to-nearest-even to the output dtype, float64 sums of squares reduced in a
// fixed order (deterministic: the same bits for any launch timing), one final
// rounding to float32.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ampx.h"

namespace ampx {
namespace {

constexpr int kMaxTensors = 48;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;
constexpr int kPackBytes = 16;

struct Meta {
  const void* src[kMaxTensors];
  void* dst[kMaxTensors];
  int64_t numel[kMaxTensors];
  int32_t index[kMaxTensors];  // position in the caller's list (per-tensor outputs)
  uint8_t src_kind[kMaxTensors];
  uint8_t dst_kind[kMaxTensors];
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};
static_assert(sizeof(Meta) < 4000, "Meta must fit in the 4 KiB kernel parameter space");
static_assert(kChunk % (kPackBytes / 2) == 0, "chunks must start on a pack boundary");

// ---- element access ----
template <typename T>
__device__ __forceinline__ float load_f(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}
template <typename T>
__device__ __forceinline__ void store_f(T* p, int64_t i, float v) {
  p[i] = static_cast<T>(v);  // c10::Half/BFloat16: round to nearest even
}

// N elements of T moved as one aligned access (16 bytes, or 32 as two 16-byte halves).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements per thread and iteration for a src/dst type pair: 16 bytes of the narrower.
template <typename S, typename D>
constexpr int kPackWidth =
    kPackBytes / static_cast<int>(sizeof(S) < sizeof(D) ? sizeof(S) : sizeof(D));

template <int N, typename T>
__device__ __forceinline__ bool aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N) == 0;
}

template <int N, typename T>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, int64_t i, float (&out)[N]) {
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p + i);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    out[k] = static_cast<float>(pack.v[k]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* __restrict__ p, int64_t i, const float (&in)[N]) {
  Pack<T, N> pack;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    pack.v[k] = static_cast<T>(in[k]);
  }
  *reinterpret_cast<Pack<T, N>*>(p + i) = pack;
}

// std::min/std::max semantics (NaN in the first argument propagates), as on CPU.
__device__ __forceinline__ float min_like_std(float a, float b) { return (b < a) ? b : a; }
__device__ __forceinline__ float max_like_std(float a, float b) { return (a < b) ? b : a; }

struct Span {
  int t;
  int64_t begin;
  int64_t end;
};

__device__ __forceinline__ Span block_span(const Meta& m) {
  const int t = m.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(m.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = begin + kChunk < m.numel[t] ? begin + kChunk : m.numel[t];
  return {t, begin, end};
}

// Where the pack loop stops and the scalar loop takes over: the span's end rounded
// down to whole packs when the pointers allow packs, else its beginning.
template <int N>
__device__ __forceinline__ int64_t pack_end(const Span& s, bool packs) {
  return packs ? s.begin + (s.end - s.begin) / N * N : s.begin;
}

__device__ __forceinline__ void raise_flags(bool bad, const Meta& m, int t, float* found_inf,
                                            float* per_tensor) {
  if (__syncthreads_or(bad) && threadIdx.x == 0) {
    *found_inf = 1.f;
    if (per_tensor != nullptr) {
      per_tensor[m.index[t]] = 1.f;
    }
  }
}

// ---- unscale_ ----
template <typename T>
__device__ bool unscale_span(T* __restrict__ p, const Span& s, float inv) {
  constexpr int N = kPackWidth<T, T>;
  bool bad = false;
  const bool scale = inv != 1.f;
  const int64_t tail = pack_end<N>(s, aligned<N>(p));
  for (int64_t i = s.begin + threadIdx.x * N; i < tail; i += blockDim.x * N) {
    float v[N];
    load_pack<N>(p, i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      bad |= !isfinite(v[k]);
      v[k] = __fmul_rn(v[k], inv);
    }
    if (scale) {
      store_pack<N>(p, i, v);
    }
  }
  for (int64_t i = tail + threadIdx.x; i < s.end; i += blockDim.x) {
    const float v = load_f(p, i);
    bad |= !isfinite(v);
    if (scale) {
      store_f(p, i, __fmul_rn(v, inv));
    }
  }
  return bad;
}

__global__ void __launch_bounds__(kThreads)
    unscale_kernel(Meta m, const float* __restrict__ inv_scale, float* found_inf,
                   float* per_tensor) {
  const Span s = block_span(m);
  const float inv = *inv_scale;
  void* p = m.dst[s.t];
  bool bad = false;
  switch (static_cast<Kind>(m.src_kind[s.t])) {
    case Kind::F16:
      bad = unscale_span(static_cast<c10::Half*>(p), s, inv);
      break;
    case Kind::BF16:
      bad = unscale_span(static_cast<c10::BFloat16*>(p), s, inv);
      break;
    default:
      bad = unscale_span(static_cast<float*>(p), s, inv);
      break;
  }
  raise_flags(bad, m, s.t, found_inf, per_tensor);
}

// ---- unscale_into_ ----
template <bool Accumulate, typename S, typename D>
__device__ bool into_span(const S* __restrict__ src, D* __restrict__ dst, const Span& s,
                          float inv) {
  constexpr int N = kPackWidth<S, D>;
  bool bad = false;
  const int64_t tail = pack_end<N>(s, aligned<N>(src) && aligned<N>(dst));
  for (int64_t i = s.begin + threadIdx.x * N; i < tail; i += blockDim.x * N) {
    float v[N];
    load_pack<N>(src, i, v);
    float d[N];
    if (Accumulate) {
      load_pack<N>(dst, i, d);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      bad |= !isfinite(v[k]);
      v[k] = __fmul_rn(v[k], inv);
      if (Accumulate) {
        v[k] = __fadd_rn(d[k], v[k]);
      }
    }
    store_pack<N>(dst, i, v);
  }
  for (int64_t i = tail + threadIdx.x; i < s.end; i += blockDim.x) {
    const float v = load_f(src, i);
    bad |= !isfinite(v);
    float r = __fmul_rn(v, inv);
    if (Accumulate) {
      r = __fadd_rn(load_f(dst, i), r);
    }
    store_f(dst, i, r);
  }
  return bad;
}

template <bool Accumulate, typename S>
__device__ bool into_dispatch_dst(const S* src, const Meta& m, const Span& s, float inv) {
  void* d = m.dst[s.t];
  switch (static_cast<Kind>(m.dst_kind[s.t])) {
    case Kind::F16:
      return into_span<Accumulate>(src, static_cast<c10::Half*>(d), s, inv);
    case Kind::BF16:
      return into_span<Accumulate>(src, static_cast<c10::BFloat16*>(d), s, inv);
    default:
      return into_span<Accumulate>(src, static_cast<float*>(d), s, inv);
  }
}

template <bool Accumulate>
__global__ void __launch_bounds__(kThreads)
    unscale_into_kernel(Meta m, const float* __restrict__ inv_scale, float* found_inf,
                        float* per_tensor) {
  const Span s = block_span(m);
  const float inv = *inv_scale;
  const void* p = m.src[s.t];
  bool bad = false;
  switch (static_cast<Kind>(m.src_kind[s.t])) {
    case Kind::F16:
      bad = into_dispatch_dst<Accumulate>(static_cast<const c10::Half*>(p), m, s, inv);
      break;
    case Kind::BF16:
      bad = into_dispatch_dst<Accumulate>(static_cast<const c10::BFloat16*>(p), m, s, inv);
      break;
    default:
      bad = into_dispatch_dst<Accumulate>(static_cast<const float*>(p), m, s, inv);
      break;
  }
  raise_flags(bad, m, s.t, found_inf, per_tensor);
}

// ---- copy_ ----
template <typename S, typename D>
__device__ void copy_span(const S* __restrict__ src, D* __restrict__ dst, const Span& s) {
  constexpr int N = kPackWidth<S, D>;
  const int64_t tail = pack_end<N>(s, aligned<N>(src) && aligned<N>(dst));
  for (int64_t i = s.begin + threadIdx.x * N; i < tail; i += blockDim.x * N) {
    float v[N];
    load_pack<N>(src, i, v);
    store_pack<N>(dst, i, v);
  }
  for (int64_t i = tail + threadIdx.x; i < s.end; i += blockDim.x) {
    store_f(dst, i, load_f(src, i));
  }
}

template <typename S>
__device__ void copy_dispatch_dst(const S* src, const Meta& m, const Span& s) {
  void* d = m.dst[s.t];
  switch (static_cast<Kind>(m.dst_kind[s.t])) {
    case Kind::F16:
      copy_span(src, static_cast<c10::Half*>(d), s);
      break;
    case Kind::BF16:
      copy_span(src, static_cast<c10::BFloat16*>(d), s);
      break;
    default:
      copy_span(src, static_cast<float*>(d), s);
      break;
  }
}

__global__ void __launch_bounds__(kThreads) copy_kernel(Meta m) {
  const Span s = block_span(m);
  const void* p = m.src[s.t];
  switch (static_cast<Kind>(m.src_kind[s.t])) {
    case Kind::F16:
      copy_dispatch_dst(static_cast<const c10::Half*>(p), m, s);
      break;
    case Kind::BF16:
      copy_dispatch_dst(static_cast<const c10::BFloat16*>(p), m, s);
      break;
    default:
      copy_dispatch_dst(static_cast<const float*>(p), m, s);
      break;
  }
}

// ---- l2norm ----
// Sums a block's values into shared[0] in a fixed tree order (deterministic).
__device__ __forceinline__ double block_sum(double value, double* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) {
      shared[threadIdx.x] += shared[threadIdx.x + stride];
    }
    __syncthreads();
  }
  return shared[0];
}

template <typename T>
__device__ double sumsq_span(const T* __restrict__ p, const Span& s) {
  constexpr int N = kPackWidth<T, T>;
  double acc[N] = {};  // one accumulator per pack lane: independent adds, fixed order
  const int64_t tail = pack_end<N>(s, aligned<N>(p));
  for (int64_t i = s.begin + threadIdx.x * N; i < tail; i += blockDim.x * N) {
    float v[N];
    load_pack<N>(p, i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const double x = static_cast<double>(v[k]);
      acc[k] += x * x;
    }
  }
  for (int64_t i = tail + threadIdx.x; i < s.end; i += blockDim.x) {
    const double x = static_cast<double>(load_f(p, i));
    acc[0] += x * x;
  }
  double total = 0.0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    total += acc[k];
  }
  return total;
}

// One float64 partial sum of squares per block. Partials are written in launch order,
// so each tensor's partials are consecutive and `owner` (its list index) is sorted.
__global__ void __launch_bounds__(kThreads)
    l2norm_partial_kernel(Meta m, double* __restrict__ partial, int32_t* __restrict__ owner,
                          int64_t base) {
  __shared__ double shared[kThreads];
  const Span s = block_span(m);
  const void* p = m.src[s.t];
  double acc = 0.0;
  switch (static_cast<Kind>(m.src_kind[s.t])) {
    case Kind::F16:
      acc = sumsq_span(static_cast<const c10::Half*>(p), s);
      break;
    case Kind::BF16:
      acc = sumsq_span(static_cast<const c10::BFloat16*>(p), s);
      break;
    default:
      acc = sumsq_span(static_cast<const float*>(p), s);
      break;
  }
  const double sum = block_sum(acc, shared);
  if (threadIdx.x == 0) {
    partial[base + blockIdx.x] = sum;
    owner[base + blockIdx.x] = m.index[s.t];
  }
}

// First position in the sorted owner[0, n) whose value is >= key.
__device__ __forceinline__ int64_t lower_bound(const int32_t* owner, int64_t n, int32_t key) {
  int64_t lo = 0;
  int64_t hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (owner[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Block i sums tensor i's partials: each thread a fixed strided subset, then a tree.
__global__ void __launch_bounds__(kThreads)
    l2norm_tensor_kernel(const double* __restrict__ partial, const int32_t* __restrict__ owner,
                         int64_t nblocks, double* __restrict__ sumsq) {
  __shared__ double shared[kThreads];
  const auto t = static_cast<int32_t>(blockIdx.x);
  const int64_t begin = lower_bound(owner, nblocks, t);
  const int64_t end = lower_bound(owner, nblocks, t + 1);
  double acc = 0.0;
  for (int64_t b = begin + threadIdx.x; b < end; b += blockDim.x) {
    acc += partial[b];
  }
  const double sum = block_sum(acc, shared);
  if (threadIdx.x == 0) {
    sumsq[t] = sum;
  }
}

// One block: the total over the per-tensor sums (fixed order), the square roots.
__global__ void __launch_bounds__(kThreads)
    l2norm_total_kernel(const double* __restrict__ sumsq, int64_t ntensors,
                        float* __restrict__ norms, float* __restrict__ total) {
  __shared__ double shared[kThreads];
  double acc = 0.0;
  for (int64_t t = threadIdx.x; t < ntensors; t += blockDim.x) {
    acc += sumsq[t];
    if (norms != nullptr) {
      norms[t] = static_cast<float>(sqrt(sumsq[t]));
    }
  }
  const double all = block_sum(acc, shared);
  if (threadIdx.x == 0) {
    *total = static_cast<float>(sqrt(all));
  }
}

// ---- update_scale_ ----
__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker,
                                    int32_t* hysteresis_tracker, const float* found_inf,
                                    ScaleParams p) {
  float s = *scale;
  if (*found_inf > 0.f) {
    *growth_tracker = 0;
    if (*hysteresis_tracker <= 1) {
      *scale = min_like_std(max_like_std(__fmul_rn(s, p.backoff), p.min_scale), p.max_scale);
    } else {
      *hysteresis_tracker -= 1;
    }
  } else {
    const int64_t next = static_cast<int64_t>(*growth_tracker) + 1;
    if (next >= p.interval) {
      const float grown = __fmul_rn(s, p.growth);
      if (isfinite(grown)) {
        *scale = min_like_std(grown, p.max_scale);
      }
      *growth_tracker = 0;
      *hysteresis_tracker = p.hysteresis;
    } else {
      *growth_tracker = static_cast<int32_t>(next);
    }
  }
}

// ---- host side ----
// Packs (tensor, chunk) work into Meta and calls launch(meta, nblocks) per batch.
template <typename Launch>
void for_each_launch(const TensorList& src, const TensorList* dst, const Launch& launch) {
  Meta m;
  int nt = 0;
  int nb = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const int64_t n = src[i].numel();
    if (n == 0) {
      continue;
    }
    const at::Tensor& out = dst != nullptr ? (*dst)[i] : src[i];
    m.src[nt] = src[i].data_ptr();
    m.dst[nt] = out.data_ptr();
    m.numel[nt] = n;
    m.index[nt] = static_cast<int32_t>(i);
    m.src_kind[nt] = static_cast<uint8_t>(kind_of(src[i]));
    m.dst_kind[nt] = static_cast<uint8_t>(kind_of(out));
    ++nt;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      m.block_tensor[nb] = static_cast<uint8_t>(nt - 1);
      m.block_chunk[nb] = static_cast<int32_t>(c);
      ++nb;
      const bool last = c == chunks - 1;
      if (nb == kMaxBlocks || (nt == kMaxTensors && last)) {
        launch(m, nb);
        nb = 0;
        if (last) {
          nt = 0;
        } else {  // carry the unfinished tensor over to the next batch
          m.src[0] = m.src[nt - 1];
          m.dst[0] = m.dst[nt - 1];
          m.numel[0] = m.numel[nt - 1];
          m.index[0] = m.index[nt - 1];
          m.src_kind[0] = m.src_kind[nt - 1];
          m.dst_kind[0] = m.dst_kind[nt - 1];
          nt = 1;
        }
      }
    }
  }
  if (nb > 0) {
    launch(m, nb);
  }
}

float* flags_ptr(const OptTensor& per_tensor) {
  return per_tensor.has_value() ? per_tensor->data_ptr<float>() : nullptr;
}

}  // namespace

void unscale_cuda(const TensorList& grads, const at::Tensor& inv_scale,
                  const at::Tensor& found_inf, const OptTensor& per_tensor) {
  const c10::cuda::CUDAGuard guard(grads[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float* inv = inv_scale.data_ptr<float>();
  float* found = found_inf.data_ptr<float>();
  float* flags = flags_ptr(per_tensor);
  for_each_launch(grads, nullptr, [&](const Meta& m, int nb) {
    unscale_kernel<<<nb, kThreads, 0, stream>>>(m, inv, found, flags);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void unscale_into_cuda(const TensorList& src, const TensorList& dst,
                       const at::Tensor& inv_scale, const at::Tensor& found_inf,
                       const OptTensor& per_tensor, bool accumulate) {
  const c10::cuda::CUDAGuard guard(src[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float* inv = inv_scale.data_ptr<float>();
  float* found = found_inf.data_ptr<float>();
  float* flags = flags_ptr(per_tensor);
  for_each_launch(src, &dst, [&](const Meta& m, int nb) {
    if (accumulate) {
      unscale_into_kernel<true><<<nb, kThreads, 0, stream>>>(m, inv, found, flags);
    } else {
      unscale_into_kernel<false><<<nb, kThreads, 0, stream>>>(m, inv, found, flags);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void copy_cuda(const TensorList& src, const TensorList& dst) {
  const c10::cuda::CUDAGuard guard(src[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for_each_launch(src, &dst, [&](const Meta& m, int nb) {
    copy_kernel<<<nb, kThreads, 0, stream>>>(m);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor> l2norm_cuda(const TensorList& tensors, bool per_tensor) {
  const at::Device device = tensors[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int64_t nblocks = 0;
  for (const at::Tensor& t : tensors) {
    nblocks += (t.numel() + kChunk - 1) / kChunk;
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor total = at::zeros({}, f32);
  at::Tensor norms = at::zeros({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, f32);
  if (nblocks == 0) {
    return {total, norms};
  }
  at::Tensor partial = at::empty({nblocks}, f32.dtype(at::kDouble));
  at::Tensor owner = at::empty({nblocks}, f32.dtype(at::kInt));
  double* partial_ptr = partial.data_ptr<double>();
  int32_t* owner_ptr = owner.data_ptr<int32_t>();
  int64_t base = 0;
  for_each_launch(tensors, nullptr, [&](const Meta& m, int nb) {
    l2norm_partial_kernel<<<nb, kThreads, 0, stream>>>(m, partial_ptr, owner_ptr, base);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    base += nb;
  });
  const auto ntensors = static_cast<int64_t>(tensors.size());
  at::Tensor sumsq = at::empty({ntensors}, f32.dtype(at::kDouble));
  l2norm_tensor_kernel<<<static_cast<unsigned>(ntensors), kThreads, 0, stream>>>(
      partial_ptr, owner_ptr, nblocks, sumsq.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  l2norm_total_kernel<<<1, kThreads, 0, stream>>>(
      sumsq.data_ptr<double>(), ntensors, per_tensor ? norms.data_ptr<float>() : nullptr,
      total.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {total, norms};
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       const ScaleParams& p) {
  const c10::cuda::CUDAGuard guard(scale.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  update_scale_kernel<<<1, 1, 0, stream>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
      hysteresis_tracker.data_ptr<int32_t>(), found_inf.data_ptr<float>(), p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

CudaLimits cuda_limits() { return {kChunk, kMaxTensors, kMaxBlocks, kThreads, kPackBytes}; }

std::string cuda_probe(int device) {
  // Asks the runtime for the kernel image this device would run: fails with "no kernel
  // image is available" (or a PTX/driver mismatch) instead of at the first launch.
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaFuncAttributes attributes{};
  const cudaError_t status = cudaFuncGetAttributes(&attributes, unscale_kernel);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: this failure must not surface in a later call
    return cudaGetErrorString(status);
  }
  return "";
}

}  // namespace ampx
