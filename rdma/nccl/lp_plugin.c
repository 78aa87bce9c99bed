/*
 * lp_plugin.c: LinkPass's NCCL net plugin, the one implementation (lp_shims.c exports it as
 * ncclNetPlugin_v8 .. v12). Host memory only; C, libc and pthreads (libibverbs loaded at run
 * time for verbs lanes, lp_verbs.c).
 *
 * Model (docs/nccl-plugin.md):
 * - A device is a LinkPass plane (LINKPASS_NICS, in plane order). The plugin listens on every
 *   plane's address; a listen handle carries all of them, a token and whether this host offers
 *   verbs lanes.
 * - A send comm made on device p owns lanes: LINKPASS_LANES from plane p's address to the peer's
 *   plane-p address (each its own source port, so its own ECMP path) and LINKPASS_STANDBY_LANES on
 *   every other plane. The receiver's recv comm holds the same lanes.
 * - Two kinds of lane, one protocol: a TCP lane carries its frames on its socket; a verbs lane is
 *   an RC queue pair whose RoCEv2 source port is chosen from the entropy table's healthy ports for
 *   (peer, plane), and carries every frame as one SEND after a handshake on a TCP socket that
 *   stays open only to tell each end when the other closed the lane. Everything below this
 *   line is the same for both: what a lane carries, how chunks are acknowledged, resent and
 *   de-duplicated, how a lane is judged and moved.
 * - Flow control is receiver-driven: irecv sends a CTS (sequence, posted size) on every lane; the
 *   sender puts a message on the wire only after its CTS, split into chunks (sequence, offset).
 *   The receiver writes a chunk straight into the posted buffer, keeps one bit per chunk, and ACKs
 *   each chunk on the lane it came on; duplicates are ACKed and dropped. A send completes when
 *   every chunk is ACKed; a receive when every chunk arrived, exactly once.
 * - The sender judges its lanes: a lane with unacknowledged data (or an unanswered ping) and no
 *   answer for longer than max(LINKPASS_STUCK_MS, 8 x its RTT), or a socket error, goes down; its
 *   unACKed chunks go back to the queue and leave on other lanes. Down lanes reconnect in the
 *   background from a fresh source port, after a hold-out that doubles with every failure and
 *   decays while the lane stays up.
 * - Chunks go to the first plane, starting with p, that has a live lane and that the entropy table
 *   does not mark unusable (FAIL_STATIC, or no healthy port) for that peer; if every plane is so
 *   marked, a live lane is used anyway (the table never stops traffic). Within the plane, the lane
 *   with the shortest queue takes the chunk.
 * - Errors reach NCCL only when no lane of a comm could carry data for LINKPASS_GIVEUP_MS.
 *
 * Threads: one progress thread per process does every socket operation; NCCL's threads only post
 * requests, test them and mark comms closed, under one mutex. Comms are freed by the progress
 * thread, so nothing it handles disappears while it waits in poll().
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../../linkpass/probe/blake2b.h"
#include "../entropy_table.h"
#include "lp_lanes.h"
#include "lp_plugin.h"
#include "lp_policy.h"
#include "lp_verbs.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "lp_plugin.c: the lane protocol is little-endian; big-endian hosts need byte swaps"
#endif

#define LP_MAX_PLANES 8
#define LP_MAX_LANES 64
#define LP_NREQ NCCL_NET_MAX_REQUESTS /* request slots per comm: slot = seq % LP_NREQ */
#define LP_CTS_RING (2 * LP_NREQ)
#define LP_LANE_Q 4                    /* chunks queued on a lane, not yet written */
#define LP_CTL_MAX (256 * 1024)        /* control bytes a lane may owe before it counts as stuck */
#define LP_PING_NS 100000000ull        /* an idle lane is pinged every 100 ms */
#define LP_CONNECT_MIN_NS 1000000000ull
#define LP_PENDING_MAX 256             /* sockets waiting for their first frame, from every source ... */
#define LP_PENDING_PER_SOURCE 16       /* ... and from one address: beyond, its oldest is closed */
#define LP_ACCEPTS_PER_PASS 64         /* per plane and progress pass: bounded work under a flood */
#define LP_PENDING_NS 5000000000ull
#define LP_KEY_LEN 16                  /* the listen handle's secret, which signs every lane's hello */
#define LP_LINGER_NS 1000000000ull     /* a closed receive comm's last ACKs get this long to leave */
#define LP_READ_BUDGET (4u << 20)
#define LP_LOOK_MS 10             /* the progress thread's longest sleep */
#define LP_LOOK_WAITING_MS 1      /* ... while chunks wait for ACKs (its heartbeat is its last look) */
#define LP_MAX_BYTES MAX_NET_SIZE /* test() reports sizes as int: keep messages <= 1 GiB */
#define LP_VWIN 4                 /* verbs lane: chunks in flight (the receiver posts this many slots and more) */
#define LP_VRECV_SPARE 4          /* receive slots beyond the window: the ping, and slack */
#define LP_VCTL 256               /* verbs lane: control frames the sender can receive at once (ACK, CTS, PONG) */
#define LP_VCTL_OUT 32            /* ... and the receiver keeps in flight; more wait in the lane's queue, so a
                                     QP whose peer is gone retransmits at most this many per timeout */
#define LP_VCTL_SIZE 64           /* their slots */

/* ---- logging through NCCL's logger -------------------------------------------------------- */

static ncclDebugLogger_t g_logger;

static void lp_log(ncclDebugLogLevel level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void lp_log(ncclDebugLogLevel level, const char *file, int line, const char *fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (g_logger) g_logger(level, NCCL_NET, file, line, "NET/LinkPass : %s", buf);
    else if (level == NCCL_LOG_WARN) fprintf(stderr, "NET/LinkPass WARN %s\n", buf);
}
#define LP_WARN(...) lp_log(NCCL_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define LP_INFO(...) lp_log(NCCL_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define LP_TRACE(...) lp_log(NCCL_LOG_TRACE, __FILE__, __LINE__, __VA_ARGS__)

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- configuration (LINKPASS_*), validated once ----------------------------------------- */

struct lp_nic {
    struct in_addr addr;
    char label[IF_NAMESIZE + 20]; /* interface name, or the address when no interface has it */
    char *pci;                     /* /sys/... PCI path or NULL */
    int speed;                     /* Mbps */
};

enum { LP_T_AUTO, LP_T_TCP, LP_T_VERBS };
static const char *const transport_name[] = {"auto", "tcp", "verbs"};

static struct {
    int nplanes;
    struct lp_nic nic[LP_MAX_PLANES];
    char entropy_path[256];
    int lanes, standby;
    uint64_t stuck_ns, giveup_ns;
    size_t chunk;
    unsigned test_yield;
    int transport;      /* LINKPASS_TRANSPORT */
    int verbs;          /* verbs lanes are offered and used with peers that offer them too */
    char no_verbs[256]; /* why not, when auto chose TCP */
    int qp_timeout, qp_retry;
} cfg;

static long env_long(const char *name, long lo, long hi, long def, const char *unit) {
    const char *v = getenv(name);
    if (!v || !*v) return def;
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        LP_WARN("%s=%s is not valid: it must be an integer %ld..%ld (%s); using the default %ld", name, v, lo, hi, unit,
                def);
        return def;
    }
    return x;
}

/* One LINKPASS_NICS item: an IPv4 address or an interface name; fills addr and label. */
static int nic_resolve(const char *item, struct lp_nic *nic) {
    struct ifaddrs *ifs = NULL, *i;
    int by_addr = inet_pton(AF_INET, item, &nic->addr) == 1, found = 0;
    if (getifaddrs(&ifs) == 0) {
        for (i = ifs; i; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
            struct in_addr a = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
            if (by_addr ? a.s_addr == nic->addr.s_addr : strcmp(i->ifa_name, item) == 0) {
                nic->addr = a;
                snprintf(nic->label, sizeof nic->label, "%s", i->ifa_name);
                found = 1;
                break;
            }
        }
        freeifaddrs(ifs);
    }
    if (!found && !by_addr) return -1;
    if (!found) snprintf(nic->label, sizeof nic->label, "%s", item);
    nic->speed = 10000;
    nic->pci = NULL;
    if (found) {
        char p[128];
        snprintf(p, sizeof p, "/sys/class/net/%s/speed", nic->label);
        FILE *f = fopen(p, "r");
        if (f) {
            int s = 0;
            if (fscanf(f, "%d", &s) == 1 && s > 0) nic->speed = s;
            fclose(f);
        }
        snprintf(p, sizeof p, "/sys/class/net/%s/device", nic->label);
        nic->pci = realpath(p, NULL); /* NULL for virtual interfaces: NCCL treats them as such */
    }
    return 0;
}

static void config_load(void) {
    memset(&cfg, 0, sizeof cfg);
    const char *ep = getenv("LINKPASS_ENTROPY_TABLE");
    if (ep && *ep && (ep[0] != '/' || strlen(ep) >= sizeof cfg.entropy_path)) {
        LP_WARN("LINKPASS_ENTROPY_TABLE=%s is not valid: it must be an absolute path shorter than %zu bytes; using the "
                "default %s", ep, sizeof cfg.entropy_path, LPE_DEFAULT_PATH);
        ep = NULL;
    }
    snprintf(cfg.entropy_path, sizeof cfg.entropy_path, "%s", ep && *ep ? ep : LPE_DEFAULT_PATH);
    cfg.lanes = (int)env_long("LINKPASS_LANES", 1, 16, 4, "TCP lanes per connection on its own plane");
    cfg.standby = (int)env_long("LINKPASS_STANDBY_LANES", 0, 16, 1, "standby lanes on each other plane");
    cfg.stuck_ns = (uint64_t)env_long("LINKPASS_STUCK_MS", 1, 60000, 50, "ms without an answer before a lane is stuck") * 1000000ull;
    cfg.giveup_ns = (uint64_t)env_long("LINKPASS_GIVEUP_MS", 100, 3600000, 30000, "ms with no usable lane before an error") * 1000000ull;
    cfg.chunk = (size_t)env_long("LINKPASS_CHUNK_KB", 4, 65536, 512, "KiB per chunk") * 1024;
    cfg.test_yield = (unsigned)env_long("LINKPASS_TEST_YIELD", 0, 1000000, 16,
                                        "open requests tested before the testing thread yields its CPU (0: never)");
    cfg.qp_timeout = (int)env_long("LINKPASS_QP_TIMEOUT", 1, 31, 14, "verbs lanes' QP ack timeout, 4.096 us x 2^value");
    cfg.qp_retry = (int)env_long("LINKPASS_QP_RETRY", 0, 7, 7, "verbs lanes' QP retry count");
    cfg.transport = LP_T_AUTO;
    const char *tr = getenv("LINKPASS_TRANSPORT");
    if (tr && *tr) {
        int k = -1;
        for (int i = 0; i < 3; i++) if (strcmp(tr, transport_name[i]) == 0) k = i;
        if (k < 0)
            LP_WARN("LINKPASS_TRANSPORT=%s is not valid: it must be auto (verbs lanes where every plane has a RoCE v2 "
                    "device, else TCP), tcp or verbs; using auto", tr);
        else
            cfg.transport = k;
    }

    const char *nics = getenv("LINKPASS_NICS");
    if (!nics || !*nics) {
        LP_WARN("LINKPASS_NICS is not set: it must list this host's LinkPass NICs in plane order, as IPv4 addresses or "
                "interface names (e.g. LINKPASS_NICS=p0,p1); no devices");
        return;
    }
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", nics);
    char *save = NULL;
    int n = 0;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ') tok++;
        if (n == LP_MAX_PLANES || nic_resolve(tok, &cfg.nic[n]) < 0) {
            LP_WARN("LINKPASS_NICS=%s is not valid: it must be 1..%d IPv4 addresses or interface names with an IPv4 "
                    "address, comma-separated, in plane order (\"%s\" %s); no devices",
                    nics, LP_MAX_PLANES, tok, n == LP_MAX_PLANES ? "is one too many" : "is neither");
            for (int i = 0; i < n; i++) free(cfg.nic[i].pci);
            cfg.nplanes = 0;
            return;
        }
        n++;
    }
    cfg.nplanes = n;
}

/* ---- the lane protocol -------------------------------------------------------------------- */

enum { F_HELLO = 1, F_HELLO_OK = 2, F_DATA = 3, F_ACK = 4, F_CTS = 5, F_PING = 6, F_PONG = 7 };

struct frame { /* 32 bytes, little-endian */
    uint8_t type;
    uint8_t flags;
    uint16_t lane;
    uint32_t len;  /* payload bytes that follow */
    uint64_t seq;  /* message sequence number (DATA, ACK, CTS) */
    uint64_t off;  /* byte offset of a chunk (DATA, ACK) */
    uint64_t arg;  /* DATA: the sender's message size; CTS: posted size; PING/PONG: timestamp */
};
_Static_assert(sizeof(struct frame) == 32, "lane frame header is 32 bytes");

#define LP_HELLO_MAGIC 0x314c43434e50504cull /* "LPPNCCL1" */
enum { LK_TCP = 0, LK_VERBS = 1 }; /* lane kinds */
struct hello { /* payload of F_HELLO: the first frame on every lane's socket, sender to receiver */
    uint64_t magic;
    uint64_t token;  /* the listen handle's */
    uint64_t nonce;  /* the send comm's */
    uint32_t chunk;
    uint16_t plane, lane;
    uint32_t epoch;  /* reconnects of this lane: a receiver takes only a later one than it has */
    uint32_t kind;   /* LK_TCP, or LK_VERBS: a struct lpv_info (the sender's QP) follows */
    uint8_t mac[B2_TAG_LEN]; /* BLAKE2b under the handle's key over the hello (mac zero) and the QP info */
};
_Static_assert(sizeof(struct hello) == 56, "hello is 56 bytes");
/* F_HELLO_OK carries no payload on a TCP lane, the receiver's struct lpv_info on a verbs lane. */
#define LP_BOOT_MAX (sizeof(struct frame) + sizeof(struct hello) + sizeof(struct lpv_info))

