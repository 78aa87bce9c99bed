/*
 * lp_harness: drive an NCCL net plugin exactly as NCCL's proxy does, without NCCL or a GPU.
 *
 *   lp_harness [-l LIB] [-v 8..12] info
 *       the version loaded (newest found, or -v), devices and their properties
 *   lp_harness [-l LIB] [-v 8..12] nonblocking -H FILE
 *       accept on a fresh listen comm and 50 connects to the handle in FILE (a peer that never
 *       answers) must each return at once with NULL; exit 0 if they do
 *   lp_harness [-l LIB] [-v 8..12] transfer [options]
 *       connect a send comm to a recv comm (connect + accept polled to completion), register
 *       host buffers, then stream messages through isend/irecv/test and check every byte:
 *       -d DEV        device (plane) to connect on (0)
 *       -s SIZES      comma-separated message sizes in bytes, cycled (default 1048576); K/M suffixes
 *       -n ROUNDS     times through the size list (1)
 *       -w WINDOW     outstanding requests per side, 1..32 (32: NCCL's NCCL_NET_MAX_REQUESTS)
 *       -x EXTRA      post each receive EXTRA bytes larger than the send (0); the excess must stay untouched
 *       -N            test() receives with sizes == NULL (as NCCL does for flushes)
 *       -z            post 0-byte sends and receives with a NULL buffer
 *       -p            preset *request to NCCL_NET_OPTIONAL_RECV_COMPLETION (0x1) before every irecv
 *       -B            bandwidth only: do not fill or check the buffers (sizes are still checked)
 *       -t            sender and receiver on two threads (NCCL's progress threads), connections on a third
 *       -k MS[:N]     every MS ms, reset the lane with the most bytes in flight (data lost), N times (1)
 *       -K MS         after MS ms shut down every socket of the plugin, listeners too: the peer is gone;
 *                     success is then one error (ncclSystemError) on each side, reported with its delay
 *       -T SECONDS    give up after this long (60)
 *       -S FILE       stop when FILE exists: post no more messages, finish the ones posted (one process only)
 *       -r send|recv -H FILE   one side only, the other side in another process: recv listens and
 *                     writes its handle to FILE; send reads FILE and connects
 * Exit: 0 ok, 1 wrong data or size, 2 an error from the plugin (or, with -K, none), 3 usage or setup.
 * Log lines from the plugin go to stderr as "NCCL WARN ..." / "NCCL INFO ...".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lp_netload.h"

static double ms_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
    (void)flags; (void)file; (void)line;
    if (level != NCCL_LOG_WARN && level != NCCL_LOG_INFO) return;
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&log_mu);
    fprintf(stderr, "NCCL %s %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", buf);
    pthread_mutex_unlock(&log_mu);
}

static unsigned char pattern(size_t msg, size_t off) { return (unsigned char)(msg * 251u + off * 13u + (off >> 9)); }
#define CANARY 0xA5

/* ---- one transfer: the send side and the receive side as non-blocking steps ------------------- */

struct xfer {
    struct lpn *p;
    void *sc, *rc, *smh, *rmh;
    size_t *sizes;
    int nsizes, window, null_sizes, preset, no_check, null_zero;
    size_t extra, maxsize, total;
    unsigned char *sbuf, *rbuf;
    void *sreq[NCCL_NET_MAX_REQUESTS], *rreq[NCCL_NET_MAX_REQUESTS];
    size_t s_posted, s_done, r_posted, r_done;
    size_t bytes, wrong, bad_size;
    volatile int stop;
    pthread_mutex_t mu, post_mu;
    int err;            /* the first error a plugin call returned */
    const char *err_call;
    double err_at;
    int keep_going;     /* -K: each side stops at its own error, the other goes on until it has one */
    int side_err[2];    /* 0 send, 1 recv */
    double side_err_at[2];
};

static size_t msg_size(const struct xfer *x, size_t i) { return x->sizes[i % (size_t)x->nsizes]; }
/* -S lowers total while the side threads run */
static size_t total_of(const struct xfer *x) { return __atomic_load_n(&x->total, __ATOMIC_RELAXED); }

