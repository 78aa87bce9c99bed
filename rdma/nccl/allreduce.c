/*
 * lp_allreduce: a ring all-reduce over N ranks that uses nothing but an NCCL net plugin's API,
 * driven as NCCL's proxy drives it (lp_netload.h): listen/connect/accept polled to completion,
 * regMr, isend/irecv/test with a bounded window of requests per comm, posting order matching.
 * One process per rank (on the testbed: one per host, in its namespace). Every byte is checked.
 *
 *   lp_allreduce --plugin SO --rank R --nranks N --dir DIR [options]
 *     --version V        force ncclNetPlugin_vV (default: the newest found, as NCCL does)
 *     --sizes A,B,..     message sizes in bytes (K/M/G suffixes), one nccl-tests row each
 *     --iters I          timed iterations per size (default 20), after --warmup W (default 2)
 *     --seconds S        instead: run the first size back to back for S seconds (fault runs),
 *     --stop-file F      or until F exists (rank 0 decides, and tells the others through the
 *                        all-reduce itself: one more element, so every rank stops after the same one)
 *     --channels C       rings in parallel, channel c on device c % ndev (default: ndev)
 *     --slice B          bytes per request (default 512K), --window W requests per comm (8, <= 32)
 *     --trace FILE       a JSON line per iteration, as the demo's gloo job logs a step: step,
 *                        start_ns and end_ns (wall clock), ok, bytes, wrong (elements), and the
 *                        plugin's counters if it exports linkpass_nccl_stats (lanes, chunks per
 *                        plane: where the traffic went); appended
 *     --start-step K     number iterations (and derive their data) from K: a restarted job goes on
 *     --timeout-ms T     give up connecting after T ms (default 60000)
 *     --compute-ms C     sleep C ms before each iteration, as a training step computes (default 0)
 *   lp_allreduce --raw-tcp ADDR --rank R --nranks N --dir DIR [--sizes ..] [--iters ..]
 *     the same ring's traffic over one plain TCP stream per neighbour (no plugin): each rank sends
 *     SIZE bytes to the next while it receives SIZE from the previous; the peer a plugin is held to.
 *
 * Rendezvous: DIR is a directory every rank can read (the testbed's namespaces share the
 * filesystem); each rank writes its listen handles there and reads its next neighbour's.
 *
 * Output: nccl-tests' columns (size, count, type, redop, time us, algbw GB/s, busbw GB/s, #wrong)
 * on stdout from rank 0, and a last line "# errors E wrong W". The plugin's log lines go to stderr,
 * each after "[SECONDS]" of CLOCK_MONOTONIC. Exit codes: 0 every byte right and
 * no error from the plugin, 1 wrong bytes, 2 usage, 3 the plugin returned an error, 4 set-up failed.
 *
 * The data: rank r contributes (r + 1) * f(i, iter) to element i (uint32, wrapping), so the sum is
 * N(N+1)/2 * f(i, iter): a chunk at the wrong offset, lost, or counted twice changes it.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lp_netload.h"

#define MAX_CHANNELS 16
#define MAX_SIZES 16

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "lp_allreduce: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

static size_t parse_size(const char *s) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) die(2, "size %s: expected bytes, e.g. 1M", s);
    switch (*end) {
    case 'K': case 'k': v <<= 10; end++; break;
    case 'M': case 'm': v <<= 20; end++; break;
    case 'G': case 'g': v <<= 30; end++; break;
    default: break;
    }
    if (*end) die(2, "size %s: expected a number with an optional K, M or G", s);
    return (size_t)v;
}

/* ---- rendezvous through files ------------------------------------------------------------- */

static void put_file(const char *dir, const char *name, const void *data, size_t len) {
    char tmp[4096], path[4096];
    snprintf(tmp, sizeof tmp, "%s/.%s.%d", dir, name, getpid());
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) die(4, "cannot write %s: %s", tmp, strerror(errno));
    if (rename(tmp, path) != 0) die(4, "cannot rename %s: %s", tmp, strerror(errno));
}