#define LP_HANDLE_MAGIC 0x4c504e31u /* "LPN1" */
#define LP_HF_VERBS 0x1u           /* the listener takes verbs lanes */
#define LP_HANDLE_VERSION 2
struct handle { /* what listen() writes into NCCL's 128-byte handle */
    uint32_t magic;
    uint16_t version;
    uint8_t nplanes;
    uint8_t flags;
    uint64_t token;
    uint8_t key[LP_KEY_LEN]; /* only holders of the handle can sign a lane's hello */
    struct { uint32_t addr; uint16_t port; uint16_t reserved; } ep[LP_MAX_PLANES];
};
_Static_assert(sizeof(struct handle) <= NCCL_NET_HANDLE_MAXSIZE, "the handle must fit NCCL's 128 bytes");

/* ---- state ------------------------------------------------------------------------------ */

enum { L_DOWN = LP_DOWN, L_CONNECTING = LP_CONNECTING, L_HELLO = LP_HELLO, L_LIVE = LP_LIVE };
enum { REQ_FREE, REQ_ACTIVE, REQ_DONE, REQ_ERROR };
enum { C_UNASSIGNED, C_QUEUED, C_WRITTEN, C_ACKED }; /* send chunks */
enum { K_SEND = 1, K_RECV = 2 };

struct comm;
struct req;

struct lane {
    int fd, state, plane, id;
    uint16_t sport, prev_sport; /* the TCP socket's */
    uint32_t epoch;
    /* verbs lanes: the queue pair, its RoCEv2 source port, the handshake bytes for the socket */
    struct lpv_lane *v;
    uint16_t rsport, prev_rsport;
    int rsport_from_table;      /* the port was one of the table's healthy ports (else a random one) */
    int qp_up;                  /* frames go on the QP: sender after its RTS, receiver after the first frame */
    uint32_t credits;           /* sender: messages the receiver has slots for */
    uint32_t credits_max;       /* sender: the slots it said it posted (a peer cannot raise it) */
    uint32_t qpn;
    uint8_t boot[LP_BOOT_MAX];
    size_t boot_len, boot_off;
    /* tx */
    uint8_t *ctl;
    size_t ctl_len, ctl_off, ctl_cap;
    struct { struct req *rq; uint32_t chunk; } q[LP_LANE_Q];
    int qh, qn;
    int cur_active; /* the frame at q[qh] is partly written */
    struct frame cur_hdr;
    size_t cur_done; /* bytes of header + payload written */
    uint32_t unacked; /* chunks written here and not ACKed */
    int rep;          /* send lane: its slot in the lane report (lp_lanes.c), -1 none */
    /* rx */
    union { struct frame f; uint8_t b[32]; } rxh;
    size_t rxh_got;
    int rx_payload;
    size_t rx_len, rx_got;
    uint8_t *rx_dst;     /* NULL: discard */
    struct req *rx_rq;
    uint32_t rx_chunk;
    uint8_t rx_small[sizeof(struct hello)];
    /* health */
    uint64_t last_rx, expect_since, ping_sent, next_ping;
    uint64_t hold_until, started, live_since;
    struct lp_health health; /* penalty, its decay, RTT (lp_policy.c) */
    int suspect;
    int ever;         /* receiver: the sender made this lane at least once */
    int ctl_overflow; /* a control frame did not fit: the peer stopped reading */
    short revents;    /* from the last poll: a lane is read only when it has something, written when it can take more */
    int rx_more, tx_blocked;
    char cause[256];
};

struct req {
    int kind, state;
    ncclResult_t err;
    struct comm *c;
    uint64_t seq;
    char *data;
    size_t size;      /* send: message size; recv: posted size */
    size_t msg_size;  /* recv: the sender's size, once known */
    uint32_t nchunks, ndone, next_unassigned;
    int writing;      /* send: lanes in the middle of one of its chunks */
    uint8_t *cstate;
    int16_t *clane;
    uint32_t cap;     /* entries allocated in cstate/clane */
    int cts;          /* send: the receiver's CTS is in */
    int cts_seen;     /* recv: a DATA frame for it arrived */
};

struct comm {
    int kind, closing, accepted, failed, dev, nplanes;
    int verbs;    /* its lanes are verbs lanes */
    int tclass;   /* NCCL's traffic class for the comm (-1: none) */
    int respread; /* a verbs lane came up: see whether the plane's lanes are spread over its healthy paths */
    struct comm *next;
    uint64_t token, nonce;
    uint8_t key[LP_KEY_LEN]; /* the listen handle's: signs (sender) and checks (receiver) every hello */
    struct { struct in_addr addr; uint16_t port; } peer[LP_MAX_PLANES];
    struct lane lanes[LP_MAX_LANES];
    int nlanes;
    struct req reqs[LP_NREQ];
    uint64_t next_seq;
    uint64_t cts_seq[LP_CTS_RING];
    size_t cts_size[LP_CTS_RING];
    uint8_t cts_valid[LP_CTS_RING];
    size_t chunk;
    int cur_plane, avoid[LP_MAX_PLANES];
    uint64_t nolane_since, last_rx;
    uint64_t linger_until; /* closed, its last control frames still leaving: freed at this time at the latest */
    char peer_name[64];
    /* counters, reported by linkpass_nccl_stats */
    uint64_t lanes_down, lanes_up, chunks_resent, dup_chunks, bad_frames, table_moves;
};

struct lcomm {
    int closing, dev;
    int taken; /* its receive comm exists: a handle makes one comm, NCCL connects to it once */
    uint64_t token;
    uint8_t key[LP_KEY_LEN];
    struct lcomm *next;
};

struct pending { int fd; uint32_t src; uint64_t since; size_t got; uint8_t buf[LP_BOOT_MAX]; };

/* why a socket's first frame was refused (linkpass_nccl_stats: hellos_<name>) */
enum { HR_MALFORMED, HR_UNKNOWN, HR_UNSIGNED, HR_REPLAYED, HR_SECOND_COMM, HR_CHUNK, HR_KIND, HR_EVICTED, HR_TIMEOUT,
       HR_COUNT };
static const char *HR_NAMES[HR_COUNT] = {"malformed", "unknown_token", "unsigned", "replayed", "second_comm",
                                         "chunk_mismatch", "transport_mismatch", "evicted", "timed_out"};

struct ctx { uint64_t commId; int trafficClass; };

static struct {
    pthread_mutex_t mu;
    pthread_once_t once;
    int inited, stop, wake_pending;
    pthread_t thread;
    int wake[2];
    int listen_fd[LP_MAX_PLANES];
    uint16_t listen_port[LP_MAX_PLANES];
    struct comm *comms;
    struct lcomm *lcomms;
    struct pending pend[LP_PENDING_MAX];
    int npend;
    uint64_t hellos_refused[HR_COUNT];
    /* entropy table */
    struct lpe_table et;
    int et_open, et_valid;
    uint64_t et_seq, et_retry;
    uint8_t *et_good;
    uint32_t et_count;
    char et_last_why[512];
    uint64_t totals[6]; /* lanes down, up, chunks resent, duplicates, bad frames, lanes moved by the table */
    uint64_t chunks_plane[LP_MAX_PLANES]; /* chunks written per plane, every send comm */
    uint64_t rng;                         /* random RoCEv2 source ports for lanes the table has no port for */
    int warned_verbs_peer;
    /* the report's life: contexts not yet finalized, an init without one (v8..v10: no finalize
     * comes), the last context finalized (close once the comms are gone), closed that way */
    int nctx, ctxless, fini_pending, report_closed;
} G = {.mu = PTHREAD_MUTEX_INITIALIZER, .once = PTHREAD_ONCE_INIT};

static uint8_t scratch[256 * 1024]; /* discarded payload lands here (progress thread only) */

static void wake_progress(void) {
    if (G.wake_pending) return;
    G.wake_pending = 1;
    char b = 1;
    if (write(G.wake[1], &b, 1) < 0) { /* full pipe: a wake-up is pending anyway */ }
}


static const char *addr_str(struct in_addr a, char *buf) { return inet_ntop(AF_INET, &a, buf, INET_ADDRSTRLEN); }

/* ---- the lane report (docs/lanes.md): the agent learns which paths the job uses ------------- */

static void report_log(const char *msg) { LP_INFO("%s", msg); }

/* A live send lane's slot, naming its path: the verbs lane's RoCE source port, 0 for a TCP lane
 * (the kernel hashes its ports, so every path of (peer, plane) is the lane's). */
static void report_claim(struct comm *c, struct lane *l) {
    if (l->rep >= 0) lpl_release(l->rep);
    l->rep = lpl_claim(4, &c->peer[l->plane].addr, (uint16_t)l->plane, l->v ? l->rsport : 0,
                       l->v ? LPL_KIND_VERBS : LPL_KIND_TCP);
}

static void report_release(struct lane *l) {
    lpl_release(l->rep);
    l->rep = -1;
}

static void report_open(void) {
    if (lpl_open(report_log) < 0) return;
    for (struct comm *c = G.comms; c; c = c->next)
        for (int j = 0; c->kind == K_SEND && j < c->nlanes; j++)
            if (c->lanes[j].state == L_LIVE) report_claim(c, &c->lanes[j]);
}

static void report_close(void) {
    for (struct comm *c = G.comms; c; c = c->next)
        for (int j = 0; j < LP_MAX_LANES; j++) c->lanes[j].rep = -1;
    lpl_close();
}

/* ---- lanes: control frames and closing ---------------------------------------------------- */

static int ctl_push(struct lane *l, const struct frame *f, const void *body, size_t blen) {
    size_t need = sizeof *f + blen;
    if (l->ctl_len - l->ctl_off + need > LP_CTL_MAX) return -1;
    if (l->ctl_off && l->ctl_off == l->ctl_len) l->ctl_off = l->ctl_len = 0;
    if (l->ctl_len + need > l->ctl_cap) {
        if (l->ctl_off) { /* compact */
            memmove(l->ctl, l->ctl + l->ctl_off, l->ctl_len - l->ctl_off);
            l->ctl_len -= l->ctl_off;
            l->ctl_off = 0;
        }
        if (l->ctl_len + need > l->ctl_cap) {
            size_t cap = l->ctl_cap ? l->ctl_cap : 1024;
            while (cap < l->ctl_len + need) cap *= 2;
            uint8_t *p = realloc(l->ctl, cap);
            if (!p) return -1;
            l->ctl = p;
            l->ctl_cap = cap;
        }
    }
    memcpy(l->ctl + l->ctl_len, f, sizeof *f);
    if (blen) memcpy(l->ctl + l->ctl_len + sizeof *f, body, blen);
    l->ctl_len += need;
    return 0;
}

static void ctl_frame(struct lane *l, int type, uint64_t seq, uint64_t off, uint64_t arg) {
    struct frame f = {.type = (uint8_t)type, .lane = (uint16_t)l->id, .seq = seq, .off = off, .arg = arg};
    if (ctl_push(l, &f, NULL, 0) < 0) l->ctl_overflow = 1;
}

/* A request's last state change: test() reads the state without the lock, so everything the
 * progress thread did for the request (the received bytes above all) happens-before it sees DONE. */
static void req_finish(struct req *rq, int state) { __atomic_store_n(&rq->state, state, __ATOMIC_RELEASE); }

static size_t chunk_len(const struct req *rq, uint32_t i, size_t chunk) {
    size_t off = (size_t)i * chunk;
    return rq->size > off ? (rq->size - off < chunk ? rq->size - off : chunk) : 0;
}

/* A send is done when every chunk is ACKed and no lane is in the middle of one of its chunks; its
 * slot may then be reused, so no lane queue may keep pointing at it. */
static void send_req_maybe_done(struct req *rq) {
    if (rq->state != REQ_ACTIVE || rq->ndone != rq->nchunks || rq->writing) return;
    req_finish(rq, REQ_DONE);
    struct comm *c = rq->c;
    for (int j = 0; j < c->nlanes; j++) {
        struct lane *l = &c->lanes[j];
        int n = 0;
        for (int k = 0; k < l->qn; k++) {
            int from = (l->qh + k) % LP_LANE_Q, to = (l->qh + n) % LP_LANE_Q;
            if (l->q[from].rq == rq) continue;
            l->q[to] = l->q[from];
            n++;
        }
        l->qn = n;
    }
}

/* Close a lane's socket and queue pair; its work goes back to the comm (send: chunks to re-queue;
 * recv: claims). */
static void lane_close(struct comm *c, struct lane *l) {
    report_release(l);
    if (l->fd >= 0) close(l->fd);
    l->fd = -1;
    lpv_close(l->v);
    l->v = NULL;
    l->qp_up = 0;
    l->credits = 0;
    l->boot_len = l->boot_off = 0;
    if (c->kind == K_SEND) {
        uint32_t moved = 0;
        if (l->cur_active) l->q[l->qh].rq->writing--;
        for (int s = 0; s < LP_NREQ; s++) {
            struct req *rq = &c->reqs[s];
            if (rq->state != REQ_ACTIVE || rq->kind != K_SEND) continue;
            for (uint32_t i = 0; i < rq->nchunks; i++)
                if (rq->clane[i] == l->id && (rq->cstate[i] == C_QUEUED || rq->cstate[i] == C_WRITTEN)) {
                    if (rq->cstate[i] == C_WRITTEN) moved++;
                    rq->cstate[i] = C_UNASSIGNED;
                    rq->clane[i] = -1;
                    if (i < rq->next_unassigned) rq->next_unassigned = i;
                }
            send_req_maybe_done(rq);
        }
        c->chunks_resent += moved;
        G.totals[2] += moved;
    } else if (l->rx_rq && l->rx_dst && l->rx_rq->clane[l->rx_chunk] == l->id) {
        l->rx_rq->clane[l->rx_chunk] = -1;
    }
    l->cur_active = 0;
    l->cur_done = 0;
    l->qh = l->qn = 0;
    l->unacked = 0;
    l->ctl_len = l->ctl_off = 0;
    l->ctl_overflow = 0;
    l->revents = 0;
    l->rx_more = l->tx_blocked = 0;
    l->rxh_got = 0;
    l->rx_payload = 0;
    l->rx_rq = NULL;
    l->rx_dst = NULL;
    l->ping_sent = 0;
    l->expect_since = 0;
    l->suspect = 0;
}

