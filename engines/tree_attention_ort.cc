// glance.TreeAttention for ONNX Runtime (CPU, float32): the kernel behind the `plugin` export flavor.
//
// Same contract as the torch op glance::tree_attention (glance_rt/attention.py) and the portable
// flavor's ONNX function: q [B, H, T, D], k, v [B, KVH, L, D], tree_mask [B, T, T] bool, prefix_len [B]
// int64 (one sequence: B = 1 with tree_mask [T, T] and prefix_len [] allowed), attribute scale -> out
// [B, H, T, D]. Query row t of sequence b, head h attends sequence b's KV head h / (H / KVH) at cache
// rows j < prefix_len[b], and at rows prefix_len[b] + i where tree_mask[b, t, i]; every other row (the
// static tail of the cache) is skipped, not masked, so it costs nothing.
//
// Built by glance_rt.engines.ort_plugin against ONNX Runtime's C API header (onnxruntime_c_api.h,
// API version 13 or newer); it does not link against libonnxruntime: ORT hands the API table to
// RegisterCustomOps. It asks for API 13 and fills the OrtCustomOp table of version 13, so it loads
// in ONNX Runtime 1.13 and every later release (the C API only ever appends).

#include <onnxruntime_c_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

// The C API version this library asks for and fills its op table for: every call used exists since 1.13.
constexpr uint32_t kApiVersion = 13;
const OrtApi* g_api = nullptr;

struct Kernel {
  float scale;
};

OrtStatus* Error(const std::string& what) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("glance.TreeAttention: " + what).c_str());
}

// A version-13 kernel cannot return a status: ONNX Runtime catches what its kernels throw and
// fails the run with the message.
void Check(OrtStatus* status) {
  if (status == nullptr) return;
  std::string msg = g_api->GetErrorMessage(status);
  g_api->ReleaseStatus(status);
  throw std::runtime_error(msg);
}

// Shape of an input or output value; nullptr status on success.
OrtStatus* Shape(const OrtValue* value, std::vector<int64_t>* dims, ONNXTensorElementDataType* type) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = g_api->GetTensorTypeAndShape(value, &info)) return s;
  size_t n = 0;
  OrtStatus* s = g_api->GetDimensionsCount(info, &n);
  if (!s) {
    dims->assign(n, 0);
    s = g_api->GetDimensions(info, dims->data(), n);
  }
  if (!s) s = g_api->GetTensorElementType(info, type);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return s;
}