static void get_file(const char *dir, const char *name, void *data, size_t len, int timeout_ms) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    uint64_t end = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        FILE *f = fopen(path, "rb");
        if (f) {
            size_t got = fread(data, 1, len, f);
            fclose(f);
            if (got == len) return;
        }
        if (now_ns() > end) die(4, "no %s after %d ms: did the other ranks start?", path, timeout_ms);
        usleep(2000);
    }
}

/* ---- the data ------------------------------------------------------------------------------ */

static inline uint32_t f_of(size_t i, int iter) { return (uint32_t)(i * 2654435761u + (uint32_t)iter * 40503u + 1u); }

static void fill(uint32_t *d, size_t count, int rank, int iter) {
    uint32_t mult = (uint32_t)rank + 1;
    for (size_t i = 0; i < count; i++) d[i] = mult * f_of(i, iter);
}

static size_t count_wrong(const uint32_t *d, size_t count, int nranks, int iter) {
    uint32_t mult = (uint32_t)(nranks * (nranks + 1) / 2);
    size_t wrong = 0;
    for (size_t i = 0; i < count; i++) wrong += d[i] != mult * f_of(i, iter);
    return wrong;
}

/* ---- one channel's ring --------------------------------------------------------------------- */

struct op_req { void *req; int slot; };

struct channel {
    void *sc, *rc, *smh, *rmh;
    uint32_t *tmp;            /* window slots of slice bytes: receives land here, then are reduced or copied */
    size_t off, len;          /* this channel's part of the buffer (elements) */
};

struct ring {
    struct lpn *p;
    int rank, nranks, window;
    size_t slice;             /* bytes per request */
    int nch;
    struct channel ch[MAX_CHANNELS];
    long errors;              /* error returns from the plugin */
};

/* Chunk c of a channel's part: [start, start + n) elements, the parts split as evenly as can be. */
static void chunk_of(size_t len, int nranks, int c, size_t *start, size_t *n) {
    size_t base = len / (size_t)nranks, extra = len % (size_t)nranks;
    *start = (size_t)c * base + ((size_t)c < extra ? (size_t)c : extra);
    *n = base + ((size_t)c < extra);
}

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* The k-th operation of a rank's ring (k = step * m + j; steps 0..N-2 reduce-scatter, N-1..2N-3
 * all-gather): the chunk it sends, the chunk it receives, and slice j's element range of each. */
struct op { int send_chunk, recv_chunk, reduce; size_t s_off, s_n, r_off, r_n; };

static struct op op_at(const struct ring *R, const struct channel *c, size_t m, size_t k) {
    int N = R->nranks, r = R->rank;
    int step = (int)(k / m);
    size_t j = k % m, per = R->slice / 4;
    struct op o;
    if (step < N - 1) {
        o.send_chunk = mod(r - step, N);
        o.recv_chunk = mod(r - step - 1, N);
        o.reduce = 1;
    } else {
        int s = step - (N - 1);
        o.send_chunk = mod(r + 1 - s, N);
        o.recv_chunk = mod(r - s, N);
        o.reduce = 0;
    }
    size_t st, n;
    chunk_of(c->len, N, o.send_chunk, &st, &n);
    o.s_off = c->off + st + (j * per < n ? j * per : n);
    o.s_n = j * per < n ? (n - j * per < per ? n - j * per : per) : 0;
    chunk_of(c->len, N, o.recv_chunk, &st, &n);
    o.r_off = c->off + st + (j * per < n ? j * per : n);
    o.r_n = j * per < n ? (n - j * per < per ? n - j * per : per) : 0;
    return o;
}

