/* Allocation loop for the CUDA probe benchmark: ITER x (cudaMalloc + cudaFree)
 * through the runtime library given on the command line (the stub, or a real
 * libcudart, where calls fail fast without a GPU). Prints calls and nanoseconds.
 * MODE "free0" calls cudaFree(NULL) instead: a real runtime call that does no
 * work once the context exists, so the probes' own cost is what is timed.
 * MODE "batch:E" calls the driver's cuMemcpyBatchAsync with E copies from device
 * memory to a pinned host buffer (vLLM's KV offload: one call per transfer), so the
 * probe's read of the sizes array and its host-range lookups are what is timed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*host_fn)(void **, size_t, unsigned);
typedef int (*batch_fn)(unsigned long long *, unsigned long long *, size_t *, size_t, void *, size_t *, size_t,
                        size_t *, void *);

/* E copies of 4096 + i bytes, device -> pinned host; the arrays are filled once */
static long batch_loop(void *h, long iters, long e) {
    host_fn ha = (host_fn)dlsym(h, "cudaHostAlloc");
    malloc_fn cm = (malloc_fn)dlsym(h, "cudaMalloc");
    batch_fn bf = (batch_fn)dlsym(h, "cuMemcpyBatchAsync");
    if (!ha || !cm || !bf) { fprintf(stderr, "batch symbols missing\n"); exit(1); }
    size_t span = (size_t)e * 8192 + (1 << 20);
    void *host = 0, *dev = 0;
    ha(&host, span, 0);
    cm(&dev, span);
    unsigned long long *src = calloc(e, 8), *dst = calloc(e, 8);
    size_t *sizes = calloc(e, sizeof(size_t));
    for (long i = 0; i < e; i++) {
        src[i] = (unsigned long long)dev + i * 8192;
        dst[i] = (unsigned long long)host + i * 8192;
        sizes[i] = 4096 + i;
    }
    unsigned attrs[6] = {1, 0, 0, 0, 0, 0};
    size_t idx = 0, fail = 0;
    for (long i = 0; i < iters; i++)
        bf(dst, src, sizes, e, attrs, &idx, 1, &fail, (void *)1);
    return iters;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: cuda_loop LIB ITER [wait [free0]]\n"); return 2; }
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    malloc_fn cm = (malloc_fn)dlsym(h, "cudaMalloc");
    free_fn cf = (free_fn)dlsym(h, "cudaFree");
    long iters = atol(argv[2]);
    int free0 = argc > 4 && argv[4][0] == 'f';
    long entries = argc > 4 && strncmp(argv[4], "batch:", 6) == 0 ? atol(argv[4] + 6) : 0;
    if (free0) cf(0); /* creates the context before timing */
    if (argc > 3) { char b[8]; if (!fgets(b, sizeof b, stdin)) return 1; }
    struct timespec a, z;
    clock_gettime(CLOCK_MONOTONIC, &a);
    if (entries) {
        long calls = batch_loop(h, iters, entries);
        clock_gettime(CLOCK_MONOTONIC, &z);
        printf("%ld %lld\n", calls, (z.tv_sec - a.tv_sec) * 1000000000LL + (z.tv_nsec - a.tv_nsec));
        return 0;
    }
    for (long i = 0; i < iters; i++) {
        if (free0) {
            cf(0);
            continue;
        }
        void *p = 0;
        cm(&p, 2 << 20);
        cf(p);
    }
    clock_gettime(CLOCK_MONOTONIC, &z);
    printf("%ld %lld\n", free0 ? iters : 2 * iters, (z.tv_sec - a.tv_sec) * 1000000000LL + (z.tv_nsec - a.tv_nsec));
    return 0;
}