static void fail(struct xfer *x, int rc, const char *call) {
    pthread_mutex_lock(&x->mu);
    if (!x->err) { x->err = rc; x->err_call = call; x->err_at = ms_now(); }
    int side = strstr(call, "recv") != NULL;
    if (!x->side_err[side]) { x->side_err[side] = rc; x->side_err_at[side] = ms_now(); }
    if (!x->keep_going || !rc) x->stop = 1;
    pthread_mutex_unlock(&x->mu);
}

/* 1: this side is done; 0: more to do; -1: stopped */
static int send_step(struct xfer *x) {
    if (x->stop || x->side_err[0]) return -1;
    for (;;) { /* posting under post_mu: -S fixes the last message while both sides post */
        pthread_mutex_lock(&x->post_mu);
        if (!(x->s_posted < total_of(x) && x->s_posted - x->s_done < (size_t)x->window)) {
            pthread_mutex_unlock(&x->post_mu);
            break;
        }
        size_t i = x->s_posted, n = msg_size(x, i);
        unsigned char *b = x->sbuf + (i % (size_t)x->window) * x->maxsize;
        if (!x->no_check) for (size_t k = 0; k < n; k++) b[k] = pattern(i, k);
        void *req = NULL;
        int rc = lpn_isend(x->p, x->sc, x->null_zero && n == 0 ? NULL : b, n, 0, x->smh, &req);
        if (!rc && req) { x->sreq[i % (size_t)x->window] = req; x->s_posted++; }
        pthread_mutex_unlock(&x->post_mu);
        if (rc) { fail(x, rc, "isend"); return -1; }
        if (!req) break; /* not now: post again later, as NCCL does */
    }
    if (x->s_done < x->s_posted) {
        int done = 0, size = -1;
        int rc = lpn_test(x->p, x->sreq[x->s_done % (size_t)x->window], &done, x->null_sizes ? NULL : &size);
        if (rc) { fail(x, rc, "test(send)"); return -1; }
        if (done) {
            if (!x->null_sizes && (size_t)size != msg_size(x, x->s_done)) x->bad_size++;
            x->s_done++;
        }
    }
    return x->s_done == total_of(x);
}

static int recv_step(struct xfer *x) {
    if (x->stop || x->side_err[1]) return -1;
    size_t slot = x->maxsize + x->extra;
    for (;;) {
        pthread_mutex_lock(&x->post_mu);
        if (!(x->r_posted < total_of(x) && x->r_posted - x->r_done < (size_t)x->window)) {
            pthread_mutex_unlock(&x->post_mu);
            break;
        }
        size_t i = x->r_posted, n = msg_size(x, i);
        unsigned char *b = x->rbuf + (i % (size_t)x->window) * slot;
        if (!x->no_check) memset(b, CANARY, n + x->extra);
        void *req = x->preset ? (void *)NCCL_NET_OPTIONAL_RECV_COMPLETION : NULL;
        int rc = lpn_irecv(x->p, x->rc, x->null_zero && n + x->extra == 0 ? NULL : b, n + x->extra, 0, x->rmh, &req);
        int preset_left = req == (void *)NCCL_NET_OPTIONAL_RECV_COMPLETION;
        if (!rc && req && !preset_left) { x->rreq[i % (size_t)x->window] = req; x->r_posted++; }
        pthread_mutex_unlock(&x->post_mu);
        if (rc) { fail(x, rc, "irecv"); return -1; }
        if (preset_left) {
            fprintf(stderr, "lp_harness: irecv left *request at the preset 0x1\n");
            x->wrong++;
            fail(x, 0, "irecv");
            return -1;
        }
        if (!req) break;
    }
    if (x->r_done < x->r_posted) {
        size_t i = x->r_done;
        int done = 0, size = -1;
        int rc = lpn_test(x->p, x->rreq[i % (size_t)x->window], &done, x->null_sizes ? NULL : &size);
        if (rc) { fail(x, rc, "test(recv)"); return -1; }
        if (done) {
            size_t n = msg_size(x, i);
            const unsigned char *b = x->rbuf + (i % (size_t)x->window) * slot;
            size_t bad = 0;
            for (size_t k = 0; k < n && !x->no_check; k++) bad += b[k] != pattern(i, k);
            for (size_t k = n; k < n + x->extra && !x->no_check; k++) bad += b[k] != CANARY;
            if (bad && x->wrong < 5) fprintf(stderr, "lp_harness: message %zu (%zu bytes): %zu wrong bytes\n", i, n, bad);
            x->wrong += bad;
            if (!x->null_sizes && (size_t)size != n) {
                if (x->bad_size < 5) fprintf(stderr, "lp_harness: message %zu: test() said %d bytes, sent %zu\n", i, size, n);
                x->bad_size++;
            }
            x->bytes += n;
            x->r_done++;
        }
    }
    return x->r_done == total_of(x);
}

