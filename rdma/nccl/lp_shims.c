/*
 * lp_shims.c: the exported ncclNetPlugin_v8 .. v12 tables. Each is a thin adapter from one ABI
 * version's signatures to the one implementation in lp_plugin.c; nothing here decides anything.
 */
#include <string.h>

#include "lp_plugin.h"

#define EXPORT __attribute__((visibility("default")))

static void fill_common(const struct lp_props *p, char **name, char **pci, uint64_t *guid, int *ptr, int *global,
                        int *speed, int *port, float *lat, int *maxComms, int *maxRecvs, ncclNetDeviceType *type,
                        int *ver) {
    *name = p->name;
    *pci = p->pciPath;
    *guid = p->guid;
    *ptr = NCCL_PTR_HOST;
    *global = 0;
    *speed = p->speed;
    *port = p->port;
    *lat = 0;
    *maxComms = p->maxComms;
    *maxRecvs = 1;
    *type = NCCL_NET_DEVICE_HOST;
    *ver = NCCL_NET_DEVICE_INVALID_VERSION;
}

#define FILL(P, X) fill_common(&P, &X->name, &X->pciPath, &X->guid, &X->ptrSupport, &X->regIsGlobal, &X->speed, \
                               &X->port, &X->latency, &X->maxComms, &X->maxRecvs, &X->netDeviceType,             \
                               &X->netDeviceVersion)

/* ---- calls every version shares --------------------------------------------------------------- */

static ncclResult_t devices(int *ndev) { return lp_devices(ndev); }
static ncclResult_t accept_(void *lc, void **rc, ncclNetDeviceHandle_v7_t **dev) {
    if (dev) *dev = NULL;
    return lp_accept(lc, rc);
}
static ncclResult_t reg_mr(void *comm, void *data, size_t size, int type, void **mh) {
    return lp_reg_mr(comm, data, size, type, mh);
}
static ncclResult_t dereg_mr(void *comm, void *mh) { return lp_dereg_mr(comm, mh); }
static ncclResult_t iflush(void *rc, int n, void **data, int *sizes, void **mh, void **req) {
    return lp_iflush(rc, n, data, sizes, mh, req);
}
static ncclResult_t test(void *req, int *done, int *sizes) { return lp_test(req, done, sizes); }
static ncclResult_t close_send(void *sc) { return lp_close_send(sc); }
static ncclResult_t close_recv(void *rc) { return lp_close_recv(rc); }
static ncclResult_t close_listen(void *lc) { return lp_close_listen(lc); }
static ncclResult_t finalize(void *ctx) { return lp_finalize(ctx); }

static ncclResult_t isend_sz(void *sc, void *data, size_t size, int tag, void *mh, void **req) {
    (void)mh;
    return lp_isend(sc, data, size, tag, req);
}
static ncclResult_t irecv_sz(void *rc, int n, void **data, size_t *sizes, int *tags, void **mh, void **req) {
    (void)tags; (void)mh;
    return lp_irecv(rc, n, data, sizes, req);
}

/* ---- v8: int sizes, init(log) ------------------------------------------------------------------ */

static ncclResult_t init_v8(ncclDebugLogger_t log) { return lp_init(NULL, 0, NCCL_NET_TRAFFIC_CLASS_UNDEF, log); }
static ncclResult_t props_v8(int dev, ncclNetProperties_v8_t *x) {
    struct lp_props p;
    ncclResult_t r = lp_get_properties(dev, &p);
    if (r != ncclSuccess) return r;
    memset(x, 0, sizeof *x);
    FILL(p, x);
    return ncclSuccess;
}
static ncclResult_t listen_old(int dev, void *h, void **lc) { return lp_listen(NULL, dev, h, lc); }
static ncclResult_t connect_old(int dev, void *h, void **sc, ncclNetDeviceHandle_v7_t **dev_) {
    if (dev_) *dev_ = NULL;
    return lp_connect(NULL, dev, h, sc);
}
static ncclResult_t isend_v8(void *sc, void *data, int size, int tag, void *mh, void **req) {
    if (size < 0) return ncclInternalError;
    return isend_sz(sc, data, (size_t)size, tag, mh, req);
}
static ncclResult_t irecv_v8(void *rc, int n, void **data, int *sizes, int *tags, void **mh, void **req) {
    if (n != 1 || sizes[0] < 0) return ncclInternalError;
    size_t s = (size_t)sizes[0];
    return irecv_sz(rc, n, data, &s, tags, mh, req);
}

EXPORT const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = LP_PLUGIN_NAME, .init = init_v8, .devices = devices, .getProperties = props_v8, .listen = listen_old,
    .connect = connect_old, .accept = accept_, .regMr = reg_mr, .regMrDmaBuf = NULL, .deregMr = dereg_mr,
    .isend = isend_v8, .irecv = irecv_v8, .iflush = iflush, .test = test, .closeSend = close_send,
    .closeRecv = close_recv, .closeListen = close_listen, .getDeviceMr = NULL, .irecvConsumed = NULL,
};

/* ---- v9: size_t sizes, vProps ------------------------------------------------------------------- */

static ncclResult_t props_v9(int dev, ncclNetProperties_v9_t *x) {
    struct lp_props p;
    ncclResult_t r = lp_get_properties(dev, &p);
    if (r != ncclSuccess) return r;
    memset(x, 0, sizeof *x);
    FILL(p, x);
    x->forceFlush = 0;
    x->vProps.ndevs = 1;
    x->vProps.devs[0] = dev;
    x->maxP2pBytes = x->maxCollBytes = p.maxBytes;
    return ncclSuccess;
}

