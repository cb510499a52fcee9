/* kvwatch CUDA allocation probes (uprobe + uretprobe pairs).
 *
 * Hooks, attached per watched process with pid= to the exact libcudart.so.N /
 * libcuda.so.1 file that process mapped (the loader passes the API table as
 * the X-macro KVW_CUDA_APIS, so Python holds the single list):
 *   runtime  cudaMalloc, cudaMallocAsync, cudaMallocHost, cudaHostAlloc, cudaHostRegister,
 *            cudaFree, cudaFreeAsync, cudaFreeHost, cudaHostUnregister
 *   driver   cuMemAlloc_v2, cuMemAllocAsync, cuMemFree_v2, cuMemFreeAsync,
 *            cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap
 *   copies   cudaMemcpyAsync, cudaMemcpy (direction argument), cuMemcpy{HtoD,DtoH}{,Async}_v2
 *   batched  cudaMemcpyBatchAsync, cuMemcpyBatchAsync (CUDA 12.8 ABI), cuMemcpyBatchAsync_v2
 *            (13.0 ABI): vLLM's KV offload moves every block of a transfer in one such call
 *            (through a cuGetProcAddress pointer, which is the exported symbol). Bytes are the
 *            sum of the sizes array (read in chunks of 64, up to BATCH_MAX_ENTRIES entries:
 *            a larger call is counted up to there and the truncation counted as lost). The
 *            direction comes from the first copy's location hints when set, else from
 *            where its pointers fall: in a pinned host range this process allocated or
 *            registered (>= 1 MiB, HOST_RANGE_SLOTS per process) or not; neither known
 *            host side -> "default" (device to device, or memory allocated before attach).
 *
 * Success-aware: the entry stores the call's arguments by thread; the return
 * counts it as ok only when the API returned 0, reads the pointer/handle the
 * call wrote through its out-argument, and keeps pointer -> size in a ledger so
 * frees carry bytes. A call made while another probed call is in flight on the
 * same thread (cudaMalloc calling cuMemAlloc_v2 beneath it) is not counted again.
 *
 * Cost (bench/bench_cuda.py): ~1.0 us per probed call (uprobe + uretprobe and
 * this code), ~1.7 us when the runtime call also hits a probed driver function
 * beneath it; a batched copy adds the read of its sizes array (about 0.1 us per
 * 64 entries) and up to 2 x HOST_RANGE_SLOTS map lookups; nothing for other
 * processes (pid= filter). PyTorch's caching
 * allocator calls these only on a cache miss. The loader probes just past a
 * leading endbr64: single-stepping it would cost ~16 us per hit in a VM.
 * Caveat: UCX's memory hooks patch the entry code of some driver functions; the
 * loader leaves those driver symbols alone in processes that map libucm.
 */
#include "common.h"

#ifndef MAX_LEDGER
#define MAX_LEDGER 65536
#endif
#ifndef MAX_CUDA_PROCS
#define MAX_CUDA_PROCS 1024
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 16
#endif
#ifndef LARGE_ALLOC_BYTES
#define LARGE_ALLOC_BYTES (1ULL << 30)
#endif
#define STALE_INFLIGHT_NS (10ULL * 1000000000ULL)
#define RETRY_WINDOW_NS (100ULL * 1000000ULL)
#define FREE_CLUSTER_NS (1000000ULL)
#define MIB (1024ULL * 1024ULL)

/* ops (the loader uses the same numbers) */
#define OP_ALLOC_OUT 1   /* allocation returned through a pointer argument */
#define OP_REGISTER 2    /* caller's memory registered: the key is an input argument */
#define OP_FREE 3        /* free / unregister / release by pointer or handle */
#define OP_MAP 4         /* cuMemMap: bytes mapped, no ledger */
#define OP_UNMAP 5       /* cuMemUnmap */
#define OP_COPY 6        /* host <-> device copy: bytes by direction (cudaMemcpyKind) */
#define OP_BATCH_COPY 7  /* batched copies: bytes = sum of the sizes array, direction found at entry */

#ifndef BATCH_MAX_ENTRIES
#define BATCH_MAX_ENTRIES 65536
#endif
#define BATCH_CHUNK 64
#define HOST_RANGE_SLOTS 64
#define HOST_RANGE_MIN_BYTES (1ULL << 20)
#define KIND_HOST 1       /* the loader's KINDS order: device, host, vmm */
#define DIR_H2H 0         /* cudaMemcpyKind numbering */
#define DIR_H2D 1
#define DIR_D2H 2
#define DIR_DEFAULT 4

struct inflight_t {
    u64 start_ns;
    u64 a;          /* out-pointer address, or the key for frees/registers */
    u64 size;
    u32 api;
    u32 depth;      /* nested probed calls beneath this one */
};
/* A regular (preallocated) hash: an entry whose return never came is replaced
 * after STALE_INFLIGHT_NS, and counted. */