inline float Dot(const float* a, const float* b, int64_t d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 independent partial sums: vectorises without -ffast-math
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

// One query row: softmax(scale * q.k_j) over the visible rows `rows`, weighted sum of v_j. Built for
// AVX-512, AVX2 and baseline x86-64, picked by the loader for the CPU it runs on (GCC target_clones).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void AttendRow(const float* q, const float* k, const float* v, const std::vector<int64_t>& rows, int64_t d,
               float scale, std::vector<float>* scores, float* out) {
  scores->resize(rows.size());
  float top = -INFINITY;
  for (size_t n = 0; n < rows.size(); ++n) {
    (*scores)[n] = Dot(q, k + rows[n] * d, d) * scale;
    top = std::max(top, (*scores)[n]);
  }
  std::fill(out, out + d, 0.0f);
  float total = 0.0f;
  for (size_t n = 0; n < rows.size(); ++n) {
    const float w = std::exp((*scores)[n] - top);
    total += w;
    const float* vr = v + rows[n] * d;
    for (int64_t i = 0; i < d; ++i) out[i] += w * vr[i];
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // a row that sees nothing gives zeros
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

OrtStatus* Compute(const Kernel& kernel, OrtKernelContext* ctx) {
  const OrtValue* in[5];
  std::vector<int64_t> dims[5];
  ONNXTensorElementDataType types[5];
  for (size_t i = 0; i < 5; ++i) {
    if (OrtStatus* s = g_api->KernelContext_GetInput(ctx, i, &in[i])) return s;
    if (OrtStatus* s = Shape(in[i], &dims[i], &types[i])) return s;
  }
  for (int i = 0; i < 3; ++i)
    if (types[i] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      return Error("this CPU kernel runs float32 q, k, v only; export in float32 or use the portable flavor");
  if (dims[0].size() != 4 || dims[1].size() != 4 || dims[2] != dims[1] || dims[0][0] != dims[1][0] ||
      dims[0][3] != dims[1][3])
    return Error("expected q [B, H, T, D] and k, v [B, KVH, L, D]");
  const int64_t batch = dims[0][0], heads = dims[0][1], t = dims[0][2], d = dims[0][3], kv_heads = dims[1][1],
                len = dims[1][2];
  if (kv_heads == 0 || heads % kv_heads != 0) return Error("query heads must be a multiple of KV heads");
  const bool one_mask = batch == 1 && dims[3].size() == 2;  // a single sequence's [T, T]
  if (!one_mask && !(dims[3].size() == 3 && dims[3][0] == batch))
    return Error("expected tree_mask [B, T, T] (or [T, T] for one sequence)");
  if (dims[3][dims[3].size() - 1] != t || dims[3][dims[3].size() - 2] != t) return Error("tree_mask's rows must be T");
  const bool one_prefix = batch == 1 && (dims[4].size() == 0 || (dims[4].size() == 1 && dims[4][0] == 1));
  if (!one_prefix && !(dims[4].size() == 1 && dims[4][0] == batch))
    return Error("expected prefix_len [B] (or a scalar for one sequence)");

  void* data[5];
  for (int i = 0; i < 5; ++i)
    if (OrtStatus* s = g_api->GetTensorMutableData(const_cast<OrtValue*>(in[i]), &data[i])) return s;
  const float* q = static_cast<const float*>(data[0]);
  const float* k = static_cast<const float*>(data[1]);
  const float* v = static_cast<const float*>(data[2]);
  const bool* mask = static_cast<const bool*>(data[3]);
  const int64_t* prefix = static_cast<const int64_t*>(data[4]);
  for (int64_t b = 0; b < batch; ++b)
    if (prefix[b] < 0 || prefix[b] + t > len) return Error("prefix_len + T must fit in the cache's L rows");

  OrtValue* out_value = nullptr;
  if (OrtStatus* s = g_api->KernelContext_GetOutput(ctx, 0, dims[0].data(), dims[0].size(), &out_value)) return s;
  void* out_data = nullptr;
  if (OrtStatus* s = g_api->GetTensorMutableData(out_value, &out_data)) return s;
  float* out = static_cast<float*>(out_data);

  const int64_t groups = heads / kv_heads;
  // the cache rows query row r of sequence b sees (rows[b * t + r]): its prefix, then its tree rows
  std::vector<std::vector<int64_t>> rows(batch * t);
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < t; ++r) {
      std::vector<int64_t>& seen = rows[b * t + r];
      for (int64_t j = 0; j < prefix[b]; ++j) seen.push_back(j);
      for (int64_t i = 0; i < t; ++i)
        if (mask[(b * t + r) * t + i]) seen.push_back(prefix[b] + i);
      work += static_cast<int64_t>(seen.size()) * heads * d;
    }
  // (sequence, head) pairs n = b * heads + h, split over threads
  auto pairs_from_to = [&](int64_t n0, int64_t n1) {
    std::vector<float> scores;
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t b = n / heads, h = n % heads;
      const int64_t kv = (b * kv_heads + h / groups) * len * d;
      for (int64_t r = 0; r < t; ++r)
        AttendRow(q + (n * t + r) * d, k + kv, v + kv, rows[b * t + r], d, kernel.scale, &scores, out + (n * t + r) * d);
    }
  };
  // Threads when there is enough work to pay for starting them (~1M multiply-adds each).
  const int64_t total = batch * heads;
  const int64_t threads = std::min<int64_t>({total, std::max(1u, std::thread::hardware_concurrency()),
                                             std::max<int64_t>(1, work >> 20)});
  std::vector<std::thread> pool;
  for (int64_t n = 1; n < threads; ++n) pool.emplace_back(pairs_from_to, total * n / threads, total * (n + 1) / threads);
  pairs_from_to(0, total / threads);
  for (auto& th : pool) th.join();
  return nullptr;
}

// --- the OrtCustomOp table ---------------------------------------------------------------------

const char* ORT_API_CALL GetName(const OrtCustomOp*) { return "TreeAttention"; }
const char* ORT_API_CALL GetExecutionProviderType(const OrtCustomOp*) { return "CPUExecutionProvider"; }

ONNXTensorElementDataType ORT_API_CALL GetInputType(const OrtCustomOp*, size_t index) {
  if (index == 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  if (index == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t ORT_API_CALL GetInputTypeCount(const OrtCustomOp*) { return 5; }
ONNXTensorElementDataType ORT_API_CALL GetOutputType(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
size_t ORT_API_CALL GetOutputTypeCount(const OrtCustomOp*) { return 1; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL Required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}
OrtMemType ORT_API_CALL GetInputMemoryType(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }

void* ORT_API_CALL CreateKernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  float scale = 0.0f;
  Check(g_api->KernelInfoGetAttribute_float(info, "scale", &scale));
  return new Kernel{scale};
}
void ORT_API_CALL KernelCompute(void* kernel, OrtKernelContext* ctx) {
  Check(Compute(*static_cast<Kernel*>(kernel), ctx));
}
void ORT_API_CALL KernelDestroy(void* kernel) { delete static_cast<Kernel*>(kernel); }

OrtCustomOp MakeOp() {
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));  // fields past `version` are read only as far as `version` says
  op.version = kApiVersion;
  op.CreateKernel = CreateKernel;
  op.GetName = GetName;
  op.GetExecutionProviderType = GetExecutionProviderType;
  op.GetInputType = GetInputType;
  op.GetInputTypeCount = GetInputTypeCount;
  op.GetOutputType = GetOutputType;
  op.GetOutputTypeCount = GetOutputTypeCount;
  op.KernelCompute = KernelCompute;
  op.KernelDestroy = KernelDestroy;
  op.GetInputCharacteristic = Required;
  op.GetOutputCharacteristic = Required;
  op.GetInputMemoryType = GetInputMemoryType;
  return op;
}

OrtCustomOp g_op = MakeOp();

}  // namespace

// ORT_EXPORT is empty on Linux; the library is built with hidden visibility, so say it here.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  g_api = base->GetApi(kApiVersion);
  if (g_api == nullptr) return nullptr;  // cannot even report: this ONNX Runtime predates API 13
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* s = g_api->CreateCustomOpDomain("glance", &domain)) return s;
  if (OrtStatus* s = g_api->CustomOpDomain_Add(domain, &g_op)) return s;
  return g_api->AddCustomOpDomain(options, domain);  // the session options keep the domain alive
}
