/* kvwatch kernel-memory probes.
 *
 * Hooks (tracepoints only; each compiled in only when the loader defines
 * KVW_HOOK_<NAME>, after checking that the tracepoint exists on this kernel):
 *   kmem:mm_page_free                       pages released per watched TGID (1 << order per hit).
 *                                           mm_page_free_batched fires for the same pages: not attached.
 *   filemap:mm_filemap_delete_from_page_cache  KV-tier file pages leaving the page cache, by cause:
 *                                           reclaim (kswapd/kdamond, or the task is inside a direct/memcg reclaim
 *                                           window) or policy (unlink, truncate, fadvise, drop_caches); reclaimed
 *                                           pages also by reclaimer (kind, and the task's cgroup v2 id).
 *   filemap:mm_filemap_add_to_page_cache    KV-tier file pages coming back; a refault when the same
 *                                           (dev, ino, 16-page granule) was evicted by reclaim before.
 *   vmscan:mm_vmscan_{direct,memcg}_reclaim_{begin,end}
 *                                           reclaim windows per thread (all tasks: they classify evictions),
 *                                           stall time per watched TGID.
 *   oom:mark_victim                         every OOM victim on the node, through the ring buffer.
 *   task:task_newtask                       a new process (not thread) forked by a watched process is
 *                                           watched at once: filters do not follow fork by themselves.
 *   sched:sched_process_exec / _exit        discovery hints and immediate exits, through the ring buffer.
 *   task:task_rename                        process-title changes (vLLM renames its processes), a hint.
 *
 * Cost (measured, see bench/): page free ~tens of ns per hit, the hash lookup is
 * the work; page-cache hooks pay one (dev, ino) lookup per page-cache change on
 * the node, and a reclaimed KV-tier page one more hash update (its reclaimer); the
 * rest fire rarely.
 *
 * Caveats: mm_page_free fires in the freeing task's context, so a watched
 * process is charged for pages it frees (its own munmap/exit, but also page cache
 * it truncates). Inodes are keyed by the kernel's s_dev (MKDEV: major << 20 |
 * minor), which the loader learns from a canary read, not from st_dev.
 */
#include "common.h"

#ifndef MAX_WATCHED
#define MAX_WATCHED 4096
#endif
#ifndef MAX_KV_INODES
#define MAX_KV_INODES 65536
#endif
#ifndef MAX_EVICTED
#define MAX_EVICTED 131072
#endif
#ifndef MAX_TIERS
#define MAX_TIERS 64
#endif
#ifndef MAX_RECLAIMERS
#define MAX_RECLAIMERS 4096
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif
#define CLONE_THREAD_FLAG 0x00010000ULL

/* ---- maps written by the daemon ------------------------------------------------ */

struct watched_t {
    u32 root_tgid;      /* the discovered process this one descends from (itself at the root) */
    u32 flags;
};
BPF_HASH(watched, u32, struct watched_t, MAX_WATCHED);

struct kv_inode_key_t {
    u64 ino;
    u32 dev;            /* kernel s_dev */
    u32 pad;
};
struct kv_inode_val_t {
    u32 tier;
    u32 pad;
};
BPF_F_TABLE("hash", struct kv_inode_key_t, struct kv_inode_val_t, kv_inodes, MAX_KV_INODES, BPF_F_NO_PREALLOC);

/* Device-number canary: while canary_on[0] is set, page-cache adds of an inode listed
 * here record the s_dev the kernel uses, so the daemon never guesses it from st_dev. */
BPF_ARRAY(canary_on, u32, 1);
BPF_HASH(canary_dev, u64, u32, 64);

/* ---- maps read by the daemon ------------------------------------------------------ */

struct proc_stats_t {
    u64 page_free_pages;
    u64 direct_reclaim_ns;
    u64 direct_reclaim_count;
    u64 memcg_reclaim_ns;
    u64 memcg_reclaim_count;
};
/* Also the filter of the hot paths: an entry exists exactly for each watched TGID. */
BPF_PERCPU_HASH(proc_stats, u32, struct proc_stats_t, MAX_WATCHED);

