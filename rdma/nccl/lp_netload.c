/* lp_netload.c: see lp_netload.h. Each call switches on the loaded table's version. */
#define _GNU_SOURCE
#include "lp_netload.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define T8 ((const ncclNet_v8_t *)p->table)
#define T9 ((const ncclNet_v9_t *)p->table)
#define T10 ((const ncclNet_v10_t *)p->table)
#define T11 ((const ncclNet_v11_t *)p->table)
#define T12 ((const ncclNet_v12_t *)p->table)
/* Calls with one signature in every version: the field sits at the same offset in each table. */
#define SAME(field) (p->version == 8 ? (void *)T8->field : p->version == 9 ? (void *)T9->field : \
                     p->version == 10 ? (void *)T10->field : p->version == 11 ? (void *)T11->field : (void *)T12->field)

struct lpn *lpn_open(const char *path, int version, char *err, size_t errlen) {
    void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!dl) { snprintf(err, errlen, "dlopen %s: %s", path, dlerror()); return NULL; }
    for (int v = 12; v >= 8; v--) {
        if (version && v != version) continue;
        char sym[32];
        snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", v);
        const void *t = dlsym(dl, sym);
        if (!t) continue;
        struct lpn *p = calloc(1, sizeof *p);
        if (!p) break;
        p->dl = dl;
        p->version = v;
        p->table = t;
        p->name = *(const char *const *)t; /* name is the first field of every version */
        return p;
    }
    if (version) snprintf(err, errlen, "%s exports no ncclNetPlugin_v%d", path, version);
    else snprintf(err, errlen, "%s exports none of ncclNetPlugin_v8..v12", path);
    dlclose(dl);
    return NULL;
}

void lpn_close(struct lpn *p) {
    if (!p) return;
    dlclose(p->dl);
    free(p);
}

ncclResult_t lpn_init(struct lpn *p, void **ctx, uint64_t commId, ncclDebugLogger_t log) {
    *ctx = NULL;
    switch (p->version) {
    case 8: return T8->init(log);
    case 9: return T9->init(log);
    case 10: return T10->init(log, NULL);
    case 11: { ncclNetCommConfig_v11_t c = {NCCL_NET_TRAFFIC_CLASS_UNDEF}; return T11->init(ctx, commId, &c, log, NULL); }
    default: { ncclNetCommConfig_v12_t c = {NCCL_NET_TRAFFIC_CLASS_UNDEF}; return T12->init(ctx, commId, &c, log, NULL); }
    }
}

ncclResult_t lpn_finalize(struct lpn *p, void *ctx) {
    if (p->version == 11) return T11->finalize(ctx);
    if (p->version == 12) return T12->finalize(ctx);
    return ncclSuccess; /* NCCL's v8..v10 compatibility layers supply a stub */
}

ncclResult_t lpn_devices(struct lpn *p, int *ndev) { return ((ncclResult_t(*)(int *))SAME(devices))(ndev); }

ncclResult_t lpn_get_properties(struct lpn *p, int dev, struct lpn_props *o) {
    memset(o, 0, sizeof *o);
    o->vdevs = 1;
    o->maxP2pBytes = MAX_NET_SIZE;
    o->maxCollBytes = MAX_COLLNET_SIZE;
    o->maxMultiRequestSize = 1;
    o->railId = o->planeId = NCCL_NET_ID_UNDEF;
#define COMMON(x) do { o->name = x.name; o->pciPath = x.pciPath; o->guid = x.guid; o->ptrSupport = x.ptrSupport; \
        o->regIsGlobal = x.regIsGlobal; o->speed = x.speed; o->port = x.port; o->latency = x.latency;          \
        o->maxComms = x.maxComms; o->maxRecvs = x.maxRecvs; o->netDeviceType = x.netDeviceType;               \
        o->netDeviceVersion = x.netDeviceVersion; } while (0)
    ncclResult_t r;
    if (p->version == 8) {
        ncclNetProperties_v8_t x;
        if ((r = T8->getProperties(dev, &x)) != ncclSuccess) return r;
        COMMON(x);
    } else if (p->version == 9 || p->version == 10) {
        ncclNetProperties_v9_t x;
        r = p->version == 9 ? T9->getProperties(dev, &x) : T10->getProperties(dev, &x);
        if (r != ncclSuccess) return r;
        COMMON(x);
        o->forceFlush = x.forceFlush; o->vdevs = x.vProps.ndevs; o->maxP2pBytes = x.maxP2pBytes; o->maxCollBytes = x.maxCollBytes;
    } else if (p->version == 11) {
        ncclNetProperties_v11_t x;
        if ((r = T11->getProperties(dev, &x)) != ncclSuccess) return r;
        COMMON(x);
        o->forceFlush = x.forceFlush; o->vdevs = x.vProps.ndevs; o->maxP2pBytes = x.maxP2pBytes; o->maxCollBytes = x.maxCollBytes;
        o->maxMultiRequestSize = x.maxMultiRequestSize;
    } else {
        ncclNetProperties_v12_t x;
        if ((r = T12->getProperties(dev, &x)) != ncclSuccess) return r;
        COMMON(x);
        o->forceFlush = x.forceFlush; o->vdevs = x.vProps.ndevs; o->maxP2pBytes = x.maxP2pBytes; o->maxCollBytes = x.maxCollBytes;
        o->maxMultiRequestSize = x.maxMultiRequestSize; o->railId = x.railId; o->planeId = x.planeId;
    }
    return ncclSuccess;
}

ncclResult_t lpn_listen(struct lpn *p, void *ctx, int dev, void *handle, void **lc) {
    if (p->version >= 11) return (p->version == 11 ? T11->listen : T12->listen)(ctx, dev, handle, lc);
    return ((ncclResult_t(*)(int, void *, void **))SAME(listen))(dev, handle, lc);
}

