// prefetch.cu: the L2 prefetch kernels of l2prefetch, compiled at run time by
// NVRTC for the exact architecture of the device (csrc/kernels.c).
//
// One launch pulls every byte of a table of ranges into L2.  The table travels
// in the kernel parameters (no device allocation, nothing to free, and the
// first copy issues without a dependent global load); each range starts 16-byte
// aligned, its size need not be a multiple of 16.
//
// Work is split by bytes, not by range: the 16-byte granules of all ranges,
// laid end to end, are cut into gridDim.x equal slices, one per CTA, and each
// CTA walks the pieces of the ranges its slice overlaps.  A range's last
// partial granule (size % 16 bytes) is touched by one single-byte load of its
// first byte, so no granule outside a range is ever read.
//
// Selected by -D at compile time (csrc/kernels.c names the variants):
//   L2P_KIND  1 ring:  real loads, the way that works on the H200.  One thread
//                      per CTA issues cp.async.bulk copies of L2P_CHUNK bytes
//                      into an L2P_STAGES-deep ring of shared memory, each
//                      completed by an mbarrier; the data is discarded.  A real
//                      load leaves a copy of the line near the loading SM,
//                      which the prefetch instructions below do not (the H200's
//                      L2 is two partitions: a prefetch fills only the home
//                      one).  sm_90+.
//            2 bulk:  cp.async.bulk.prefetch.L2 of L2P_CHUNK-byte pieces, one
//                     piece per thread in turn.  sm_90+.
//            3 line:  prefetch.global.L2 of every 128-byte line.  sm_80+.
//            4 load:  16-byte ld.global.cg loads, 4 in flight per thread.  sm_80+.
//   L2P_BLOCK       threads per CTA (the launch uses the same number).

#ifndef L2P_KIND
#define L2P_KIND 1
#endif
#ifndef L2P_CHUNK
#define L2P_CHUNK 16384
#endif
#ifndef L2P_STAGES
#define L2P_STAGES 4
#endif
#ifndef L2P_BLOCK
#define L2P_BLOCK 32
#endif

typedef unsigned long long u64;

struct L2pRange {
    u64 ptr;
    u64 nbytes;
};

// Must match the parameter block built by csrc/prepared.c.
template <int CAP>
struct L2pTable {
    u64 count;     // ranges used
    u64 granules;  // sum of nbytes / 16 over the ranges
    L2pRange r[CAP];
};

// Calls fn(address, bytes) for the pieces (at most max_piece bytes, multiples
// of 16) of the granules [g0, g1) of the concatenated ranges.
template <int CAP, typename Fn>
__device__ __forceinline__ void for_each_piece(const L2pTable<CAP>& t, u64 g0, u64 g1,
                                               u64 max_piece, Fn fn)
{
    u64 before = 0;  // granules of the ranges before r
    for (u64 r = 0; r < t.count && before < g1; ++r) {
        u64 n = t.r[r].nbytes >> 4;
        u64 lo = g0 > before ? g0 - before : 0;
        u64 hi = g1 - before < n ? g1 - before : n;
        for (u64 g = lo; g < hi;) {
            u64 bytes = (hi - g) << 4;
            if (bytes > max_piece)
                bytes = max_piece;
            fn(t.r[r].ptr + (g << 4), bytes);
            g += bytes >> 4;
        }
        before += n;
    }
}

template <int CAP>
__device__ __forceinline__ void touch_tails(const L2pTable<CAP>& t)
{
    if (threadIdx.x != blockDim.x - 1)
        return;
    for (u64 r = blockIdx.x; r < t.count; r += gridDim.x) {
        if (t.r[r].nbytes & 15) {
            unsigned int v;
            asm volatile("ld.global.u8 %0, [%1];" : "=r"(v) : "l"(t.r[r].ptr + (t.r[r].nbytes & ~15ull)));
        }
    }
}