struct tier_stats_t {
    u64 reclaim_pages;
    u64 policy_pages;
    u64 added_pages;
    u64 refault_pages;
    u64 unattributed_pages;     /* reclaim_pages that found tier_reclaimers full */
};
BPF_PERCPU_ARRAY(tier_stats, struct tier_stats_t, MAX_TIERS);

/* Who reclaimed a tier's pages. kind is KVW_RECLAIMER_*: a task inside a direct (global) or
 * memcg (a limit) reclaim window, whose cgroup is the one to blame, or kswapd / kdamond,
 * kernel threads answering node-wide pressure (cgroup_id 0). Every reclaimed page lands here
 * or, when the map is full, in its tier's unattributed_pages: the entries of a tier and that
 * field add up to its reclaim_pages. */
struct reclaimer_key_t {
    u64 cgroup_id;      /* bpf_get_current_cgroup_id(): the inode of the task's cgroup v2 directory */
    u32 tier;
    u32 kind;
};
BPF_HASH(tier_reclaimers, struct reclaimer_key_t, u64, MAX_RECLAIMERS);

/* Which watched processes bring a tier's pages in (read or write its files): the
 * tier's owners, whose reclaim stalls count as the tier's pain. */
struct tier_reader_t {
    u32 tgid;
    u32 tier;
};
BPF_HASH(tier_readers, struct tier_reader_t, u64, 1024);

/* ---- kernel-private state ----------------------------------------------------------- */

struct reclaim_window_t {
    u64 start_ns;
    u32 kind;           /* KVW_RECLAIMER_DIRECT or KVW_RECLAIMER_MEMCG */
    u32 pad;
};
/* LRU: a begin whose end we never saw must not pin a slot forever. */
BPF_TABLE("lru_hash", u32, struct reclaim_window_t, reclaim_window, 16384);

/* Pages evicted by reclaim, remembered per 16-page granule of a file (large folios
 * come back at other sizes and alignments than they left with). A page-cache add
 * whose first granule is here is a refault. LRU: the oldest evictions age out. */
#define GRANULE_SHIFT 4
#define MAX_GRANULES_PER_FOLIO 32   /* order-9 folio = 512 pages = 32 granules */
struct evicted_key_t {
    u64 ino;
    u64 granule;
    u32 dev;
    u32 pad;
};
BPF_TABLE("lru_hash", struct evicted_key_t, u8, evicted, MAX_EVICTED);

/* ---- rare events ---------------------------------------------------------------------- */

struct kvw_event_t {
    u32 type;           /* KVW_EV_* */
    u32 pid;            /* subject: victim, new process, exec'd or exiting process */
    u32 tgid;           /* current task's TGID when the hook ran */
    u32 aux;            /* parent/old pid; watched flag for OOM */
    u64 ts_ns;
    u64 a;              /* OOM: total_vm (kB); newtask: clone flags */
    u64 b;              /* OOM: anon_rss (kB) */
    u64 c;              /* OOM: file_rss (kB) */
    u64 d;              /* OOM: shmem_rss (kB) */
    char comm[KVW_COMM_LEN];
    char name[64];      /* exec filename, renamed comm */
};
KVW_MIRRORED(kvw_event_t);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);