/* Like NCCL's proxy progress loop: poll without pause, but yield the CPU when a round changed nothing. */
static size_t moved(const struct xfer *x) { return x->s_posted + x->s_done + x->r_posted + x->r_done; }
static void *send_thread(void *a) {
    struct xfer *x = a;
    for (size_t m = moved(x); send_step(x) == 0; m = moved(x)) if (moved(x) == m) sched_yield();
    return NULL;
}
static void *recv_thread(void *a) {
    struct xfer *x = a;
    for (size_t m = moved(x); recv_step(x) == 0; m = moved(x)) if (moved(x) == m) sched_yield();
    return NULL;
}

/* ---- faults: the plugin's sockets, found in this process's descriptor table ------------------- */

static int listener_ports(unsigned short *ports, int max) {
    int n = 0;
    for (int fd = 3; fd < 4096 && n < max; fd++) {
        int acc = 0, type = 0;
        socklen_t l = sizeof acc;
        if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &l) < 0 || !acc) continue;
        l = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l) < 0 || type != SOCK_STREAM) continue;
        struct sockaddr_in a;
        l = sizeof a;
        if (getsockname(fd, (struct sockaddr *)&a, &l) == 0 && a.sin_family == AF_INET) ports[n++] = ntohs(a.sin_port);
    }
    return n;
}

/* Reset one lane mid-transfer: the lane socket (either end) with the most bytes queued in the
 * kernel. connect(AF_UNSPEC) disconnects a TCP socket in place: the peer gets a reset and both
 * ends' queued bytes are lost, as when a path dies with data in flight, while the plugin's
 * descriptor stays valid (it sees the error and closes it itself). */
static int kill_one_lane(int min_queued) {
    unsigned short lp[64];
    int nl = listener_ports(lp, 64), best = -1, best_q = -1;
    for (int fd = 3; fd < 1024; fd++) {
        int acc = 1, type = 0;
        socklen_t l = sizeof acc;
        if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &l) < 0 || acc) continue;
        l = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l) < 0 || type != SOCK_STREAM) continue;
        struct sockaddr_in me, peer;
        socklen_t ml = sizeof me, pl = sizeof peer;
        if (getsockname(fd, (struct sockaddr *)&me, &ml) < 0 || getpeername(fd, (struct sockaddr *)&peer, &pl) < 0) continue;
        if (me.sin_family != AF_INET) continue;
        int lane = 0;
        for (int i = 0; i < nl; i++) lane |= ntohs(me.sin_port) == lp[i] || ntohs(peer.sin_port) == lp[i];
        if (!lane) continue;
        int out = 0, in = 0;
        ioctl(fd, SIOCOUTQ, &out);
        ioctl(fd, SIOCINQ, &in);
        if (out + in > best_q) { best_q = out + in; best = fd; }
    }
    if (best >= 0 && best_q >= min_queued) {
        struct sockaddr_in me;
        socklen_t ml = sizeof me;
        getsockname(best, (struct sockaddr *)&me, &ml);
        fprintf(stderr, "lp_harness: reset lane fd %d (port %u, %d bytes queued)\n", best, ntohs(me.sin_port), best_q);
        struct sockaddr un = {.sa_family = AF_UNSPEC};
        connect(best, &un, sizeof un);
        return best;
    }
    return -1;
}

static int kill_everything(void) {
    int n = 0;
    for (int fd = 3; fd < 4096; fd++) {
        int type = 0;
        socklen_t l = sizeof type;
        struct sockaddr_in a;
        socklen_t al = sizeof a;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l) < 0 || type != SOCK_STREAM) continue;
        if (getsockname(fd, (struct sockaddr *)&a, &al) < 0 || a.sin_family != AF_INET) continue;
        shutdown(fd, SHUT_RDWR);
        n++;
    }
    fprintf(stderr, "lp_harness: shut down %d sockets (every lane and listener)\n", n);
    return n;
}

