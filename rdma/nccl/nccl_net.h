/*
 * nccl_net.h: NCCL's external net-plugin ABI, versions 8 to 12, as LinkPass's plugin uses it.
 *
 * Written from the documented layouts (x86-64; NCCL 2.20 .. 2.32), not copied from NCCL: no NCCL,
 * CUDA or verbs header is needed to build the plugin. Every struct size and field offset NCCL
 * relies on is checked at compile time below, so a wrong field order cannot build.
 */
#ifndef LINKPASS_NCCL_NET_H
#define LINKPASS_NCCL_NET_H

#include <stddef.h>
#include <stdint.h>

#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_NET_MAX_REQUESTS 32
#define NCCL_NET_OPTIONAL_RECV_COMPLETION 0x1
#define NCCL_NET_MULTI_REQUEST 0x2
#define NCCL_MAX_NET_SIZE_BYTES (1 * 1024 * 1024 * 1024 * 1024L)
#define MAX_NET_SIZE (1024 * 1024 * 1024L)
#define MAX_COLLNET_SIZE (512 * 1024 * 1024L)
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
#define NCCL_NET_MAX_DEVS_PER_NIC_V11 4
#define NCCL_NET_MAX_DEVS_PER_NIC_V12 8
#define NCCL_NET_TRAFFIC_CLASS_UNDEF -1
#define NCCL_NET_ID_UNDEF -1
#define NCCL_NET_ATTR_UNDEF -1
#define NCCL_NET_DEVICE_INVALID_VERSION 0x0
#define NCCL_NET_DEVICE_UNPACK_VERSION 0x7

typedef enum {
    ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
    ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6
} ncclResult_t;

typedef enum {
    NCCL_LOG_NONE = 0, NCCL_LOG_VERSION = 1, NCCL_LOG_WARN = 2, NCCL_LOG_INFO = 3, NCCL_LOG_ABORT = 4, NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

typedef enum {
    NCCL_INIT = 1, NCCL_COLL = 2, NCCL_P2P = 4, NCCL_SHM = 8, NCCL_NET = 16, NCCL_GRAPH = 32, NCCL_TUNING = 64,
    NCCL_ENV = 128, NCCL_ALLOC = 256, NCCL_CALL = 512, NCCL_PROXY = 1024, NCCL_NVLS = 2048, NCCL_BOOTSTRAP = 4096,
    NCCL_REG = 8192, NCCL_PROFILE = 16384, NCCL_RAS = 32768, NCCL_DESTROY = 65536, NCCL_ALLOC_HOST = 131072,
    NCCL_ALL = ~0
} ncclDebugLogSubSys;

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                                  const char *fmt, ...);
typedef ncclResult_t (*ncclProfilerCallback_t)(void **eHandle, int type, void *phandle, int64_t pluginId,
                                               void *extData);

typedef enum {
    NCCL_NET_DEVICE_HOST = 0, NCCL_NET_DEVICE_UNPACK = 1, NCCL_NET_DEVICE_GIN_PROXY = 2, NCCL_NET_DEVICE_GIN_GDAKI = 3
} ncclNetDeviceType;

typedef struct {
    ncclNetDeviceType netDeviceType;
    int netDeviceVersion;
    void *handle;
    size_t size;
    int needsProxyProgress;
} ncclNetDeviceHandle_v7_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v8_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v9_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v10_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v11_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v12_t;

/* ---- properties ------------------------------------------------------------------------------ */

typedef struct {
    char *name;
    char *pciPath;
    uint64_t guid;
    int ptrSupport;
    int regIsGlobal;
    int speed;
    int port;
    float latency;
    int maxComms;
    int maxRecvs;
    ncclNetDeviceType netDeviceType;
    int netDeviceVersion;
} ncclNetProperties_v8_t;

typedef struct { int ndevs; int devs[NCCL_NET_MAX_DEVS_PER_NIC_V11]; } ncclNetVDeviceProps_v9_t;
typedef ncclNetVDeviceProps_v9_t ncclNetVDeviceProps_v10_t;
typedef ncclNetVDeviceProps_v9_t ncclNetVDeviceProps_v11_t;
typedef struct { int ndevs; int devs[NCCL_NET_MAX_DEVS_PER_NIC_V12]; } ncclNetVDeviceProps_v12_t;

typedef struct {
    char *name;
    char *pciPath;
    uint64_t guid;
    int ptrSupport;
    int regIsGlobal;
    int forceFlush;
    int speed;
    int port;
    float latency;
    int maxComms;
    int maxRecvs;
    ncclNetDeviceType netDeviceType;
    int netDeviceVersion;
    ncclNetVDeviceProps_v9_t vProps;
    size_t maxP2pBytes;
    size_t maxCollBytes;
} ncclNetProperties_v9_t;
typedef ncclNetProperties_v9_t ncclNetProperties_v10_t;

