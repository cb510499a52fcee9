/* Allocation loop for the CUDA probe benchmark: ITER x (cudaMalloc + cudaFree)
 * through the runtime library given on the command line (the stub, or a real
 * libcudart, where calls fail fast without a GPU). Prints calls and nanoseconds. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: cuda_loop LIB ITER [wait]\n"); return 2; }
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    malloc_fn cm = (malloc_fn)dlsym(h, "cudaMalloc");
    free_fn cf = (free_fn)dlsym(h, "cudaFree");
    long iters = atol(argv[2]);
    if (argc > 3) { char b[8]; if (!fgets(b, sizeof b, stdin)) return 1; }
    struct timespec a, z;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < iters; i++) {
        void *p = 0;
        cm(&p, 2 << 20);
        cf(p);
    }
    clock_gettime(CLOCK_MONOTONIC, &z);
    printf("%ld %lld\n", 2 * iters, (z.tv_sec - a.tv_sec) * 1000000000LL + (z.tv_nsec - a.tv_nsec));
    return 0;
}
