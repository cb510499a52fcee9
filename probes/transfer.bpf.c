/* kvwatch KV-transfer probes (uprobe + uretprobe pairs), per watched process.
 *
 * Hooks (the loader passes the table as the X-macro KVW_TRANSFER_APIS and
 * attaches each symbol with pid= to the exact library file the process mapped;
 * NIXL wheels bundle their own UCX and libibverbs under hashed names):
 *   NIXL   nixlAgent::postXferReq / getXferStatus / releaseXferReq
 *          a request posted, paired with its completion by handle -> per-transfer latency
 *   UCX    ucp_put_nbx / ucp_get_nbx: bytes (3rd argument). Inside a NIXL post they
 *          are the post's bytes and peer; called directly, they count as lib=ucx.
 *   verbs  ibv_reg_mr_iova2, ibv_reg_dmabuf_mr (length: 3rd argument), ibv_dereg_mr:
 *          bytes registered for RDMA, with an mr -> length ledger
 *   NCCL   ncclSend / ncclRecv (count x datatype: 2nd, 3rd), ncclAllGather (3rd, 4th):
 *          bytes enqueued (these calls only enqueue work)
 *
 * Cost: one uprobe pair per call (~1 us); nothing for unwatched processes.
 * Caveats: a NIXL transfer's bytes come from the UCX calls made inside its post;
 * other NIXL backends are counted as transfers with unknown bytes. NCCL and direct
 * UCX calls have no completion here, so no latency.
 */
#include "common.h"

#ifndef MAX_PENDING
#define MAX_PENDING 65536
#endif
#ifndef MAX_PROCS
#define MAX_PROCS 1024
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 16
#endif
#define NBUCKETS 26              /* log2 buckets of ns: [<2^10, <2^11, ..., >=2^34] */
#define FIRST_BUCKET_LOG2 10
#define STALE_INFLIGHT_NS (10ULL * 1000000000ULL)

/* roles (the loader uses the same numbers) */
#define R_NIXL_POST 1
#define R_NIXL_STATUS 2
#define R_NIXL_RELEASE 3
#define R_UCP_PUT 4
#define R_UCP_GET 5
#define R_VERBS_REG 6
#define R_VERBS_DEREG 7
#define R_NCCL 8

#define LIB_NIXL 0
#define LIB_UCX 1
#define LIB_NCCL 2
#define OP_WRITE 0
#define OP_READ 1
#define OP_SEND 2
#define OP_RECV 3
#define OP_ALLGATHER 4
#define OP_UNKNOWN 5

struct call_t {
    u64 start_ns;
    u64 a;       /* pointer/handle argument */
    u64 size;    /* bytes (ucp count, verbs length) or NCCL count */
    u64 extra;   /* NCCL datatype, ucp endpoint */
    u32 api;
    u32 depth;
};
BPF_HASH(call_inflight, u64, struct call_t, 16384);

struct post_t {
    u64 start_ns;
    u64 handle;
    u64 bytes;
    u64 ep;
    u32 op;
    u32 pad;
};
BPF_HASH(post_inflight, u64, struct post_t, 16384);
BPF_HASH(status_inflight, u64, u64, 16384);

struct pending_key_t {
    u32 tgid;
    u32 pad;
    u64 handle;
};
BPF_HASH(pending, struct pending_key_t, struct post_t, MAX_PENDING);

struct xfer_key_t {
    u32 tgid;
    u16 lib;
    u16 op;
};
struct xfer_stats_t {
    u64 calls;       /* NIXL: posts; UCX/NCCL: successful calls */
    u64 errors;
    u64 bytes;       /* NIXL: bytes of completed transfers; UCX/NCCL: bytes submitted */
    u64 completed;   /* NIXL transfers completed */
    u64 duration_ns; /* sum over completed transfers */
    u64 hist[NBUCKETS];
};
BPF_PERCPU_HASH(xfer_stats, struct xfer_key_t, struct xfer_stats_t, MAX_PROCS * 8);

/* Per peer (the UCX endpoint a transfer used): the detector ignores a new peer's first seconds. */
struct peer_key_t {
    u32 tgid;
    u32 lib;
    u64 ep;
};
struct peer_stats_t {
    u64 first_ns;
    u64 bytes;
    u64 duration_ns;
    u64 completed;
};
BPF_TABLE("lru_hash", struct peer_key_t, struct peer_stats_t, peers, 4096);

