/* Stand-ins for the KV-transfer libraries, for tests and `kvwatch demo` without NIXL,
 * RDMA hardware or GPUs. Built by kvwatch.daemon.lab.stublib, one library per section:
 *   KVWSTUB_NIXL   libnixl.so      nixlAgent::postXferReq / getXferStatus / releaseXferReq
 *                                  (exported under their C++ mangled names), calling
 *   KVWSTUB_UCP    libucp.so.0     ucp_put_nbx / ucp_get_nbx beneath, like NIXL's UCX backend
 *   KVWSTUB_VERBS  libibverbs.so.1 ibv_reg_mr_iova2, ibv_reg_dmabuf_mr, and ibv_dereg_mr in
 *                                  two versions (IBVERBS_1.0 and the default @@IBVERBS_1.1),
 *                                  like rdma-core
 *   KVWSTUB_NCCL   libnccl.so.2    ncclSend / ncclRecv / ncclAllGather
 * Behaviour is set by the caller through kvwstub_* functions: what the next post moves
 * and returns, what a status poll returns. Nothing here moves data.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))
NOINLINE static int ok(int rc) { __asm__ volatile(""); return rc; }

#ifdef KVWSTUB_UCP
static int ucp_fail;
void kvwstub_ucp_fail(int on) { ucp_fail = on; }
NOINLINE static void *ucp_result(void) { __asm__ volatile(""); return ucp_fail ? (void *)(intptr_t)-3 : NULL; }
void *ucp_put_nbx(void *ep, const void *buf, size_t count, uint64_t raddr, void *rkey, const void *param) {
    (void)ep; (void)buf; (void)count; (void)raddr; (void)rkey; (void)param;
    return ucp_result();
}
void *ucp_get_nbx(void *ep, void *buf, size_t count, uint64_t raddr, void *rkey, const void *param) {
    (void)ep; (void)buf; (void)count; (void)raddr; (void)rkey; (void)param;
    return ucp_result();
}
#endif

#ifdef KVWSTUB_NIXL
void *ucp_put_nbx(void *ep, const void *buf, size_t count, uint64_t raddr, void *rkey, const void *param);
void *ucp_get_nbx(void *ep, void *buf, size_t count, uint64_t raddr, void *rkey, const void *param);

static struct { uint64_t bytes; int rc; uint64_t ep; int read; int chunks; } next_post = {0, 0, 1, 0, 1};
#define MAXH 4096
static struct { uintptr_t handle; int rc; } status_of[MAXH];

void kvwstub_next_post(uint64_t bytes, int rc, uint64_t ep, int read, int chunks) {
    next_post.bytes = bytes; next_post.rc = rc; next_post.ep = ep; next_post.read = read;
    next_post.chunks = chunks > 0 ? chunks : 1;
}
void kvwstub_set_status(uintptr_t handle, int rc) {
    int free_slot = -1;
    for (int i = 0; i < MAXH; i++) {
        if (status_of[i].handle == handle) { status_of[i].rc = rc; return; }
        if (!status_of[i].handle && free_slot < 0) free_slot = i;
    }
    if (free_slot >= 0) { status_of[free_slot].handle = handle; status_of[free_slot].rc = rc; }
}

/* nixlAgent::postXferReq(nixlXferReqH*, nixlAgentOptionalArgs const*) const */
int _ZNK9nixlAgent11postXferReqEP12nixlXferReqHPK21nixlAgentOptionalArgs(void *self, void *handle, void *opts) {
    (void)self; (void)opts;
    static char buf[1];
    uint64_t each = next_post.bytes / (uint64_t)next_post.chunks;
    for (int i = 0; i < next_post.chunks; i++) {
        uint64_t n = i == next_post.chunks - 1 ? next_post.bytes - each * (uint64_t)(next_post.chunks - 1) : each;
        if (next_post.read)
            ucp_get_nbx((void *)next_post.ep, buf, n, 0, NULL, NULL);
        else
            ucp_put_nbx((void *)next_post.ep, buf, n, 0, NULL, NULL);
    }
    kvwstub_set_status((uintptr_t)handle, next_post.rc == 0 ? 0 : 1);
    return ok(next_post.rc);
}
/* nixlAgent::getXferStatus(nixlXferReqH*) const */
int _ZNK9nixlAgent13getXferStatusEP12nixlXferReqH(void *self, void *handle) {
    (void)self;
    for (int i = 0; i < MAXH; i++)
        if (status_of[i].handle == (uintptr_t)handle) return ok(status_of[i].rc);
    return ok(-1);
}
/* nixlAgent::releaseXferReq(nixlXferReqH*) const */
int _ZNK9nixlAgent14releaseXferReqEP12nixlXferReqH(void *self, void *handle) {
    (void)self;
    for (int i = 0; i < MAXH; i++)
        if (status_of[i].handle == (uintptr_t)handle) status_of[i].handle = 0;
    return ok(0);
}
#endif

#ifdef KVWSTUB_VERBS
struct fake_mr { size_t length; };
static int reg_fail;
void kvwstub_reg_fail(int on) { reg_fail = on; }
NOINLINE static void *new_mr(size_t length) {
    if (reg_fail || length == 0) return NULL;
    struct fake_mr *mr = malloc(sizeof *mr);
    if (mr) mr->length = length;
    return mr;
}
void *ibv_reg_mr_iova2(void *pd, void *addr, size_t length, uint64_t iova, unsigned access) {
    (void)pd; (void)addr; (void)iova; (void)access;
    return new_mr(length);
}
void *ibv_reg_dmabuf_mr(void *pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access) {
    (void)pd; (void)offset; (void)iova; (void)fd; (void)access;
    return new_mr(length);
}
/* the old ABI: what bcc's own symbol lookup picks, and what nobody calls */
int ibv_dereg_mr_1_0(void *mr) { (void)mr; return ok(-1); }
__asm__(".symver ibv_dereg_mr_1_0,ibv_dereg_mr@IBVERBS_1.0");
/* the default version, the one programs link against */
int ibv_dereg_mr_1_1(void *mr) { free(mr); return ok(0); }
__asm__(".symver ibv_dereg_mr_1_1,ibv_dereg_mr@@IBVERBS_1.1");
#endif

#ifdef KVWSTUB_NCCL
static int nccl_rc;
void kvwstub_nccl_rc(int rc) { nccl_rc = rc; }
int ncclSend(const void *buf, size_t count, int datatype, int peer, void *comm, void *stream) {
    (void)buf; (void)count; (void)datatype; (void)peer; (void)comm; (void)stream;
    return ok(nccl_rc);
}
int ncclRecv(void *buf, size_t count, int datatype, int peer, void *comm, void *stream) {
    (void)buf; (void)count; (void)datatype; (void)peer; (void)comm; (void)stream;
    return ok(nccl_rc);
}
int ncclAllGather(const void *sendbuf, void *recvbuf, size_t count, int datatype, void *comm, void *stream) {
    (void)sendbuf; (void)recvbuf; (void)count; (void)datatype; (void)comm; (void)stream;
    return ok(nccl_rc);
}
#endif