/* Every state change of a send lane goes through the table in lp_policy.c. */
static void lane_event(struct lane *l, int event) {
    int next = lp_lane_next(l->state, event);
    if (next < 0) {
        LP_WARN("lane %d.%d: event %d in state %s ignored (a bug)", l->plane, l->id, event, lp_lane_state_name[l->state]);
        return;
    }
    l->state = next;
}

static uint64_t lane_bound(const struct lane *l) { return lp_stuck_bound(&l->health, cfg.stuck_ns, 1); }

/* How a lane is named in log lines: "lane 0.1 (sport 41233) to 198.18.64.3:40123" for a TCP lane,
 * "lane 0.1 (QP 17, RoCE source port 49160) to 198.18.64.3" for a verbs lane. */
static const char *lane_desc(const struct comm *c, const struct lane *l, char *buf, size_t n) {
    char a[INET_ADDRSTRLEN];
    addr_str(c->peer[l->plane].addr, a);
    if (c->verbs)
        snprintf(buf, n, "lane %d.%d (QP %u, RoCE source port %u) to %s", l->plane, l->id, l->qpn, l->rsport, a);
    else
        snprintf(buf, n, "lane %d.%d (sport %u) to %s:%u", l->plane, l->id, l->sport, a, c->peer[l->plane].port);
    return buf;
}

/* A send lane goes down: socket closed, chunks re-queued, hold-out from its penalty. */
static void lane_down(struct comm *c, struct lane *l, uint64_t now, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void lane_down(struct comm *c, struct lane *l, uint64_t now, const char *fmt, ...) {
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    snprintf(l->cause, sizeof l->cause, "%s", why);
    int was = l->state;
    uint64_t before = c->chunks_resent;
    lane_close(c, l);
    lane_event(l, LP_EV_FAIL);
    l->hold_until = lp_health_down(&l->health, now);
    if (was == L_LIVE) {
        c->lanes_down++;
        G.totals[0]++;
        char d[160];
        LP_INFO("%s on plane %d down: %s; %llu chunks move to other lanes; retry in %llu ms", lane_desc(c, l, d, sizeof d),
                l->plane, why, (unsigned long long)(c->chunks_resent - before),
                (unsigned long long)((l->hold_until - now) / 1000000));
    } else {
        LP_TRACE("lane %d.%d %s failed: %s", l->plane, l->id, lp_lane_state_name[was], why);
    }
}

/* A live verbs lane is re-made on another path although nothing failed (its path is healthy but
 * crowded): closed without a penalty, reconnecting at once. */
static void lane_retire(struct comm *c, struct lane *l, uint64_t now, const char *why) {
    char d[160];
    uint64_t before = c->chunks_resent;
    lane_desc(c, l, d, sizeof d);
    snprintf(l->cause, sizeof l->cause, "%s", why);
    lane_close(c, l);
    lane_event(l, LP_EV_FAIL);
    l->hold_until = now;
    LP_INFO("%s on plane %d is re-made: %s; %llu chunks move to other lanes", d, l->plane, why,
            (unsigned long long)(c->chunks_resent - before));
}

/* ---- the entropy table's ports for a peer -------------------------------------------------- */

struct tports { int have, fail_static, n; uint16_t port[LPE_MAX_PORTS]; };

static void table_ports(const struct comm *c, int q, struct tports *t) {
    memset(t, 0, sizeof *t);
    struct lpe_table view = {.entries = G.et_good, .count = G.et_valid ? G.et_count : 0};
    uint8_t a[16] = {0};
    memcpy(a, &c->peer[q].addr, 4);
    const uint8_t *e = lpe_find(&view, 4, a, (unsigned)q);
    if (!e) return;
    t->have = 1;
    t->fail_static = (lpe_get32(e + LPE_E_FLAGS) & LPE_ENTRY_FAIL_STATIC) != 0;
    t->n = e[LPE_E_NPORTS] < LPE_MAX_PORTS ? e[LPE_E_NPORTS] : LPE_MAX_PORTS;
    for (int i = 0; i < t->n; i++) t->port[i] = lpe_get16(e + LPE_E_PORTS + 2 * (size_t)i);
}

/* Unpredictable bytes (tokens, nonces, handle keys): the kernel's CSPRNG; -1 (said) when it
 * fails, and the caller makes no handle rather than one someone else could guess. */
static int random_bytes(void *out, size_t n) {
    uint8_t *p = out;
    while (n) {
        ssize_t got = getrandom(p, n, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            LP_WARN("getrandom failed (%s): no secret for a connection's handle", got < 0 ? strerror(errno) : "no bytes");
            return -1;
        }
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

static uint64_t rng_next(void) {
    G.rng ^= G.rng << 13;
    G.rng ^= G.rng >> 7;
    G.rng ^= G.rng << 17;
    return G.rng;
}

/* The RoCEv2 source port a verbs lane connects on: one of the table's healthy ports for its
 * (peer, plane), spread over the plane's lanes (lp_pick_port), or a random one without an entry. */
static uint16_t lane_pick_port(struct comm *c, struct lane *l) {
    struct tports t;
    table_ports(c, l->plane, &t);
    uint16_t used[LP_MAX_LANES];
    int nused = 0;
    unsigned key = 0;
    for (int j = 0; j < c->nlanes; j++) {
        const struct lane *o = &c->lanes[j];
        if (o->plane != l->plane || o == l) continue;
        if (j < l->id) key++;
        if (o->state != L_DOWN && o->rsport) used[nused++] = o->rsport;
    }
    uint16_t fallback = (uint16_t)(LP_SPORT_MIN | (rng_next() & 0x3FFF));
    l->rsport_from_table = t.n > 0;
    return lp_pick_port(t.port, t.n, used, nused, l->prev_rsport, key, fallback);
}

/* ---- sender: connecting lanes ------------------------------------------------------------ */

static void lane_connect(struct comm *c, struct lane *l, uint64_t now) {
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) { snprintf(l->cause, sizeof l->cause, "socket: %s", strerror(errno)); break; }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        struct sockaddr_in la = {.sin_family = AF_INET, .sin_addr = cfg.nic[l->plane].addr};
        struct sockaddr_in ra = {.sin_family = AF_INET, .sin_addr = c->peer[l->plane].addr,
                                 .sin_port = htons(c->peer[l->plane].port)};
        if (bind(fd, (struct sockaddr *)&la, sizeof la) < 0) {
            snprintf(l->cause, sizeof l->cause, "bind: %s", strerror(errno));
            close(fd);
            break;
        }
        struct sockaddr_in got;
        socklen_t gl = sizeof got;
        if (connect(fd, (struct sockaddr *)&ra, sizeof ra) < 0 && errno != EINPROGRESS) {
            snprintf(l->cause, sizeof l->cause, "connect: %s", strerror(errno));
            close(fd);
            break;
        }
        getsockname(fd, (struct sockaddr *)&got, &gl);
        uint16_t sport = ntohs(got.sin_port);
        if (sport == l->prev_sport && attempt == 0) { close(fd); continue; } /* a fresh port: a fresh path */
        if (c->verbs) {
            char why[160];
            uint16_t rsport = lane_pick_port(c, l);
            size_t msg = sizeof(struct frame) + c->chunk;
            l->v = lpv_open(l->plane, rsport, msg, LP_VWIN + LP_VRECV_SPARE, LP_VCTL_SIZE, LP_VCTL, why, sizeof why);
            if (!l->v) {
                snprintf(l->cause, sizeof l->cause, "queue pair: %s", why);
                close(fd);
                break;
            }
            struct lpv_info me;
            lpv_local(l->v, &me);
            l->qpn = me.qpn;
            l->rsport = l->prev_rsport = rsport;
        }
        l->fd = fd;
        l->sport = sport;
        l->prev_sport = sport;
        lane_event(l, LP_EV_HOLD_OVER);
        l->started = now;
        l->epoch++;
        return;
    }
    lane_event(l, LP_EV_FAIL);
    l->hold_until = lp_health_down(&l->health, now);
}

static void lane_connected(struct comm *c, struct lane *l, uint64_t now) {
    int err = 0;
    socklen_t el = sizeof err;
    getsockopt(l->fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (err) { lane_down(c, l, now, "connect: %s", strerror(err)); return; }
    struct sockaddr_in pa;
    socklen_t pl = sizeof pa;
    if (getpeername(l->fd, (struct sockaddr *)&pa, &pl) < 0) return; /* still in progress */
    struct hello h = {.magic = LP_HELLO_MAGIC, .token = c->token, .nonce = c->nonce, .chunk = (uint32_t)c->chunk,
                      .plane = (uint16_t)l->plane, .lane = (uint16_t)l->id, .epoch = l->epoch,
                      .kind = l->v ? LK_VERBS : LK_TCP};
    struct frame f = {.type = F_HELLO, .lane = (uint16_t)l->id, .len = sizeof h};
    struct lpv_info me;
    if (l->v) {
        lpv_local(l->v, &me);
        me.tclass = (uint8_t)(c->tclass > 0 ? c->tclass : 0);
        f.len += sizeof me;
    }
    memcpy(l->boot, &f, sizeof f);
    memcpy(l->boot + sizeof f, &h, sizeof h);
    if (l->v) memcpy(l->boot + sizeof f + sizeof h, &me, sizeof me);
    b2_tag16(c->key, LP_KEY_LEN, l->boot + sizeof f, f.len, l->boot + sizeof f + offsetof(struct hello, mac));
    l->boot_len = sizeof f + f.len;
    l->boot_off = 0;
    lane_event(l, LP_EV_CONNECTED);
}

/* ---- tx ----------------------------------------------------------------------------------- */

static int blocked(struct lane *l) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        snprintf(l->cause, sizeof l->cause, "send: %s", strerror(errno));
        return -1;
    }
    l->tx_blocked = 1;
    return 0;
}

/* The DATA header of chunk i of a send. */
static struct frame data_header(const struct comm *c, const struct lane *l, const struct req *rq, uint32_t i) {
    return (struct frame){.type = F_DATA, .lane = (uint16_t)l->id, .seq = rq->seq, .off = (uint64_t)i * c->chunk,
                          .arg = rq->size, .len = (uint32_t)chunk_len(rq, i, c->chunk)};
}

/* The chunk at the head of a lane's queue is on the wire: it leaves the queue and waits for its ACK. */
static void chunk_sent(struct lane *l, struct req *rq, uint32_t i, uint64_t now) {
    G.chunks_plane[l->plane]++;
    lpl_sent(l->rep, chunk_len(rq, i, rq->c->chunk));
    if (rq->cstate[i] == C_QUEUED) {
        rq->cstate[i] = C_WRITTEN;
        l->unacked++;
        if (!l->expect_since) l->expect_since = now;
    }
    l->qh = (l->qh + 1) % LP_LANE_Q;
    l->qn--;
}

/* A verbs lane's frames, each one SEND on its QP: control frames first (a PING needs a receive
 * slot at the peer, so a credit), then queued chunks while the receiver has slots for them.
 * 0 ok, -1 error (cause set). */
static int verbs_write(struct comm *c, struct lane *l, uint64_t now) {
    if (!l->v || !l->qp_up) return 0;
    char why[160];
    while (l->ctl_off + sizeof(struct frame) <= l->ctl_len) {
        struct frame f;
        memcpy(&f, l->ctl + l->ctl_off, sizeof f);
        int ping = f.type == F_PING;
        if (ping && !l->credits) break;
        int rc = lpv_send(l->v, &f, sizeof f, NULL, 0, why, sizeof why);
        if (rc == 1) break;
        if (rc < 0) { snprintf(l->cause, sizeof l->cause, "%s", why); return -1; }
        if (ping) l->credits--;
        l->ctl_off += sizeof f;
    }
    if (l->ctl_off == l->ctl_len) l->ctl_off = l->ctl_len = 0;
    if (c->kind != K_SEND || l->state != L_LIVE) return 0;
    while (l->qn && l->credits) {
        struct req *rq = l->q[l->qh].rq;
        uint32_t i = l->q[l->qh].chunk;
        if (rq->cstate[i] == C_ACKED) { /* ACKed meanwhile, through another lane */
            l->qh = (l->qh + 1) % LP_LANE_Q;
            l->qn--;
            continue;
        }
        struct frame hdr = data_header(c, l, rq, i);
        int rc = lpv_send(l->v, &hdr, sizeof hdr, rq->data + hdr.off, hdr.len, why, sizeof why);
        if (rc == 1) break;
        if (rc < 0) { snprintf(l->cause, sizeof l->cause, "%s", why); return -1; }
        l->credits--;
        chunk_sent(l, rq, i, now);
    }
    return 0;
}

/* Write what a lane owes: its handshake, then (TCP) control frames, whole, then queued chunks, or
 * (verbs) the same on its QP. 0 ok, -1 error (cause set). */
