/*
 * lp_verbs.c: verbs lanes' I/O (lp_verbs.h). libibverbs is opened with dlopen the first time a
 * host asks for verbs lanes, so the plugin has no link-time dependency on it.
 */
#define _GNU_SOURCE
#include "lp_verbs.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lp_policy.h"

#if defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#define LPV_HAVE_VERBS 1
#endif
#endif

#ifndef LPV_HAVE_VERBS

int lpv_setup(int nplanes, const struct in_addr *addrs, char *why, size_t n) {
    (void)nplanes; (void)addrs;
    snprintf(why, n, "the plugin was built without the verbs headers (install libibverbs-dev and rebuild it)");
    return -1;
}
const char *lpv_describe(int plane) { (void)plane; return ""; }
struct lpv_lane *lpv_open(int plane, uint16_t sport, size_t send_size, uint32_t nsend, size_t recv_size,
                          uint32_t nrecv, char *why, size_t n) {
    (void)plane; (void)sport; (void)send_size; (void)nsend; (void)recv_size; (void)nrecv;
    snprintf(why, n, "no verbs support in this build");
    return NULL;
}
void lpv_local(const struct lpv_lane *v, struct lpv_info *out) { (void)v; memset(out, 0, sizeof *out); }
int lpv_connect(struct lpv_lane *v, const struct lpv_info *peer, int timeout, int retry, int tclass, char *why,
                size_t n) {
    (void)v; (void)peer; (void)timeout; (void)retry; (void)tclass;
    snprintf(why, n, "no verbs support in this build");
    return -1;
}
int lpv_fd(const struct lpv_lane *v) { (void)v; return -1; }
int lpv_send(struct lpv_lane *v, const void *a, size_t alen, const void *b, size_t blen, char *why, size_t n) {
    (void)v; (void)a; (void)alen; (void)b; (void)blen;
    snprintf(why, n, "no verbs support in this build");
    return -1;
}
int lpv_poll(struct lpv_lane *v, lpv_msg_fn fn, void *arg, char *why, size_t n) {
    (void)v; (void)fn; (void)arg;
    snprintf(why, n, "no verbs support in this build");
    return -1;
}
uint32_t lpv_sending(const struct lpv_lane *v) { return v ? v->nsend - v->nfree : 0; }

void lpv_close(struct lpv_lane *v) { (void)v; }

#else

#include <infiniband/verbs.h>

#define LPV_SYSFS "/sys/class/infiniband"
#define LPV_MAX_PLANES 8
#define LPV_RECV_BIT (1ull << 63)

/* The libibverbs calls that are real symbols; the data path (post, poll, notify) is inline in
 * verbs.h and goes through the device's ops, so it needs none. */
static struct {
    void *lib;
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_port)(struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *);
    int (*destroy_comp_channel)(struct ibv_comp_channel *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*destroy_qp)(struct ibv_qp *);
    int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **);
    void (*ack_cq_events)(struct ibv_cq *, unsigned int);
    const char *(*wc_status_str)(enum ibv_wc_status);
} V;

struct lpv_dev {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    uint8_t port;
    int gid_index;
    uint8_t gid[16];
    enum ibv_mtu mtu;
    char desc[96];
};

static struct lpv_dev D[LPV_MAX_PLANES];
static int D_n;
static uint64_t psn_state;

struct lpv_lane {
    struct lpv_dev *d;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    uint8_t *slab;
    size_t send_size, recv_size, recv_off;
    uint32_t nsend, nrecv;
    uint32_t *free_send, nfree;
    uint32_t psn;
    uint16_t sport;
};