BPF_HASH(inflight, u64, struct inflight_t, 16384);

struct api_key_t {
    u32 tgid;
    u32 api;
};
struct api_stats_t {
    u64 ok;
    u64 err;
    u64 bytes;       /* allocated (alloc ops), freed with known size (free ops), mapped (map ops) */
    u64 unknown;     /* frees of pointers the ledger never saw (allocated before we attached) */
};
BPF_PERCPU_HASH(api_stats, struct api_key_t, struct api_stats_t, MAX_CUDA_PROCS * 8);

struct proc_cuda_t {
    u64 last_fail_ns;
    u64 last_free_ns;
    u64 frees_after_failure;   /* frees within 100 ms of a failed allocation: the OOM-retry path */
    u64 clustered_frees;       /* frees within 1 ms of the previous one: empty_cache() bursts */
    u64 seg_2m;                /* allocations of exactly 2 MiB / 20 MiB: caching-allocator segments */
    u64 seg_20m;
    u64 max_alloc;             /* largest single allocation (the KV pool, for vLLM) */
    u64 nested;                /* calls skipped because a probed call was already in flight */
    u64 host_slot;             /* next slot of host_ranges to fill (round robin) */
};
BPF_HASH(proc_cuda, u32, struct proc_cuda_t, MAX_CUDA_PROCS);

struct ledger_key_t {
    u32 tgid;
    u32 kind;
    u64 ptr;
};
struct ledger_val_t {
    u64 size;
    u32 api;
    u32 pad;
};
/* Preallocated: an insert on the allocation path must not allocate. */
BPF_HASH(ledger, struct ledger_key_t, struct ledger_val_t, MAX_LEDGER);

/* Pinned host ranges per process, for the direction of batched copies (whose API has no
 * direction argument and whose location hints vLLM leaves unset). */
struct range_key_t {
    u32 tgid;
    u32 slot;
};
struct range_t {
    u64 start;
    u64 end;
};
BPF_HASH(host_ranges, struct range_key_t, struct range_t, MAX_CUDA_PROCS * 8);

struct batch_chunk_t {
    u64 v[BATCH_CHUNK];
};
BPF_PERCPU_ARRAY(batch_scratch, struct batch_chunk_t, 1);

/* CUmemcpyAttributes / cudaMemcpyAttributes (24 bytes): the location hints' types are
 * CU_MEM_LOCATION_TYPE_DEVICE = 1, HOST = 2, HOST_NUMA = 3, HOST_NUMA_CURRENT = 4. */
struct memcpy_attrs_t {
    u32 src_access_order;
    u32 src_type;
    u32 src_id;
    u32 dst_type;
    u32 dst_id;
    u32 flags;
};

struct cuda_event_t {
    u32 type;       /* 1 failed allocation, 2 large allocation */
    u32 tgid;
    u32 api;
    s32 rc;
    u64 size;
    u64 ts_ns;
};
KVW_MIRRORED(cuda_event_t);
BPF_RINGBUF_OUTPUT(cuda_events, RINGBUF_PAGES);

static __always_inline u64 kvw_arg(struct pt_regs *ctx, int n) {
    switch (n) {
    case 1: return PT_REGS_PARM1(ctx);
    case 2: return PT_REGS_PARM2(ctx);
    case 3: return PT_REGS_PARM3(ctx);
    case 4: return PT_REGS_PARM4(ctx);
    case 5: return PT_REGS_PARM5(ctx);
    default: return 0;
    }
}

/* Whole chunks summed with no branch inside (the verifier walks every iteration of the
 * outer loop: a branch per entry would multiply what it has to explore), then the rest. */
static __always_inline u64 kvw_batch_bytes(u64 sizes, u64 count) {
    u32 zero = 0;
    struct batch_chunk_t *b = batch_scratch.lookup(&zero);
    if (!b)
        return 0;
    if (count > BATCH_MAX_ENTRIES) {
        kvw_lost(KVW_LOST_BATCH_TRUNCATED);
        count = BATCH_MAX_ENTRIES;
    }
    u64 whole = count / BATCH_CHUNK, total = 0;
    for (u32 c = 0; c < BATCH_MAX_ENTRIES / BATCH_CHUNK; c++) {
        if (c >= whole)
            break;
        if (bpf_probe_read_user(b->v, sizeof(b->v), (void *)(sizes + (u64)c * sizeof(b->v)))) {
            kvw_lost(KVW_LOST_BATCH_UNREADABLE);
            return total;
        }
#pragma unroll
        for (u32 i = 0; i < BATCH_CHUNK; i++)
            total += b->v[i];
    }
    u64 rest = count % BATCH_CHUNK;
    if (rest == 0)
        return total;
    __builtin_memset(b->v, 0, sizeof(b->v));  /* the entries past the end add nothing */
    if (bpf_probe_read_user(b->v, rest * sizeof(u64), (void *)(sizes + whole * sizeof(b->v)))) {
        kvw_lost(KVW_LOST_BATCH_UNREADABLE);
        return total;
    }
#pragma unroll
    for (u32 i = 0; i < BATCH_CHUNK; i++)
        total += b->v[i];
    return total;
}