/* ---- commands --------------------------------------------------------------------------------- */

static int cmd_info(struct lpn *p) {
    void *ctx = NULL;
    int rc = lpn_init(p, &ctx, 1, logger), n = 0;
    if (rc) { fprintf(stderr, "lp_harness: init: %d\n", rc); return 2; }
    if ((rc = lpn_devices(p, &n))) { fprintf(stderr, "lp_harness: devices: %d\n", rc); return 2; }
    printf("plugin name=%s version=v%d devices=%d\n", p->name, p->version, n);
    for (int d = 0; d < n; d++) {
        struct lpn_props o;
        if ((rc = lpn_get_properties(p, d, &o))) { fprintf(stderr, "lp_harness: getProperties(%d): %d\n", d, rc); return 2; }
        printf("device %d name=%s pci=%s guid=0x%llx ptrSupport=%d regIsGlobal=%d forceFlush=%d speed=%d port=%d "
               "latency=%g maxComms=%d maxRecvs=%d netDeviceType=%d netDeviceVersion=%d vdevs=%d maxP2pBytes=%zu "
               "maxCollBytes=%zu maxMultiRequestSize=%d railId=%d planeId=%d\n",
               d, o.name, o.pciPath ? o.pciPath : "-", (unsigned long long)o.guid, o.ptrSupport, o.regIsGlobal,
               o.forceFlush, o.speed, o.port, o.latency, o.maxComms, o.maxRecvs, o.netDeviceType, o.netDeviceVersion,
               o.vdevs, o.maxP2pBytes, o.maxCollBytes, o.maxMultiRequestSize, o.railId, o.planeId);
    }
    lpn_finalize(p, ctx);
    return 0;
}

static size_t parse_size(const char *s) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end == 'K' || *end == 'k') v <<= 10, end++;
    else if (*end == 'M' || *end == 'm') v <<= 20, end++;
    if (*end) return (size_t)-1;
    return (size_t)v;
}

struct opts {
    int dev, rounds, window, null_sizes, preset, no_check, threads, kill_every_ms, kill_count, kill_all_ms, timeout_s;
    int null_zero;
    size_t extra;
    const char *sizes, *role, *hfile, *stop_file;
};

static int write_handle(const char *path, const unsigned char *h) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    for (int i = 0; i < NCCL_NET_HANDLE_MAXSIZE; i++) fprintf(f, "%02x", h[i]);
    fprintf(f, "\n");
    fclose(f);
    return rename(tmp, path);
}

static int read_handle(const char *path, unsigned char *h, int timeout_s) {
    double end = ms_now() + timeout_s * 1e3;
    while (ms_now() < end) {
        FILE *f = fopen(path, "r");
        if (f) {
            int ok = 1;
            for (int i = 0; i < NCCL_NET_HANDLE_MAXSIZE && ok; i++) {
                unsigned v;
                ok = fscanf(f, "%2x", &v) == 1;
                h[i] = (unsigned char)v;
            }
            fclose(f);
            if (ok) return 0;
        }
        usleep(20000);
    }
    return -1;
}