ncclResult_t lpn_connect(struct lpn *p, void *ctx, int dev, void *handle, void **sc) {
    ncclNetDeviceHandle_v7_t *dh = NULL;
    switch (p->version) {
    case 8: return T8->connect(dev, handle, sc, &dh);
    case 9: return T9->connect(dev, handle, sc, &dh);
    case 10: { ncclNetCommConfig_v10_t c = {NCCL_NET_TRAFFIC_CLASS_UNDEF}; return T10->connect(dev, &c, handle, sc, &dh); }
    case 11: return T11->connect(ctx, dev, handle, sc, &dh);
    default: return T12->connect(ctx, dev, handle, sc, &dh);
    }
}

ncclResult_t lpn_accept(struct lpn *p, void *lc, void **rc) {
    ncclNetDeviceHandle_v7_t *dh = NULL;
    return ((ncclResult_t(*)(void *, void **, ncclNetDeviceHandle_v7_t **))SAME(accept))(lc, rc, &dh);
}

ncclResult_t lpn_reg_mr(struct lpn *p, void *comm, void *data, size_t size, int type, void **mh) {
    return ((ncclResult_t(*)(void *, void *, size_t, int, void **))SAME(regMr))(comm, data, size, type, mh);
}

ncclResult_t lpn_dereg_mr(struct lpn *p, void *comm, void *mh) {
    return ((ncclResult_t(*)(void *, void *))SAME(deregMr))(comm, mh);
}

ncclResult_t lpn_isend(struct lpn *p, void *sc, void *data, size_t size, int tag, void *mh, void **req) {
    switch (p->version) {
    case 8:
        if (size > MAX_NET_SIZE) return ncclInternalError; /* NCCL's v8 layer refuses > 1 GiB */
        return T8->isend(sc, data, (int)size, tag, mh, req);
    case 9: return T9->isend(sc, data, size, tag, mh, req);
    case 10: return T10->isend(sc, data, size, tag, mh, NULL, req);
    case 11: return T11->isend(sc, data, size, tag, mh, NULL, req);
    default: return T12->isend(sc, data, size, tag, mh, NULL, req);
    }
}

ncclResult_t lpn_irecv(struct lpn *p, void *rc, void *data, size_t size, int tag, void *mh, void **req) {
    void *d[1] = {data}, *m[1] = {mh}, *ph[1] = {NULL};
    int tags[1] = {tag};
    size_t sizes[1] = {size};
    switch (p->version) {
    case 8: {
        if (size > MAX_NET_SIZE) return ncclInternalError;
        int isz[1] = {(int)size};
        if (*req == (void *)NCCL_NET_OPTIONAL_RECV_COMPLETION) *req = NULL;
        return T8->irecv(rc, 1, d, isz, tags, m, req);
    }
    case 9: return T9->irecv(rc, 1, d, sizes, tags, m, req);
    case 10: return T10->irecv(rc, 1, d, sizes, tags, m, ph, req);
    case 11: return T11->irecv(rc, 1, d, sizes, tags, m, ph, req);
    default: return T12->irecv(rc, 1, d, sizes, tags, m, ph, req);
    }
}

ncclResult_t lpn_test(struct lpn *p, void *req, int *done, int *size) {
    return ((ncclResult_t(*)(void *, int *, int *))SAME(test))(req, done, size);
}

ncclResult_t lpn_close_send(struct lpn *p, void *sc) { return ((ncclResult_t(*)(void *))SAME(closeSend))(sc); }
ncclResult_t lpn_close_recv(struct lpn *p, void *rc) { return ((ncclResult_t(*)(void *))SAME(closeRecv))(rc); }
ncclResult_t lpn_close_listen(struct lpn *p, void *lc) { return ((ncclResult_t(*)(void *))SAME(closeListen))(lc); }

static double ms_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void pause_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

ncclResult_t lpn_connect_wait(struct lpn *p, void *ctx, int dev, void *handle, void **sc, int timeout_ms) {
    double end = ms_now() + timeout_ms;
    *sc = NULL;
    for (;;) {
        ncclResult_t r = lpn_connect(p, ctx, dev, handle, sc);
        if (r != ncclSuccess || *sc) return r;
        if (ms_now() > end) return ncclSystemError;
        pause_us(200);
    }
}

ncclResult_t lpn_accept_wait(struct lpn *p, void *lc, void **rc, int timeout_ms) {
    double end = ms_now() + timeout_ms;
    *rc = NULL;
    for (;;) {
        ncclResult_t r = lpn_accept(p, lc, rc);
        if (r != ncclSuccess || *rc) return r;
        if (ms_now() > end) return ncclSystemError;
        pause_us(200);
    }
}

ncclResult_t lpn_connect_pair(struct lpn *p, void *sctx, void *rctx, int dev, void **sc, void **rc, int timeout_ms) {
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    void *lc = NULL;
    *sc = *rc = NULL;
    ncclResult_t r = lpn_listen(p, rctx, dev, handle, &lc);
    if (r != ncclSuccess) return r;
    if (!lc) return ncclInternalError;
    double end = ms_now() + timeout_ms;
    while (!*sc || !*rc) {
        if (!*sc && (r = lpn_connect(p, sctx, dev, handle, sc)) != ncclSuccess) break;
        if (!*rc && (r = lpn_accept(p, lc, rc)) != ncclSuccess) break;
        if (ms_now() > end) { r = ncclSystemError; break; }
        if (!*sc || !*rc) pause_us(200);
    }
    ncclResult_t r2 = lpn_close_listen(p, lc);
    return r != ncclSuccess ? r : r2;
}
