/*
 * libnccl-net-single-tcp.so: the baseline the LinkPass plugin is measured against. One TCP
 * connection per communicator, as NCCL's own Socket transport uses with its defaults: a size
 * header, then the bytes, in posting order; no lanes, no failover. A path that fails under the
 * connection stalls it until the path heals (or TCP gives up, and then this returns an error).
 * Exports ncclNetPlugin_v8 (name "SingleTCP"). Devices: LINKPASS_NICS, IPv4 addresses only.
 * It is a measuring stick for bench/nccl_plugin.py and the fault tests, not a product.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "nccl_net.h"

#define MAX_DEVS 16
#define MAX_REQS NCCL_NET_MAX_REQUESTS
#define MAGIC 0x4c505354u /* "LPST" */

static struct in_addr devs[MAX_DEVS];
static int ndevs;
static ncclDebugLogger_t logf_;

struct handle { uint32_t magic; struct sockaddr_in addr; };
struct listen_comm { int fd; };
struct comm;
struct req {
    struct comm *comm;
    int used, is_send, done;
    char *data;
    size_t size, max, at;     /* bytes to move, the receive's capacity, bytes moved */
    uint32_t hdr;             /* the size header, sent or received first */
    size_t hdr_at;
};
struct comm {
    int fd, connecting;
    pthread_mutex_t mu;        /* NCCL calls from its service and progress threads */
    struct req reqs[MAX_REQS];
    uint64_t posted, moved;    /* requests posted, and completed on the wire, in posting order: a
                                * slot (seq % MAX_REQS) is free again once NCCL has tested it done */
};

static ncclResult_t st_init(ncclDebugLogger_t log) {
    logf_ = log;
    ndevs = 0;
    const char *v = getenv("LINKPASS_NICS");
    if (!v) return ncclSuccess;
    char *copy = strdup(v), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t && ndevs < MAX_DEVS; t = strtok_r(NULL, ",", &save))
        if (inet_pton(AF_INET, t, &devs[ndevs]) == 1) ndevs++;
    free(copy);
    return ncclSuccess;
}

static ncclResult_t st_devices(int *n) { *n = ndevs; return ncclSuccess; }

static ncclResult_t st_props(int dev, ncclNetProperties_v8_t *p) {
    if (dev < 0 || dev >= ndevs) return ncclInvalidArgument;
    static char names[MAX_DEVS][24];
    inet_ntop(AF_INET, &devs[dev], names[dev], sizeof names[dev]);
    memset(p, 0, sizeof *p);
    p->name = names[dev];
    p->guid = (uint64_t)dev;
    p->ptrSupport = NCCL_PTR_HOST;
    p->speed = 10000;
    p->latency = 0;
    p->maxComms = 65536;
    p->maxRecvs = 1;
    return ncclSuccess;
}

static int nonblocking_socket(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int one = 1;
    if (fd >= 0) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static ncclResult_t st_listen(int dev, void *opaque, void **lc) {
    if (dev < 0 || dev >= ndevs) return ncclInvalidArgument;
    struct handle *h = opaque;
    int fd = nonblocking_socket();
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr = devs[dev]};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 64) || getsockname(fd, (struct sockaddr *)&a, &len)) {
        if (fd >= 0) close(fd);
        return ncclSystemError;
    }
    memset(h, 0, NCCL_NET_HANDLE_MAXSIZE);
    h->magic = MAGIC;
    h->addr = a;
    struct listen_comm *l = calloc(1, sizeof *l);
    l->fd = fd;
    *lc = l;
    return ncclSuccess;
}

static struct comm *new_comm(int fd) {
    struct comm *c = calloc(1, sizeof *c);
    c->fd = fd;
    pthread_mutex_init(&c->mu, NULL);
    return c;
}

/* Connect: non-blocking; NCCL calls again while *sc is NULL. The connecting comm is kept in the
 * handle's spare bytes, as the Socket transport keeps its state across calls. */
static ncclResult_t st_connect(int dev, void *opaque, void **sc, ncclNetDeviceHandle_v8_t **dc) {
    (void)dc;
    struct handle *h = opaque;
    struct comm **pending = (struct comm **)((char *)h + 64);
    *sc = NULL;
    if (h->magic != MAGIC || dev < 0 || dev >= ndevs) return ncclInvalidArgument;
    if (!*pending) {
        int fd = nonblocking_socket();
        struct sockaddr_in me = {.sin_family = AF_INET, .sin_addr = devs[dev]};
        if (fd < 0 || bind(fd, (struct sockaddr *)&me, sizeof me)) return ncclSystemError;
        if (connect(fd, (struct sockaddr *)&h->addr, sizeof h->addr) && errno != EINPROGRESS) { close(fd); return ncclSystemError; }
        *pending = new_comm(fd);
    }
    struct pollfd pf = {.fd = (*pending)->fd, .events = POLLOUT};
    if (poll(&pf, 1, 0) <= 0) return ncclSuccess;
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(pf.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err) { close(pf.fd); free(*pending); *pending = NULL; return ncclSystemError; }
    *sc = *pending;
    *pending = NULL;
    return ncclSuccess;
}