typedef struct {
    char *name;
    char *pciPath;
    uint64_t guid;
    int ptrSupport;
    int regIsGlobal;
    int forceFlush;
    int speed;
    int port;
    float latency;
    int maxComms;
    int maxRecvs;
    ncclNetDeviceType netDeviceType;
    int netDeviceVersion;
    ncclNetVDeviceProps_v11_t vProps;
    size_t maxP2pBytes;
    size_t maxCollBytes;
    int maxMultiRequestSize;
} ncclNetProperties_v11_t;

typedef struct {
    char *name;
    char *pciPath;
    uint64_t guid;
    int ptrSupport;
    int regIsGlobal;
    int forceFlush;
    int speed;
    int port;
    float latency;
    int maxComms;
    int maxRecvs;
    ncclNetDeviceType netDeviceType;
    int netDeviceVersion;
    ncclNetVDeviceProps_v12_t vProps;
    size_t maxP2pBytes;
    size_t maxCollBytes;
    int maxMultiRequestSize;
    int16_t railId;
    int16_t planeId;
} ncclNetProperties_v12_t;

/* ---- per-communicator config and attributes (v10+) ------------------------------------------ */

typedef struct { int trafficClass; } ncclNetCommConfig_v10_t;
typedef ncclNetCommConfig_v10_t ncclNetCommConfig_v11_t;
typedef ncclNetCommConfig_v10_t ncclNetCommConfig_v12_t;

typedef struct { int32_t maxConcurrentPeers, minConcurrentPeers, maxFlowsPerPeer, minFlowsPerPeer; } ncclNetCommAttr_v11_t;
typedef struct { ncclNetCommAttr_v11_t sendCommAttr, recvCommAttr; uint32_t op, algo, proto; } ncclNetAttr_v11_t;
typedef ncclNetCommAttr_v11_t ncclNetCommAttr_v12_t;
typedef ncclNetAttr_v11_t ncclNetAttr_v12_t;