#if L2P_KIND == 1
template <int CAP>
__device__ __forceinline__ void prefetch(const L2pTable<CAP>& t, u64 g0, u64 g1)
{
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 bar[L2P_STAGES];
    if (threadIdx.x != 0 || g0 >= g1)
        return;
    unsigned int bars = (unsigned int)__cvta_generic_to_shared(bar);
    unsigned int base = (unsigned int)__cvta_generic_to_shared(ring);
    for (int s = 0; s < L2P_STAGES; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");

    u64 issued = 0;
    auto wait = [&](unsigned int b, unsigned int parity) {
        unsigned int done = 0;
        while (!done)
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                : "=r"(done) : "r"(b), "r"(parity) : "memory");
    };
    for_each_piece(t, g0, g1, (u64)L2P_CHUNK, [&](u64 src, u64 bytes) {
        unsigned int s = (unsigned int)(issued % L2P_STAGES);
        unsigned int use = (unsigned int)(issued / L2P_STAGES);
        unsigned int b = bars + 8 * s;
        if (use > 0)
            wait(b, (use - 1) & 1);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"((unsigned int)bytes) : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
            ::"r"(base + s * L2P_CHUNK), "l"(src), "r"((unsigned int)bytes), "r"(b) : "memory");
        ++issued;
    });
    // The copies write this CTA's shared memory: wait for all before exiting.
    for (u64 s = 0; s < L2P_STAGES && s < issued; ++s) {
        u64 uses = (issued - s + L2P_STAGES - 1) / L2P_STAGES;
        wait(bars + 8 * (unsigned int)s, (unsigned int)((uses - 1) & 1));
    }
}
#elif L2P_KIND == 2
template <int CAP>
__device__ __forceinline__ void prefetch(const L2pTable<CAP>& t, u64 g0, u64 g1)
{
    u64 i = 0;
    for_each_piece(t, g0, g1, (u64)L2P_CHUNK, [&](u64 src, u64 bytes) {
        if (i++ % blockDim.x != threadIdx.x)
            return;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"((unsigned int)bytes) : "memory");
    });
}
#elif L2P_KIND == 3
template <int CAP>
__device__ __forceinline__ void prefetch(const L2pTable<CAP>& t, u64 g0, u64 g1)
{
    for_each_piece(t, g0, g1, (u64)1 << 62, [&](u64 src, u64 bytes) {
        // Every 128-byte line the piece touches, the first one included.
        u64 first = src & ~127ull, last = (src + bytes - 1) & ~127ull;
        for (u64 a = first + 128ull * threadIdx.x; a <= last; a += 128ull * blockDim.x) {
            u64 p = a < src ? src : a;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p) : "memory");
        }
    });
}
#elif L2P_KIND == 4
template <int CAP>
__device__ __forceinline__ void prefetch(const L2pTable<CAP>& t, u64 g0, u64 g1)
{
    unsigned int acc = 0;
    for_each_piece(t, g0, g1, (u64)1 << 62, [&](u64 src, u64 bytes) {
        u64 n = bytes >> 4, step = blockDim.x;
        u64 g = threadIdx.x;
        for (; g + 3 * step < n; g += 4 * step) {
            unsigned int a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3;
            asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "l"(src + (g << 4)));
            asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3) : "l"(src + ((g + step) << 4)));
            asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(c0), "=r"(c1), "=r"(c2), "=r"(c3) : "l"(src + ((g + 2 * step) << 4)));
            asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3) : "l"(src + ((g + 3 * step) << 4)));
            acc ^= a0 ^ b1 ^ c2 ^ d3;
        }
        for (; g < n; g += step) {
            unsigned int a0, a1, a2, a3;
            asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "l"(src + (g << 4)));
            acc ^= a0;
        }
    });
    // ptxas deletes a load whose value is dead, asm volatile or not (the first
    // version ran at 7.6 TB/s, above the HBM's peak, so it loaded nothing): make
    // acc observable behind a branch no launch takes (no table holds 2^64-1 granules).
    if (t.granules == ~0ull && acc == 0x9e3779b9u)
        __trap();
}
#else
#error "unknown L2P_KIND"
#endif

template <int CAP>
__device__ __forceinline__ void body(const L2pTable<CAP>& t)
{
    u64 grid = gridDim.x, b = blockIdx.x;
#if __CUDA_ARCH__ >= 900
    // An inline graph fork's loader is a programmatic dependent of the kernel
    // before it (csrc/capture.c, NOTE [inline graph fork]): it may launch while
    // that kernel finishes, and loads only once it is done.  Elsewhere a no-op.
    // Every thread must reach it, unconditionally: where a capture fails after
    // the launch, the next node is ordered after that kernel only through K's end.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    u64 g0 = t.granules * b / grid, g1 = t.granules * (b + 1) / grid;
    touch_tails(t);
    prefetch(t, g0, g1);
}

// One entry per table capacity; the host picks the smallest that fits
// (csrc/kernels.c: l2p_capacities).  The table is the parameter block
// (__grid_constant__: read in place, never copied to local memory); a table in
// device memory was slower (benchmarks/RESULTS.md, run 10, table).
#define L2P_ENTRY(CAP)                                                               \
    extern "C" __global__ void __launch_bounds__(L2P_BLOCK)                          \
        l2p_prefetch_##CAP(const __grid_constant__ L2pTable<CAP> t)                  \
    {                                                                                \
        body(t);                                                                     \
    }
L2P_ENTRY(8)
L2P_ENTRY(32)
L2P_ENTRY(128)