static int cmd_transfer(struct lpn *p, const struct opts *o) {
    struct xfer x;
    memset(&x, 0, sizeof x);
    pthread_mutex_init(&x.mu, NULL);
    pthread_mutex_init(&x.post_mu, NULL);
    x.p = p;
    x.window = o->window;
    x.null_sizes = o->null_sizes;
    x.null_zero = o->null_zero;
    x.preset = o->preset;
    x.no_check = o->no_check;
    x.extra = o->extra;
    x.keep_going = o->kill_all_ms > 0;
    char list[1024];
    snprintf(list, sizeof list, "%s", o->sizes);
    size_t sizes[64];
    int ns = 0;
    char *save = NULL;
    for (char *t = strtok_r(list, ",", &save); t && ns < 64; t = strtok_r(NULL, ",", &save)) {
        sizes[ns] = parse_size(t);
        if (sizes[ns] == (size_t)-1) { fprintf(stderr, "lp_harness: -s: %s is not a size\n", t); return 3; }
        if (sizes[ns] > x.maxsize) x.maxsize = sizes[ns];
        ns++;
    }
    if (!ns) { fprintf(stderr, "lp_harness: -s: no sizes\n"); return 3; }
    x.sizes = sizes;
    x.nsizes = ns;
    x.total = (size_t)ns * (size_t)o->rounds;
    int do_send = !o->role || strcmp(o->role, "send") == 0, do_recv = !o->role || strcmp(o->role, "recv") == 0;
    if (do_send) x.sbuf = malloc((size_t)x.window * (x.maxsize ? x.maxsize : 1));
    if (do_recv) x.rbuf = malloc((size_t)x.window * (x.maxsize + x.extra ? x.maxsize + x.extra : 1));
    if ((do_send && !x.sbuf) || (do_recv && !x.rbuf)) { fprintf(stderr, "lp_harness: out of memory\n"); return 3; }

    /* the service thread's part: init per communicator, connect/accept polled, regMr */
    void *sctx = NULL, *rctx = NULL;
    int rc = lpn_init(p, &sctx, 1, logger);
    if (!rc) rc = lpn_init(p, &rctx, 2, logger);
    if (rc) { fprintf(stderr, "lp_harness: init: %d\n", rc); return 2; }
    int ndev = 0;
    lpn_devices(p, &ndev);
    if (o->dev >= ndev) { fprintf(stderr, "lp_harness: device %d of %d\n", o->dev, ndev); return 3; }
    int to_ms = o->timeout_s * 1000;
    if (!o->role) {
        rc = lpn_connect_pair(p, sctx, rctx, o->dev, &x.sc, &x.rc, to_ms);
    } else if (do_recv) {
        unsigned char h[NCCL_NET_HANDLE_MAXSIZE];
        void *lc = NULL;
        rc = lpn_listen(p, rctx, o->dev, h, &lc);
        if (!rc && write_handle(o->hfile, h) < 0) { fprintf(stderr, "lp_harness: cannot write %s\n", o->hfile); return 3; }
        if (!rc) rc = lpn_accept_wait(p, lc, &x.rc, to_ms);
        if (lc) lpn_close_listen(p, lc);
    } else {
        unsigned char h[NCCL_NET_HANDLE_MAXSIZE];
        if (read_handle(o->hfile, h, o->timeout_s) < 0) { fprintf(stderr, "lp_harness: no handle in %s\n", o->hfile); return 3; }
        rc = lpn_connect_wait(p, sctx, o->dev, h, &x.sc, to_ms);
    }
    if (rc) { fprintf(stderr, "lp_harness: connect/accept: %d\n", rc); return 2; }
    if (do_send && (rc = lpn_reg_mr(p, x.sc, x.sbuf, (size_t)x.window * x.maxsize, NCCL_PTR_HOST, &x.smh))) {
        fprintf(stderr, "lp_harness: regMr(send): %d\n", rc);
        return 2;
    }
    if (do_recv && (rc = lpn_reg_mr(p, x.rc, x.rbuf, (size_t)x.window * (x.maxsize + x.extra), NCCL_PTR_HOST, &x.rmh))) {
        fprintf(stderr, "lp_harness: regMr(recv): %d\n", rc);
        return 2;
    }

    double t0 = ms_now(), next_kill = o->kill_every_ms ? t0 + o->kill_every_ms : 0, cut_at = 0, next_stop_check = 0;
    int kills = 0, s_fin = !do_send, r_fin = !do_recv;
    pthread_t ts, tr;
    if (o->threads) {
        if (do_send) pthread_create(&ts, NULL, send_thread, &x);
        if (do_recv) pthread_create(&tr, NULL, recv_thread, &x);
    }
    for (;;) {
        if (o->threads) {
            usleep(1000);
            pthread_mutex_lock(&x.mu);
            s_fin = !do_send || x.s_done == x.total || x.side_err[0];
            r_fin = !do_recv || x.r_done == x.total || x.side_err[1];
            pthread_mutex_unlock(&x.mu);
        } else {
            size_t m = moved(&x);
            if (!s_fin) { int s = send_step(&x); if (s < 0 && !x.keep_going) break; s_fin = s != 0; }
            if (!r_fin) { int s = recv_step(&x); if (s < 0 && !x.keep_going) break; r_fin = s != 0; }
            if (moved(&x) == m) sched_yield();
        }
        if (x.stop || (s_fin && r_fin)) break;
        double now = ms_now();
        if (next_kill && now >= next_kill && kills < o->kill_count) {
            /* wait (up to 2 s) for a lane with data in flight, so the reset loses some */
            if (kill_one_lane(now - next_kill < 2000 ? 65536 : 0) >= 0) {
                kills++;
                next_kill = now + o->kill_every_ms;
            }
        }
        if (o->kill_all_ms && !cut_at && now - t0 >= o->kill_all_ms) { kill_everything(); cut_at = now; }
        if (o->stop_file && !o->role && now >= next_stop_check) {
            next_stop_check = now + 10;
            struct stat st;
            if (stat(o->stop_file, &st) == 0) {
                pthread_mutex_lock(&x.post_mu);
                size_t last = x.s_posted > x.r_posted ? x.s_posted : x.r_posted;
                if (last < x.total) __atomic_store_n(&x.total, last, __ATOMIC_RELAXED);
                pthread_mutex_unlock(&x.post_mu);
            }
        }
        if (now - t0 > to_ms) { fprintf(stderr, "lp_harness: timed out after %d s\n", o->timeout_s); x.stop = 1; break; }
    }
    x.stop = 1;
    if (o->threads) {
        if (do_send) pthread_join(ts, NULL);
        if (do_recv) pthread_join(tr, NULL);
    }
    double el = ms_now() - t0;
    printf("transfer version=v%d messages=%zu bytes=%zu wrong=%zu bad_sizes=%zu lanes_killed=%d elapsed_ms=%.0f "
           "send_done=%zu recv_done=%zu checked=%s gbps=%.2f\n", p->version, x.r_done, x.bytes, x.wrong, x.bad_size,
           kills, el, x.s_done, x.r_done, x.no_check ? "no" : "yes", el > 0 ? x.bytes * 8.0 / el / 1e6 : 0.0);
    int (*stats)(char *, size_t) = (int (*)(char *, size_t))dlsym(p->dl, "linkpass_nccl_stats");
    if (stats) { char b[1024]; stats(b, sizeof b); printf("stats %s\n", b); }
    int code = 0;
    if (o->kill_all_ms) {
        if (x.err) printf("error rc=%d call=%s after_ms=%.0f\n", x.err, x.err_call, x.err_at - cut_at);
        else printf("error none\n");
        for (int k = 0; k < 2; k++)
            if (x.side_err[k]) printf("side_error side=%s rc=%d after_ms=%.0f\n", k ? "recv" : "send", x.side_err[k],
                                      x.side_err_at[k] - cut_at);
        code = x.err == ncclSystemError && (!do_send || x.side_err[0] == ncclSystemError) &&
               (!do_recv || x.side_err[1] == ncclSystemError) ? 0 : 2;
    } else if (x.err) {
        printf("error rc=%d call=%s\n", x.err, x.err_call);
        code = 2;
    } else if (x.wrong || x.bad_size || x.s_done != (do_send ? x.total : 0) || x.r_done != (do_recv ? x.total : 0)) {
        code = 1;
    }
    if (!x.err || o->kill_all_ms) {
        if (do_send) { lpn_dereg_mr(p, x.sc, x.smh); lpn_close_send(p, x.sc); }
        if (do_recv) { lpn_dereg_mr(p, x.rc, x.rmh); lpn_close_recv(p, x.rc); }
    }
    lpn_finalize(p, sctx);
    lpn_finalize(p, rctx);
    free(x.sbuf);
    free(x.rbuf);
    return code;
}