/* ---- function tables ------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    ncclResult_t (*init)(ncclDebugLogger_t logFunction);
    ncclResult_t (*devices)(int *ndev);
    ncclResult_t (*getProperties)(int dev, ncclNetProperties_v8_t *props);
    ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
    ncclResult_t (*connect)(int dev, void *handle, void **sendComm, ncclNetDeviceHandle_v8_t **sendDevComm);
    ncclResult_t (*accept)(void *listenComm, void **recvComm, ncclNetDeviceHandle_v8_t **recvDevComm);
    ncclResult_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);
    ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset, int fd, void **mhandle);
    ncclResult_t (*deregMr)(void *comm, void *mhandle);
    ncclResult_t (*isend)(void *sendComm, void *data, int size, int tag, void *mhandle, void **request);
    ncclResult_t (*irecv)(void *recvComm, int n, void **data, int *sizes, int *tags, void **mhandles, void **request);
    ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles, void **request);
    ncclResult_t (*test)(void *request, int *done, int *sizes);
    ncclResult_t (*closeSend)(void *sendComm);
    ncclResult_t (*closeRecv)(void *recvComm);
    ncclResult_t (*closeListen)(void *listenComm);
    ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
    ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
} ncclNet_v8_t;

typedef struct {
    const char *name;
    ncclResult_t (*init)(ncclDebugLogger_t logFunction);
    ncclResult_t (*devices)(int *ndev);
    ncclResult_t (*getProperties)(int dev, ncclNetProperties_v9_t *props);
    ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
    ncclResult_t (*connect)(int dev, void *handle, void **sendComm, ncclNetDeviceHandle_v9_t **sendDevComm);
    ncclResult_t (*accept)(void *listenComm, void **recvComm, ncclNetDeviceHandle_v9_t **recvDevComm);
    ncclResult_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);
    ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset, int fd, void **mhandle);
    ncclResult_t (*deregMr)(void *comm, void *mhandle);
    ncclResult_t (*isend)(void *sendComm, void *data, size_t size, int tag, void *mhandle, void **request);
    ncclResult_t (*irecv)(void *recvComm, int n, void **data, size_t *sizes, int *tags, void **mhandles, void **request);
    ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles, void **request);
    ncclResult_t (*test)(void *request, int *done, int *sizes);
    ncclResult_t (*closeSend)(void *sendComm);
    ncclResult_t (*closeRecv)(void *recvComm);
    ncclResult_t (*closeListen)(void *listenComm);
    ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
    ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
    ncclResult_t (*makeVDevice)(int *d, ncclNetVDeviceProps_v9_t *props);
} ncclNet_v9_t;

typedef struct {
    const char *name;
    ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
    ncclResult_t (*devices)(int *ndev);
    ncclResult_t (*getProperties)(int dev, ncclNetProperties_v10_t *props);
    ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
    ncclResult_t (*connect)(int dev, ncclNetCommConfig_v10_t *config, void *handle, void **sendComm,
                            ncclNetDeviceHandle_v10_t **sendDevComm);
    ncclResult_t (*accept)(void *listenComm, void **recvComm, ncclNetDeviceHandle_v10_t **recvDevComm);
    ncclResult_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);
    ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset, int fd, void **mhandle);
    ncclResult_t (*deregMr)(void *comm, void *mhandle);
    ncclResult_t (*isend)(void *sendComm, void *data, size_t size, int tag, void *mhandle, void *phandle, void **request);
    ncclResult_t (*irecv)(void *recvComm, int n, void **data, size_t *sizes, int *tags, void **mhandles, void **phandles,
                          void **request);
    ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles, void **request);
    ncclResult_t (*test)(void *request, int *done, int *sizes);
    ncclResult_t (*closeSend)(void *sendComm);
    ncclResult_t (*closeRecv)(void *recvComm);
    ncclResult_t (*closeListen)(void *listenComm);
    ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
    ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
    ncclResult_t (*makeVDevice)(int *d, ncclNetVDeviceProps_v10_t *props);
} ncclNet_v10_t;

#define LP_NCCL_NET_V11_LIKE(PROPS, VPROPS, CONFIG, ATTR, DEVH)                                                       \
    struct {                                                                                                          \
        const char *name;                                                                                             \
        ncclResult_t (*init)(void **ctx, uint64_t commId, CONFIG *config, ncclDebugLogger_t logFunction,             \
                             ncclProfilerCallback_t profFunction);                                                    \
        ncclResult_t (*devices)(int *ndev);                                                                           \
        ncclResult_t (*getProperties)(int dev, PROPS *props);                                                         \
        ncclResult_t (*listen)(void *ctx, int dev, void *handle, void **listenComm);                                 \
        ncclResult_t (*connect)(void *ctx, int dev, void *handle, void **sendComm, DEVH **sendDevComm);              \
        ncclResult_t (*accept)(void *listenComm, void **recvComm, DEVH **recvDevComm);                               \
        ncclResult_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);                        \
        ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,          \
                                    void **mhandle);                                                                  \
        ncclResult_t (*deregMr)(void *comm, void *mhandle);                                                           \
        ncclResult_t (*isend)(void *sendComm, void *data, size_t size, int tag, void *mhandle, void *phandle,        \
                              void **request);                                                                        \
        ncclResult_t (*irecv)(void *recvComm, int n, void **data, size_t *sizes, int *tags, void **mhandles,         \
                              void **phandles, void **request);                                                       \
        ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles, void **request);     \
        ncclResult_t (*test)(void *request, int *done, int *sizes);                                                   \
        ncclResult_t (*closeSend)(void *sendComm);                                                                    \
        ncclResult_t (*closeRecv)(void *recvComm);                                                                    \
        ncclResult_t (*closeListen)(void *listenComm);                                                                \
        ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);                                 \
        ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);                                         \
        ncclResult_t (*makeVDevice)(int *d, VPROPS *props);                                                           \
        ncclResult_t (*finalize)(void *ctx);                                                                          \
        ncclResult_t (*setNetAttr)(void *ctx, ATTR *netAttr);                                                         \
    }

typedef LP_NCCL_NET_V11_LIKE(ncclNetProperties_v11_t, ncclNetVDeviceProps_v11_t, ncclNetCommConfig_v11_t,
                             ncclNetAttr_v11_t, ncclNetDeviceHandle_v11_t) ncclNet_v11_t;
typedef LP_NCCL_NET_V11_LIKE(ncclNetProperties_v12_t, ncclNetVDeviceProps_v12_t, ncclNetCommConfig_v12_t,
                             ncclNetAttr_v12_t, ncclNetDeviceHandle_v12_t) ncclNet_v12_t;

/* ---- the documented layouts, checked (x86-64 LP64) ------------------------------------------- */

#if defined(__x86_64__) || defined(__aarch64__)
#define LP_ABI_AT(T, F, OFF) _Static_assert(offsetof(T, F) == (OFF), #T "." #F " must be at " #OFF)
#define LP_ABI_SIZE(T, N) _Static_assert(sizeof(T) == (N), "sizeof(" #T ") must be " #N)