static __always_inline int kvw_in_host_range(u32 tgid, u64 ptr) {
    struct range_key_t k = {};
    k.tgid = tgid;
    for (u32 i = 0; i < HOST_RANGE_SLOTS; i++) {
        k.slot = i;
        struct range_t *r = host_ranges.lookup(&k);
        if (r && ptr >= r->start && ptr < r->end)
            return 1;
    }
    return 0;
}

/* The first copy's direction: its location hints when given, else host ranges. */
static __always_inline u64 kvw_batch_direction(u32 tgid, u64 dsts, u64 srcs, u64 attrs) {
    struct memcpy_attrs_t a = {};
    u64 dst = 0, src = 0;
    if (attrs)
        bpf_probe_read_user(&a, sizeof(a), (void *)attrs);
    bpf_probe_read_user(&dst, sizeof(dst), (void *)dsts);
    bpf_probe_read_user(&src, sizeof(src), (void *)srcs);
    int src_host = a.src_type ? a.src_type >= 2 : kvw_in_host_range(tgid, src);
    int dst_host = a.dst_type ? a.dst_type >= 2 : kvw_in_host_range(tgid, dst);
    if (src_host && dst_host)
        return DIR_H2H;
    if (src_host)
        return DIR_H2D;
    if (dst_host)
        return DIR_D2H;
    return DIR_DEFAULT;
}

static __always_inline void kvw_host_range_add(u32 tgid, struct proc_cuda_t *pc, u64 ptr, u64 size) {
    if (!ptr || size < HOST_RANGE_MIN_BYTES)
        return;
    struct range_key_t k = {};
    k.tgid = tgid;
    k.slot = __sync_fetch_and_add(&pc->host_slot, 1) % HOST_RANGE_SLOTS;
    struct range_t r = {};
    r.start = ptr;
    r.end = ptr + size;
    if (host_ranges.update(&k, &r))
        kvw_lost(KVW_LOST_LEDGER_FULL);
}

static __always_inline void kvw_host_range_drop(u32 tgid, u64 ptr) {
    struct range_key_t k = {};
    k.tgid = tgid;
    for (u32 i = 0; i < HOST_RANGE_SLOTS; i++) {
        k.slot = i;
        struct range_t *r = host_ranges.lookup(&k);
        if (r && r->start == ptr) {
            host_ranges.delete(&k);
            return;
        }
    }
}

static __always_inline int kvw_enter(struct pt_regs *ctx, u32 api, u32 hit, u32 op, int ptr_arg, int size_arg) {
    kvw_hit(hit);
    u64 tid = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    struct inflight_t *cur = inflight.lookup(&tid);
    if (cur) {
        if (now - cur->start_ns < STALE_INFLIGHT_NS) {
            cur->depth += 1;    /* e.g. the driver call beneath cudaMalloc: counted once, above */
            u32 tgid = tid >> 32;
            struct proc_cuda_t zero = {};
            struct proc_cuda_t *pc = proc_cuda.lookup_or_try_init(&tgid, &zero);
            if (pc)
                __sync_fetch_and_add(&pc->nested, 1);
            return 0;
        }
        kvw_lost(KVW_LOST_STALE_INFLIGHT);  /* a return we never saw (longjmp, thread killed) */
    }
    struct inflight_t f = {};
    f.start_ns = now;
    f.api = api;
    if (op == OP_BATCH_COPY) {  /* (dsts, srcs, sizes, count, attrs, ...) */
        f.size = kvw_batch_bytes(PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx));
        f.a = kvw_batch_direction(tid >> 32, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM5(ctx));
    } else {
        f.a = kvw_arg(ctx, ptr_arg);
        f.size = size_arg ? kvw_arg(ctx, size_arg) : 0;
    }
    if (inflight.update(&tid, &f))
        kvw_lost(KVW_LOST_INFLIGHT_FULL);
    return 0;
}

static __always_inline void kvw_event(u32 type, u32 tgid, u32 api, s32 rc, u64 size) {
    struct cuda_event_t *e = cuda_events.ringbuf_reserve(sizeof(struct cuda_event_t));
    if (!e) {
        kvw_lost(KVW_LOST_RINGBUF);
        return;
    }
    e->type = type;
    e->tgid = tgid;
    e->api = api;
    e->rc = rc;
    e->size = size;
    e->ts_ns = bpf_ktime_get_ns();
    cuda_events.ringbuf_submit(e, 0);
}

