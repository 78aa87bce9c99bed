/*
 * lp_plugin.h: the one implementation behind every exported ncclNetPlugin_vN (lp_shims.c adapts
 * each version's table to these calls). Sizes are size_t here; shims narrow or widen.
 */
#ifndef LINKPASS_LP_PLUGIN_H
#define LINKPASS_LP_PLUGIN_H

#include "nccl_net.h"

#define LP_PLUGIN_NAME "LinkPass"

/* What getProperties reports; each shim copies it into its version's struct. */
struct lp_props {
    char *name;
    char *pciPath;
    uint64_t guid;
    int speed;   /* Mbps */
    int port;
    int maxComms;
    size_t maxBytes;
};

ncclResult_t lp_init(void **ctx, uint64_t commId, int trafficClass, ncclDebugLogger_t log);
ncclResult_t lp_devices(int *ndev);
ncclResult_t lp_get_properties(int dev, struct lp_props *props);
ncclResult_t lp_listen(void *ctx, int dev, void *handle, void **listenComm);
ncclResult_t lp_connect(void *ctx, int dev, void *handle, void **sendComm);
ncclResult_t lp_accept(void *listenComm, void **recvComm);
ncclResult_t lp_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle);
ncclResult_t lp_dereg_mr(void *comm, void *mhandle);
ncclResult_t lp_isend(void *sendComm, void *data, size_t size, int tag, void **request);
ncclResult_t lp_irecv(void *recvComm, int n, void **data, const size_t *sizes, void **request);
ncclResult_t lp_iflush(void *recvComm, int n, void **data, int *sizes, void **mhandles, void **request);
ncclResult_t lp_test(void *request, int *done, int *sizes);
ncclResult_t lp_close_send(void *sendComm);
ncclResult_t lp_close_recv(void *recvComm);
ncclResult_t lp_close_listen(void *listenComm);
ncclResult_t lp_finalize(void *ctx);

#endif