/* listen/accept and connect must return at once, with NULL, when the other side is not there yet:
 * accept on a fresh listen comm, connect to the handle in hfile (a peer that never answers). */
static int cmd_nonblocking(struct lpn *p, const struct opts *o) {
    void *ctx = NULL, *lc = NULL, *rc = NULL, *sc = NULL;
    unsigned char h[NCCL_NET_HANDLE_MAXSIZE];
    int r = lpn_init(p, &ctx, 1, logger);
    if (!r) r = lpn_listen(p, ctx, o->dev, h, &lc);
    if (r || !lc) { fprintf(stderr, "lp_harness: listen: %d\n", r); return 2; }
    if ((r = lpn_accept(p, lc, &rc))) { fprintf(stderr, "lp_harness: accept: %d\n", r); return 2; }
    if (!o->hfile || read_handle(o->hfile, h, o->timeout_s) < 0) { fprintf(stderr, "lp_harness: -H: no handle\n"); return 3; }
    int polls = 0, got = 0;
    for (; polls < 50 && !got; polls++) {
        if ((r = lpn_connect(p, ctx, o->dev, h, &sc))) { fprintf(stderr, "lp_harness: connect: %d\n", r); return 2; }
        got = sc != NULL;
        usleep(10000);
    }
    printf("nonblocking accept=%s connect=%s polls=%d\n", rc ? "set" : "null", sc ? "set" : "null", polls);
    lpn_close_listen(p, lc);
    lpn_finalize(p, ctx);
    return rc || sc ? 1 : 0;
}