static __always_inline int kvw_return(struct pt_regs *ctx, u32 op, u32 kind) {
    u64 tid = bpf_get_current_pid_tgid();
    struct inflight_t *cur = inflight.lookup(&tid);
    if (!cur || !kvw_outermost_return(&cur->depth))
        return 0;
    struct inflight_t f = *cur;
    inflight.delete(&tid);
    u32 tgid = tid >> 32;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u64 now = bpf_ktime_get_ns();

    struct api_key_t k = {};
    k.tgid = tgid;
    k.api = f.api;
    if (op == OP_COPY || op == OP_BATCH_COPY) {
        /* the direction: fixed by the function (its KIND), else the runtime's argument (or
         * what the batch's entry found) */
        u64 dir = kind ? kind : f.a;
        if (dir > 4)
            dir = 4;
        k.api = f.api | ((u32)dir << 8);
    }
    struct api_stats_t zero = {};
    struct api_stats_t *s = api_stats.lookup_or_try_init(&k, &zero);
    struct proc_cuda_t pzero = {};
    struct proc_cuda_t *pc = proc_cuda.lookup_or_try_init(&tgid, &pzero);
    if (!s || !pc) {
        kvw_lost(KVW_LOST_STATS_FULL);
        return 0;
    }
    if (rc != 0) {
        __sync_fetch_and_add(&s->err, 1);
        if (op == OP_ALLOC_OUT || op == OP_REGISTER) {
            pc->last_fail_ns = now;
            kvw_event(1, tgid, f.api, rc, f.size);
        }
        return 0;
    }
    __sync_fetch_and_add(&s->ok, 1);

    struct ledger_key_t lk = {};
    lk.tgid = tgid;
    lk.kind = kind;
    if (op == OP_ALLOC_OUT || op == OP_REGISTER) {
        u64 ptr = f.a;
        if (op == OP_ALLOC_OUT) {
            ptr = 0;
            bpf_probe_read_user(&ptr, sizeof(ptr), (void *)f.a);
        }
        __sync_fetch_and_add(&s->bytes, f.size);
        if (f.size == 2 * MIB)
            __sync_fetch_and_add(&pc->seg_2m, 1);
        else if (f.size == 20 * MIB)
            __sync_fetch_and_add(&pc->seg_20m, 1);
        if (f.size > pc->max_alloc)
            pc->max_alloc = f.size;
        if (f.size >= LARGE_ALLOC_BYTES)
            kvw_event(2, tgid, f.api, 0, f.size);
        lk.ptr = ptr;
        struct ledger_val_t lv = {};
        lv.size = f.size;
        lv.api = f.api;
        if (ptr && ledger.update(&lk, &lv))
            kvw_lost(KVW_LOST_LEDGER_FULL);
        if (kind == KIND_HOST)
            kvw_host_range_add(tgid, pc, ptr, f.size);
    } else if (op == OP_FREE) {
        if (now - pc->last_fail_ns < RETRY_WINDOW_NS)
            __sync_fetch_and_add(&pc->frees_after_failure, 1);
        if (now - pc->last_free_ns < FREE_CLUSTER_NS)
            __sync_fetch_and_add(&pc->clustered_frees, 1);
        pc->last_free_ns = now;
        lk.ptr = f.a;
        if (!f.a)
            return 0;   /* cudaFree(NULL): a no-op (or context creation), nothing freed */
        struct ledger_val_t *lv = ledger.lookup(&lk);
        if (lv) {
            __sync_fetch_and_add(&s->bytes, lv->size);
            if (kind == KIND_HOST && lv->size >= HOST_RANGE_MIN_BYTES)
                kvw_host_range_drop(tgid, f.a);
            ledger.delete(&lk);
        } else {
            __sync_fetch_and_add(&s->unknown, 1);
        }
    } else {
        __sync_fetch_and_add(&s->bytes, f.size);   /* map / unmap / copy: the size argument */
    }
    return 0;
}

/* One entry and one return function per API, from the loader's table:
 * X(name, api index, hit index, op, kind (copies: fixed direction, 0 = from the
 * "pointer" argument), pointer argument, size argument). */
#define X(NAME, API, HIT, OP, KIND, PTR_ARG, SIZE_ARG)                                   \
    int kvw_enter_##NAME(struct pt_regs *ctx) { return kvw_enter(ctx, API, HIT, OP, PTR_ARG, SIZE_ARG); } \
    int kvw_return_##NAME(struct pt_regs *ctx) { return kvw_return(ctx, OP, KIND); }
KVW_CUDA_APIS
#undef X