static ncclResult_t st_accept(void *lc, void **rc, ncclNetDeviceHandle_v8_t **dc) {
    (void)dc;
    struct listen_comm *l = lc;
    *rc = NULL;
    int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? ncclSuccess : ncclSystemError;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    *rc = new_comm(fd);
    return ncclSuccess;
}

static ncclResult_t st_reg(void *comm, void *data, size_t size, int type, void **mh) {
    (void)comm; (void)data; (void)size;
    if (type != NCCL_PTR_HOST) return ncclInternalError;
    *mh = (void *)1;
    return ncclSuccess;
}
static ncclResult_t st_reg_dmabuf(void *comm, void *data, size_t size, int type, uint64_t off, int fd, void **mh) {
    (void)off; (void)fd;
    return st_reg(comm, data, size, type, mh);
}
static ncclResult_t st_dereg(void *comm, void *mh) { (void)comm; (void)mh; return ncclSuccess; }

static struct req *post(struct comm *c, int is_send, void *data, size_t size) {
    pthread_mutex_lock(&c->mu);
    struct req *r = &c->reqs[c->posted % MAX_REQS];
    if (r->used) {
        r = NULL;  /* 32 outstanding: NCCL posts again later */
    } else {
        *r = (struct req){.comm = c, .used = 1, .is_send = is_send, .data = data, .size = is_send ? size : 0,
                          .max = size, .hdr = (uint32_t)size};
        c->posted++;
    }
    pthread_mutex_unlock(&c->mu);
    return r;
}

static ncclResult_t st_isend(void *sc, void *data, int size, int tag, void *mh, void **req) {
    (void)tag; (void)mh;
    *req = post(sc, 1, data, (size_t)size);
    return ncclSuccess;
}

static ncclResult_t st_irecv(void *rc, int n, void **data, int *sizes, int *tags, void **mh, void **req) {
    (void)tags; (void)mh;
    if (n != 1) return ncclInternalError;
    *req = post(rc, 0, data[0], (size_t)sizes[0]);
    return ncclSuccess;
}

static ncclResult_t st_iflush(void *rc, int n, void **data, int *sizes, void **mh, void **req) {
    (void)rc; (void)n; (void)data; (void)sizes; (void)mh;
    *req = NULL;
    return ncclSuccess;
}

/* Move the oldest unfinished request's bytes as far as the socket lets us; 1 when it is complete,
 * 0 when the socket would block, -1 on error. */
static int progress_head(struct comm *c) {
    struct req *r = &c->reqs[c->moved % MAX_REQS];
    while (r->hdr_at < sizeof r->hdr) {
        ssize_t n = r->is_send ? send(c->fd, (char *)&r->hdr + r->hdr_at, sizeof r->hdr - r->hdr_at, MSG_NOSIGNAL)
                               : recv(c->fd, (char *)&r->hdr + r->hdr_at, sizeof r->hdr - r->hdr_at, 0);
        if (n > 0) { r->hdr_at += (size_t)n; continue; }
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
        return 0;
    }
    if (!r->is_send && r->size == 0 && r->at == 0) {
        if (r->hdr > r->max) return -1; /* a send larger than the receive: NCCL calls that an error */
        r->size = r->hdr;
    }
    while (r->at < r->size) {
        ssize_t n = r->is_send ? send(c->fd, r->data + r->at, r->size - r->at, MSG_NOSIGNAL)
                               : recv(c->fd, r->data + r->at, r->size - r->at, 0);
        if (n > 0) { r->at += (size_t)n; continue; }
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
        return 0;
    }
    return 1;
}

static ncclResult_t st_test(void *request, int *done, int *sizes) {
    struct req *r = request;
    struct comm *c = r->comm;
    ncclResult_t res = ncclSuccess;
    pthread_mutex_lock(&c->mu);
    while (c->moved < c->posted) {
        int k = progress_head(c);
        if (k < 0) {
            if (logf_) logf_(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, "NET/SingleTCP: connection failed: %s",
                             strerror(errno));
            res = ncclSystemError;
            break;
        }
        if (k == 0) break;
        c->reqs[c->moved % MAX_REQS].done = 1;
        c->moved++;
    }
    if (res == ncclSuccess && r->done) {
        *done = 1;
        if (sizes) sizes[0] = (int)r->size;
        r->used = 0;
    } else {
        *done = 0;
    }
    pthread_mutex_unlock(&c->mu);
    return res;
}

static ncclResult_t st_close(void *comm) {
    struct comm *c = comm;
    if (!c) return ncclSuccess;
    close(c->fd);
    pthread_mutex_destroy(&c->mu);
    free(c);
    return ncclSuccess;
}

static ncclResult_t st_close_listen(void *lc) {
    struct listen_comm *l = lc;
    close(l->fd);
    free(l);
    return ncclSuccess;
}

__attribute__((visibility("default"))) const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = "SingleTCP", .init = st_init, .devices = st_devices, .getProperties = st_props, .listen = st_listen,
    .connect = st_connect, .accept = st_accept, .regMr = st_reg, .regMrDmaBuf = st_reg_dmabuf, .deregMr = st_dereg,
    .isend = st_isend, .irecv = st_irecv, .iflush = st_iflush, .test = st_test, .closeSend = st_close,
    .closeRecv = st_close, .closeListen = st_close_listen, .getDeviceMr = NULL, .irecvConsumed = NULL,
};
