/* A stand-in CUDA runtime + driver for machines without a GPU.
 *
 * Built twice by kvwatch.daemon.lab.stublib: as libcuda.so.1 (driver symbols) and
 * as libcudart.so.12 (runtime symbols, linked against the former), so that the
 * runtime calls the driver beneath it exactly like the real libraries do and
 * kvwatch's no-double-counting path is exercised. Every call succeeds, unless
 * the device "capacity" (KVWSTUB_CAPACITY bytes, default 80 GiB) would be
 * exceeded (error 2: cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY) or
 * kvwstub_fail_next() asked for failures. Pointers are fake, never dereferenced.
 * Used by the tests and `kvwatch demo`; never loaded by a real engine.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef KVWSTUB_DRIVER
static uint64_t next_ptr = 0x7f0000000000ULL;
static uint64_t next_handle = 1;
static uint64_t used, capacity;
static int fail_next, fail_code = 2;

struct blk { uint64_t ptr, size; };
#define MAXB 65536
static struct blk blocks[MAXB];

static void init_capacity(void) {
    if (!capacity) {
        const char *c = getenv("KVWSTUB_CAPACITY");
        capacity = c ? strtoull(c, NULL, 10) : (80ULL << 30);
    }
}

/* noinline helpers: every exported function then opens with a real frame
 * (endbr64; push %rbp), like the real libraries, instead of an early-out test. */
__attribute__((noinline)) static int take(uint64_t size, uint64_t *out) {
    init_capacity();
    if (fail_next > 0) { fail_next--; return fail_code; }
    if (used + size > capacity) return 2;
    for (int i = 0; i < MAXB; i++) {
        if (!blocks[i].ptr) {
            blocks[i].ptr = next_ptr;
            blocks[i].size = size;
            *out = next_ptr;
            next_ptr += (size + 0xfffff) & ~0xfffffULL;
            used += size;
            return 0;
        }
    }
    return 2;
}

__attribute__((noinline)) static int give(uint64_t ptr) {
    if (!ptr) return 0;
    for (int i = 0; i < MAXB; i++) {
        if (blocks[i].ptr == ptr) {
            used -= blocks[i].size;
            blocks[i].ptr = 0;
            return 0;
        }
    }
    return 1; /* CUDA_ERROR_INVALID_VALUE */
}

void kvwstub_fail_next(int n, int code) { fail_next = n; fail_code = code; }
uint64_t kvwstub_used(void) { return used; }

int cuMemAlloc_v2(uint64_t *p, size_t size) { return take(size, p); }
int cuMemAllocAsync(uint64_t *p, size_t size, void *stream) { (void)stream; return take(size, p); }
int cuMemFree_v2(uint64_t p) { return give(p); }
int cuMemFreeAsync(uint64_t p, void *stream) { (void)stream; return give(p); }
int cuMemHostAlloc(void **p, size_t size, unsigned flags) { uint64_t v; (void)flags; int r = take(size, &v); *p = (void *)v; return r; }
int cuMemFreeHost(void *p) { return give((uint64_t)p); }
int cuMemCreate(uint64_t *handle, size_t size, const void *prop, unsigned long long flags) {
    uint64_t v; (void)prop; (void)flags;
    int r = take(size, &v);
    if (r == 0) *handle = v;
    return r;
}
int cuMemRelease(uint64_t handle) { return give(handle); }
__attribute__((noinline)) static int ok(void) { __asm__ volatile(""); return 0; }
int cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, unsigned long long flags) {
    (void)ptr; (void)size; (void)offset; (void)handle; (void)flags; return ok();
}
int cuMemUnmap(uint64_t ptr, size_t size) { (void)ptr; (void)size; return ok(); }
/* copies move nothing here (the pointers are fake); they succeed */
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t n, void *stream) {
    (void)dst; (void)src; (void)n; (void)stream; return ok();
}
int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t n, void *stream) {
    (void)dst; (void)src; (void)n; (void)stream; return ok();
}
int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t n) { (void)dst; (void)src; (void)n; return ok(); }
int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t n) { (void)dst; (void)src; (void)n; return ok(); }
/* batched copies: the CUDA 12.8 ABI (with failIdx, what vLLM calls) and 13.0's _v2 */
int cuMemcpyBatchAsync(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, void *attrs,
                       size_t *attrs_idxs, size_t num_attrs, size_t *fail_idx, void *stream) {
    (void)dsts; (void)srcs; (void)sizes; (void)count; (void)attrs; (void)attrs_idxs; (void)num_attrs;
    (void)fail_idx; (void)stream; return ok();
}
int cuMemcpyBatchAsync_v2(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, void *attrs,
                          size_t *attrs_idxs, size_t num_attrs, void *stream) {
    (void)dsts; (void)srcs; (void)sizes; (void)count; (void)attrs; (void)attrs_idxs; (void)num_attrs;
    (void)stream; return ok();
}
#else
/* runtime: each call goes through the driver, as cudart does */
int cuMemAlloc_v2(uint64_t *p, size_t size);
int cuMemAllocAsync(uint64_t *p, size_t size, void *stream);
int cuMemFree_v2(uint64_t p);
int cuMemFreeAsync(uint64_t p, void *stream);
int cuMemHostAlloc(void **p, size_t size, unsigned flags);
int cuMemFreeHost(void *p);

int cudaMalloc(void **p, size_t size) { return cuMemAlloc_v2((uint64_t *)p, size); }
#ifndef KVWSTUB_OLD_RUNTIME /* an older runtime without the stream-ordered allocator */
int cudaMallocAsync(void **p, size_t size, void *stream) { return cuMemAllocAsync((uint64_t *)p, size, stream); }
int cudaFreeAsync(void *p, void *stream) { return cuMemFreeAsync((uint64_t)p, stream); }
#endif
int cudaFree(void *p) { return cuMemFree_v2((uint64_t)p); }
int cudaMallocHost(void **p, size_t size) { return cuMemHostAlloc(p, size, 0); }
int cudaHostAlloc(void **p, size_t size, unsigned flags) { return cuMemHostAlloc(p, size, flags); }
int cudaFreeHost(void *p) { return cuMemFreeHost(p); }
__attribute__((noinline)) static int ok(void) { __asm__ volatile(""); return 0; }
int cudaHostRegister(void *p, size_t size, unsigned flags) { (void)p; (void)size; (void)flags; return ok(); }
int cudaHostUnregister(void *p) { (void)p; return ok(); }
/* the runtime's copies call the driver's beneath, by direction (1 host->device, 2 device->host) */
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t n, void *stream);
int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t n, void *stream);
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    if (kind == 1) return cuMemcpyHtoDAsync_v2((uint64_t)dst, src, n, stream);
    if (kind == 2) return cuMemcpyDtoHAsync_v2(dst, (uint64_t)src, n, stream);
    return ok();
}
int cudaMemcpy(void *dst, const void *src, size_t n, int kind) { return cudaMemcpyAsync(dst, src, n, kind, 0); }
int cuMemcpyBatchAsync_v2(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, void *attrs,
                          size_t *attrs_idxs, size_t num_attrs, void *stream);
int cudaMemcpyBatchAsync(void **dsts, void **srcs, size_t *sizes, size_t count, void *attrs,
                         size_t *attrs_idxs, size_t num_attrs, void *stream) {
    return cuMemcpyBatchAsync_v2((uint64_t *)dsts, (uint64_t *)srcs, sizes, count, attrs, attrs_idxs, num_attrs,
                                 stream);
}
#endif