static int usage(void) {
    fprintf(stderr, "usage: lp_harness [-l LIB] [-v 8..12] info | nonblocking -H FILE | transfer [-d DEV] [-s SIZES] [-n ROUNDS] [-w WINDOW] [-z] "
                    "[-x EXTRA] [-N] [-p] [-B] [-t] [-k MS[:N]] [-K MS] [-T SECONDS] [-S FILE] [-r send|recv -H FILE]\n");
    return 3;
}

int main(int argc, char **argv) {
    const char *lib = getenv("LP_HARNESS_PLUGIN") ? getenv("LP_HARNESS_PLUGIN") : "libnccl-net-linkpass.so";
    int version = 0, opt;
    struct opts o = {.rounds = 1, .window = NCCL_NET_MAX_REQUESTS, .kill_count = 1, .timeout_s = 60, .sizes = "1048576"};
    while ((opt = getopt(argc, argv, "l:v:d:s:n:w:x:NzpBtK:k:T:r:H:S:")) != -1) {
        switch (opt) {
        case 'l': lib = optarg; break;
        case 'v': version = atoi(optarg); if (version < 8 || version > 12) return usage(); break;
        case 'd': o.dev = atoi(optarg); break;
        case 's': o.sizes = optarg; break;
        case 'n': o.rounds = atoi(optarg); if (o.rounds < 1) return usage(); break;
        case 'w': o.window = atoi(optarg); if (o.window < 1 || o.window > NCCL_NET_MAX_REQUESTS) return usage(); break;
        case 'x': o.extra = parse_size(optarg); if (o.extra == (size_t)-1) return usage(); break;
        case 'N': o.null_sizes = 1; break;
        case 'z': o.null_zero = 1; break;
        case 'p': o.preset = 1; break;
        case 'B': o.no_check = 1; break;
        case 't': o.threads = 1; break;
        case 'k': if (sscanf(optarg, "%d:%d", &o.kill_every_ms, &o.kill_count) < 1 || o.kill_every_ms < 1) return usage(); break;
        case 'K': o.kill_all_ms = atoi(optarg); if (o.kill_all_ms < 1) return usage(); break;
        case 'T': o.timeout_s = atoi(optarg); if (o.timeout_s < 1) return usage(); break;
        case 'r': o.role = optarg; if (strcmp(optarg, "send") && strcmp(optarg, "recv")) return usage(); break;
        case 'H': o.hfile = optarg; break;
        case 'S': o.stop_file = optarg; break;
        default: return usage();
        }
    }
    if (optind >= argc) return usage();
    if (o.role && !o.hfile) return usage();
    setvbuf(stdout, NULL, _IOLBF, 0);
    char err[1024];
    struct lpn *p = lpn_open(lib, version, err, sizeof err);
    if (!p) { fprintf(stderr, "lp_harness: %s\n", err); return 3; }
    int rc;
    if (strcmp(argv[optind], "info") == 0) rc = cmd_info(p);
    else if (strcmp(argv[optind], "transfer") == 0) rc = cmd_transfer(p, &o);
    else if (strcmp(argv[optind], "nonblocking") == 0) rc = cmd_nonblocking(p, &o);
    else rc = usage();
    /* the plugin's progress thread stops in its destructor at exit; no dlclose while comms linger */
    return rc;
}
