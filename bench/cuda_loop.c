/* Allocation loop for the CUDA probe benchmark: ITER x (cudaMalloc + cudaFree)
 * through the runtime library given on the command line (the stub, or a real
 * libcudart, where calls fail fast without a GPU). Prints calls and nanoseconds.
 * MODE "free0" calls cudaFree(NULL) instead: a real runtime call that does no
 * work once the context exists, so the probes' own cost is what is timed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: cuda_loop LIB ITER [wait [free0]]\n"); return 2; }
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    malloc_fn cm = (malloc_fn)dlsym(h, "cudaMalloc");
    free_fn cf = (free_fn)dlsym(h, "cudaFree");
    long iters = atol(argv[2]);
    int free0 = argc > 4 && argv[4][0] == 'f';
    if (free0) cf(0); /* creates the context before timing */
    if (argc > 3) { char b[8]; if (!fgets(b, sizeof b, stdin)) return 1; }
    struct timespec a, z;
    clock_gettime(CLOCK_MONOTONIC, &a);
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