static int load_library(char *why, size_t n) {
    if (V.lib) return 0;
    void *h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(why, n, "cannot load libibverbs.so.1 (%s); install rdma-core's libibverbs1", dlerror());
        return -1;
    }
    struct { const char *name; void **slot; } syms[] = {
        {"ibv_get_device_list", (void **)&V.get_device_list}, {"ibv_free_device_list", (void **)&V.free_device_list},
        {"ibv_get_device_name", (void **)&V.get_device_name}, {"ibv_open_device", (void **)&V.open_device},
        {"ibv_close_device", (void **)&V.close_device}, {"ibv_query_port", (void **)&V.query_port},
        {"ibv_alloc_pd", (void **)&V.alloc_pd}, {"ibv_dealloc_pd", (void **)&V.dealloc_pd},
        {"ibv_reg_mr", (void **)&V.reg_mr}, {"ibv_dereg_mr", (void **)&V.dereg_mr},
        {"ibv_create_comp_channel", (void **)&V.create_comp_channel},
        {"ibv_destroy_comp_channel", (void **)&V.destroy_comp_channel},
        {"ibv_create_cq", (void **)&V.create_cq}, {"ibv_destroy_cq", (void **)&V.destroy_cq},
        {"ibv_create_qp", (void **)&V.create_qp}, {"ibv_modify_qp", (void **)&V.modify_qp},
        {"ibv_destroy_qp", (void **)&V.destroy_qp}, {"ibv_get_cq_event", (void **)&V.get_cq_event},
        {"ibv_ack_cq_events", (void **)&V.ack_cq_events}, {"ibv_wc_status_str", (void **)&V.wc_status_str},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        *syms[i].slot = dlsym(h, syms[i].name);
        if (!*syms[i].slot) {
            snprintf(why, n, "libibverbs.so.1 has no %s (rdma-core too old?)", syms[i].name);
            dlclose(h);
            memset(&V, 0, sizeof V);
            return -1;
        }
    }
    V.lib = h;
    return 0;
}

static int read_line(const char *path, char *buf, size_t n) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fgets(buf, (int)n, f) != NULL;
    fclose(f);
    if (!ok) return -1;
    buf[strcspn(buf, "\n")] = 0;
    return 0;
}

/* The device, port and GID index whose GID is addr's RoCE v2 GID, from sysfs (as `rdma` and
 * the kernel name them). 0 found, -1 not (why). */
static int find_gid(struct in_addr addr, char *dev, size_t devn, int *port, int *index, char *why, size_t n) {
    const uint8_t *b = (const uint8_t *)&addr;
    char want[64], got[64], path[512], a[INET_ADDRSTRLEN];
    snprintf(want, sizeof want, "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x", b[0], b[1], b[2], b[3]);
    inet_ntop(AF_INET, &addr, a, sizeof a);
    DIR *d = opendir(LPV_SYSFS);
    if (!d) {
        snprintf(why, n, "no RDMA devices (%s is missing: no RDMA driver is loaded)", LPV_SYSFS);
        return -1;
    }
    char seen[256] = "";
    struct dirent *e;
    int found = 0;
    while (!found && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        if (strlen(seen) + strlen(e->d_name) + 3 < sizeof seen)
            snprintf(seen + strlen(seen), sizeof seen - strlen(seen), "%s%s", seen[0] ? ", " : "", e->d_name);
        for (int p = 1; p <= 4 && !found; p++) {
            for (int i = 0; i < 256 && !found; i++) {
                snprintf(path, sizeof path, LPV_SYSFS "/%s/ports/%d/gids/%d", e->d_name, p, i);
                if (read_line(path, got, sizeof got) < 0) break;
                if (strcmp(got, want) != 0) continue;
                snprintf(path, sizeof path, LPV_SYSFS "/%s/ports/%d/gid_attrs/types/%d", e->d_name, p, i);
                if (read_line(path, got, sizeof got) < 0 || strcmp(got, "RoCE v2") != 0) continue;
                snprintf(dev, devn, "%s", e->d_name);
                *port = p;
                *index = i;
                found = 1;
            }
        }
    }
    closedir(d);
    if (!found)
        snprintf(why, n, "no RDMA device has a RoCE v2 GID for %s (devices: %s)", a, seen[0] ? seen : "none");
    return found ? 0 : -1;
}

static int query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *pa) {
    struct verbs_context *vctx = verbs_get_ctx_op(ctx, query_port);
    if (vctx) return vctx->query_port(ctx, port, pa, sizeof *pa);
    memset(pa, 0, sizeof *pa);
    return V.query_port(ctx, port, (struct _compat_ibv_port_attr *)pa);
}

static void close_devices(void) {
    for (int q = 0; q < D_n; q++) {
        if (D[q].pd) V.dealloc_pd(D[q].pd);
        if (D[q].ctx) V.close_device(D[q].ctx);
    }
    memset(D, 0, sizeof D);
    D_n = 0;
}

