/* Page releases at a steady rate: every tick of 1 ms, mmap/touch/munmap enough 4 KiB
 * pages to keep RATE pages per second, for SECONDS (or as many as the CPU manages, when
 * RATE is above that). Prints pages released. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    double rate = argc > 1 ? atof(argv[1]) : 10000;
    double seconds = argc > 2 ? atof(argv[2]) : 10;
    long page = sysconf(_SC_PAGESIZE);
    double start = now(), done = 0;
    long total = 0;
    while (now() - start < seconds) {
        double due = (now() - start) * rate - done, step = rate * 0.01;
        if (due > rate * 0.1) { /* fell behind (the rate is above what this CPU does): */
            done += due - step;  /* drop the backlog instead of one huge mapping */
            due = step;
        }
        long n = (long)(due < step ? due : step);
        if (n > 0) {
            char *p = mmap(NULL, n * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) { perror("mmap"); return 1; }
            for (long j = 0; j < n; j++) p[j * page] = 1;
            munmap(p, n * page);
            done += n;
            total += n;
        }
        usleep(1000);
    }
    printf("%ld\n", total);
    return 0;
}