static int lane_write(struct comm *c, struct lane *l, uint64_t now) {
    if (l->tx_blocked && !(l->revents & (POLLOUT | POLLERR | POLLHUP))) return verbs_write(c, l, now);
    l->tx_blocked = 0;
    while (l->boot_off < l->boot_len) {
        ssize_t n = send(l->fd, l->boot + l->boot_off, l->boot_len - l->boot_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) return blocked(l) < 0 ? -1 : verbs_write(c, l, now);
        l->boot_off += (size_t)n;
    }
    if (l->v) return verbs_write(c, l, now);
    for (;;) {
        if (!l->cur_active && l->ctl_off < l->ctl_len) {
            ssize_t n = send(l->fd, l->ctl + l->ctl_off, l->ctl_len - l->ctl_off, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0) return blocked(l);
            l->ctl_off += (size_t)n;
            if (l->ctl_off < l->ctl_len) { l->tx_blocked = 1; return 0; }
            l->ctl_off = l->ctl_len = 0;
        }
        if (c->kind != K_SEND || l->state != L_LIVE) return 0;
        if (!l->cur_active) {
            while (l->qn && l->q[l->qh].rq->cstate[l->q[l->qh].chunk] == C_ACKED) { /* ACKed meanwhile */
                l->qh = (l->qh + 1) % LP_LANE_Q;
                l->qn--;
            }
            if (!l->qn) return 0;
            struct req *rq = l->q[l->qh].rq;
            uint32_t i = l->q[l->qh].chunk;
            l->cur_hdr = data_header(c, l, rq, i);
            l->cur_active = 1;
            l->cur_done = 0;
            rq->writing++;
        }
        struct req *rq = l->q[l->qh].rq;
        uint32_t i = l->q[l->qh].chunk;
        size_t total = sizeof(struct frame) + l->cur_hdr.len;
        struct iovec iov[2];
        int niov = 0;
        if (l->cur_done < sizeof(struct frame)) {
            iov[niov++] = (struct iovec){(uint8_t *)&l->cur_hdr + l->cur_done, sizeof(struct frame) - l->cur_done};
            if (l->cur_hdr.len) iov[niov++] = (struct iovec){rq->data + l->cur_hdr.off, l->cur_hdr.len};
        } else {
            size_t p = l->cur_done - sizeof(struct frame);
            iov[niov++] = (struct iovec){rq->data + l->cur_hdr.off + p, l->cur_hdr.len - p};
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t n = sendmsg(l->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) return blocked(l);
        l->cur_done += (size_t)n;
        if (l->cur_done < total) { l->tx_blocked = 1; return 0; }
        l->cur_active = 0;
        rq->writing--;
        chunk_sent(l, rq, i, now);
        send_req_maybe_done(rq);
    }
}

/* ---- rx ----------------------------------------------------------------------------------- */

static struct req *req_of(struct comm *c, uint64_t seq, int kind) {
    struct req *rq = &c->reqs[seq % LP_NREQ];
    return (rq->kind == kind && rq->state != REQ_FREE && rq->seq == seq) ? rq : NULL;
}

static void bad_frame(struct comm *c) { c->bad_frames++; G.totals[4]++; }

/* A send lane's handshake has crossed its path both ways: it carries data from now on. */
static void lane_live(struct comm *c, struct lane *l, uint64_t now) {
    lane_event(l, LP_EV_HELLO_OK);
    l->live_since = now;
    report_claim(c, l);
    lp_health_up(&l->health, now);
    l->next_ping = now + (l->v ? LP_PING_NS : 0); /* a verbs lane's handshake ended with a ping */
    c->lanes_up++;
    G.totals[1]++;
    char d[160];
    if (l->cause[0]) {
        LP_INFO("%s on plane %d is back (after: %s)", lane_desc(c, l, d, sizeof d), l->plane, l->cause);
    } else if (l->v) {
        LP_INFO("%s on plane %d is up (%s)", lane_desc(c, l, d, sizeof d), l->plane,
                l->rsport_from_table ? "a port from the entropy table"
                                     : "a random port: the entropy table has none for the peer");
    }
    if (l->v) c->respread = 1;
}

/* Sender side: the header-only frames a receiver sends. -1 = protocol error. */
static int send_side_frame(struct comm *c, struct lane *l, const struct frame *f, uint64_t now) {
    if (f->len) return -1;
    switch (f->type) {
    case F_HELLO_OK: /* a verbs lane's comes on its socket, with the receiver's QP (tcp_read) */
        if (l->state != L_HELLO || l->v) return -1;
        lane_live(c, l, now);
        return 0;
    case F_ACK: {
        struct req *rq = req_of(c, f->seq, K_SEND);
        if (!rq || rq->state != REQ_ACTIVE) return 0; /* a late duplicate */
        if (f->off % c->chunk || f->off / c->chunk >= rq->nchunks) { bad_frame(c); return 0; }
        uint32_t i = (uint32_t)(f->off / c->chunk);
        if (rq->cstate[i] == C_ACKED) return 0;
        if (rq->cstate[i] == C_WRITTEN && rq->clane[i] >= 0 && rq->clane[i] < c->nlanes &&
            c->lanes[rq->clane[i]].unacked) {
            struct lane *w = &c->lanes[rq->clane[i]]; /* the lane that carried it, whichever brought the ACK */
            w->unacked--;
            lpl_acked(w->rep, chunk_len(rq, i, c->chunk), now);
        }
        rq->cstate[i] = C_ACKED;
        rq->ndone++;
        send_req_maybe_done(rq);
        return 0;
    }
    case F_CTS: {
        if (f->seq >= c->next_seq + LP_CTS_RING - LP_NREQ) { bad_frame(c); return 0; }
        if (f->seq < c->next_seq) {
            struct req *rq = req_of(c, f->seq, K_SEND);
            if (rq && !rq->cts && rq->state == REQ_ACTIVE) {
                rq->cts = 1;
                if (rq->size > f->arg) {
                    rq->err = ncclInternalError;
                    req_finish(rq, REQ_ERROR);
                    LP_WARN("send of %zu bytes to %s matched a receive of only %llu bytes", rq->size, c->peer_name,
                            (unsigned long long)f->arg);
                }
            }
            return 0;
        }
        int s = (int)(f->seq % LP_CTS_RING);
        c->cts_seq[s] = f->seq;
        c->cts_size[s] = f->arg;
        c->cts_valid[s] = 1;
        return 0;
    }
    case F_PONG:
        if (l->ping_sent && f->arg == l->ping_sent) {
            uint64_t rtt = now - l->ping_sent;
            lp_health_rtt(&l->health, rtt);
            l->ping_sent = 0;
        }
        if (l->v && l->state == L_HELLO && l->qp_up) lane_live(c, l, now); /* the first frame back on the QP */
        return 0;
    default:
        return -1;
    }
}

/* Receiver side: a DATA header is in; decide where its payload goes (l->rx_dst, NULL: discard).
 * 0: the payload is wanted; 1: not (a duplicate, ACKed again, or a failed receive); -1: a bad frame. */
static int recv_data_header(struct comm *c, struct lane *l, const struct frame *f) {
    l->rx_payload = 1;
    l->rx_len = f->len;
    l->rx_got = 0;
    l->rx_dst = NULL;
    l->rx_rq = NULL;
    if (f->len > c->chunk) { bad_frame(c); return -1; }
    if (f->seq >= c->next_seq) { bad_frame(c); return -1; } /* no CTS for it was ever sent */
    struct req *rq = req_of(c, f->seq, K_RECV);
    if (!rq || rq->state != REQ_ACTIVE) { /* a duplicate of a finished message: ACK it again */
        c->dup_chunks++;
        G.totals[3]++;
        ctl_frame(l, F_ACK, f->seq, f->off, 0);
        return 1;
    }
    if (rq->msg_size == SIZE_MAX) {
        if (f->arg > rq->size) {
            rq->err = ncclInternalError;
            req_finish(rq, REQ_ERROR);
            LP_WARN("a message of %llu bytes from %s does not fit the posted receive of %zu bytes",
                    (unsigned long long)f->arg, c->peer_name, rq->size);
            return 1;
        }
        rq->msg_size = f->arg;
        rq->nchunks = rq->msg_size ? (uint32_t)((rq->msg_size + c->chunk - 1) / c->chunk) : 1;
    }
    if (f->arg != rq->msg_size || f->off % c->chunk || f->off / c->chunk >= rq->nchunks) { bad_frame(c); return -1; }
    uint32_t i = (uint32_t)(f->off / c->chunk);
    size_t want = rq->msg_size - f->off < c->chunk ? rq->msg_size - f->off : c->chunk;
    if (f->len != want) { bad_frame(c); return -1; }
    rq->cts_seen = 1;
    if (rq->cstate[i]) { /* arrived before, on another lane */
        c->dup_chunks++;
        G.totals[3]++;
        ctl_frame(l, F_ACK, f->seq, f->off, 0);
        return 1;
    }
    int16_t holder = rq->clane[i];
    if (holder >= 0 && holder != l->id && c->lanes[holder].rx_rq == rq && c->lanes[holder].rx_chunk == i) {
        c->lanes[holder].rx_dst = NULL; /* that lane is stuck mid-chunk: its rest is discarded */
        c->lanes[holder].rx_rq = NULL;
    }
    rq->clane[i] = (int16_t)l->id;
    l->rx_rq = rq;
    l->rx_chunk = i;
    l->rx_dst = (uint8_t *)rq->data + f->off;
    return 0;
}

static void recv_data_done(struct comm *c, struct lane *l) {
    struct req *rq = l->rx_rq; /* NULL: the payload was discarded (rx_dst may be NULL for a 0-byte receive) */
    l->rx_payload = 0;
    if (!rq) return;
    uint32_t i = l->rx_chunk;
    l->rx_rq = NULL;
    l->rx_dst = NULL;
    rq->clane[i] = -1;
    rq->cstate[i] = 1;
    rq->ndone++;
    ctl_frame(l, F_ACK, rq->seq, (uint64_t)i * c->chunk, 0);
    if (rq->ndone == rq->nchunks) req_finish(rq, REQ_DONE);
}

static int verbs_hello_ok(struct comm *c, struct lane *l, uint64_t now);

/* Read what a lane's socket has. 0 ok, -1 error (cause set). A verbs lane's socket carries the
 * receiver's HELLO_OK (with its QP) and then nothing: its end is the end of the lane. */
static int tcp_read(struct comm *c, struct lane *l, uint64_t now) {
    if (!(l->revents & (POLLIN | POLLERR | POLLHUP)) && !l->rx_more) return 0;
    l->revents &= (short)~POLLIN;
    l->rx_more = 1; /* until a read comes back empty */
    size_t budget = LP_READ_BUDGET;
    while (budget) {
        if (!l->rx_payload) {
            ssize_t n = recv(l->fd, l->rxh.b + l->rxh_got, sizeof l->rxh - l->rxh_got, MSG_DONTWAIT);
            if (n == 0) { snprintf(l->cause, sizeof l->cause, "closed by the peer"); return -1; }
            if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) { l->rx_more = 0; return 0; }
                snprintf(l->cause, sizeof l->cause, "recv: %s", strerror(errno));
                return -1;
            }
            l->last_rx = c->last_rx = now;
            l->rxh_got += (size_t)n;
            if (l->rxh_got < sizeof l->rxh) continue;
            l->rxh_got = 0;
            const struct frame *f = &l->rxh.f;
            if (l->v && c->kind == K_SEND && f->type == F_HELLO_OK && f->len == sizeof(struct lpv_info) &&
                l->state == L_HELLO && !l->qp_up) {
                l->rx_payload = 1; /* the receiver's QP: read into rx_small, then verbs_hello_ok */
                l->rx_len = f->len;
                l->rx_got = 0;
                l->rx_dst = l->rx_small;
                l->rx_rq = NULL;
                continue;
            }
            if (l->v) {
                bad_frame(c);
                snprintf(l->cause, sizeof l->cause, "protocol: frame type %u on a verbs lane's socket", f->type);
                return -1;
            }
            if (c->kind == K_SEND) {
                if (send_side_frame(c, l, f, now) < 0) {
                    bad_frame(c);
                    snprintf(l->cause, sizeof l->cause, "protocol: unexpected frame type %u", f->type);
                    return -1;
                }
                continue;
            }
            if (f->type == F_DATA) {
                recv_data_header(c, l, f);
                if (f->len == 0) recv_data_done(c, l);
            } else if (f->type == F_PING && f->len == 0) {
                ctl_frame(l, F_PONG, 0, 0, f->arg);
            } else {
                bad_frame(c);
                snprintf(l->cause, sizeof l->cause, "protocol: unexpected frame type %u", f->type);
                return -1;
            }
            continue;
        }
        size_t left = l->rx_len - l->rx_got;
        uint8_t *dst = l->rx_dst ? l->rx_dst + l->rx_got : scratch;
        size_t want = l->rx_dst ? left : (left < sizeof scratch ? left : sizeof scratch);
        if (want > budget) want = budget;
        ssize_t n = recv(l->fd, dst, want, MSG_DONTWAIT);
        if (n == 0) { snprintf(l->cause, sizeof l->cause, "closed by the peer"); return -1; }
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) { l->rx_more = 0; return 0; }
            snprintf(l->cause, sizeof l->cause, "recv: %s", strerror(errno));
            return -1;
        }
        l->last_rx = c->last_rx = now;
        l->rx_got += (size_t)n;
        budget -= (size_t)n;
        if (l->rx_got == l->rx_len) {
            if (c->kind == K_RECV) recv_data_done(c, l);
            else if (verbs_hello_ok(c, l, now) < 0) return -1;
        }
    }
    return 0;
}

/* The receiver's HELLO_OK on a verbs lane: connect our QP to its QP, then ping over the QP; the
 * lane is live when the answer comes back on it (send_side_frame, F_PONG). */
static int verbs_hello_ok(struct comm *c, struct lane *l, uint64_t now) {
    struct lpv_info peer;
    char why[160];
    memcpy(&peer, l->rx_small, sizeof peer);
    l->rx_payload = 0;
    l->rx_dst = NULL;
    if (peer.sport != l->rsport) {
        bad_frame(c);
        snprintf(l->cause, sizeof l->cause, "handshake: the peer's QP is on source port %u, not %u", peer.sport, l->rsport);
        return -1;
    }
    if (lpv_connect(l->v, &peer, cfg.qp_timeout, cfg.qp_retry, c->tclass, why, sizeof why) < 0) {
        snprintf(l->cause, sizeof l->cause, "queue pair: %s", why);
        return -1;
    }
    l->credits = l->credits_max = peer.nrecv < LP_VCTL ? peer.nrecv : LP_VCTL;
    l->qp_up = 1;
    l->ping_sent = now;
    ctl_frame(l, F_PING, 0, 0, now);
    return 0;
}

/* One message off a verbs lane's QP: a frame, and for DATA its payload. -1 = protocol error
 * (cause set; the lane is closed). */
