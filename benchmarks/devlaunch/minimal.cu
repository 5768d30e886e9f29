// Minimal device-graph-launch check (issue 24): which step refuses a device-side
// cudaGraphLaunch from a kernel captured into an ordinary stream-captured graph?
// Build: nvcc -arch=sm_90 -rdc=true minimal.cu -lcudadevrt -o minimal
#include <cstdio>
#include <cuda_runtime.h>

__global__ void loader(unsigned *hits) { atomicAdd(hits, 1u); }

__global__ void trigger(cudaGraphExec_t exec, unsigned *errors) {
    if (cudaGetCurrentGraphExec() == 0) { atomicAdd(&errors[1], 1u); return; }
    cudaError_t e = cudaGraphLaunch(exec, cudaStreamGraphFireAndForget);
    if (e != cudaSuccess) { atomicAdd(&errors[0], 1u); errors[2] = (unsigned)e; }
}

#define CK(x) do { cudaError_t e_ = (x); printf("  %-60s %s\n", #x, cudaGetErrorName(e_)); \
                   if (e_ != cudaSuccess) { cudaGetLastError(); ok = false; } } while (0)

static void attempt(const char *what, unsigned long long outer_flags, bool eager) {
    bool ok = true;
    printf("== %s\n", what);
    unsigned *hits, *errors;
    cudaMalloc(&hits, 4); cudaMalloc(&errors, 12);
    cudaMemset(hits, 0, 4); cudaMemset(errors, 0, 12);
    cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    // the device graph: one loader node
    cudaGraph_t inner; cudaGraphExec_t inner_exec;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    loader<<<1, 1, 0, s>>>(hits);
    cudaStreamEndCapture(s, &inner);
    CK(cudaGraphInstantiate(&inner_exec, inner, cudaGraphInstantiateFlagDeviceLaunch));
    CK(cudaGraphUpload(inner_exec, s));
    if (eager) {
        trigger<<<1, 1, 0, s>>>(inner_exec, errors);
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(s));
    }
    cudaGraph_t outer; cudaGraphExec_t outer_exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    trigger<<<1, 1, 0, s>>>(inner_exec, errors);
    CK(cudaGetLastError());
    CK(cudaStreamEndCapture(s, &outer));
    if (ok) {
        CK(cudaGraphInstantiateWithFlags(&outer_exec, outer, outer_flags));
        if (ok) {
            if (outer_flags & cudaGraphInstantiateFlagDeviceLaunch) CK(cudaGraphUpload(outer_exec, s));
            for (int i = 0; i < 3; i++) CK(cudaGraphLaunch(outer_exec, s));
            CK(cudaStreamSynchronize(s));
        }
    }
    unsigned h, e[3];
    cudaMemcpy(&h, hits, 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(e, errors, 12, cudaMemcpyDeviceToHost);
    printf("  loader ran %u times; device refusals %u (last %s), calls outside a graph %u\n",
           h, e[0], e[0] ? cudaGetErrorName((cudaError_t)e[2]) : "-", e[1]);
    cudaDeviceSynchronize(); cudaGetLastError();
}

int main() {
    int v; cudaDriverGetVersion(&v); printf("driver %d\n", v);
    attempt("outer instantiated with flags 0, no eager call", 0, false);
    attempt("outer instantiated with flags 0, after an eager call", 0, true);
    attempt("outer instantiated for device launch", cudaGraphInstantiateFlagDeviceLaunch, false);
    return 0;
}