struct proc_xfer_t {
    u64 reg_calls;
    u64 reg_bytes;
    u64 dereg_calls;
    u64 dereg_bytes;
    u64 reg_errors;
    u64 released_incomplete;   /* releaseXferReq on a transfer that never completed */
    u64 reposted_pending;      /* postXferReq on a handle still pending */
    u64 nested;
};
BPF_HASH(proc_xfer, u32, struct proc_xfer_t, MAX_PROCS);

struct mr_key_t {
    u32 tgid;
    u32 pad;
    u64 mr;
};
BPF_HASH(mr_ledger, struct mr_key_t, u64, 65536);

struct xfer_event_t {
    u32 tgid;
    u16 lib;
    u16 op;
    u64 bytes;
    u64 start_ns;
    u64 end_ns;
    u64 ep;
    s32 status;
    u32 pad;
};
KVW_MIRRORED(xfer_event_t);
BPF_RINGBUF_OUTPUT(xfer_events, RINGBUF_PAGES);
BPF_ARRAY(emit_events, u32, 1);  /* set by `kvwatch record`: one event per completed transfer */

static __always_inline u64 kvw_arg(struct pt_regs *ctx, int n) {
    switch (n) {
    case 1: return PT_REGS_PARM1(ctx);
    case 2: return PT_REGS_PARM2(ctx);
    case 3: return PT_REGS_PARM3(ctx);
    case 4: return PT_REGS_PARM4(ctx);
    case 5: return PT_REGS_PARM5(ctx);
    case 6: return PT_REGS_PARM6(ctx);
    default: return 0;
    }
}

static __always_inline struct proc_xfer_t *kvw_proc(u32 tgid) {
    struct proc_xfer_t zero = {};
    struct proc_xfer_t *p = proc_xfer.lookup_or_try_init(&tgid, &zero);
    if (!p)
        kvw_lost(KVW_LOST_STATS_FULL);
    return p;
}

static __always_inline struct xfer_stats_t *kvw_stats(u32 tgid, u32 lib, u32 op) {
    struct xfer_key_t k = {};
    k.tgid = tgid;
    k.lib = lib;
    k.op = op;
    struct xfer_stats_t zero = {};
    struct xfer_stats_t *s = xfer_stats.lookup_or_try_init(&k, &zero);
    if (!s)
        kvw_lost(KVW_LOST_STATS_FULL);
    return s;
}

static __always_inline u32 kvw_nccl_dtype_size(u64 dt) {
    switch (dt) {
    case 0: case 1: case 10: case 11: return 1;   /* int8, uint8, fp8 e4m3/e5m2 */
    case 6: case 9: return 2;                       /* float16, bfloat16 */
    case 2: case 3: case 7: return 4;               /* int32, uint32, float32 */
    case 4: case 5: case 8: return 8;               /* int64, uint64, float64 */
    default: return 0;
    }
}

/* A NIXL transfer finished (done, or failed when status < 0). */
static __always_inline void kvw_complete(u32 tgid, struct post_t *p, u64 now, s32 status) {
    struct xfer_stats_t *s = kvw_stats(tgid, LIB_NIXL, p->op);
    if (!s)
        return;
    if (status < 0) {
        __sync_fetch_and_add(&s->errors, 1);
        return;
    }
    u64 d = now - p->start_ns;
    __sync_fetch_and_add(&s->completed, 1);
    __sync_fetch_and_add(&s->bytes, p->bytes);
    __sync_fetch_and_add(&s->duration_ns, d);
    u32 b = bpf_log2l(d);
    b = b > FIRST_BUCKET_LOG2 ? b - FIRST_BUCKET_LOG2 : 0;
    if (b >= NBUCKETS)
        b = NBUCKETS - 1;
    __sync_fetch_and_add(&s->hist[b], 1);
    struct peer_key_t pk = {};
    pk.tgid = tgid;
    pk.lib = LIB_NIXL;
    pk.ep = p->ep;
    struct peer_stats_t pz = {};
    pz.first_ns = now;
    struct peer_stats_t *ps = peers.lookup_or_try_init(&pk, &pz);
    if (ps) {
        __sync_fetch_and_add(&ps->bytes, p->bytes);
        __sync_fetch_and_add(&ps->duration_ns, d);
        __sync_fetch_and_add(&ps->completed, 1);
    }
    u32 zero_idx = 0;
    u32 *emit = emit_events.lookup(&zero_idx);
    if (emit && *emit) {
        struct xfer_event_t *e = xfer_events.ringbuf_reserve(sizeof(struct xfer_event_t));
        if (!e) {
            kvw_lost(KVW_LOST_RINGBUF);
            return;
        }
        e->tgid = tgid;
        e->lib = LIB_NIXL;
        e->op = p->op;
        e->bytes = p->bytes;
        e->start_ns = p->start_ns;
        e->end_ns = now;
        e->ep = p->ep;
        e->status = status;
        e->pad = 0;
        xfer_events.ringbuf_submit(e, 0);
    }
}