struct vmsg { struct comm *c; struct lane *l; uint64_t now; int failed; };

static int verbs_msg(void *arg, uint8_t *msg, size_t len) {
    struct vmsg *x = arg;
    struct comm *c = x->c;
    struct lane *l = x->l;
    struct frame f;
    x->failed = 1;
    if (len < sizeof f) {
        bad_frame(c);
        snprintf(l->cause, sizeof l->cause, "protocol: a %zu-byte message on the QP", len);
        return -1;
    }
    memcpy(&f, msg, sizeof f);
    if (len != sizeof f + f.len) {
        bad_frame(c);
        snprintf(l->cause, sizeof l->cause, "protocol: a frame of %u bytes in a message of %zu", f.len, len);
        return -1;
    }
    l->last_rx = c->last_rx = x->now;
    if (c->kind == K_SEND) {
        if ((f.type == F_ACK || f.type == F_PONG) && l->credits < l->credits_max)
            l->credits++; /* the receiver read one of ours */
        if (send_side_frame(c, l, &f, x->now) < 0) {
            bad_frame(c);
            snprintf(l->cause, sizeof l->cause, "protocol: unexpected frame type %u", f.type);
            return -1;
        }
        x->failed = 0;
        return 0;
    }
    l->qp_up = 1; /* the sender's QP is ready: our frames can go */
    if (f.type == F_PING && f.len == 0) {
        ctl_frame(l, F_PONG, 0, 0, f.arg);
    } else if (f.type == F_DATA) {
        int r = recv_data_header(c, l, &f);
        if (r < 0) {
            snprintf(l->cause, sizeof l->cause, "protocol: a chunk that does not belong to its message");
            return -1;
        }
        if (r == 0) {
            if (f.len) memcpy(l->rx_dst, msg + sizeof f, f.len);
            l->rx_got = f.len;
            recv_data_done(c, l);
        }
        l->rx_payload = 0;
    } else {
        bad_frame(c);
        snprintf(l->cause, sizeof l->cause, "protocol: unexpected frame type %u", f.type);
        return -1;
    }
    x->failed = 0;
    return 0;
}

static int lane_read(struct comm *c, struct lane *l, uint64_t now) {
    if (tcp_read(c, l, now) < 0) return -1;
    if (!l->v) return 0;
    struct vmsg x = {c, l, now, 0};
    char why[200];
    if (lpv_poll(l->v, verbs_msg, &x, why, sizeof why) < 0) {
        if (!x.failed) snprintf(l->cause, sizeof l->cause, "%s", why);
        return -1;
    }
    return 0;
}

/* ---- the entropy table ---------------------------------------------------------------------- */

static int lane_usable(const struct lane *l) { return l->state == L_LIVE && !l->suspect; }

/* The entropy table has just marked plane q unusable: the chunks its lanes still owe (queued,
 * mid-write or unacknowledged) go to the other planes now instead of after the lanes' own stuck
 * bound, if another plane has a usable lane. The lanes reconnect in the background (the receiver
 * drops what arrives twice); idle ones are left as they are. */
static void plane_evacuate(struct comm *c, int q, uint64_t now) {
    int elsewhere = 0;
    for (int j = 0; j < c->nlanes; j++)
        if (c->lanes[j].plane != q && !c->avoid[c->lanes[j].plane] && lane_usable(&c->lanes[j])) elsewhere++;
    if (!elsewhere) return;
    for (int j = 0; j < c->nlanes; j++) {
        struct lane *l = &c->lanes[j];
        if (l->plane == q && l->state == L_LIVE && (l->qn || l->cur_active || l->unacked))
            lane_down(c, l, now, "the entropy table marks plane %d to the peer unusable", q);
    }
}

/* Verbs lanes follow the table path by path: a lane whose source port left the healthy set of its
 * (peer, plane) is re-made on a healthy port (the last usable lane stays), and once a path is back
 * the plane's lanes are spread over the healthy paths again, one lane at a time. */
static void comm_paths(struct comm *c, uint64_t now) {
    if (c->kind != K_SEND || !c->verbs) return;
    for (int j = 0; j < c->nlanes; j++) {
        struct lane *l = &c->lanes[j];
        if (l->state == L_DOWN || !l->rsport) continue;
        struct tports t;
        table_ports(c, l->plane, &t);
        if (lp_port_verdict(t.port, t.n, t.have, t.fail_static, l->rsport) != LP_PORT_LEFT) continue;
        int others = 0;
        for (int k = 0; k < c->nlanes; k++) others += k != j && lane_usable(&c->lanes[k]);
        if (l->state == L_LIVE && !others) continue; /* the last usable lane is never closed */
        char a[INET_ADDRSTRLEN];
        c->table_moves++;
        G.totals[5]++;
        lane_down(c, l, now, "its source port %u left the entropy table's healthy set for %s on plane %d", l->rsport,
                  addr_str(c->peer[l->plane].addr, a), l->plane);
    }
    for (int q = 0; q < c->nplanes; q++) {
        struct tports t;
        table_ports(c, q, &t);
        if (!t.have || t.fail_static || t.n < 2) continue;
        uint16_t ports[LP_MAX_LANES];
        int idx[LP_MAX_LANES], n = 0, settling = 0;
        for (int j = 0; j < c->nlanes; j++) {
            const struct lane *l = &c->lanes[j];
            if (l->plane != q) continue;
            if (l->state == L_CONNECTING || l->state == L_HELLO) settling = 1;
            if (l->state == L_LIVE) { ports[n] = l->rsport; idx[n++] = j; }
        }
        int k = settling ? -1 : lp_pick_rebalance(ports, n, t.port, t.n);
        if (k < 0) continue;
        char why[128];
        snprintf(why, sizeof why, "spreading plane %d's lanes over its healthy paths again (port %u carries more)", q,
                 ports[k]);
        lane_retire(c, &c->lanes[idx[k]], now, why);
    }
}

static void comm_steer(struct comm *c, uint64_t now) {
    if (c->kind != K_SEND) return;
    struct lpe_table view = {.entries = G.et_good, .count = G.et_valid ? G.et_count : 0};
    for (int q = 0; q < c->nplanes; q++) {
        uint8_t a[16] = {0};
        memcpy(a, &c->peer[q].addr, 4);
        const uint8_t *e = lpe_find(&view, 4, a, (unsigned)q);
        int bad = e && ((lpe_get32(e + LPE_E_FLAGS) & LPE_ENTRY_FAIL_STATIC) || e[LPE_E_NPORTS] == 0);
        if (bad != c->avoid[q]) {
            char s[INET_ADDRSTRLEN];
            if (bad)
                LP_INFO("plane %d to %s: the entropy table marks it unusable (%s): traffic leaves it", q,
                        addr_str(c->peer[q].addr, s), e[LPE_E_NPORTS] ? "fail-static" : "no healthy port");
            else
                LP_INFO("plane %d to %s: the entropy table marks it usable again", q, addr_str(c->peer[q].addr, s));
        }
        c->avoid[q] = bad;
    }
    for (int q = 0; q < c->nplanes; q++)
        if (c->avoid[q]) plane_evacuate(c, q, now);
    comm_paths(c, now);
}

static void entropy_refresh(uint64_t now) {
    if (!G.et_open) {
        if (now < G.et_retry) return;
        int rc = lpe_open(cfg.entropy_path, &G.et);
        if (rc != LPE_OK) {
            if (strcmp(G.et.why, G.et_last_why) != 0)
                LP_INFO("entropy table %s not used: %s (lanes are judged by the plugin alone; retried every second)",
                        cfg.entropy_path, G.et.why);
            snprintf(G.et_last_why, sizeof G.et_last_why, "%s", G.et.why);
            lpe_close(&G.et);
            G.et_retry = now + 1000000000ull;
            if (rc != LPE_STALE && G.et_valid) { G.et_valid = 0; for (struct comm *c = G.comms; c; c = c->next) comm_steer(c, now); }
            return;
        }
        G.et_open = 1;
        G.et_seq = UINT64_MAX;
        G.et_last_why[0] = 0;
        LP_INFO("entropy table %s: steering lanes by it", cfg.entropy_path);
    }
    if (lpe_retired(&G.et)) { lpe_close(&G.et); G.et_open = 0; return; }
    uint64_t seq = lpe_load64(G.et.map, LPE_OFF_SEQ, __ATOMIC_ACQUIRE);
    if (seq == G.et_seq) return;
    int rc = lpe_read(&G.et, 256, 1000000000ull);
    if (rc == LPE_BUSY) return; /* keep what we had; next pass */
    if (rc != LPE_OK) {
        LP_WARN("entropy table %s: %s; ignored until it is readable again", cfg.entropy_path, G.et.why);
        lpe_close(&G.et);
        G.et_open = 0;
        G.et_retry = now + 1000000000ull;
        if (rc == LPE_BAD) G.et_valid = 0;
    } else {
        uint8_t *p = realloc(G.et_good, (size_t)(G.et.count ? G.et.count : 1) * LPE_ENTRY_SIZE);
        if (!p) return;
        G.et_good = p;
        memcpy(p, G.et.entries, (size_t)G.et.count * LPE_ENTRY_SIZE);
        G.et_count = G.et.count;
        G.et_valid = 1;
        G.et_seq = seq;
    }
    for (struct comm *c = G.comms; c; c = c->next) comm_steer(c, now);
}

/* ---- scheduling and timers (sender) ---------------------------------------------------------- */


/* The plane chunks go to now (lp_pick_plane: own plane first, the entropy table's marks, usable
 * before merely live lanes). -1: none. */
static int target_plane(struct comm *c) {
    int usable[LP_MAX_PLANES] = {0}, live[LP_MAX_PLANES] = {0};
    for (int j = 0; j < c->nlanes; j++) {
        const struct lane *l = &c->lanes[j];
        usable[l->plane] += lane_usable(l);
        live[l->plane] += l->state == L_LIVE;
    }
    return lp_pick_plane(c->dev, c->nplanes, c->avoid, usable, live);
}

static void log_plane_move(struct comm *c, int from, int to) {
    char a[INET_ADDRSTRLEN], b[INET_ADDRSTRLEN];
    if (from < 0 || to < 0) return;
    const char *why = c->avoid[from] ? "the entropy table marks it unusable" : "it has no usable lane";
    for (int j = 0; j < c->nlanes && !c->avoid[from]; j++)
        if (c->lanes[j].plane == from && lane_usable(&c->lanes[j])) why = "plane is back";
    if (to == c->dev) why = "its own plane is usable again";
    LP_INFO("traffic to %s moves from plane %d (%s) to plane %d (%s): %s", c->peer_name, from,
            addr_str(c->peer[from].addr, a), to, addr_str(c->peer[to].addr, b), why);
}

static void schedule(struct comm *c) {
    int q = target_plane(c);
    if (q != c->cur_plane) {
        log_plane_move(c, c->cur_plane, q);
        if (q >= 0) c->cur_plane = q;
    }
    if (q < 0) return;
    for (uint64_t s = c->next_seq > LP_NREQ ? c->next_seq - LP_NREQ : 0; s < c->next_seq; s++) {
        struct req *rq = req_of(c, s, K_SEND);
        if (!rq || rq->state != REQ_ACTIVE || !rq->cts) continue;
        for (uint32_t i = rq->next_unassigned; i < rq->nchunks; i++) {
            if (rq->cstate[i] != C_UNASSIGNED) { if (i == rq->next_unassigned) rq->next_unassigned++; continue; }
            struct lane *best = NULL;
            for (int j = 0; j < c->nlanes; j++) {
                struct lane *l = &c->lanes[j];
                if (l->plane != q || l->state != L_LIVE || (l->suspect && best)) continue;
                if (!best || (best->suspect && !l->suspect) || l->qn + (int)l->unacked < best->qn + (int)best->unacked)
                    best = l;
            }
            if (!best || best->qn == LP_LANE_Q) return;
            best->q[(best->qh + best->qn) % LP_LANE_Q].rq = rq;
            best->q[(best->qh + best->qn) % LP_LANE_Q].chunk = i;
            best->qn++;
            if (!best->expect_since) best->expect_since = 0; /* set when written */
            rq->cstate[i] = C_QUEUED;
            rq->clane[i] = (int16_t)best->id;
            if (i == rq->next_unassigned) rq->next_unassigned++;
        }
    }
}

static void comm_fail(struct comm *c, uint64_t now) {
    char msg[1800], a[INET_ADDRSTRLEN], b[INET_ADDRSTRLEN];
    size_t n = (size_t)snprintf(msg, sizeof msg, "%s %s failed: no lane could carry data for %llu ms "
                                "(LINKPASS_GIVEUP_MS). Tried:", c->kind == K_SEND ? "send to" : "receive from", c->peer_name,
                                (unsigned long long)((now - c->nolane_since) / 1000000));
    for (int q = 0; q < c->nplanes && n < sizeof msg; q++) {
        if (c->kind == K_SEND)
            n += (size_t)snprintf(msg + n, sizeof msg - n, " plane %d (%s -> %s:%u):", q, addr_str(cfg.nic[q].addr, a),
                                  addr_str(c->peer[q].addr, b), c->peer[q].port);
        else
            n += (size_t)snprintf(msg + n, sizeof msg - n, " plane %d:", q);
        for (int j = 0; j < c->nlanes && n < sizeof msg; j++) {
            struct lane *l = &c->lanes[j];
            if (l->plane != q || (c->kind == K_RECV && !l->ever)) continue;
            n += (size_t)snprintf(msg + n, sizeof msg - n, " lane %d [%s]", l->id, l->cause[0] ? l->cause : "no answer");
        }
        if (n < sizeof msg) n += (size_t)snprintf(msg + n, sizeof msg - n, ";");
    }
    LP_WARN("%s Check the peer process and the LinkPass planes to it (linkpass paths).", msg);
    c->failed = 1;
    for (int s = 0; s < LP_NREQ; s++)
        if (c->reqs[s].state == REQ_ACTIVE) { c->reqs[s].err = ncclSystemError; req_finish(&c->reqs[s], REQ_ERROR); }
    for (int j = 0; j < c->nlanes; j++) {
        lane_close(c, &c->lanes[j]);
        lane_event(&c->lanes[j], LP_EV_FAIL);
    }
}