int lpv_setup(int nplanes, const struct in_addr *addrs, char *why, size_t n) {
    if (D_n) return 0;
    if (nplanes <= 0 || nplanes > LPV_MAX_PLANES) { snprintf(why, n, "no planes"); return -1; }
    char dev[LPV_MAX_PLANES][64];
    int port[LPV_MAX_PLANES], index[LPV_MAX_PLANES];
    /* sysfs first: a host without RDMA is told so without loading the library */
    for (int q = 0; q < nplanes; q++)
        if (find_gid(addrs[q], dev[q], sizeof dev[q], &port[q], &index[q], why, n) < 0) return -1;
    if (load_library(why, n) < 0) return -1;
    int nd = 0;
    struct ibv_device **list = V.get_device_list(&nd);
    if (!list || nd <= 0) {
        snprintf(why, n, "libibverbs lists no RDMA devices although sysfs has %s", dev[0]);
        if (list) V.free_device_list(list);
        return -1;
    }
    for (int q = 0; q < nplanes; q++) {
        struct lpv_dev *x = &D[q];
        D_n = q + 1;
        for (int i = 0; i < nd && !x->ctx; i++)
            if (strcmp(V.get_device_name(list[i]), dev[q]) == 0) x->ctx = V.open_device(list[i]);
        char a[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &addrs[q], a, sizeof a);
        if (!x->ctx) { snprintf(why, n, "cannot open RDMA device %s (for %s): %s", dev[q], a, strerror(errno)); break; }
        struct ibv_port_attr pa;
        if (query_port(x->ctx, (uint8_t)port[q], &pa) != 0) {
            snprintf(why, n, "%s port %d: query failed: %s", dev[q], port[q], strerror(errno));
            break;
        }
        if (pa.state != IBV_PORT_ACTIVE) {
            snprintf(why, n, "%s port %d (for %s) is not active (state %d): is its netdev up?", dev[q], port[q], a, pa.state);
            break;
        }
        x->pd = V.alloc_pd(x->ctx);
        if (!x->pd) { snprintf(why, n, "%s: cannot allocate a protection domain: %s", dev[q], strerror(errno)); break; }
        x->port = (uint8_t)port[q];
        x->gid_index = index[q];
        memset(x->gid, 0, 10);
        x->gid[10] = x->gid[11] = 0xff;
        memcpy(x->gid + 12, &addrs[q], 4);
        x->mtu = pa.active_mtu;
        snprintf(x->desc, sizeof x->desc, "%.48s port %d GID %d, MTU %d", dev[q], port[q], index[q],
                 128 << (int)pa.active_mtu);
        why[0] = 0;
    }
    V.free_device_list(list);
    if (why[0] || D_n != nplanes) { close_devices(); return -1; }
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20);
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) { if (read(fd, &seed, sizeof seed) != (ssize_t)sizeof seed) seed ^= (uint64_t)(uintptr_t)&seed; close(fd); }
    psn_state = seed | 1;
    return 0;
}

const char *lpv_describe(int plane) { return plane >= 0 && plane < D_n ? D[plane].desc : ""; }

static uint32_t next_psn(void) {
    psn_state ^= psn_state << 13;
    psn_state ^= psn_state >> 7;
    psn_state ^= psn_state << 17;
    return (uint32_t)(psn_state & 0xFFFFFF);
}

static int post_recv(struct lpv_lane *v, uint32_t i) {
    struct ibv_sge sge = {.addr = (uintptr_t)(v->slab + v->recv_off + (size_t)i * v->recv_size),
                          .length = (uint32_t)v->recv_size, .lkey = v->mr->lkey};
    struct ibv_recv_wr wr = {.wr_id = LPV_RECV_BIT | i, .sg_list = &sge, .num_sge = 1}, *bad = NULL;
    return ibv_post_recv(v->qp, &wr, &bad);
}