/* One all-reduce of `count` elements in place. Returns 0, or -1 after a plugin error. */
static int allreduce(struct ring *R, uint32_t *data, size_t count) {
    int N = R->nranks, W = R->window;
    size_t per = R->slice / 4;
    size_t base = count / (size_t)R->nch, extra = count % (size_t)R->nch, at = 0;
    size_t m = 1, nops;
    for (int c = 0; c < R->nch; c++) {
        R->ch[c].off = at;
        R->ch[c].len = base + ((size_t)c < extra);
        at += R->ch[c].len;
        size_t biggest = R->ch[c].len / (size_t)N + 1;
        size_t mc = (biggest + per - 1) / per;
        if (mc > m) m = mc;
    }
    nops = (size_t)(2 * (N - 1)) * m;  /* every channel runs the same number of ops (some 0-byte) */
    struct state { size_t s_post, s_done, r_post, r_done; struct op_req s[32], r[32]; int s_fin[32], r_fin[32]; } st[MAX_CHANNELS];
    memset(st, 0, sizeof st);
    int idle = 0;
    for (;;) {
        int all_done = 1, progressed = 0;
        for (int ci = 0; ci < R->nch; ci++) {
            struct channel *c = &R->ch[ci];
            struct state *s = &st[ci];
            if (s->s_done < nops || s->r_done < nops) all_done = 0;
            /* post receives while slots are free */
            while (s->r_post < nops && s->r_post < s->r_done + (size_t)W) {
                struct op o = op_at(R, c, m, s->r_post);
                /* not NCCL_NET_OPTIONAL_RECV_COMPLETION: that lets a plugin complete early, for
                 * protocols whose data carries its own flags; this ring reads the bytes at completion */
                void *req = NULL;
                int slot = (int)(s->r_post % (size_t)W);
                ncclResult_t rc = lpn_irecv(R->p, c->rc, c->tmp + (size_t)slot * per, o.r_n * 4, 0, c->rmh, &req);
                if (rc != ncclSuccess) { R->errors++; return -1; }
                if (req == NULL) break;  /* the comm is full: post later */
                s->r[s->r_post % 32] = (struct op_req){req, slot};
                s->r_fin[s->r_post % 32] = 0;
                s->r_post++;
                progressed = 1;
            }
            /* post sends whose data is final: the receive of the same slice a step earlier is reduced,
             * and (all-gather) nothing still sending the region a receive will overwrite */
            while (s->s_post < nops && s->s_post < s->s_done + (size_t)W && (s->s_post < m || s->r_done > s->s_post - m)) {
                struct op o = op_at(R, c, m, s->s_post);
                void *req = NULL;
                ncclResult_t rc = lpn_isend(R->p, c->sc, data + o.s_off, o.s_n * 4, 0, c->smh, &req);
                if (rc != ncclSuccess) { R->errors++; return -1; }
                if (req == NULL) break;
                s->s[s->s_post % 32] = (struct op_req){req, 0};
                s->s_fin[s->s_post % 32] = 0;
                s->s_post++;
                progressed = 1;
            }
            /* test every outstanding request; retire them in posting order */
            for (size_t k = s->s_done; k < s->s_post; k++) {
                if (s->s_fin[k % 32]) continue;
                int done = 0;
                if (lpn_test(R->p, s->s[k % 32].req, &done, NULL) != ncclSuccess) { R->errors++; return -1; }
                if (done) { s->s_fin[k % 32] = 1; progressed = 1; }
            }
            while (s->s_done < s->s_post && s->s_fin[s->s_done % 32]) s->s_done++;
            for (size_t k = s->r_done; k < s->r_post; k++) {
                if (s->r_fin[k % 32]) continue;
                int done = 0, size = -1;
                if (lpn_test(R->p, s->r[k % 32].req, &done, &size) != ncclSuccess) { R->errors++; return -1; }
                if (done) {
                    struct op o = op_at(R, c, m, k);
                    if (size != (int)(o.r_n * 4)) {
                        fprintf(stderr, "lp_allreduce: rank %d: receive %zu got %d bytes, %zu sent\n", R->rank, k, size, o.r_n * 4);
                        R->errors++;
                        return -1;
                    }
                    s->r_fin[k % 32] = 1;
                    progressed = 1;
                }
            }
            while (s->r_done < s->r_post && s->r_fin[s->r_done % 32]) {
                size_t k = s->r_done;
                struct op o = op_at(R, c, m, k);
                /* an all-gather receive overwrites its chunk: the reduce-scatter send of that chunk
                 * (same slice, N-1 steps earlier) must be complete */
                if (!o.reduce && s->s_done <= k - (size_t)(N - 1) * m) break;
                const uint32_t *src = c->tmp + (size_t)s->r[k % 32].slot * per;
                uint32_t *dst = data + o.r_off;
                if (o.reduce) for (size_t i = 0; i < o.r_n; i++) dst[i] += src[i];
                else memcpy(dst, src, o.r_n * 4);
                s->r_done++;
                progressed = 1;
            }
        }
        if (all_done) return 0;
        /* NCCL's proxy thread spins; ranks sharing a small host's cores with the plugin's progress
         * threads and the agent must not: after a while without progress, sleep a little */
        idle = progressed ? 0 : idle + 1;
        if (idle > 200) usleep(20);
    }
}