static void send_progress(struct comm *c, uint64_t now) {
    int live = 0;
    for (int j = 0; j < c->nlanes; j++) {
        struct lane *l = &c->lanes[j];
        if (l->state == L_DOWN) {
            if (now >= l->hold_until) lane_connect(c, l, now);
            continue;
        }
        if (l->state == L_CONNECTING) lane_connected(c, l, now);
        if (l->state == L_DOWN) continue;
        if (l->state != L_CONNECTING && lane_read(c, l, now) < 0) { lane_down(c, l, now, "%s", l->cause); continue; }
        if ((l->state == L_CONNECTING || l->state == L_HELLO) &&
            now - l->started > (lane_bound(l) > LP_CONNECT_MIN_NS ? lane_bound(l) : LP_CONNECT_MIN_NS)) {
            lane_down(c, l, now, "%s timed out", l->state == L_CONNECTING ? "connect" : "handshake");
            continue;
        }
    }
    if (c->respread) {
        c->respread = 0;
        comm_paths(c, now);
    }
    schedule(c);
    for (int j = 0; j < c->nlanes; j++) {
        struct lane *l = &c->lanes[j];
        if (l->state == L_DOWN || l->state == L_CONNECTING) continue;
        if (l->state == L_LIVE && !l->ping_sent && !l->qn && !l->cur_active && now >= l->next_ping) {
            l->ping_sent = now;
            l->next_ping = now + LP_PING_NS;
            ctl_frame(l, F_PING, 0, 0, now);
        }
        if (lane_write(c, l, now) < 0) { lane_down(c, l, now, "%s", l->cause); continue; }
        if (l->ctl_overflow) {
            lane_down(c, l, now, "control backlog full (the peer stopped reading)");
            continue;
        }
        if (l->state != L_LIVE) continue;
        int expecting = l->qn || l->cur_active || l->unacked || l->ping_sent;
        if (!expecting) { l->expect_since = 0; l->suspect = 0; }
        else if (!l->expect_since) l->expect_since = now;
        uint64_t ref = l->last_rx > l->expect_since ? l->last_rx : l->expect_since;
        /* an idle lane's ping is judged more leniently: a false alarm there only costs a reconnect */
        uint64_t bound = lp_stuck_bound(&l->health, cfg.stuck_ns, l->qn || l->cur_active || l->unacked);
        if (expecting && now - ref > bound) {
            int others = 0;
            for (int k = 0; k < c->nlanes; k++) if (k != j && lane_usable(&c->lanes[k])) others++;
            if (others) {
                lane_down(c, l, now, "stuck: no answer for %llu ms with %u chunks unacknowledged (bound %llu ms)",
                          (unsigned long long)((now - ref) / 1000000), l->unacked + (unsigned)l->qn,
                          (unsigned long long)(bound / 1000000));
                continue;
            }
            if (!l->suspect)
                snprintf(l->cause, sizeof l->cause, "stuck: no answer for %llu ms (kept: the last lane)",
                         (unsigned long long)((now - ref) / 1000000));
            l->suspect = 1; /* the last lane stays, but it no longer counts as usable */
        } else if (l->suspect && now - ref <= bound) {
            l->suspect = 0;
        }
        lp_health_tick(&l->health, now);
        if (lane_usable(l)) live++;
    }
    if (live) c->nolane_since = 0;
    else if (!c->nolane_since) c->nolane_since = now;
    else if (now - c->nolane_since > cfg.giveup_ns) comm_fail(c, now);
}

static void recv_progress(struct comm *c, uint64_t now) {
    int lanes = 0, pending = 0;
    for (int j = 0; j < c->nlanes; j++) {
        struct lane *l = &c->lanes[j];
        if (l->fd < 0) continue;
        l->cause[0] = 0;
        if (lane_read(c, l, now) < 0 || lane_write(c, l, now) < 0 || l->ctl_overflow) {
            if (!l->cause[0]) snprintf(l->cause, sizeof l->cause, "control backlog full");
            LP_TRACE("receive lane %d.%d closed: %s", l->plane, l->id, l->cause);
            lane_close(c, l);
            l->state = L_DOWN;
            continue;
        }
        lanes++;
    }
    for (int s = 0; s < LP_NREQ; s++) pending += c->reqs[s].state == REQ_ACTIVE;
    /* the sender pings every lane while it lives, so silence on all of them is a lost peer */
    if (!pending || (lanes && now - c->last_rx <= cfg.giveup_ns)) { c->nolane_since = 0; return; }
    if (!c->nolane_since) c->nolane_since = c->last_rx;
    if (now - c->nolane_since > cfg.giveup_ns) comm_fail(c, now);
}

/* ---- the receiver's acceptor: sockets before their HELLO ------------------------------------ */

static struct comm *comm_new(int kind) {
    struct comm *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->kind = kind;
    c->cur_plane = -1;
    for (int j = 0; j < LP_MAX_LANES; j++) { c->lanes[j].fd = -1; c->lanes[j].id = j; c->lanes[j].rep = -1; }
    c->next = G.comms;
    G.comms = c;
    return c;
}

/* The bytes of a socket's first frame, once its header says how long it is (a HELLO on a TCP
 * lane, or one with the sender's QP on a verbs lane; anything else is refused at full length). */
static size_t pending_want(const struct pending *p) {
    if (p->got < sizeof(struct frame)) return sizeof(struct frame);
    uint32_t len;
    memcpy(&len, p->buf + offsetof(struct frame, len), sizeof len);
    return sizeof(struct frame) + (len == sizeof(struct hello) + sizeof(struct lpv_info) ? len : sizeof(struct hello));
}

/* A refused first frame: counted by why, the first of each kind said once, the socket closed. */
static void refuse_hello(struct pending *p, int why, const char *detail) {
    if (!G.hellos_refused[why]++) {
        char a[INET_ADDRSTRLEN];
        struct in_addr src = {.s_addr = p->src};
        LP_INFO("a lane from %s was refused (%s%s%s); further ones are counted (linkpass_nccl_stats hellos_%s)",
                addr_str(src, a), HR_NAMES[why], detail ? ": " : "", detail ? detail : "", HR_NAMES[why]);
    }
    close(p->fd);
}

/* Whether a hello (and the QP info after it, `extra` bytes) carries the tag of `key`. */
static int hello_signed(const uint8_t *hello, size_t len, const uint8_t key[LP_KEY_LEN]) {
    uint8_t copy[sizeof(struct hello) + sizeof(struct lpv_info)], tag[B2_TAG_LEN];
    if (len > sizeof copy) return 0;
    memcpy(copy, hello, len);
    memset(copy + offsetof(struct hello, mac), 0, B2_TAG_LEN);
    b2_tag16(key, LP_KEY_LEN, copy, len, tag);
    uint8_t diff = 0;
    for (int i = 0; i < B2_TAG_LEN; i++) diff |= tag[i] ^ hello[offsetof(struct hello, mac) + i]; /* constant time */
    return diff == 0;
}

/* A socket's first frame, checked cheapest first: its shape, then whose handle it names, then
 * the handle's key (a forged or guessed token gets nothing), then that it is not a replay and
 * asks for what this host gives; only then is a comm, a lane or a queue pair made for it. */
static void pending_hello(struct pending *p, uint64_t now) {
    struct frame f;
    struct hello h;
    struct lpv_info qp = {0};
    memcpy(&f, p->buf, sizeof f);
    memcpy(&h, p->buf + sizeof f, sizeof h);
    int verbs = f.len == sizeof h + sizeof qp;
    if (verbs) memcpy(&qp, p->buf + sizeof f + sizeof h, sizeof qp);
    if (f.type != F_HELLO || (f.len != sizeof h && !verbs) || h.kind != (verbs ? LK_VERBS : LK_TCP) ||
        h.magic != LP_HELLO_MAGIC || h.lane >= LP_MAX_LANES || h.plane >= cfg.nplanes) {
        refuse_hello(p, HR_MALFORMED, NULL);
        return;
    }
    struct comm *c = NULL;
    for (struct comm *x = G.comms; x; x = x->next)
        if (x->kind == K_RECV && !x->closing && !x->failed && x->token == h.token && x->nonce == h.nonce) c = x;
    struct lcomm *lc = NULL;
    if (!c)
        for (struct lcomm *x = G.lcomms; x; x = x->next) if (!x->closing && x->token == h.token) lc = x;
    if (!c && !lc) { refuse_hello(p, HR_UNKNOWN, "nobody listens for its handle (any more)"); return; }
    if (!hello_signed(p->buf + sizeof f, f.len, c ? c->key : lc->key)) {
        refuse_hello(p, HR_UNSIGNED, "its hello is not signed with the handle's key");
        return;
    }
    if (c && h.epoch <= c->lanes[h.lane].epoch) { refuse_hello(p, HR_REPLAYED, "an earlier connection of a lane"); return; }
    if (!c && lc->taken) { refuse_hello(p, HR_SECOND_COMM, "its handle already has its connection"); return; }
    if (h.chunk != cfg.chunk) { /* the listener's chunk size: what it pins per lane is its own choice */
        char d[160];
        snprintf(d, sizeof d, "it sends %u KiB chunks, this host takes %zu KiB: set LINKPASS_CHUNK_KB the same on every "
                 "host", h.chunk / 1024, cfg.chunk / 1024);
        refuse_hello(p, HR_CHUNK, d);
        return;
    }
    if (verbs && !cfg.verbs) {
        if (!G.warned_verbs_peer++)
            LP_WARN("a peer asked for verbs lanes, but this host uses TCP lanes (%s); its lanes are refused: set "
                    "LINKPASS_TRANSPORT the same on every host", cfg.no_verbs[0] ? cfg.no_verbs : "LINKPASS_TRANSPORT=tcp");
        G.hellos_refused[HR_KIND]++;
        close(p->fd);
        return;
    }
    if (!c) {
        c = comm_new(K_RECV);
        if (!c) { close(p->fd); return; }
        lc->taken = 1;
        memcpy(c->key, lc->key, LP_KEY_LEN);
        c->token = h.token;
        c->nonce = h.nonce;
        c->verbs = verbs;
        c->dev = lc->dev;
        c->chunk = cfg.chunk;
        c->nplanes = cfg.nplanes;
        c->nlanes = LP_MAX_LANES;
        c->last_rx = now;
        struct sockaddr_in pa;
        socklen_t pl = sizeof pa;
        char a[INET_ADDRSTRLEN] = "?";
        if (getpeername(p->fd, (struct sockaddr *)&pa, &pl) == 0) addr_str(pa.sin_addr, a);
        snprintf(c->peer_name, sizeof c->peer_name, "%s", a);
    }
    if (c->verbs != verbs) { refuse_hello(p, HR_KIND, "its lanes were of the other kind"); return; }
    struct lpv_lane *v = NULL;
    if (verbs) { /* our QP on the sender's port, connected to its QP before we answer */
        char why[200] = "";
        if (qp.sport >= LP_SPORT_MIN)
            v = lpv_open(h.plane, qp.sport, LP_VCTL_SIZE, LP_VCTL_OUT, sizeof(struct frame) + c->chunk,
                         LP_VWIN + LP_VRECV_SPARE, why, sizeof why);
        else
            snprintf(why, sizeof why, "source port %u is outside the RoCEv2 range", qp.sport);
        if (!v || lpv_connect(v, &qp, cfg.qp_timeout, cfg.qp_retry, qp.tclass, why, sizeof why) < 0) {
            LP_INFO("lane %d.%d from %s refused: no queue pair: %s", h.plane, h.lane, c->peer_name, why);
            lpv_close(v);
            close(p->fd);
            return;
        }
    }
    struct lane *l = &c->lanes[h.lane];
    if (l->fd >= 0) lane_close(c, l); /* the sender re-made this lane: the old socket is dead to it */
    l->fd = p->fd;
    l->ever = 1;
    l->epoch = h.epoch;
    l->plane = h.plane;
    l->state = L_LIVE;
    l->cause[0] = 0;
    l->last_rx = c->last_rx = now;
    struct frame ok = {.type = F_HELLO_OK, .lane = h.lane};
    memcpy(l->boot, &ok, sizeof ok);
    l->boot_len = sizeof ok;
    l->boot_off = 0;
    if (v) {
        struct lpv_info me;
        lpv_local(v, &me);
        me.tclass = qp.tclass;
        ok.len = sizeof me;
        memcpy(l->boot, &ok, sizeof ok);
        memcpy(l->boot + sizeof ok, &me, sizeof me);
        l->boot_len += sizeof me;
        l->v = v;
        l->rsport = qp.sport;
        l->qpn = me.qpn;
    }
    for (int s = 0; s < LP_NREQ; s++) { /* a new lane may be the only one left: repeat every open CTS */
        struct req *rq = &c->reqs[s];
        if (rq->kind == K_RECV && rq->state == REQ_ACTIVE) ctl_frame(l, F_CTS, rq->seq, 0, rq->size);
    }
}

/* One socket waiting for its first frame: read what has come, hand it over when whole, close it
 * past its time; 1 when it left the table (its slot now holds the last one). */
static int pending_step(int i, uint64_t now) {
    struct pending *p = &G.pend[i];
    ssize_t n = 0;
    for (int k = 0; k < 2 && p->got < pending_want(p); k++) { /* the header says how much follows */
        n = recv(p->fd, p->buf + p->got, pending_want(p) - p->got, MSG_DONTWAIT);
        if (n <= 0) break;
        p->got += (size_t)n;
    }
    int drop = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    int late = !drop && now - p->since > LP_PENDING_NS;
    int whole = p->got > sizeof(struct frame) && p->got == pending_want(p);
    if (whole) pending_hello(p, now);
    else if (late) refuse_hello(p, HR_TIMEOUT, "no first frame within 5 s");
    else if (drop) close(p->fd);
    if (!(drop || late || whole)) return 0;
    G.pend[i] = G.pend[--G.npend];
    return 1;
}