/* ---- NIXL ------------------------------------------------------------------------------ */

static __always_inline int kvw_nixl_post_enter(struct pt_regs *ctx) {
    u64 tid = bpf_get_current_pid_tgid();
    struct post_t p = {};
    p.start_ns = bpf_ktime_get_ns();
    p.handle = PT_REGS_PARM2(ctx);  /* this, req_hndl, opt_args */
    p.op = OP_UNKNOWN;
    if (post_inflight.update(&tid, &p))
        kvw_lost(KVW_LOST_INFLIGHT_FULL);
    return 0;
}

static __always_inline int kvw_nixl_post_return(struct pt_regs *ctx) {
    u64 tid = bpf_get_current_pid_tgid();
    struct post_t *cur = post_inflight.lookup(&tid);
    if (!cur)
        return 0;
    struct post_t p = *cur;
    post_inflight.delete(&tid);
    u32 tgid = tid >> 32;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u64 now = bpf_ktime_get_ns();
    struct xfer_stats_t *s = kvw_stats(tgid, LIB_NIXL, p.op);
    if (s)
        __sync_fetch_and_add(&s->calls, 1);
    if (rc == 0) {                 /* NIXL_SUCCESS: done within the post */
        kvw_complete(tgid, &p, now, 0);
    } else if (rc == 1) {          /* NIXL_IN_PROG: completion comes with getXferStatus */
        struct pending_key_t k = {};
        k.tgid = tgid;
        k.handle = p.handle;
        if (pending.lookup(&k)) {
            struct proc_xfer_t *px = kvw_proc(tgid);
            if (px)
                __sync_fetch_and_add(&px->reposted_pending, 1);
        }
        if (pending.update(&k, &p))
            kvw_lost(KVW_LOST_PENDING_FULL);
    } else if (s) {
        __sync_fetch_and_add(&s->errors, 1);
    }
    return 0;
}

static __always_inline int kvw_nixl_status_enter(struct pt_regs *ctx) {
    u64 tid = bpf_get_current_pid_tgid();
    u64 h = PT_REGS_PARM2(ctx);
    status_inflight.update(&tid, &h);
    return 0;
}

static __always_inline int kvw_nixl_status_return(struct pt_regs *ctx) {
    u64 tid = bpf_get_current_pid_tgid();
    u64 *h = status_inflight.lookup(&tid);
    if (!h)
        return 0;
    struct pending_key_t k = {};
    k.tgid = tid >> 32;
    k.handle = *h;
    status_inflight.delete(&tid);
    s32 rc = (s32)PT_REGS_RC(ctx);
    if (rc == 1)
        return 0;                  /* still in progress */
    struct post_t *p = pending.lookup(&k);
    if (!p)
        return 0;                  /* completed within its post, or never seen posted */
    struct post_t copy = *p;
    pending.delete(&k);
    kvw_complete(k.tgid, &copy, bpf_ktime_get_ns(), rc);
    return 0;
}

static __always_inline int kvw_nixl_release_enter(struct pt_regs *ctx) {
    struct pending_key_t k = {};
    k.tgid = bpf_get_current_pid_tgid() >> 32;
    k.handle = PT_REGS_PARM2(ctx);
    if (pending.lookup(&k)) {
        pending.delete(&k);
        struct proc_xfer_t *px = kvw_proc(k.tgid);
        if (px)
            __sync_fetch_and_add(&px->released_incomplete, 1);
    }
    return 0;
}

/* ---- leaf calls: UCX, verbs, NCCL --------------------------------------------------------- */

static __always_inline int kvw_call_enter(struct pt_regs *ctx, u32 api, int ptr_arg, int size_arg, int extra_arg) {
    u64 tid = bpf_get_current_pid_tgid();
    u64 now = bpf_ktime_get_ns();
    struct call_t *cur = call_inflight.lookup(&tid);
    if (cur && now - cur->start_ns < STALE_INFLIGHT_NS) {
        cur->depth += 1;
        struct proc_xfer_t *px = kvw_proc(tid >> 32);
        if (px)
            __sync_fetch_and_add(&px->nested, 1);
        return 0;
    }
    struct call_t c = {};
    c.start_ns = now;
    c.api = api;
    c.a = ptr_arg ? kvw_arg(ctx, ptr_arg) : 0;
    c.size = size_arg ? kvw_arg(ctx, size_arg) : 0;
    c.extra = extra_arg ? kvw_arg(ctx, extra_arg) : 0;
    if (call_inflight.update(&tid, &c))
        kvw_lost(KVW_LOST_INFLIGHT_FULL);
    return 0;
}