/* ---- set-up ----------------------------------------------------------------------------------- */

static void connect_ring(struct ring *R, const char *dir, int ndev, int timeout_ms) {
    char name[64];
    void *lc[MAX_CHANNELS];
    for (int c = 0; c < R->nch; c++) {
        char handle[NCCL_NET_HANDLE_MAXSIZE] = {0};
        if (lpn_listen(R->p, NULL, c % ndev, handle, &lc[c]) != ncclSuccess) die(4, "listen on device %d failed", c % ndev);
        snprintf(name, sizeof name, "handle.%d.%d", c, R->rank);
        put_file(dir, name, handle, sizeof handle);
    }
    for (int c = 0; c < R->nch; c++) {
        char handle[NCCL_NET_HANDLE_MAXSIZE];
        snprintf(name, sizeof name, "handle.%d.%d", c, (R->rank + 1) % R->nranks);
        get_file(dir, name, handle, sizeof handle, timeout_ms);
        struct channel *ch = &R->ch[c];
        ch->sc = ch->rc = NULL;
        uint64_t end = now_ns() + (uint64_t)timeout_ms * 1000000ull;
        /* connect to the next rank and accept the previous one in turn: each may wait for the other */
        while (!ch->sc || !ch->rc) {
            if (!ch->sc && lpn_connect(R->p, NULL, c % ndev, handle, &ch->sc) != ncclSuccess)
                die(4, "connect to rank %d on device %d failed", (R->rank + 1) % R->nranks, c % ndev);
            if (!ch->rc && lpn_accept(R->p, lc[c], &ch->rc) != ncclSuccess)
                die(4, "accept from rank %d on device %d failed", mod(R->rank - 1, R->nranks), c % ndev);
            if (now_ns() > end) die(4, "channel %d not connected after %d ms", c, timeout_ms);
            if (!ch->sc || !ch->rc) usleep(1000);
        }
        lpn_close_listen(R->p, lc[c]);
    }
}

/* ---- raw TCP: the same ring's traffic over one stream per neighbour ---------------------------- */

static int raw_listen(const char *addr, struct sockaddr_in *out) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    if (fd < 0 || inet_pton(AF_INET, addr, &a.sin_addr) != 1) die(2, "--raw-tcp %s: expected an IPv4 address", addr);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4)) die(4, "listen on %s: %s", addr, strerror(errno));
    socklen_t len = sizeof *out;
    getsockname(fd, (struct sockaddr *)out, &len);
    return fd;
}

