// hf_zero3 prefetch gate: the run-time half of the memory planner.
//
// The planner (hf_zero3/compile/planner.py) places each fused prefetch where its projected live
// memory fits the budget. At run time the memory can differ from the profile (dynamic shapes, an
// eval graph, fragmentation), so every planned prefetch goes through `hf_zero3::gated_prefetch`:
// it issues DeepCompile's fused all-gather when `window_peak + drift <= budget`, and otherwise
// leaves the gather to its point of use (DeepCompile's allgather_param gathers whatever is not
// resident). `launch` = [drift, budget] was agreed over the gather group once per graph launch
// (hf_zero3::agree_launch), so the decision is the same on every rank and the NCCL all-gathers
// stay in the same order everywhere.
//
// Also here: `memory_state`, the caching allocator's counters and the device's free/total read
// natively, with no Python round trip. The CUDA part is compiled only with HF_ZERO3_WITH_CUDA.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <atomic>
#include <vector>

#ifdef HF_ZERO3_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace hf_zero3 {

namespace {
std::atomic<int64_t> g_issued{0};
std::atomic<int64_t> g_deferred{0};
std::atomic<int64_t> g_issued_bytes{0};
std::atomic<int64_t> g_deferred_bytes{0};
std::atomic<int64_t> g_launches{0};
}  // namespace

// [allocated, reserved, device free, device total, per-process fraction in millionths]
std::vector<int64_t> memory_state(int64_t device)
{
#ifdef HF_ZERO3_WITH_CUDA
    const auto dev = static_cast<c10::DeviceIndex>(device);
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev);
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    size_t free_b = 0, total_b = 0;
    {
        c10::cuda::CUDAGuard guard(dev);
        C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    }
    const double fraction = c10::cuda::CUDACachingAllocator::getMemoryFraction(dev);
    return {stats.allocated_bytes[agg].current,
            stats.reserved_bytes[agg].current,
            static_cast<int64_t>(free_b),
            static_cast<int64_t>(total_b),
            static_cast<int64_t>(fraction * 1e6)};
#else
    TORCH_CHECK(false, "hf_zero3 gate was built without CUDA: memory_state needs a CUDA build");
#endif
}

// The decision: pure, identical on every rank that holds the same agreed `launch`.
bool decide(int64_t window_peak, const at::Tensor& launch)
{
    // A launch without data (DeepCompile's profiler may run the graph on meta/fake values) defers.
    if (!launch.defined() || launch.is_meta() || launch.numel() != 2) { return false; }
    const at::Tensor l = launch.to(at::kCPU, at::kLong).contiguous();  // no-op for agree_launch's
    const auto* a = l.data_ptr<int64_t>();
    return window_peak + a[0] <= a[1];
}

void note_launch() { g_launches.fetch_add(1); }

void gated_prefetch(int64_t graph_id,
                    const std::vector<at::Tensor>& params,
                    const std::vector<int64_t>& ids,
                    int64_t nbytes,
                    int64_t window_peak,
                    const at::Tensor& launch)
{
    if (!decide(window_peak, launch)) {
        g_deferred.fetch_add(1);
        g_deferred_bytes.fetch_add(nbytes);
        return;
    }
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("dc::prefetch_params_fused", "");
    torch::jit::Stack stack;
    stack.emplace_back(graph_id);
    stack.emplace_back(params);
    stack.emplace_back(ids);
    stack.emplace_back(c10::IValue());  // dtypes: as DeepSpeed's own prefetch pass
    op.callBoxed(&stack);
    g_issued.fetch_add(1);
    g_issued_bytes.fetch_add(nbytes);
}

void gated_prefetch_meta(int64_t, const std::vector<at::Tensor>&, const std::vector<int64_t>&, int64_t,
                         int64_t, const at::Tensor&)
{
}

std::map<std::string, int64_t> counters()
{
    return {{"issued", g_issued.load()},
            {"deferred", g_deferred.load()},
            {"issued_bytes", g_issued_bytes.load()},
            {"deferred_bytes", g_deferred_bytes.load()},
            {"launches", g_launches.load()}};
}

void reset_counters()
{
    g_issued = 0;
    g_deferred = 0;
    g_issued_bytes = 0;
    g_deferred_bytes = 0;
    g_launches = 0;
}

bool built_with_cuda()
{
#ifdef HF_ZERO3_WITH_CUDA
    return true;
#else
    return false;
#endif
}

}  // namespace hf_zero3

TORCH_LIBRARY_FRAGMENT(hf_zero3, m)
{
    m.def(
        "gated_prefetch(int graph_id, Tensor[] params, int[] ids, int nbytes, int window_peak, "
        "Tensor launch) -> ()");
}

TORCH_LIBRARY_IMPL(hf_zero3, CompositeExplicitAutograd, m)
{
    m.impl("gated_prefetch", &hf_zero3::gated_prefetch);
}

TORCH_LIBRARY_IMPL(hf_zero3, Meta, m) { m.impl("gated_prefetch", &hf_zero3::gated_prefetch_meta); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("memory_state", &hf_zero3::memory_state, "allocator and device memory, read natively");
    m.def("decide", &hf_zero3::decide, "issue a planned prefetch under this launch's agreement?");
    m.def("note_launch", &hf_zero3::note_launch, "count one agreed graph launch");
    m.def("counters", &hf_zero3::counters, "issued / deferred prefetches and bytes");
    m.def("reset_counters", &hf_zero3::reset_counters, "zero the counters");
    m.def("built_with_cuda", &hf_zero3::built_with_cuda, "compiled with the CUDA allocator part");
}
