/* Transfer-call loop for the transfer probe benchmark, through the stub libraries:
 * MODE "post": ITER x nixlAgent::postXferReq that completes at once (a UCX put beneath);
 * MODE "put":  ITER x ucp_put_nbx called directly. Prints calls and nanoseconds. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*post_fn)(void *, void *, void *);
typedef void (*next_fn)(uint64_t, int, uint64_t, int, int);
typedef void *(*put_fn)(void *, const void *, size_t, uint64_t, void *, const void *);

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: xfer_loop LIBDIR post|put ITER [wait]\n"); return 2; }
    char path[4096];
    snprintf(path, sizeof path, "%s/libnixl.so", argv[1]);
    void *nixl = dlopen(path, RTLD_NOW);
    snprintf(path, sizeof path, "%s/libucp.so.0", argv[1]);
    void *ucp = dlopen(path, RTLD_NOW);
    if (!nixl || !ucp) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    post_fn post = (post_fn)dlsym(nixl, "_ZNK9nixlAgent11postXferReqEP12nixlXferReqHPK21nixlAgentOptionalArgs");
    next_fn next = (next_fn)dlsym(nixl, "kvwstub_next_post");
    put_fn put = (put_fn)dlsym(ucp, "ucp_put_nbx");
    long iters = atol(argv[3]);
    int use_post = strcmp(argv[2], "post") == 0;
    next(4096, 0, 7, 0, 1);
    if (argc > 4) { char b[8]; if (!fgets(b, sizeof b, stdin)) return 1; }
    struct timespec a, z;
    static char buf[1];
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < iters; i++) {
        if (use_post)
            post((void *)0x1000, (void *)(uintptr_t)(i + 1), 0);
        else
            put((void *)7, buf, 4096, 0, 0, 0);
    }
    clock_gettime(CLOCK_MONOTONIC, &z);
    printf("%ld %lld\n", iters, (z.tv_sec - a.tv_sec) * 1000000000LL + (z.tv_nsec - a.tv_nsec));
    return 0;
}