struct lpv_lane *lpv_open(int plane, uint16_t sport, size_t send_size, uint32_t nsend, size_t recv_size,
                          uint32_t nrecv, char *why, size_t n) {
    if (plane < 0 || plane >= D_n) { snprintf(why, n, "plane %d has no RDMA device", plane); return NULL; }
    struct lpv_lane *v = calloc(1, sizeof *v);
    if (!v) { snprintf(why, n, "out of memory"); return NULL; }
    v->d = &D[plane];
    v->sport = sport;
    v->send_size = (send_size + 63) & ~(size_t)63;
    v->recv_size = (recv_size + 63) & ~(size_t)63;
    v->nsend = nsend;
    v->nrecv = nrecv;
    v->recv_off = v->send_size * nsend;
    size_t total = v->recv_off + v->recv_size * nrecv;
    v->free_send = calloc(nsend, sizeof *v->free_send);
    if (!v->free_send || posix_memalign((void **)&v->slab, 4096, total) != 0) {
        v->slab = NULL;
        snprintf(why, n, "out of memory for %zu bytes of lane buffers", total);
        goto fail;
    }
    for (uint32_t i = 0; i < nsend; i++) v->free_send[v->nfree++] = nsend - 1 - i;
    v->mr = V.reg_mr(v->d->pd, v->slab, total, IBV_ACCESS_LOCAL_WRITE);
    if (!v->mr) { snprintf(why, n, "registering %zu bytes failed: %s", total, strerror(errno)); goto fail; }
    v->ch = V.create_comp_channel(v->d->ctx);
    if (!v->ch) { snprintf(why, n, "cannot create a completion channel: %s", strerror(errno)); goto fail; }
    int fl = fcntl(v->ch->fd, F_GETFL);
    if (fl < 0 || fcntl(v->ch->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        snprintf(why, n, "completion channel: %s", strerror(errno));
        goto fail;
    }
    v->cq = V.create_cq(v->d->ctx, (int)(nsend + nrecv), v, v->ch, 0);
    if (!v->cq) { snprintf(why, n, "cannot create a completion queue of %u: %s", nsend + nrecv, strerror(errno)); goto fail; }
    if (ibv_req_notify_cq(v->cq, 0) != 0) { snprintf(why, n, "cannot arm the completion queue"); goto fail; }
    struct ibv_qp_init_attr ia = {.send_cq = v->cq, .recv_cq = v->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
                                  .cap = {.max_send_wr = nsend, .max_recv_wr = nrecv, .max_send_sge = 1,
                                          .max_recv_sge = 1}};
    v->qp = V.create_qp(v->d->pd, &ia);
    if (!v->qp) { snprintf(why, n, "cannot create an RC QP (%u sends, %u receives): %s", nsend, nrecv, strerror(errno)); goto fail; }
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = v->d->port, .qp_access_flags = 0};
    if (V.modify_qp(v->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
        snprintf(why, n, "QP to INIT: %s", strerror(errno));
        goto fail;
    }
    for (uint32_t i = 0; i < nrecv; i++)
        if (post_recv(v, i) != 0) { snprintf(why, n, "posting receive %u failed", i); goto fail; }
    v->psn = next_psn();
    return v;
fail:
    lpv_close(v);
    return NULL;
}

void lpv_local(const struct lpv_lane *v, struct lpv_info *out) {
    memset(out, 0, sizeof *out);
    out->qpn = v->qp->qp_num;
    out->psn = v->psn;
    memcpy(out->gid, v->d->gid, 16);
    out->sport = v->sport;
    out->mtu = (uint8_t)v->d->mtu;
    out->nrecv = v->nrecv;
}

int lpv_connect(struct lpv_lane *v, const struct lpv_info *peer, int timeout, int retry, int tclass, char *why,
                size_t n) {
    struct ibv_qp_attr a = {0};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = peer->mtu && peer->mtu < (uint8_t)v->d->mtu ? (enum ibv_mtu)peer->mtu : v->d->mtu;
    a.dest_qp_num = peer->qpn & 0xFFFFFF;
    a.rq_psn = peer->psn & 0xFFFFFF;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 1; /* 0.01 ms: a receive slot is posted again as soon as it is read */
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
    a.ah_attr.grh.flow_label = lp_flow_label_for_sport(v->sport);
    a.ah_attr.grh.sgid_index = (uint8_t)v->d->gid_index;
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.grh.traffic_class = (uint8_t)(tclass > 0 ? tclass : 0);
    a.ah_attr.port_num = v->d->port;
    if (V.modify_qp(v->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
        snprintf(why, n, "QP %u to RTR (peer QP %u): %s", v->qp->qp_num, a.dest_qp_num, strerror(errno));
        return -1;
    }
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = (uint8_t)timeout;
    a.retry_cnt = (uint8_t)retry;
    a.rnr_retry = 7; /* without limit: a receiver short of slots is slow, not broken */
    a.sq_psn = v->psn;
    a.max_rd_atomic = 1;
    if (V.modify_qp(v->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                   IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
        snprintf(why, n, "QP %u to RTS: %s", v->qp->qp_num, strerror(errno));
        return -1;
    }
    return 0;
}

int lpv_fd(const struct lpv_lane *v) { return v && v->ch ? v->ch->fd : -1; }

int lpv_send(struct lpv_lane *v, const void *a, size_t alen, const void *b, size_t blen, char *why, size_t n) {
    if (alen + blen > v->send_size) {
        snprintf(why, n, "a message of %zu bytes does not fit a send slot of %zu", alen + blen, v->send_size);
        return -1;
    }
    if (!v->nfree) return 1;
    uint32_t i = v->free_send[--v->nfree];
    uint8_t *slot = v->slab + (size_t)i * v->send_size;
    memcpy(slot, a, alen);
    if (blen) memcpy(slot + alen, b, blen);
    struct ibv_sge sge = {.addr = (uintptr_t)slot, .length = (uint32_t)(alen + blen), .lkey = v->mr->lkey};
    struct ibv_send_wr wr = {.wr_id = i, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED}, *bad = NULL;
    int rc = ibv_post_send(v->qp, &wr, &bad);
    if (rc != 0) {
        v->free_send[v->nfree++] = i;
        snprintf(why, n, "posting a send on QP %u failed: %s", v->qp->qp_num, strerror(rc));
        return -1;
    }
    return 0;
}

int lpv_poll(struct lpv_lane *v, lpv_msg_fn fn, void *arg, char *why, size_t n) {
    struct ibv_cq *cq;
    void *cctx;
    int events = 0;
    while (V.get_cq_event(v->ch, &cq, &cctx) == 0) {
        V.ack_cq_events(cq, 1);
        events = 1;
    }
    if (events && ibv_req_notify_cq(v->cq, 0) != 0) { snprintf(why, n, "cannot re-arm the completion queue"); return -1; }
    /* at most what the queue can hold per call, so one busy lane does not starve the others */
    for (uint32_t taken = 0; taken < v->nsend + v->nrecv;) {
        struct ibv_wc wc[16];
        int k = ibv_poll_cq(v->cq, 16, wc);
        if (k < 0) { snprintf(why, n, "polling the completion queue failed"); return -1; }
        if (k == 0) break;
        taken += (uint32_t)k;
        for (int j = 0; j < k; j++) {
            int recv = (wc[j].wr_id & LPV_RECV_BIT) != 0;
            uint32_t i = (uint32_t)(wc[j].wr_id & 0xFFFFFFFFu);
            if (wc[j].status != IBV_WC_SUCCESS) {
                snprintf(why, n, "QP %u %s failed: %s (vendor error %u)", v->qp->qp_num, recv ? "receive" : "send",
                         V.wc_status_str(wc[j].status), wc[j].vendor_err);
                return -1;
            }
            if (!recv) {
                if (i < v->nsend && v->nfree < v->nsend) v->free_send[v->nfree++] = i;
                continue;
            }
            if (i >= v->nrecv) continue;
            int rc = fn(arg, v->slab + v->recv_off + (size_t)i * v->recv_size, wc[j].byte_len);
            if (post_recv(v, i) != 0) { snprintf(why, n, "posting a receive on QP %u failed", v->qp->qp_num); return -1; }
            if (rc < 0) { snprintf(why, n, "protocol"); return -1; }
        }
    }
    return 0;
}

uint32_t lpv_sending(const struct lpv_lane *v) { return v ? v->nsend - v->nfree : 0; }

void lpv_close(struct lpv_lane *v) {
    if (!v) return;
    if (v->qp) V.destroy_qp(v->qp);
    if (v->cq) {
        struct ibv_cq *cq;
        void *cctx;
        while (v->ch && V.get_cq_event(v->ch, &cq, &cctx) == 0) V.ack_cq_events(cq, 1);
        V.destroy_cq(v->cq);
    }
    if (v->ch) V.destroy_comp_channel(v->ch);
    if (v->mr) V.dereg_mr(v->mr);
    free(v->slab);
    free(v->free_send);
    free(v);
}

#endif