static void raw_run(const char *addr, int rank, int nranks, const char *dir, size_t *sizes, int nsizes, int iters,
                    int timeout_ms) {
    struct sockaddr_in me, next;
    int lfd = raw_listen(addr, &me);
    char name[64];
    snprintf(name, sizeof name, "raw.%d", rank);
    put_file(dir, name, &me, sizeof me);
    snprintf(name, sizeof name, "raw.%d", (rank + 1) % nranks);
    get_file(dir, name, &next, sizeof next, timeout_ms);
    int out = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    uint64_t end = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (connect(out, (struct sockaddr *)&next, sizeof next) != 0) {
        if (now_ns() > end) die(4, "raw: cannot reach rank %d: %s", (rank + 1) % nranks, strerror(errno));
        close(out);
        out = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        usleep(2000);
    }
    int in = accept(lfd, NULL, NULL);
    if (in < 0) die(4, "raw: accept: %s", strerror(errno));
    close(lfd);
    fcntl(out, F_SETFL, O_NONBLOCK);
    fcntl(in, F_SETFL, O_NONBLOCK);
    size_t biggest = 0;
    for (int i = 0; i < nsizes; i++) biggest = sizes[i] > biggest ? sizes[i] : biggest;
    char *buf = calloc(1, biggest ? biggest : 1), *sink = malloc(1 << 20);
    if (rank == 0) printf("#%11s %12s %9s %10s\n#%11s %12s %9s %10s\n", "size", "time", "GB/s", "iters", "(B)", "(us)", "", "");
    for (int si = 0; si < nsizes; si++) {
        size_t size = sizes[si];
        uint64_t t0 = 0;
        for (int it = -1; it < iters; it++) {  /* one warm-up */
            if (it == 0) t0 = now_ns();
            size_t sent = 0, got = 0;
            while (sent < size || got < size) {
                struct pollfd pf[2] = {{.fd = out, .events = sent < size ? POLLOUT : 0},
                                       {.fd = in, .events = got < size ? POLLIN : 0}};
                if (poll(pf, 2, 1000) < 0 && errno != EINTR) die(3, "raw: poll: %s", strerror(errno));
                if (sent < size) {
                    ssize_t n = send(out, buf + sent, size - sent > (1u << 20) ? (1u << 20) : size - sent, MSG_NOSIGNAL);
                    if (n > 0) sent += (size_t)n;
                    else if (n < 0 && errno != EAGAIN) die(3, "raw: send: %s", strerror(errno));
                }
                if (got < size) {
                    ssize_t n = recv(in, sink, size - got > (1u << 20) ? (1u << 20) : size - got, 0);
                    if (n > 0) got += (size_t)n;
                    else if (n == 0) die(3, "raw: the previous rank closed");
                    else if (errno != EAGAIN) die(3, "raw: recv: %s", strerror(errno));
                }
            }
        }
        double us = (double)(now_ns() - t0) / 1e3 / iters;
        if (rank == 0) printf(" %11zu %12.1f %9.3f %10d\n", size, us, (double)size / us / 1e3, iters);
    }
    fflush(stdout);
    close(in);
    close(out);
    free(buf);
    free(sink);
}

/* ---- main --------------------------------------------------------------------------------------- */

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
    (void)flags; (void)file; (void)line;
    if (level > NCCL_LOG_INFO) return;
    /* the host's monotonic seconds first, the clock LinkPass agents stamp their verdicts with */
    char text[4096];
    int n = snprintf(text, sizeof text, "[%.6f] %s ", (double)now_ns() / 1e9, level == NCCL_LOG_WARN ? "NCCL WARN" : "NCCL INFO");
    if (n < 0) return;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(text + n, sizeof text - (size_t)n, fmt, ap);
    va_end(ap);
    n = m < 0 ? n : n + m;
    if (n > (int)sizeof text - 2) n = (int)sizeof text - 2; /* cut short, still a line */
    text[n++] = '\n';
    /* one write per line: the plugin's threads log while the main thread prints its summary on
     * stdout into the same file, and a line written in pieces gets another's in between */
    if (write(STDERR_FILENO, text, (size_t)n) < 0) { /* stderr gone: nowhere to say it */ }
}

int main(int argc, char **argv) {
    const char *plugin = NULL, *dir = NULL, *trace_path = NULL, *raw = NULL, *stop_file = NULL;
    int start_step = 0, rank = -1, nranks = 0, version = 0, iters = 20, warmup = 2, channels = 0, window = 8, timeout_ms = 60000;
    double seconds = 0, compute_ms = 0;
    size_t slice = 512 << 10, sizes[MAX_SIZES] = {1 << 20};
    int nsizes = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define ARG(flag) (strcmp(a, flag) == 0 && v && ++i)
        if (ARG("--plugin")) plugin = v;
        else if (ARG("--dir")) dir = v;
        else if (ARG("--rank")) rank = atoi(v);
        else if (ARG("--nranks")) nranks = atoi(v);
        else if (ARG("--version")) version = atoi(v);
        else if (ARG("--iters")) iters = atoi(v);
        else if (ARG("--warmup")) warmup = atoi(v);
        else if (ARG("--seconds")) seconds = atof(v);
        else if (ARG("--channels")) channels = atoi(v);
        else if (ARG("--slice")) slice = parse_size(v);
        else if (ARG("--window")) window = atoi(v);
        else if (ARG("--trace")) trace_path = v;
        else if (ARG("--stop-file")) stop_file = v;
        else if (ARG("--start-step")) start_step = atoi(v);
        else if (ARG("--compute-ms")) compute_ms = atof(v);
        else if (ARG("--timeout-ms")) timeout_ms = atoi(v);
        else if (ARG("--raw-tcp")) raw = v;
        else if (ARG("--sizes")) {
            char *copy = strdup(v), *save = NULL;
            nsizes = 0;
            for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (nsizes == MAX_SIZES) die(2, "--sizes: at most %d sizes", MAX_SIZES);
                sizes[nsizes++] = parse_size(t);
            }
            free(copy);
        } else die(2, "unknown or incomplete option %s (see the comment at the top of rdma/nccl/allreduce.c)", a);
