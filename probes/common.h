/* Helpers shared by kvwatch's BPF programs.
 *
 * Programs read only tracepoint fields, probe arguments and helpers, never a
 * kernel struct layout, so any kernel headers compile them.
 *
 * The loader passes the index constants (-DKVW_HIT_<NAME>=i, -DKVW_LOST_<NAME>=i,
 * -DKVW_NR_HITS, -DKVW_NR_LOST) so that Python holds the single list of hooks
 * and loss sources; this header only provides the counters.
 *
 * bcc rewrites map calls only in the main file, so the loader puts this header's
 * text in front of each program instead of letting clang include it.
 */
#ifndef KVW_COMMON_H
#define KVW_COMMON_H

#include <uapi/linux/ptrace.h>

#ifndef KVW_NR_HITS
#error "KVW_NR_HITS must be defined by the loader"
#endif
#ifndef KVW_NR_LOST
#error "KVW_NR_LOST must be defined by the loader"
#endif

#define KVW_COMM_LEN 16

/* Times each hook fired: per-CPU, so a hot tracepoint pays a plain increment. */
BPF_PERCPU_ARRAY(hits, u64, KVW_NR_HITS);
/* Events dropped in the kernel: ring buffer full, map full. */
BPF_PERCPU_ARRAY(lost, u64, KVW_NR_LOST);

/* Functions, not macros: bcc cannot rewrite map calls inside a macro. */
static __always_inline void kvw_hit(u32 idx) {
    u64 *v = hits.lookup(&idx);
    if (v)
        *v += 1;
}

static __always_inline void kvw_lost(u32 idx) {
    u64 *v = lost.lookup(&idx);
    if (v)
        *v += 1;
}

static __always_inline u32 kvw_tgid(void) { return bpf_get_current_pid_tgid() >> 32; }
static __always_inline u32 kvw_tid(void) { return (u32)bpf_get_current_pid_tgid(); }

/* Uprobe families keep a probed call's context per thread (keyed by
 * bpf_get_current_pid_tgid()) from its entry probe to its return probe. A probed call made
 * beneath another one on the same thread (cudaMalloc -> cuMemAlloc_v2) gets no record of
 * its own: its entry raises the outer record's depth, so the work is counted once, by the
 * outermost call.
 *
 * A return probe looks its thread's record up and, when there is one, passes its depth
 * here: 1 when the record is the returning call's own (the probe then copies it, deletes
 * it and counts the call), 0 for the return of a nested call, whose depth is taken back.
 * The lookup and the delete stay in the program: bcc rewrites map calls neither inside a
 * macro nor through a map passed as an argument. */
static __always_inline int kvw_outermost_return(u32 *depth) {
    if (*depth == 0)
        return 1;
    *depth -= 1;
    return 0;
}

/* A struct that a loader decodes (a ring-buffer record) is declared in C only, in its
 * program: the loader builds its ctypes class from that declaration (probes/cstruct.py, which
 * reads fixed-width integers, int, char and one-dimensional arrays of them, rejecting anything
 * else). The class's size comes back as -DKVW_SIZEOF_<struct name> and is asserted against
 * the compiler's, so a layout the reader got wrong (padding, alignment) fails the compile,
 * naming the struct, instead of decoding garbage. */
#define KVW_MIRRORED(NAME)                                                                  \
    _Static_assert(sizeof(struct NAME) == KVW_SIZEOF_##NAME,                                \
                   "struct " #NAME " and its ctypes class in the loader differ in size")

#endif /* KVW_COMMON_H */
