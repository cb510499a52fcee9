/* Helpers shared by kvwatch's BPF programs.
 *
 * Design rule 1: programs read only tracepoint fields, probe arguments and
 * helpers, never a kernel struct layout, so any kernel headers compile them.
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

#endif /* KVW_COMMON_H */