#undef ARG
    }
    if (!dir || nranks < 2 || nranks > 1024 || rank < 0 || rank >= nranks)
        die(2, "--dir, --nranks (2..1024) and --rank (0..nranks-1) are required");
    if (iters < 1 || warmup < 0 || window < 1 || window > NCCL_NET_MAX_REQUESTS || slice < 4 || slice % 4)
        die(2, "--iters >= 1, --warmup >= 0, --window 1..%d, --slice a multiple of 4 bytes", NCCL_NET_MAX_REQUESTS);
    for (int i = 0; i < nsizes; i++)
        if (sizes[i] % 4) die(2, "--sizes: %zu is not a multiple of 4 bytes (uint32 elements)", sizes[i]);
    if (raw) {
        raw_run(raw, rank, nranks, dir, sizes, nsizes, iters, timeout_ms);
        return 0;
    }
    if (!plugin) die(2, "--plugin SO (or --raw-tcp ADDR) is required");
    char err[512];
    struct ring R = {.rank = rank, .nranks = nranks, .window = window, .slice = slice};
    R.p = lpn_open(plugin, version, err, sizeof err);
    if (!R.p) die(4, "%s", err);
    void *ctx = NULL;
    if (lpn_init(R.p, &ctx, 0x4c50, logger) != ncclSuccess) die(4, "the plugin's init failed");
    int ndev = 0;
    if (lpn_devices(R.p, &ndev) != ncclSuccess || ndev < 1) die(4, "the plugin has no devices (LINKPASS_NICS?)");
    R.nch = channels > 0 ? channels : ndev;
    if (R.nch > MAX_CHANNELS) die(2, "--channels: at most %d", MAX_CHANNELS);
    connect_ring(&R, dir, ndev, timeout_ms);
    size_t biggest = 0;
    for (int i = 0; i < nsizes; i++) biggest = sizes[i] > biggest ? sizes[i] : biggest;
    uint32_t *data = malloc(biggest + 4);
    if (!data) die(4, "no memory for %zu bytes", biggest);
    for (int c = 0; c < R.nch; c++) {
        R.ch[c].tmp = malloc((size_t)window * slice);
        if (!R.ch[c].tmp) die(4, "no memory for the receive slots");
        if (lpn_reg_mr(R.p, R.ch[c].sc, data, biggest + 4, NCCL_PTR_HOST, &R.ch[c].smh) != ncclSuccess ||
            lpn_reg_mr(R.p, R.ch[c].rc, R.ch[c].tmp, (size_t)window * slice, NCCL_PTR_HOST, &R.ch[c].rmh) != ncclSuccess)
            die(4, "regMr failed");
    }
    FILE *trace = trace_path ? fopen(trace_path, "a") : NULL;
    if (trace_path && !trace) die(4, "cannot write %s: %s", trace_path, strerror(errno));
    if (rank == 0)
        printf("# lp_allreduce: %d ranks, plugin %s (v%d), %d channels, slice %zu B, window %d\n"
               "#%11s %12s %8s %6s %10s %8s %8s %8s\n#%11s %12s %8s %6s %10s %8s %8s %8s\n",
               nranks, R.p->name, R.p->version, R.nch, slice, window, "size", "count", "type", "redop", "time", "algbw",
               "busbw", "#wrong", "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "");
    long wrong_total = 0;
    int iter_no = start_step, failed = 0;
    /* the LinkPass plugin's own counters (not NCCL's ABI; other plugins do not have them) */
    int (*stats)(char *, size_t) = (int (*)(char *, size_t))dlsym(R.p->dl, "linkpass_nccl_stats");
    int until = seconds > 0 || stop_file;  /* run until rank 0 says stop, through the stop element */
    for (int si = 0; si < nsizes && !failed; si++) {
        size_t count = sizes[si] / 4;
        double sum_us = 0;
        long wrong = 0;
        int timed = 0, stop = 0;
        uint64_t stop_at = seconds > 0 ? now_ns() + (uint64_t)(seconds * 1e9) : 0;
        for (int it = 0; !failed && !stop; it++) {
            if (!until && it >= warmup + iters) break;
            if (compute_ms > 0) usleep((useconds_t)(compute_ms * 1000));
            fill(data, count, rank, iter_no);
            if (until)  /* rank 0's vote to stop after this iteration; the others add nothing */
                data[count] = rank == 0 && ((stop_at && now_ns() >= stop_at) || (stop_file && access(stop_file, F_OK) == 0));
            struct timespec w0, w1;
            clock_gettime(CLOCK_REALTIME, &w0);
            uint64_t t0 = now_ns();
            if (allreduce(&R, data, count + (size_t)until) != 0) {
                failed = 1;
                struct timespec we;
                clock_gettime(CLOCK_REALTIME, &we);
                if (trace) fprintf(trace, "{\"error\": \"the plugin returned an error in iteration %d\", \"rank\": %d, "
                                   "\"at_ns\": %" PRIu64 "}\n", iter_no, rank, (uint64_t)(we.tv_sec * 1000000000ll + we.tv_nsec));
                fprintf(stderr, "lp_allreduce: rank %d: the plugin returned an error in iteration %d\n", rank, iter_no);
                break;
            }
            uint64_t t1 = now_ns();
            clock_gettime(CLOCK_REALTIME, &w1);
            size_t w = count_wrong(data, count, nranks, iter_no);
            if (until) {
                if (data[count] > 1) w++;  /* the stop element is data too */
                stop = data[count] != 0;
            }
            char counters[512] = "";
            if (trace && stats) stats(counters, sizeof counters);
            if (trace) fprintf(trace, "{\"step\": %d, \"start_ns\": %" PRIu64 ", \"end_ns\": %" PRIu64 ", \"ok\": %s, "
                               "\"bytes\": %zu, \"wrong\": %zu, \"plugin\": \"%s\"}\n", iter_no,
                               (uint64_t)(w0.tv_sec * 1000000000ll + w0.tv_nsec),
                               (uint64_t)(w1.tv_sec * 1000000000ll + w1.tv_nsec), w ? "false" : "true", sizes[si], w, counters);
            iter_no++;
            if (it >= warmup) { sum_us += (double)(t1 - t0) / 1e3; wrong += (long)w; timed++; }
            if (w && wrong_total == 0) fprintf(stderr, "lp_allreduce: rank %d: %zu wrong elements in iteration %d\n", rank, w, iter_no - 1);
            wrong_total += (long)w;
            if (trace) fflush(trace);
        }
        if (rank == 0 && timed) {
            double us = sum_us / timed, algbw = (double)sizes[si] / us / 1e3;
            printf(" %11zu %12zu %8s %6s %10.1f %8.3f %8.3f %8ld\n", sizes[si], count, "uint32", "sum", us, algbw,
                   algbw * 2.0 * (nranks - 1) / nranks, wrong);
            fflush(stdout);
        }
        if (until) break;  /* a run until told to stop measures one size */
    }
    char counters[512] = "";
    if (stats) stats(counters, sizeof counters);
    printf("# rank %d: errors %ld wrong %ld iterations %d %s\n", rank, R.errors, wrong_total, iter_no - start_step, counters);
    fflush(stdout);
    if (trace) fclose(trace);
    for (int c = 0; c < R.nch; c++) {
        lpn_dereg_mr(R.p, R.ch[c].sc, R.ch[c].smh);
        lpn_dereg_mr(R.p, R.ch[c].rc, R.ch[c].rmh);
        lpn_close_send(R.p, R.ch[c].sc);
        lpn_close_recv(R.p, R.ch[c].rc);
        free(R.ch[c].tmp);
    }
    lpn_finalize(R.p, ctx);
    lpn_close(R.p);
    free(data);
    return failed ? 3 : wrong_total ? 1 : 0;
}
