/*
 * lp_netload.h: load an NCCL net plugin and drive it the way NCCL's proxy does, whatever ABI
 * version it exports (v8..v12). The harness uses it; so can any program built on the plugin API
 * alone (a ring all-reduce over N ranks): one call per plugin entry point, in v12 terms, plus the
 * connection helpers that poll connect/accept to completion.
 */
#ifndef LINKPASS_LP_NETLOAD_H
#define LINKPASS_LP_NETLOAD_H

#include "nccl_net.h"

struct lpn {
    void *dl;
    int version;        /* 8..12 */
    const char *name;   /* the plugin's name field */
    const void *table;  /* the ncclNet_vN_t */
};

/* What every version's getProperties can say, in one struct. */
struct lpn_props {
    const char *name, *pciPath;
    uint64_t guid;
    int ptrSupport, regIsGlobal, forceFlush, speed, port, maxComms, maxRecvs, netDeviceType, netDeviceVersion;
    float latency;
    int vdevs;
    size_t maxP2pBytes, maxCollBytes;
    int maxMultiRequestSize, railId, planeId;
};

/* dlopen path and take ncclNetPlugin_v<version> (0: the newest found, v12 first, as NCCL does).
 * NULL on failure, with why in err. */
struct lpn *lpn_open(const char *path, int version, char *err, size_t errlen);
void lpn_close(struct lpn *p);

/* init: for v11+ once per communicator (ctx per comm); for older versions NCCL calls it once per
 * process and *ctx is set to NULL. */
ncclResult_t lpn_init(struct lpn *p, void **ctx, uint64_t commId, ncclDebugLogger_t log);
ncclResult_t lpn_finalize(struct lpn *p, void *ctx);
ncclResult_t lpn_devices(struct lpn *p, int *ndev);
ncclResult_t lpn_get_properties(struct lpn *p, int dev, struct lpn_props *out);
ncclResult_t lpn_listen(struct lpn *p, void *ctx, int dev, void *handle, void **lc);
ncclResult_t lpn_connect(struct lpn *p, void *ctx, int dev, void *handle, void **sc);
ncclResult_t lpn_accept(struct lpn *p, void *lc, void **rc);
ncclResult_t lpn_reg_mr(struct lpn *p, void *comm, void *data, size_t size, int type, void **mh);
ncclResult_t lpn_dereg_mr(struct lpn *p, void *comm, void *mh);
ncclResult_t lpn_isend(struct lpn *p, void *sc, void *data, size_t size, int tag, void *mh, void **req);
/* *req may hold NCCL_NET_OPTIONAL_RECV_COMPLETION on entry, as NCCL may preset it; for v8 it is
 * reset to NULL first, as NCCL's v8 compatibility layer does. */
ncclResult_t lpn_irecv(struct lpn *p, void *rc, void *data, size_t size, int tag, void *mh, void **req);
ncclResult_t lpn_test(struct lpn *p, void *req, int *done, int *size);
ncclResult_t lpn_close_send(struct lpn *p, void *sc);
ncclResult_t lpn_close_recv(struct lpn *p, void *rc);
ncclResult_t lpn_close_listen(struct lpn *p, void *lc);

/* Poll connect until it gives a send comm (or an error, or timeout_ms: ncclSystemError). */
ncclResult_t lpn_connect_wait(struct lpn *p, void *ctx, int dev, void *handle, void **sc, int timeout_ms);
/* Poll accept until it gives a recv comm. */
ncclResult_t lpn_accept_wait(struct lpn *p, void *lc, void **rc, int timeout_ms);
/* Both ends in one process: listen, then poll connect and accept in turn, then close the listen comm. */
ncclResult_t lpn_connect_pair(struct lpn *p, void *sctx, void *rctx, int dev, void **sc, void **rc, int timeout_ms);

#endif