static void pending_read(uint64_t now) {
    for (int i = 0; i < G.npend;)
        if (!pending_step(i, now)) i++;
}

/* Room for a socket from `src`: at LP_PENDING_PER_SOURCE from that address, or LP_PENDING_MAX in
 * all, the oldest of them is closed. A flood of sockets that never say hello evicts itself: a
 * real lane's hello follows its connect within a round trip and is read before it is oldest. */
static void pending_room(uint32_t src) {
    int mine = 0, oldest = -1, oldest_mine = -1;
    for (int i = 0; i < G.npend; i++) {
        if (oldest < 0 || G.pend[i].since < G.pend[oldest].since) oldest = i;
        if (G.pend[i].src != src) continue;
        mine++;
        if (oldest_mine < 0 || G.pend[i].since < G.pend[oldest_mine].since) oldest_mine = i;
    }
    int evict = mine >= LP_PENDING_PER_SOURCE ? oldest_mine : G.npend >= LP_PENDING_MAX ? oldest : -1;
    if (evict < 0) return;
    refuse_hello(&G.pend[evict], HR_EVICTED, "more sockets without a first frame than the listener keeps");
    G.pend[evict] = G.pend[--G.npend];
}

static void acceptor(uint64_t now) {
    pending_read(now);
    for (int q = 0; q < cfg.nplanes; q++) {
        if (G.listen_fd[q] < 0) continue;
        for (int k = 0; k < LP_ACCEPTS_PER_PASS; k++) {
            struct sockaddr_in from = {0};
            socklen_t fl = sizeof from;
            int fd = accept4(G.listen_fd[q], (struct sockaddr *)&from, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0 && errno == EINVAL) { /* the socket stopped listening (shut down): peers cannot reach us */
                char s[INET_ADDRSTRLEN];
                LP_WARN("plane %d (%s): the listening socket failed; peers cannot connect to this host on it", q,
                        addr_str(cfg.nic[q].addr, s));
                close(G.listen_fd[q]);
                G.listen_fd[q] = -1;
                break;
            }
            if (fd < 0) break;
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            pending_room(from.sin_addr.s_addr);
            G.pend[G.npend++] = (struct pending){.fd = fd, .src = from.sin_addr.s_addr, .since = now};
            /* a lane's hello comes with its connect: read at once, it is never the oldest to evict */
            pending_step(G.npend - 1, now);
        }
    }
    pending_read(now);
}

/* ---- the progress thread -------------------------------------------------------------------- */

static void comm_free(struct comm *c) {
    for (int j = 0; j < LP_MAX_LANES; j++) {
        report_release(&c->lanes[j]);
        if (c->lanes[j].fd >= 0) close(c->lanes[j].fd);
        lpv_close(c->lanes[j].v);
        free(c->lanes[j].ctl);
    }
    for (int s = 0; s < LP_NREQ; s++) { free(c->reqs[s].cstate); free(c->reqs[s].clane); }
    free(c);
}

/* A receive comm whose control frames (the ACKs of its last chunks above all) have not all left:
 * queued on a lane, or posted on a QP and not yet completed. */
static int comm_flushing(const struct comm *c) {
    for (int j = 0; j < c->nlanes; j++) {
        const struct lane *l = &c->lanes[j];
        if (l->ctl_off < l->ctl_len || lpv_sending(l->v)) return 1;
    }
    return 0;
}

static void reap(uint64_t now) {
    for (struct comm **pp = &G.comms; *pp;) {
        struct comm *c = *pp;
        /* NCCL may close a receive comm the moment its last receive is done, before that
         * receive's ACKs have left: freed then, its sender would wait on them forever */
        if (c->closing && c->kind == K_RECV && !c->failed && comm_flushing(c)) {
            if (!c->linger_until) c->linger_until = now + LP_LINGER_NS;
            if (now < c->linger_until) { pp = &c->next; continue; }
        }
        int orphan = c->kind == K_RECV && !c->accepted;
        if (orphan) {
            orphan = 1;
            for (struct lcomm *x = G.lcomms; x; x = x->next) if (x->token == c->token && !x->closing) orphan = 0;
        }
        if (c->closing || orphan) { *pp = c->next; comm_free(c); }
        else pp = &c->next;
    }
    for (struct lcomm **pp = &G.lcomms; *pp;) {
        struct lcomm *x = *pp;
        if (x->closing) { *pp = x->next; free(x); }
        else pp = &x->next;
    }
}

static void *progress_main(void *arg) {
    (void)arg;
    struct pollfd *fds = NULL;
    struct lane **owner = NULL; /* the lane of each pollfd (comms are freed only at the top of a pass) */
    size_t cap = 0;
    pthread_mutex_lock(&G.mu);
    while (!G.stop) {
        uint64_t now = now_ns();
        reap(now);
        /* every context finalized and every comm gone: the job is done with the plugin */
        if (G.fini_pending && !G.comms) {
            G.fini_pending = 0;
            G.report_closed = lpl_is_open();
            report_close();
        }
        acceptor(now);
        entropy_refresh(now);
        for (struct comm *c = G.comms; c; c = c->next) {
            if (c->failed) continue;
            if (c->kind == K_SEND) send_progress(c, now);
            else recv_progress(c, now);
        }
        /* this pass's start, once every ACK that had arrived by then is counted: the agent
         * judges a lane's stall at its writer's last look (docs/lanes.md) */
        lpl_heartbeat(now);
        size_t need = 1 + (size_t)cfg.nplanes + (size_t)G.npend;
        for (struct comm *c = G.comms; c; c = c->next) need += 2 * (size_t)c->nlanes; /* a socket and a QP's channel */
        if (need > cap) {
            struct pollfd *p = realloc(fds, need * sizeof *fds);
            struct lane **o = realloc(owner, need * sizeof *owner);
            if (p) fds = p;
            if (o) owner = o;
            if (p && o) cap = need;
        }
        size_t n = 0;
        int waiting = 0; /* chunks wait for ACKs: look every LP_LOOK_WAITING_MS, so a stall shows at once */
        if (cap >= need) {
            for (size_t i = 0; i < need; i++) owner[i] = NULL;
            fds[n++] = (struct pollfd){.fd = G.wake[0], .events = POLLIN};
            for (int q = 0; q < cfg.nplanes; q++)
                if (G.listen_fd[q] >= 0) fds[n++] = (struct pollfd){.fd = G.listen_fd[q], .events = POLLIN};
            for (int i = 0; i < G.npend; i++) fds[n++] = (struct pollfd){.fd = G.pend[i].fd, .events = POLLIN};
            for (struct comm *c = G.comms; c; c = c->next)
                for (int j = 0; j < c->nlanes; j++) {
                    struct lane *l = &c->lanes[j];
                    if (l->fd < 0 || l->state == L_DOWN) continue;
                    short ev = l->state == L_CONNECTING ? POLLOUT : POLLIN;
                    /* a verbs lane's frames go on its QP: its socket is written only for the handshake */
                    if (l->boot_off < l->boot_len || (!l->v && (l->ctl_off < l->ctl_len || l->cur_active || l->qn)))
                        ev |= POLLOUT;
                    waiting |= l->unacked > 0;
                    owner[n] = l;
                    fds[n++] = (struct pollfd){.fd = l->fd, .events = ev};
                    if (l->v) fds[n++] = (struct pollfd){.fd = lpv_fd(l->v), .events = POLLIN}; /* every pass polls it */
                }
        }
        G.wake_pending = 0;
        pthread_mutex_unlock(&G.mu);
        poll(fds, (nfds_t)n, waiting ? LP_LOOK_WAITING_MS : LP_LOOK_MS);
        if (n && (fds[0].revents & POLLIN)) {
            char b[64];
            while (read(G.wake[0], b, sizeof b) > 0) {}
        }
        pthread_mutex_lock(&G.mu);
        for (size_t i = 0; i < n; i++)
            if (owner[i] && owner[i]->fd == fds[i].fd) owner[i]->revents = fds[i].revents;
    }
    pthread_mutex_unlock(&G.mu);
    free(fds);
    free(owner);
    return NULL;
}

/* Verbs lanes where LINKPASS_TRANSPORT allows them and every plane's address is a RoCE v2 GID. */
static void transport_init(void) {
    if (!cfg.nplanes || cfg.transport == LP_T_TCP) {
        if (cfg.transport == LP_T_TCP) snprintf(cfg.no_verbs, sizeof cfg.no_verbs, "LINKPASS_TRANSPORT=tcp");
        return;
    }
    struct in_addr a[LP_MAX_PLANES];
    char why[256];
    for (int q = 0; q < cfg.nplanes; q++) a[q] = cfg.nic[q].addr;
    if (lpv_setup(cfg.nplanes, a, why, sizeof why) == 0) {
        cfg.verbs = 1;
        return;
    }
    if (cfg.transport == LP_T_VERBS) {
        LP_WARN("LINKPASS_TRANSPORT=verbs, but %s; no devices (set LINKPASS_TRANSPORT=auto to use TCP lanes there)", why);
        for (int q = 0; q < cfg.nplanes; q++) free(cfg.nic[q].pci);
        cfg.nplanes = 0;
        return;
    }
    snprintf(cfg.no_verbs, sizeof cfg.no_verbs, "%s", why);
}

static void global_init(void) {
    config_load();
    transport_init();
    if (cfg.nplanes) report_open();
    if (pipe2(G.wake, O_CLOEXEC | O_NONBLOCK) < 0) { G.wake[0] = G.wake[1] = -1; return; }
    for (int q = 0; q < LP_MAX_PLANES; q++) G.listen_fd[q] = -1;
    for (int q = 0; q < cfg.nplanes; q++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr = cfg.nic[q].addr};
        socklen_t al = sizeof a;
        if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 256) < 0 ||
            getsockname(fd, (struct sockaddr *)&a, &al) < 0) {
            char s[INET_ADDRSTRLEN];
            LP_WARN("plane %d (%s, %s): cannot listen: %s; peers cannot reach this host on it", q, cfg.nic[q].label,
                    addr_str(cfg.nic[q].addr, s), strerror(errno));
            if (fd >= 0) close(fd);
            continue;
        }
        G.listen_fd[q] = fd;
        G.listen_port[q] = ntohs(a.sin_port);
    }
    uint64_t seed = now_ns() ^ ((uint64_t)getpid() << 32);
    if (random_bytes(&seed, sizeof seed) < 0) seed ^= (uint64_t)(uintptr_t)&seed;
    G.rng = (seed * 0x9E3779B97F4A7C15ull) | 1; /* source ports only: not a secret */
    if (pthread_create(&G.thread, NULL, progress_main, NULL) != 0) { report_close(); return; }
    G.inited = 1;
    char s[INET_ADDRSTRLEN];
    for (int q = 0; q < cfg.nplanes; q++)
        LP_INFO("device %d = plane %d: %s (%s), %d Mbps, listening on port %u", q, q, cfg.nic[q].label,
                addr_str(cfg.nic[q].addr, s), cfg.nic[q].speed, G.listen_port[q]);
    LP_INFO("lanes: %d on its own plane + %d standby on each other; stuck after %llu ms (or 8 RTTs); give up after "
            "%llu ms; chunks of %zu KiB; entropy table %s", cfg.lanes, cfg.standby,
            (unsigned long long)(cfg.stuck_ns / 1000000), (unsigned long long)(cfg.giveup_ns / 1000000),
            cfg.chunk / 1024, cfg.entropy_path);
    if (cfg.verbs) {
        for (int q = 0; q < cfg.nplanes; q++) LP_INFO("plane %d: verbs lanes on %s", q, lpv_describe(q));
        LP_INFO("lanes are RC queue pairs (verbs) with peers that offer them, TCP otherwise; QP timeout %d (%.1f ms), "
                "retry count %d; source ports from the entropy table", cfg.qp_timeout,
                4.096e-3 * (double)(1u << cfg.qp_timeout), cfg.qp_retry);
    } else if (cfg.nplanes) {
        LP_INFO("lanes are TCP connections (verbs lanes not used: %s)", cfg.no_verbs);
    }
}

/* Also the report's exit hook: an atexit handler would run before this stops the thread that
 * writes the report, and could unmap it under that thread. */
__attribute__((destructor)) static void global_fini(void) {
    if (G.inited) {
        pthread_mutex_lock(&G.mu);
        G.stop = 1;
        wake_progress();
        pthread_mutex_unlock(&G.mu);
        pthread_join(G.thread, NULL);
        G.inited = 0;
    }
    lpl_close();
}

/* ---- the API ---------------------------------------------------------------------------------- */

static struct ctx default_ctx;

ncclResult_t lp_init(void **ctx, uint64_t commId, int trafficClass, ncclDebugLogger_t log) {
    if (log) g_logger = log;
    pthread_once(&G.once, global_init);
    if (!G.inited) { LP_WARN("could not start (pipe or thread creation failed)"); return ncclSystemError; }
    if (ctx) {
        struct ctx *x = calloc(1, sizeof *x);
        if (!x) return ncclSystemError;
        x->commId = commId;
        x->trafficClass = trafficClass;
        *ctx = x;
    }
    pthread_mutex_lock(&G.mu);
    if (ctx) G.nctx++;
    else G.ctxless = 1; /* no finalize will come: the report stays until exit */
    G.fini_pending = 0;
    if (G.report_closed) { G.report_closed = 0; report_open(); }
    pthread_mutex_unlock(&G.mu);
    return ncclSuccess;
}

ncclResult_t lp_devices(int *ndev) {
    *ndev = cfg.nplanes;
    return ncclSuccess;
}

ncclResult_t lp_get_properties(int dev, struct lp_props *p) {
    if (dev < 0 || dev >= cfg.nplanes) return ncclInvalidArgument;
    p->name = cfg.nic[dev].label;
    p->pciPath = cfg.nic[dev].pci;
    p->guid = ((uint64_t)ntohl(cfg.nic[dev].addr.s_addr) << 8) | (uint64_t)dev;
    p->speed = cfg.nic[dev].speed;
    p->port = 0;
    p->maxComms = 65536;
    p->maxBytes = LP_MAX_BYTES;
    return ncclSuccess;
}