LP_ABI_SIZE(ncclNetDeviceHandle_v7_t, 32);
LP_ABI_AT(ncclNetDeviceHandle_v7_t, handle, 8);
LP_ABI_AT(ncclNetDeviceHandle_v7_t, size, 16);
LP_ABI_AT(ncclNetDeviceHandle_v7_t, needsProxyProgress, 24);

LP_ABI_SIZE(ncclNetProperties_v8_t, 64);
LP_ABI_AT(ncclNetProperties_v8_t, name, 0);
LP_ABI_AT(ncclNetProperties_v8_t, pciPath, 8);
LP_ABI_AT(ncclNetProperties_v8_t, guid, 16);
LP_ABI_AT(ncclNetProperties_v8_t, ptrSupport, 24);
LP_ABI_AT(ncclNetProperties_v8_t, regIsGlobal, 28);
LP_ABI_AT(ncclNetProperties_v8_t, speed, 32);
LP_ABI_AT(ncclNetProperties_v8_t, port, 36);
LP_ABI_AT(ncclNetProperties_v8_t, latency, 40);
LP_ABI_AT(ncclNetProperties_v8_t, maxComms, 44);
LP_ABI_AT(ncclNetProperties_v8_t, maxRecvs, 48);
LP_ABI_AT(ncclNetProperties_v8_t, netDeviceType, 52);
LP_ABI_AT(ncclNetProperties_v8_t, netDeviceVersion, 56);

LP_ABI_SIZE(ncclNetProperties_v9_t, 104);
LP_ABI_AT(ncclNetProperties_v9_t, forceFlush, 32);
LP_ABI_AT(ncclNetProperties_v9_t, speed, 36);
LP_ABI_AT(ncclNetProperties_v9_t, vProps, 64);
LP_ABI_AT(ncclNetProperties_v9_t, maxP2pBytes, 88);
LP_ABI_AT(ncclNetProperties_v9_t, maxCollBytes, 96);

LP_ABI_SIZE(ncclNetProperties_v11_t, 112);
LP_ABI_AT(ncclNetProperties_v11_t, vProps, 64);
LP_ABI_AT(ncclNetProperties_v11_t, maxP2pBytes, 88);
LP_ABI_AT(ncclNetProperties_v11_t, maxCollBytes, 96);
LP_ABI_AT(ncclNetProperties_v11_t, maxMultiRequestSize, 104);

LP_ABI_SIZE(ncclNetProperties_v12_t, 128);
LP_ABI_AT(ncclNetProperties_v12_t, forceFlush, 32);
LP_ABI_AT(ncclNetProperties_v12_t, vProps, 64);
LP_ABI_AT(ncclNetProperties_v12_t, maxP2pBytes, 104);
LP_ABI_AT(ncclNetProperties_v12_t, maxCollBytes, 112);
LP_ABI_AT(ncclNetProperties_v12_t, maxMultiRequestSize, 120);
LP_ABI_AT(ncclNetProperties_v12_t, railId, 124);
LP_ABI_AT(ncclNetProperties_v12_t, planeId, 126);

LP_ABI_SIZE(ncclNetAttr_v11_t, 44);
LP_ABI_SIZE(ncclNetAttr_v12_t, 44);

LP_ABI_SIZE(ncclNet_v8_t, 152);
LP_ABI_AT(ncclNet_v8_t, test, 104);
LP_ABI_AT(ncclNet_v8_t, irecvConsumed, 144);
LP_ABI_SIZE(ncclNet_v9_t, 160);
LP_ABI_AT(ncclNet_v9_t, test, 104);
LP_ABI_AT(ncclNet_v9_t, makeVDevice, 152);
LP_ABI_SIZE(ncclNet_v10_t, 160);
LP_ABI_AT(ncclNet_v10_t, test, 104);
LP_ABI_AT(ncclNet_v10_t, makeVDevice, 152);
LP_ABI_SIZE(ncclNet_v11_t, 176);
LP_ABI_AT(ncclNet_v11_t, test, 104);
LP_ABI_AT(ncclNet_v11_t, makeVDevice, 152);
LP_ABI_AT(ncclNet_v11_t, finalize, 160);
LP_ABI_AT(ncclNet_v11_t, setNetAttr, 168);
LP_ABI_SIZE(ncclNet_v12_t, 176);
LP_ABI_AT(ncclNet_v12_t, test, 104);
LP_ABI_AT(ncclNet_v12_t, makeVDevice, 152);
LP_ABI_AT(ncclNet_v12_t, finalize, 160);
LP_ABI_AT(ncclNet_v12_t, setNetAttr, 168);
#else
#error "nccl_net.h: the layouts are checked for LP64 (x86-64, aarch64) only"
#endif

#endif