static __always_inline int kvw_call_return(struct pt_regs *ctx, u32 role, u32 op) {
    u64 tid = bpf_get_current_pid_tgid();
    struct call_t *cur = call_inflight.lookup(&tid);
    if (!cur || !kvw_outermost_return(&cur->depth))
        return 0;
    struct call_t c = *cur;
    call_inflight.delete(&tid);
    u32 tgid = tid >> 32;
    u64 rc = PT_REGS_RC(ctx);

    if (role == R_UCP_PUT || role == R_UCP_GET) {
        /* ucs_status_ptr_t: NULL (done), a request, or an error code (UCS_PTR_IS_ERR) */
        int failed = rc >= (u64)-100;
        struct post_t *p = post_inflight.lookup(&tid);
        if (p && !failed) {
            p->bytes += c.size;
            p->ep = c.extra;
            p->op = op;
            return 0;
        }
        struct xfer_stats_t *s = kvw_stats(tgid, LIB_UCX, op);
        if (!s)
            return 0;
        if (failed) {
            __sync_fetch_and_add(&s->errors, 1);
        } else {
            __sync_fetch_and_add(&s->calls, 1);
            __sync_fetch_and_add(&s->bytes, c.size);
        }
        return 0;
    }
    if (role == R_NCCL) {
        struct xfer_stats_t *s = kvw_stats(tgid, LIB_NCCL, op);
        if (!s)
            return 0;
        if ((s32)rc != 0) {
            __sync_fetch_and_add(&s->errors, 1);
        } else {
            __sync_fetch_and_add(&s->calls, 1);
            __sync_fetch_and_add(&s->bytes, c.size * kvw_nccl_dtype_size(c.extra));
        }
        return 0;
    }
    struct proc_xfer_t *px = kvw_proc(tgid);
    if (!px)
        return 0;
    struct mr_key_t mk = {};
    mk.tgid = tgid;
    if (role == R_VERBS_REG) {
        if (rc == 0) {                       /* NULL: registration failed */
            __sync_fetch_and_add(&px->reg_errors, 1);
            return 0;
        }
        __sync_fetch_and_add(&px->reg_calls, 1);
        __sync_fetch_and_add(&px->reg_bytes, c.size);
        mk.mr = rc;
        u64 len = c.size;
        if (mr_ledger.update(&mk, &len))
            kvw_lost(KVW_LOST_LEDGER_FULL);
    } else if (role == R_VERBS_DEREG) {
        if ((s32)rc != 0)
            return 0;
        __sync_fetch_and_add(&px->dereg_calls, 1);
        mk.mr = c.a;
        u64 *len = mr_ledger.lookup(&mk);
        if (len) {
            __sync_fetch_and_add(&px->dereg_bytes, *len);
            mr_ledger.delete(&mk);
        }
    }
    return 0;
}

/* X(symbol-as-identifier, api index, role, op, pointer arg, size arg, extra arg):
 * one entry and one return function per API. */
#define X(NAME, API, ROLE, OP, PTR_ARG, SIZE_ARG, EXTRA_ARG)                                  \
    int kvw_enter_##NAME(struct pt_regs *ctx) {                                               \
        kvw_hit(API);                                                                         \
        if (ROLE == R_NIXL_POST) return kvw_nixl_post_enter(ctx);                             \
        if (ROLE == R_NIXL_STATUS) return kvw_nixl_status_enter(ctx);                         \
        if (ROLE == R_NIXL_RELEASE) return kvw_nixl_release_enter(ctx);                       \
        return kvw_call_enter(ctx, API, PTR_ARG, SIZE_ARG, EXTRA_ARG);                        \
    }                                                                                         \
    int kvw_return_##NAME(struct pt_regs *ctx) {                                              \
        if (ROLE == R_NIXL_POST) return kvw_nixl_post_return(ctx);                            \
        if (ROLE == R_NIXL_STATUS) return kvw_nixl_status_return(ctx);                        \
        if (ROLE == R_NIXL_RELEASE) return 0;                                                 \
        return kvw_call_return(ctx, ROLE, OP);                                                \
    }
KVW_TRANSFER_APIS
#undef X