static __always_inline struct kvw_event_t *kvw_reserve(u32 type) {
    struct kvw_event_t *e = events.ringbuf_reserve(sizeof(struct kvw_event_t));
    if (!e) {
        kvw_lost(KVW_LOST_RINGBUF);
        return 0;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->type = type;
    e->tgid = kvw_tgid();
    e->ts_ns = bpf_ktime_get_ns();
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    return e;
}

/* ---- page release ---------------------------------------------------------------------- */

#ifdef KVW_HOOK_PAGE_FREE
int kvw_page_free(struct tracepoint__kmem__mm_page_free *args)
{
    kvw_hit(KVW_HIT_PAGE_FREE);
    /* One lookup on the hottest path: proc_stats holds an entry for exactly the
     * watched TGIDs (the daemon creates it with the watch, task_newtask for children). */
    u32 tgid = kvw_tgid();
    struct proc_stats_t *s = proc_stats.lookup(&tgid);
    if (s)
        __sync_fetch_and_add(&s->page_free_pages, 1ULL << args->order);
    return 0;
}
#endif

/* ---- page cache of KV-tier files ---------------------------------------------------------- */

/* Kernel threads that reclaim outside any vmscan reclaim window: kswapd, and kdamond,
 * whose DAMOS "pageout" action (proactive reclaim, on by default on some cloud kernels)
 * evicts through reclaim_pages() -> shrink_folio_list() with no mm_vmscan_*_reclaim_begin
 * around it. Returns KVW_RECLAIMER_KSWAPD / KVW_RECLAIMER_KDAMOND, or 0. */
static __always_inline u32 kvw_reclaimer_thread(void) {
    char comm[8];
    bpf_get_current_comm(&comm, sizeof(comm));
    if (comm[0] != 'k')
        return 0;
    if (comm[1] == 's' && comm[2] == 'w' && comm[3] == 'a' && comm[4] == 'p' && comm[5] == 'd')
        return KVW_RECLAIMER_KSWAPD;
    if (comm[1] == 'd' && comm[2] == 'a' && comm[3] == 'm' && comm[4] == 'o' && comm[5] == 'n' && comm[6] == 'd')
        return KVW_RECLAIMER_KDAMOND;
    return 0;
}

/* The reclaim path's one extra map update: the pages go to their reclaimer's entry, or to the
 * tier's unattributed count when the map is full (the tier total is kept either way). */
static __always_inline void kvw_count_reclaimer(struct tier_stats_t *ts, u32 tier, u32 kind, u64 cgroup_id,
                                                u64 pages) {
    struct reclaimer_key_t rk = {};
    rk.cgroup_id = cgroup_id;
    rk.tier = tier;
    rk.kind = kind;
    u64 zero = 0;
    u64 *n = tier_reclaimers.lookup_or_try_init(&rk, &zero);
    if (n) {
        __sync_fetch_and_add(n, pages);
    } else {
        __sync_fetch_and_add(&ts->unattributed_pages, pages);
        kvw_lost(KVW_LOST_RECLAIMERS_FULL);
    }
}

#ifdef KVW_HOOK_PAGECACHE_DELETE
int kvw_pagecache_delete(struct tracepoint__filemap__mm_filemap_delete_from_page_cache *args)
{
    kvw_hit(KVW_HIT_PAGECACHE_DELETE);
    struct kv_inode_key_t key = {};
    key.ino = args->i_ino;
    key.dev = args->s_dev;
    struct kv_inode_val_t *kv = kv_inodes.lookup(&key);
    if (!kv)
        return 0;
    u32 tier = kv->tier;
    struct tier_stats_t *ts = tier_stats.lookup(&tier);
    if (!ts)
        return 0;
    u64 pages = 1ULL << args->order;
    u32 tid = kvw_tid();
    struct evicted_key_t ek = {};
    ek.ino = args->i_ino;
    ek.dev = args->s_dev;
    u64 first = args->index >> GRANULE_SHIFT;
    u64 last = (args->index + pages - 1) >> GRANULE_SHIFT;
    u64 cgroup_id = 0;
    u32 kind = kvw_reclaimer_thread();
    if (!kind) {
        struct reclaim_window_t *w = reclaim_window.lookup(&tid);
        if (w) {
            kind = w->kind;
            cgroup_id = bpf_get_current_cgroup_id();
        }
    }
    if (kind) {
        /* the tier total first: a reader that reads the reclaimers before the tiers never
         * sees more attributed than reclaimed */
        __sync_fetch_and_add(&ts->reclaim_pages, pages);
        kvw_count_reclaimer(ts, tier, kind, cgroup_id, pages);
        u8 one = 1;
        for (int i = 0; i < MAX_GRANULES_PER_FOLIO; i++) {
            if (first + i > last)
                break;
            ek.granule = first + i;
            evicted.update(&ek, &one);
        }
    } else {
        __sync_fetch_and_add(&ts->policy_pages, pages);
        /* deleted or truncated on purpose: what comes back later is new data, not a refault */
        for (int i = 0; i < MAX_GRANULES_PER_FOLIO; i++) {
            if (first + i > last)
                break;
            ek.granule = first + i;
            evicted.delete(&ek);
        }
    }
    return 0;
}
#endif

#ifdef KVW_HOOK_PAGECACHE_ADD
int kvw_pagecache_add(struct tracepoint__filemap__mm_filemap_add_to_page_cache *args)
{
    kvw_hit(KVW_HIT_PAGECACHE_ADD);
    u32 zero_idx = 0;
    u32 *canary = canary_on.lookup(&zero_idx);
    if (canary && *canary) {
        u64 ino = args->i_ino;
        u32 *dev = canary_dev.lookup(&ino);
        if (dev)
            *dev = args->s_dev;
    }
    struct kv_inode_key_t key = {};
    key.ino = args->i_ino;
    key.dev = args->s_dev;
    struct kv_inode_val_t *kv = kv_inodes.lookup(&key);
    if (!kv)
        return 0;
    u32 tier = kv->tier;
    struct tier_stats_t *ts = tier_stats.lookup(&tier);
    if (!ts)
        return 0;
    u64 pages = 1ULL << args->order;
    __sync_fetch_and_add(&ts->added_pages, pages);
    struct tier_reader_t rk = {};
    rk.tgid = kvw_tgid();
    rk.tier = tier;
    if (watched.lookup(&rk.tgid)) {
        u64 zero = 0;
        u64 *n = tier_readers.lookup_or_try_init(&rk, &zero);
        if (n)
            __sync_fetch_and_add(n, pages);
    }
    struct evicted_key_t ek = {};
    ek.ino = args->i_ino;
    ek.granule = args->index >> GRANULE_SHIFT;
    ek.dev = args->s_dev;
    if (evicted.lookup(&ek))
        __sync_fetch_and_add(&ts->refault_pages, pages);
    return 0;
}
#endif

/* ---- reclaim windows and stalls ----------------------------------------------------------- */

static __always_inline int kvw_reclaim_begin(u32 kind) {
    u32 tid = kvw_tid();
    struct reclaim_window_t w = {};
    w.start_ns = bpf_ktime_get_ns();
    w.kind = kind;
    if (reclaim_window.update(&tid, &w))
        kvw_lost(KVW_LOST_RECLAIM_WINDOW_FULL);
    return 0;
}

static __always_inline int kvw_reclaim_end(void) {
    u32 tid = kvw_tid();
    struct reclaim_window_t *w = reclaim_window.lookup(&tid);
    if (!w)
        return 0;
    u64 delta = bpf_ktime_get_ns() - w->start_ns;
    u32 kind = w->kind;
    reclaim_window.delete(&tid);
    u32 tgid = kvw_tgid();
    struct proc_stats_t *s = proc_stats.lookup(&tgid);
    if (!s)
        return 0;
    if (kind == KVW_RECLAIMER_MEMCG) {
        __sync_fetch_and_add(&s->memcg_reclaim_ns, delta);
        __sync_fetch_and_add(&s->memcg_reclaim_count, 1);
    } else {
        __sync_fetch_and_add(&s->direct_reclaim_ns, delta);
        __sync_fetch_and_add(&s->direct_reclaim_count, 1);
    }
    return 0;
}

#ifdef KVW_HOOK_DIRECT_RECLAIM_BEGIN
int kvw_direct_reclaim_begin(struct tracepoint__vmscan__mm_vmscan_direct_reclaim_begin *args)
{
    kvw_hit(KVW_HIT_DIRECT_RECLAIM_BEGIN);
    return kvw_reclaim_begin(KVW_RECLAIMER_DIRECT);
}
#endif
#ifdef KVW_HOOK_DIRECT_RECLAIM_END
int kvw_direct_reclaim_end(struct tracepoint__vmscan__mm_vmscan_direct_reclaim_end *args)
{
    kvw_hit(KVW_HIT_DIRECT_RECLAIM_END);
    return kvw_reclaim_end();
}
#endif
#ifdef KVW_HOOK_MEMCG_RECLAIM_BEGIN
int kvw_memcg_reclaim_begin(struct tracepoint__vmscan__mm_vmscan_memcg_reclaim_begin *args)
{
    kvw_hit(KVW_HIT_MEMCG_RECLAIM_BEGIN);
    return kvw_reclaim_begin(KVW_RECLAIMER_MEMCG);
}
#endif
#ifdef KVW_HOOK_MEMCG_RECLAIM_END
int kvw_memcg_reclaim_end(struct tracepoint__vmscan__mm_vmscan_memcg_reclaim_end *args)
{
    kvw_hit(KVW_HIT_MEMCG_RECLAIM_END);
    return kvw_reclaim_end();
}
#endif

/* ---- OOM ------------------------------------------------------------------------------------ */

#ifdef KVW_HOOK_OOM_VICTIM
int kvw_oom_victim(struct tracepoint__oom__mark_victim *args)
{
    kvw_hit(KVW_HIT_OOM_VICTIM);
    struct kvw_event_t *e = kvw_reserve(KVW_EV_OOM);
    if (!e)
        return 0;
    u32 victim = args->pid;
    e->pid = victim;
    e->aux = watched.lookup(&victim) ? 1 : 0;
    e->a = args->total_vm;
    e->b = args->anon_rss;
    e->c = args->file_rss;
    e->d = args->shmem_rss;
    /* the victim's comm (the current task is the one that ran the OOM killer) */
    TP_DATA_LOC_READ_CONST(&e->name, comm, sizeof(e->comm));
    events.ringbuf_submit(e, 0);
    return 0;
}
#endif

/* ---- process lifecycle ------------------------------------------------------------------------ */

#ifdef KVW_HOOK_TASK_NEWTASK
int kvw_task_newtask(struct tracepoint__task__task_newtask *args)
{
    kvw_hit(KVW_HIT_TASK_NEWTASK);
    if (args->clone_flags & CLONE_THREAD_FLAG)
        return 0;
    u32 parent = kvw_tgid();
    struct watched_t *pw = watched.lookup(&parent);
    if (!pw)
        return 0;
    u32 child = args->pid;
    struct watched_t cw = {};
    cw.root_tgid = pw->root_tgid;
    struct proc_stats_t zero = {};
    if (watched.update(&child, &cw) || proc_stats.update(&child, &zero))
        kvw_lost(KVW_LOST_WATCHED_FULL);
    struct kvw_event_t *e = kvw_reserve(KVW_EV_FORK);
    if (!e)
        return 0;
    e->pid = child;
    e->aux = parent;
    e->a = args->clone_flags;
    events.ringbuf_submit(e, 0);
    return 0;
}
#endif

#ifdef KVW_HOOK_PROCESS_EXEC
int kvw_process_exec(struct tracepoint__sched__sched_process_exec *args)
{
    kvw_hit(KVW_HIT_PROCESS_EXEC);
    struct kvw_event_t *e = kvw_reserve(KVW_EV_EXEC);
    if (!e)
        return 0;
    e->pid = args->pid;
    e->aux = args->old_pid;
    TP_DATA_LOC_READ_STR(&e->name, filename, sizeof(e->name));
    events.ringbuf_submit(e, 0);
    return 0;
}
#endif

#ifdef KVW_HOOK_PROCESS_EXIT
int kvw_process_exit(struct tracepoint__sched__sched_process_exit *args)
{
    kvw_hit(KVW_HIT_PROCESS_EXIT);
    if (!args->group_dead)
        return 0;
    u32 tgid = kvw_tgid();
    if (!watched.lookup(&tgid))
        return 0;
    struct kvw_event_t *e = kvw_reserve(KVW_EV_EXIT);
    if (!e)
        return 0;
    e->pid = tgid;
    events.ringbuf_submit(e, 0);
    return 0;
}
#endif

#ifdef KVW_HOOK_TASK_RENAME
int kvw_task_rename(struct tracepoint__task__task_rename *args)
{
    kvw_hit(KVW_HIT_TASK_RENAME);
    struct kvw_event_t *e = kvw_reserve(KVW_EV_RENAME);
    if (!e)
        return 0;
    e->pid = kvw_tgid();
    bpf_probe_read_kernel_str(&e->name, sizeof(e->comm), args->newcomm);
    events.ringbuf_submit(e, 0);
    return 0;
}
#endif