EXPORT const ncclNet_v9_t ncclNetPlugin_v9 = {
    .name = LP_PLUGIN_NAME, .init = init_v8, .devices = devices, .getProperties = props_v9, .listen = listen_old,
    .connect = connect_old, .accept = accept_, .regMr = reg_mr, .regMrDmaBuf = NULL, .deregMr = dereg_mr,
    .isend = isend_sz, .irecv = irecv_sz, .iflush = iflush, .test = test, .closeSend = close_send,
    .closeRecv = close_recv, .closeListen = close_listen, .getDeviceMr = NULL, .irecvConsumed = NULL,
    .makeVDevice = NULL,
};

/* ---- v10: init(log, prof), connect(config), phandles ------------------------------------------ */

static ncclResult_t init_v10(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
    (void)prof;
    return init_v8(log);
}
static ncclResult_t connect_v10(int dev, ncclNetCommConfig_v10_t *cfg, void *h, void **sc,
                                ncclNetDeviceHandle_v10_t **dev_) {
    (void)cfg;
    return connect_old(dev, h, sc, dev_);
}
static ncclResult_t isend_ph(void *sc, void *data, size_t size, int tag, void *mh, void *ph, void **req) {
    (void)ph;
    return isend_sz(sc, data, size, tag, mh, req);
}
static ncclResult_t irecv_ph(void *rc, int n, void **data, size_t *sizes, int *tags, void **mh, void **ph, void **req) {
    (void)ph;
    return irecv_sz(rc, n, data, sizes, tags, mh, req);
}

EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
    .name = LP_PLUGIN_NAME, .init = init_v10, .devices = devices, .getProperties = props_v9, .listen = listen_old,
    .connect = connect_v10, .accept = accept_, .regMr = reg_mr, .regMrDmaBuf = NULL, .deregMr = dereg_mr,
    .isend = isend_ph, .irecv = irecv_ph, .iflush = iflush, .test = test, .closeSend = close_send,
    .closeRecv = close_recv, .closeListen = close_listen, .getDeviceMr = NULL, .irecvConsumed = NULL,
    .makeVDevice = NULL,
};

/* ---- v11 / v12: a context per communicator, finalize ------------------------------------------ */

static ncclResult_t init_v11(void **ctx, uint64_t commId, ncclNetCommConfig_v11_t *cfg, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof) {
    (void)prof;
    return lp_init(ctx, commId, cfg ? cfg->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF, log);
}
static ncclResult_t listen_ctx(void *ctx, int dev, void *h, void **lc) { return lp_listen(ctx, dev, h, lc); }
static ncclResult_t connect_ctx(void *ctx, int dev, void *h, void **sc, ncclNetDeviceHandle_v11_t **dev_) {
    if (dev_) *dev_ = NULL;
    return lp_connect(ctx, dev, h, sc);
}
static ncclResult_t props_v11(int dev, ncclNetProperties_v11_t *x) {
    struct lp_props p;
    ncclResult_t r = lp_get_properties(dev, &p);
    if (r != ncclSuccess) return r;
    memset(x, 0, sizeof *x);
    FILL(p, x);
    x->vProps.ndevs = 1;
    x->vProps.devs[0] = dev;
    x->maxP2pBytes = x->maxCollBytes = p.maxBytes;
    x->maxMultiRequestSize = 1;
    return ncclSuccess;
}
static ncclResult_t props_v12(int dev, ncclNetProperties_v12_t *x) {
    struct lp_props p;
    ncclResult_t r = lp_get_properties(dev, &p);
    if (r != ncclSuccess) return r;
    memset(x, 0, sizeof *x);
    FILL(p, x);
    x->vProps.ndevs = 1;
    x->vProps.devs[0] = dev;
    x->maxP2pBytes = x->maxCollBytes = p.maxBytes;
    x->maxMultiRequestSize = 1;
    x->railId = x->planeId = NCCL_NET_ID_UNDEF;
    return ncclSuccess;
}

EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {
    .name = LP_PLUGIN_NAME, .init = init_v11, .devices = devices, .getProperties = props_v11, .listen = listen_ctx,
    .connect = connect_ctx, .accept = accept_, .regMr = reg_mr, .regMrDmaBuf = NULL, .deregMr = dereg_mr,
    .isend = isend_ph, .irecv = irecv_ph, .iflush = iflush, .test = test, .closeSend = close_send,
    .closeRecv = close_recv, .closeListen = close_listen, .getDeviceMr = NULL, .irecvConsumed = NULL,
    .makeVDevice = NULL, .finalize = finalize, .setNetAttr = NULL,
};

EXPORT const ncclNet_v12_t ncclNetPlugin_v12 = {
    .name = LP_PLUGIN_NAME, .init = (ncclResult_t(*)(void **, uint64_t, ncclNetCommConfig_v12_t *, ncclDebugLogger_t,
                                                     ncclProfilerCallback_t))init_v11,
    .devices = devices, .getProperties = props_v12, .listen = listen_ctx, .connect = connect_ctx, .accept = accept_,
    .regMr = reg_mr, .regMrDmaBuf = NULL, .deregMr = dereg_mr, .isend = isend_ph, .irecv = irecv_ph,
    .iflush = iflush, .test = test, .closeSend = close_send, .closeRecv = close_recv, .closeListen = close_listen,
    .getDeviceMr = NULL, .irecvConsumed = NULL, .makeVDevice = NULL, .finalize = finalize, .setNetAttr = NULL,
};
