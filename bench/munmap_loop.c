/* A munmap-heavy workload with a known number of page releases:
 * ITER times: mmap REGION pages of private anonymous memory, touch each page,
 * munmap. Prints pages released and elapsed nanoseconds. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 1000;
    long pages = argc > 2 ? atol(argv[2]) : 2048;
    long page = sysconf(_SC_PAGESIZE);
    if (argc > 3) { /* wait for a line on stdin before starting (so a watcher can attach) */
        char buf[8];
        if (!fgets(buf, sizeof buf, stdin)) return 1;
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < iters; i++) {
        char *p = mmap(NULL, pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) { perror("mmap"); return 1; }
        for (long j = 0; j < pages; j++) p[j * page] = 1;
        munmap(p, pages * page);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    long long ns = (b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec);
    printf("%ld %lld\n", iters * pages, ns);
    return 0;
}