ncclResult_t lp_listen(void *ctx, int dev, void *handle, void **listenComm) {
    (void)ctx;
    if (dev < 0 || dev >= cfg.nplanes) return ncclInvalidArgument;
    struct lcomm *lc = calloc(1, sizeof *lc);
    if (!lc) return ncclSystemError;
    struct handle h = {.magic = LP_HANDLE_MAGIC, .version = LP_HANDLE_VERSION, .nplanes = (uint8_t)cfg.nplanes,
                       .flags = cfg.verbs ? LP_HF_VERBS : 0};
    if (random_bytes(&h.token, sizeof h.token) < 0 || random_bytes(h.key, sizeof h.key) < 0) {
        free(lc);
        return ncclSystemError;
    }
    lc->token = h.token;
    memcpy(lc->key, h.key, sizeof lc->key);
    pthread_mutex_lock(&G.mu);
    lc->dev = dev;
    for (int q = 0; q < cfg.nplanes; q++) {
        h.ep[q].addr = cfg.nic[q].addr.s_addr;
        h.ep[q].port = G.listen_fd[q] >= 0 ? G.listen_port[q] : 0;
    }
    lc->next = G.lcomms;
    G.lcomms = lc;
    pthread_mutex_unlock(&G.mu);
    memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
    memcpy(handle, &h, sizeof h);
    *listenComm = lc;
    return ncclSuccess;
}

ncclResult_t lp_connect(void *ctx, int dev, void *handle, void **sendComm) {
    *sendComm = NULL;
    if (dev < 0 || dev >= cfg.nplanes) return ncclInvalidArgument;
    struct handle h;
    memcpy(&h, handle, sizeof h);
    if (h.magic != LP_HANDLE_MAGIC || h.version != LP_HANDLE_VERSION || h.nplanes == 0 || h.nplanes > LP_MAX_PLANES) {
        LP_WARN("connect: the handle is not a LinkPass handle of this version (is the peer using another net plugin, "
                "or another LinkPass release?)");
        return ncclInternalError;
    }
    pthread_mutex_lock(&G.mu);
    /* A comm in the making is found again by its handle's token: connect is called until it is ready. */
    struct comm *c = NULL;
    for (struct comm *x = G.comms; x; x = x->next)
        if (x->kind == K_SEND && !x->accepted && !x->closing && x->token == h.token) c = x;
    if (!c) {
        c = comm_new(K_SEND);
        if (!c) { pthread_mutex_unlock(&G.mu); return ncclSystemError; }
        c->token = h.token;
        memcpy(c->key, h.key, sizeof c->key);
        if (random_bytes(&c->nonce, sizeof c->nonce) < 0) c->failed = 1; /* answered below */
        c->dev = dev;
        c->cur_plane = dev; /* where traffic belongs: leaving it is logged, also on the first chunk */
        c->chunk = cfg.chunk;
        c->verbs = cfg.verbs && (h.flags & LP_HF_VERBS);
        c->tclass = ctx ? ((struct ctx *)ctx)->trafficClass : -1;
        c->nplanes = h.nplanes < cfg.nplanes ? h.nplanes : cfg.nplanes;
        if (dev >= c->nplanes) c->dev = c->cur_plane = 0;
        for (int q = 0; q < c->nplanes; q++) {
            c->peer[q].addr.s_addr = h.ep[q].addr;
            c->peer[q].port = h.ep[q].port;
        }
        char a[INET_ADDRSTRLEN];
        snprintf(c->peer_name, sizeof c->peer_name, "%s", addr_str(c->peer[c->dev].addr, a));
        if (cfg.transport == LP_T_VERBS && !c->verbs) {
            LP_WARN("connect to %s: LINKPASS_TRANSPORT=verbs, but the peer offers TCP lanes only (its "
                    "LINKPASS_TRANSPORT, or no RoCE v2 device for its planes); set LINKPASS_TRANSPORT the same on every "
                    "host", c->peer_name);
            c->failed = 1;
            c->closing = 1;
            pthread_mutex_unlock(&G.mu);
            return ncclInvalidUsage;
        }
        int n = 0;
        for (int pass = 0; pass < 2; pass++)
            for (int q = 0; q < c->nplanes; q++) {
                if ((pass == 0) != (q == c->dev) || !c->peer[q].port) continue;
                int k = q == c->dev ? cfg.lanes : cfg.standby;
                for (int i = 0; i < k && n < LP_MAX_LANES; i++) {
                    c->lanes[n].plane = q;
                    c->lanes[n].state = L_DOWN;
                    n++;
                }
            }
        c->nlanes = n;
        comm_steer(c, now_ns());
        wake_progress();
    }
    if (c->failed) { pthread_mutex_unlock(&G.mu); return ncclSystemError; }
    int live = 0;
    for (int j = 0; j < c->nlanes; j++) live += c->lanes[j].state == L_LIVE;
    if (live) { c->accepted = 1; *sendComm = c; }
    pthread_mutex_unlock(&G.mu);
    return ncclSuccess;
}

ncclResult_t lp_accept(void *listenComm, void **recvComm) {
    struct lcomm *lc = listenComm;
    *recvComm = NULL;
    pthread_mutex_lock(&G.mu);
    for (struct comm *x = G.comms; x; x = x->next)
        if (x->kind == K_RECV && !x->accepted && !x->closing && x->token == lc->token) {
            x->accepted = 1;
            *recvComm = x;
            break;
        }
    pthread_mutex_unlock(&G.mu);
    return ncclSuccess;
}

ncclResult_t lp_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle) {
    (void)data; (void)size;
    if (type != NCCL_PTR_HOST) {
        LP_WARN("regMr: memory type %d is not host memory; LinkPass supports NCCL_PTR_HOST only", type);
        return ncclInternalError;
    }
    *mhandle = comm;
    return ncclSuccess;
}

ncclResult_t lp_dereg_mr(void *comm, void *mhandle) { (void)comm; (void)mhandle; return ncclSuccess; }

static int req_arrays(struct req *rq, uint32_t n) {
    if (n > rq->cap) {
        uint8_t *s = realloc(rq->cstate, n);
        if (!s) return -1;
        rq->cstate = s;
        int16_t *l = realloc(rq->clane, n * sizeof *l);
        if (!l) return -1;
        rq->clane = l;
        rq->cap = n;
    }
    memset(rq->cstate, 0, n);
    for (uint32_t i = 0; i < n; i++) rq->clane[i] = -1;
    return 0;
}

ncclResult_t lp_isend(void *sendComm, void *data, size_t size, int tag, void **request) {
    (void)tag;
    struct comm *c = sendComm;
    *request = NULL;
    if (size > LP_MAX_BYTES) { LP_WARN("isend: %zu bytes is more than maxP2pBytes", size); return ncclInternalError; }
    pthread_mutex_lock(&G.mu);
    if (c->failed) { pthread_mutex_unlock(&G.mu); return ncclSystemError; }
    struct req *rq = &c->reqs[c->next_seq % LP_NREQ];
    uint32_t n = size ? (uint32_t)((size + c->chunk - 1) / c->chunk) : 1;
    if (rq->state != REQ_FREE || req_arrays(rq, n) < 0) { pthread_mutex_unlock(&G.mu); return ncclSuccess; }
    rq->kind = K_SEND;
    rq->c = c;
    rq->seq = c->next_seq++;
    rq->data = data;
    rq->size = size;
    rq->nchunks = n;
    rq->ndone = rq->next_unassigned = 0;
    rq->writing = 0;
    rq->cts = 0;
    rq->err = ncclSuccess;
    rq->state = REQ_ACTIVE;
    int s = (int)(rq->seq % LP_CTS_RING);
    if (c->cts_valid[s] && c->cts_seq[s] == rq->seq) {
        c->cts_valid[s] = 0;
        rq->cts = 1;
        if (size > c->cts_size[s]) {
            rq->err = ncclInternalError;
            req_finish(rq, REQ_ERROR);
            LP_WARN("send of %zu bytes to %s matched a receive of only %zu bytes", size, c->peer_name, c->cts_size[s]);
        }
    }
    wake_progress();
    pthread_mutex_unlock(&G.mu);
    *request = rq;
    return ncclSuccess;
}

ncclResult_t lp_irecv(void *recvComm, int n, void **data, const size_t *sizes, void **request) {
    struct comm *c = recvComm;
    *request = NULL; /* overwrites NCCL_NET_OPTIONAL_RECV_COMPLETION: every receive completes normally */
    if (n != 1) { LP_WARN("irecv: n=%d, but maxRecvs is 1", n); return ncclInternalError; }
    if (sizes[0] > LP_MAX_BYTES) { LP_WARN("irecv: %zu bytes is more than maxP2pBytes", sizes[0]); return ncclInternalError; }
    pthread_mutex_lock(&G.mu);
    if (c->failed) { pthread_mutex_unlock(&G.mu); return ncclSystemError; }
    struct req *rq = &c->reqs[c->next_seq % LP_NREQ];
    uint32_t k = sizes[0] ? (uint32_t)((sizes[0] + c->chunk - 1) / c->chunk) : 1;
    if (rq->state != REQ_FREE || req_arrays(rq, k) < 0) { pthread_mutex_unlock(&G.mu); return ncclSuccess; }
    rq->kind = K_RECV;
    rq->c = c;
    rq->seq = c->next_seq++;
    rq->data = data[0];
    rq->size = sizes[0];
    rq->msg_size = SIZE_MAX;
    rq->nchunks = k;
    rq->ndone = 0;
    rq->cts_seen = 0;
    rq->err = ncclSuccess;
    rq->state = REQ_ACTIVE;
    for (int j = 0; j < c->nlanes; j++)
        if (c->lanes[j].fd >= 0) ctl_frame(&c->lanes[j], F_CTS, rq->seq, 0, rq->size);
    wake_progress();
    pthread_mutex_unlock(&G.mu);
    *request = rq;
    return ncclSuccess;
}

ncclResult_t lp_iflush(void *recvComm, int n, void **data, int *sizes, void **mhandles, void **request) {
    (void)recvComm; (void)n; (void)data; (void)sizes; (void)mhandles;
    *request = NULL; /* host memory: nothing to flush */
    return ncclSuccess;
}

ncclResult_t lp_test(void *request, int *done, int *sizes) {
    struct req *rq = request;
    ncclResult_t r = ncclSuccess;
    *done = 0;
    /* NCCL's progress thread spins on test(): while the request is open, answer without the lock,
     * and every test_yield open answers give the CPU away, so the spinning does not starve the
     * thread that moves the bytes when the two share a core (on a 2-core testbed: +25 % bus
     * bandwidth at 1 MB, the same as one plain TCP connection; sched_yield is ~1 µs when no one
     * else wants the core) */
    if (__atomic_load_n(&rq->state, __ATOMIC_ACQUIRE) == REQ_ACTIVE) {
        static __thread unsigned open_answers;
        if (cfg.test_yield && ++open_answers % cfg.test_yield == 0) sched_yield();
        return ncclSuccess;
    }
    pthread_mutex_lock(&G.mu);
    if (rq->state == REQ_DONE) {
        *done = 1;
        if (sizes) sizes[0] = (int)(rq->kind == K_RECV ? rq->msg_size : rq->size);
        rq->state = REQ_FREE;
    } else if (rq->state == REQ_ERROR) {
        r = rq->err;
    } else if (rq->state == REQ_FREE) {
        r = ncclInternalError;
    }
    pthread_mutex_unlock(&G.mu);
    return r;
}

static ncclResult_t close_comm(void *comm) {
    struct comm *c = comm;
    pthread_mutex_lock(&G.mu);
    c->closing = 1;
    wake_progress();
    pthread_mutex_unlock(&G.mu);
    return ncclSuccess;
}

ncclResult_t lp_close_send(void *sendComm) { return close_comm(sendComm); }
ncclResult_t lp_close_recv(void *recvComm) { return close_comm(recvComm); }

ncclResult_t lp_close_listen(void *listenComm) {
    struct lcomm *lc = listenComm;
    pthread_mutex_lock(&G.mu);
    lc->closing = 1;
    pthread_mutex_unlock(&G.mu);
    return ncclSuccess;
}

ncclResult_t lp_finalize(void *ctx) {
    if (ctx && ctx != &default_ctx) {
        pthread_mutex_lock(&G.mu);
        if (G.nctx) G.nctx--;
        G.fini_pending = !G.nctx && !G.ctxless; /* the progress thread closes the report once the comms are gone */
        wake_progress();
        pthread_mutex_unlock(&G.mu);
    }
    if (ctx != &default_ctx) free(ctx);
    return ncclSuccess;
}

/* Not part of NCCL's ABI: counters for the harness and for operators (dlsym "linkpass_nccl_stats"). */
__attribute__((visibility("default"))) int linkpass_nccl_stats(char *buf, size_t n) {
    pthread_mutex_lock(&G.mu);
    int k = snprintf(buf, n, "lanes_down=%llu lanes_up=%llu chunks_resent=%llu dup_chunks=%llu bad_frames=%llu "
                     "table_moves=%llu lane_kind=%s",
                     (unsigned long long)G.totals[0], (unsigned long long)G.totals[1], (unsigned long long)G.totals[2],
                     (unsigned long long)G.totals[3], (unsigned long long)G.totals[4], (unsigned long long)G.totals[5],
                     cfg.verbs ? "verbs" : "tcp");
    for (int q = 0; q < cfg.nplanes && k >= 0 && (size_t)k < n; q++)
        k += snprintf(buf + k, n - (size_t)k, " chunks_plane%d=%llu", q, (unsigned long long)G.chunks_plane[q]);
    for (int r = 0; r < HR_COUNT && k >= 0 && (size_t)k < n; r++)
        k += snprintf(buf + k, n - (size_t)k, " hellos_%s=%llu", HR_NAMES[r], (unsigned long long)G.hellos_refused[r]);
    pthread_mutex_unlock(&G.mu);
    return k;
}
