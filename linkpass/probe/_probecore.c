/*
 * linkpass.probe._probecore: the per-packet data path of the probe engine, in C.
 *
 * Why C: the Python engine (linkpass/probe/engine.py) does ~7 500 exchanges/s on a core; an
 * agent on a host with 8 NICs x 16 paths at 1 kHz needs 128 000/s. This core does the hot loop
 * (send, receive, reflect, timestamps, authentication, replay windows) with sendmmsg/recvmmsg
 * and the GIL released, and hands completed exchanges to Python as packed records.
 * Decisions stay in Python.
 *
 * The wire format is exactly linkpass/core/wire.py's (tests compare the two byte for byte):
 *   BTH(12) | header(64) | padding | BLAKE2b-128 tag over header+padding | ICRC(4, little-endian)
 * BLAKE2b (RFC 7693) and CRC-32 are implemented here so the extension needs no libraries.
 *
 * Sockets are created by Python inside the right network namespace and passed in as fds:
 * per NIC, a UDP socket bound to NIC:4791 with SO_TIMESTAMPNS, and a raw IPPROTO_RAW socket
 * bound to the NIC (headers built here: IPv4 DF, id 0, as the ICRC expects).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define ROCE_PORT 4791
#define LINKPASS_QPN 0x4C5001u
#define OPCODE_RC_SEND_ONLY 0x04
#define VERSION 1
#define KIND_REQUEST 1
#define KIND_REPLY 2
#define BTH_LEN 12
#define HDR_LEN 64
#define TAG_LEN 16
#define ICRC_LEN 4
#define MIN_PAYLOAD (BTH_LEN + HDR_LEN + TAG_LEN + ICRC_LEN)
#define MAX_PAD 9000
#define MAX_PKT (28 + MIN_PAYLOAD + MAX_PAD)
#define MAX_NICS 16
#define MAX_PATHS 4096
#define BATCH 64
#define REPLAY_WORDS 64 /* 4096-sequence window */
#define REFLECT_SLOTS 16384 /* power of two */
#define XRING_DEFAULT (1 << 17)
/* probes due within this much of a wake-up go out in it: one wake-up (and one sendmmsg) serves
 * many paths instead of one each, which is most of the loop's cost at 1 kHz per path */
#define COALESCE_NS 200000

/* drop reasons: the first ones are wire.DROP_REASONS, in the same order */
enum { D_SHORT, D_NOT_ROCE, D_BAD_MAGIC, D_BAD_VERSION, D_BAD_KIND, D_BAD_LENGTH, D_BAD_ICRC, D_BAD_TAG,
       D_REPLAY, D_UNKNOWN_PEER, D_UNEXPECTED, D_SEND_FULL, D_SEND_ERROR, D_REFLECT_FULL, D_RING_FULL, D_COUNT };
static const char *DROP_NAMES[D_COUNT] = {"short", "not_roce", "bad_magic", "bad_version", "bad_kind", "bad_length",
                                          "bad_icrc", "bad_tag", "replay", "unknown_peer", "unexpected",
                                          "send_buffer_full", "send_error", "reflector_table_full", "ring_full"};

/* ---- CRC-32 (IEEE, reflected, as zlib) ------------------------------------------------- */
static uint32_t crc_table[256];
static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}
static uint32_t crc_update(uint32_t crc, const uint8_t *p, size_t n) { /* crc is the running, inverted value */
    while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

/* ---- BLAKE2b (RFC 7693), keyed, 16-byte output --------------------------------------------- */
static const uint64_t B2_IV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                                  0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                                  0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
static const uint8_t B2_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

typedef struct {
    uint64_t h[8];
    uint64_t t;
    uint8_t buf[128];
    size_t n;
} b2_t;

static inline uint64_t rotr64(uint64_t x, int r) { return (x >> r) | (x << (64 - r)); }
static inline uint64_t load64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; } /* x86: little-endian */

static void b2_compress(b2_t *s, const uint8_t *block, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) { v[i] = s->h[i]; v[i + 8] = B2_IV[i]; }
    v[12] ^= s->t;
    if (last) v[14] = ~v[14];
#define G(a, b, c, d, x, y)                     \
    do {                                        \
        v[a] = v[a] + v[b] + (x);               \
        v[d] = rotr64(v[d] ^ v[a], 32);         \
        v[c] = v[c] + v[d];                     \
        v[b] = rotr64(v[b] ^ v[c], 24);         \
        v[a] = v[a] + v[b] + (y);               \
        v[d] = rotr64(v[d] ^ v[a], 16);         \
        v[c] = v[c] + v[d];                     \
        v[b] = rotr64(v[b] ^ v[c], 63);         \
    } while (0)
    for (int r = 0; r < 12; r++) {
        const uint8_t *sg = B2_SIGMA[r];
        G(0, 4, 8, 12, m[sg[0]], m[sg[1]]);
        G(1, 5, 9, 13, m[sg[2]], m[sg[3]]);
        G(2, 6, 10, 14, m[sg[4]], m[sg[5]]);
        G(3, 7, 11, 15, m[sg[6]], m[sg[7]]);
        G(0, 5, 10, 15, m[sg[8]], m[sg[9]]);
        G(1, 6, 11, 12, m[sg[10]], m[sg[11]]);
        G(2, 7, 8, 13, m[sg[12]], m[sg[13]]);
        G(3, 4, 9, 14, m[sg[14]], m[sg[15]]);
    }
#undef G
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void b2_update(b2_t *s, const uint8_t *p, size_t n) {
    while (n > 0) {
        if (s->n == 128) { /* a full buffer is compressed only once more data follows */
            s->t += 128;
            b2_compress(s, s->buf, 0);
            s->n = 0;
        }
        size_t take = 128 - s->n;
        if (take > n) take = n;
        memcpy(s->buf + s->n, p, take);
        s->n += take;
        p += take;
        n -= take;
    }
}

/* state after absorbing the key block: computed once per key, copied per message */
static void b2_keyed_init(b2_t *s, const uint8_t *key, size_t keylen) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 8; i++) s->h[i] = B2_IV[i];
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ TAG_LEN;
    uint8_t block[128] = {0};
    memcpy(block, key, keylen);
    b2_update(s, block, 128);
}

static void b2_final16(b2_t *s, uint8_t out[TAG_LEN]) {
    s->t += s->n;
    memset(s->buf + s->n, 0, 128 - s->n);
    b2_compress(s, s->buf, 1);
    memcpy(out, s->h, TAG_LEN);
}

/* ---- wire helpers ----------------------------------------------------------------------- */
static inline void put16(uint8_t *p, uint16_t v) { p[0] = v >> 8; p[1] = v; }
static inline void put32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }
static inline void put64(uint8_t *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }
static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t get32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }
static inline uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

typedef struct {
    uint8_t kind, flags;
    uint16_t pad;
    uint32_t sender, reflector, path, rx_count;
    uint64_t seq;
    int64_t t1, t2, t3, t4;
} probe_t;

/* addresses in network byte order as stored in the packet (4 raw bytes) */
static uint32_t icrc(const uint8_t src[4], const uint8_t dst[4], uint16_t sport, uint16_t dport, const uint8_t *roce,
                     size_t roce_len) {
    uint8_t pre[8 + 20 + 8 + BTH_LEN];
    memset(pre, 0xFF, 8);
    uint8_t *ip = pre + 8;
    uint16_t total = (uint16_t)(20 + 8 + roce_len + ICRC_LEN);
    ip[0] = 0x45; ip[1] = 0xFF; put16(ip + 2, total); put16(ip + 4, 0); put16(ip + 6, 0x4000);
    ip[8] = 0xFF; ip[9] = 17; put16(ip + 10, 0xFFFF); memcpy(ip + 12, src, 4); memcpy(ip + 16, dst, 4);
    uint8_t *udp = ip + 20;
    put16(udp, sport); put16(udp + 2, dport); put16(udp + 4, (uint16_t)(8 + roce_len + ICRC_LEN)); put16(udp + 6, 0xFFFF);
    uint8_t *bth = udp + 8;
    memcpy(bth, roce, BTH_LEN);
    bth[4] = 0xFF; /* FECN, BECN, resv6 */
    uint32_t c = crc_update(0xFFFFFFFFu, pre, sizeof pre);
    c = crc_update(c, roce + BTH_LEN, roce_len - BTH_LEN);
    return c ^ 0xFFFFFFFFu;
}

/* writes the UDP payload of `p` into out (room for MIN_PAYLOAD + pad); returns its length */
static size_t encode(const b2_t *keyed, const probe_t *p, const uint8_t src[4], const uint8_t dst[4], uint16_t sport,
                     uint16_t dport, uint8_t *out) {
    out[0] = OPCODE_RC_SEND_ONLY; out[1] = 0; put16(out + 2, 0xFFFF);
    put32(out + 4, LINKPASS_QPN); put32(out + 8, (uint32_t)(p->seq & 0xFFFFFF));
    uint8_t *h = out + BTH_LEN;
    h[0] = 'L'; h[1] = 'P'; h[2] = VERSION; h[3] = p->kind; h[4] = p->flags; h[5] = 0; put16(h + 6, p->pad);
    put32(h + 8, p->sender); put32(h + 12, p->reflector); put32(h + 16, p->path); put32(h + 20, p->rx_count);
    put64(h + 24, p->seq); put64(h + 32, (uint64_t)p->t1); put64(h + 40, (uint64_t)p->t2);
    put64(h + 48, (uint64_t)p->t3); put64(h + 56, (uint64_t)p->t4);
    memset(h + HDR_LEN, 0, p->pad);
    size_t body = HDR_LEN + p->pad;
    b2_t s = *keyed;
    b2_update(&s, h, body);
    b2_final16(&s, h + body);
    size_t roce_len = BTH_LEN + body + TAG_LEN;
    uint32_t c = icrc(src, dst, sport, dport, out, roce_len);
    out[roce_len] = c; out[roce_len + 1] = c >> 8; out[roce_len + 2] = c >> 16; out[roce_len + 3] = c >> 24;
    return roce_len + ICRC_LEN;
}

/* returns -1 on success, else a drop reason */
static int decode(const b2_t *keyed, const uint8_t *d, size_t n, const uint8_t src[4], const uint8_t dst[4],
                  uint16_t sport, uint16_t dport, probe_t *p) {
    if (n < MIN_PAYLOAD) return D_SHORT;
    if (d[0] != OPCODE_RC_SEND_ONLY || (get32(d + 4) & 0xFFFFFF) != LINKPASS_QPN) return D_NOT_ROCE;
    const uint8_t *h = d + BTH_LEN;
    if (h[0] != 'L' || h[1] != 'P') return D_BAD_MAGIC;
    if (h[2] != VERSION) return D_BAD_VERSION;
    if (h[3] != KIND_REQUEST && h[3] != KIND_REPLY) return D_BAD_KIND;
    uint16_t pad = get16(h + 6);
    if (n != (size_t)MIN_PAYLOAD + pad) return D_BAD_LENGTH;
    size_t roce_len = n - ICRC_LEN;
    uint32_t c = icrc(src, dst, sport, dport, d, roce_len);
    const uint8_t *ic = d + roce_len;
    if ((uint32_t)(ic[0] | ic[1] << 8 | ic[2] << 16 | (uint32_t)ic[3] << 24) != c) return D_BAD_ICRC;
    size_t body = HDR_LEN + pad;
    uint8_t tag[TAG_LEN];
    b2_t s = *keyed;
    b2_update(&s, h, body);
    b2_final16(&s, tag);
    uint8_t diff = 0;
    for (int i = 0; i < TAG_LEN; i++) diff |= tag[i] ^ h[body + i]; /* constant time */
    if (diff) return D_BAD_TAG;
    p->kind = h[3]; p->flags = h[4]; p->pad = pad;
    p->sender = get32(h + 8); p->reflector = get32(h + 12); p->path = get32(h + 16); p->rx_count = get32(h + 20);
    p->seq = get64(h + 24); p->t1 = (int64_t)get64(h + 32); p->t2 = (int64_t)get64(h + 40);
    p->t3 = (int64_t)get64(h + 48); p->t4 = (int64_t)get64(h + 56);
    return -1;
}

/* ---- replay window ---------------------------------------------------------------------- */
typedef struct {
    uint64_t top; /* highest accepted seq + 1 (0: none yet) */
    uint64_t bits[REPLAY_WORDS]; /* bit i: seq (top-1-i) seen */
} replay_t;

static int replay_accept(replay_t *w, uint64_t seq) {
    const uint64_t size = REPLAY_WORDS * 64;
    if (seq >= w->top) {
        uint64_t shift = seq + 1 - w->top;
        if (w->top == 0 || shift >= size) {
            memset(w->bits, 0, sizeof w->bits);
        } else { /* shift the bitmap left by `shift` bits (towards older) */
            uint64_t words = shift / 64, bitsh = shift % 64;
            for (int i = REPLAY_WORDS - 1; i >= 0; i--) {
                uint64_t v = 0;
                if ((uint64_t)i >= words) {
                    v = w->bits[i - words] << bitsh;
                    if (bitsh && (uint64_t)i > words) v |= w->bits[i - words - 1] >> (64 - bitsh);
                }
                w->bits[i] = v;
            }
        }
        w->top = seq + 1;
        w->bits[0] |= 1;
        return 1;
    }
    uint64_t back = w->top - 1 - seq;
    if (back >= size) return 0;
    uint64_t m = 1ULL << (back % 64);
    if (w->bits[back / 64] & m) return 0;
    w->bits[back / 64] |= m;
    return 1;
}

/* ---- the engine ------------------------------------------------------------------------- */
typedef struct {
    int rx_fd, tx_fd;
    uint8_t addr[4];
} nic_t;

/* Judging mode (track(True)): the loop matches every reply to its request and hands Python an
 * ordered stream of events instead of one record per exchange, so Python's work per path is a few
 * calls per second rather than one per probe (the detector stays in Python; only the per-probe
 * bookkeeping is here). A request is *on time* if its reply arrives by its deadline, sent time +
 * the path's rto (which the detector computes and pushes with set_rto). Events, in the order the
 * loop learned them, per path:
 *   ANSWERED  on-time replies since the last event of the path: count, seq/rx_count/t1..t4 of the
 *             newest, size = 1 if any was a full-size probe. Flushed before any other event of the
 *             path (so order is kept) and on take_events(all=True).
 *   MISS      a request whose deadline passed with no reply: seq, size, t1 = sent, t4 = deadline.
 *             Judged when the loop has read every packet that arrived before the deadline (the
 *             evidence time), or when a reply to a later request of the path arrived after it.
 *   LATE      a reply that came after its request was judged missed (or that matched none). */
enum { EV_ANSWERED = 1, EV_MISS = 2, EV_LATE = 3 };
typedef struct { /* little-endian, 64 bytes: "<IIQIIIIqqqq" */
    uint32_t kind, path_id;
    uint64_t seq;
    uint32_t count, rx_count, size, worst_rtt; /* worst_rtt: ANSWERED's largest round trip, ns */
    int64_t t1, t2, t3, t4;
} ev_t;

#define OUT_SLOTS 128 /* requests awaiting a reply per path; more in flight are judged missed */
typedef struct {
    uint64_t seq;
    int64_t t_sent, deadline;
    uint8_t waiting, size;
} out_t;

typedef struct {
    uint32_t path_id, peer_id;
    uint8_t peer[4];
    uint16_t sport, pad;
    int nic;
    int64_t pair_gap_ns; /* > 0: coded pairs, a second probe this long after each first (clock sync) */
    int64_t pair_due; /* when the pending second probe of a pair is due; 0: none */
    int64_t interval_ns, next_due;
    uint32_t size_every, size_count; /* every Nth probe is a full-size one (MTU black holes) */
    uint16_t size_pad;
    /* judging mode */
    int64_t rto_ns;
    out_t *out; /* OUT_SLOTS, by seq */
    uint64_t exp_seq; /* requests below this are judged */
    ev_t agg; /* pending ANSWERED (agg.count > 0) */
    uint64_t next_seq, sent;
    replay_t replay;
} path_t;

typedef struct {
    uint32_t sender, path; /* key; sender 0 = empty slot */
    uint32_t count;
    replay_t replay;
} reflect_t;

typedef struct { /* one completed exchange, as handed to Python (little-endian, 48 bytes) */
    uint32_t path_id, rx_count;
    uint64_t seq;
    int64_t t1, t2, t3, t4;
} xrec_t;


struct txbatch;

typedef struct {
    PyObject_HEAD
    b2_t keyed;
    uint32_t agent_id;
    int nnics, npaths;
    nic_t nics[MAX_NICS];
    path_t *paths;
    reflect_t *reflect;
    uint32_t reflect_used;
    xrec_t *ring;
    uint32_t ring_cap, ring_head, ring_len;
    /* sent requests (only while tracking) and the evidence time: every packet that reached a
     * socket before `drained_local` is in the rings. A detector may judge a probe missed only up
     * to that time, so neither a late Python nor a descheduled loop can fake a miss. */
    ev_t *evring;
    uint32_t ev_head, ev_len, tracking;
    int efd; /* eventfd: readable when a MISS or LATE is waiting (Python sleeps on it) */
    int notify; /* set under `mu` when one was pushed; the loop signals efd after unlocking */
    int64_t drained_local;
    uint64_t drops[D_COUNT];
    uint64_t sent, reflected, replies, received, wakeups, evidence_updates;
    /* synthetic clock: local = base_local + (true - base_true) * (1 + rate_ppb / 1e9) */
    int64_t clk_base_true, clk_base_local, clk_rate_ppb;
    uint64_t rng; /* xorshift64* for jitter */
    uint32_t jitter_ppm;
    /* background mode: a native thread runs the loop continuously, so reflecting and receiving
     * never pause for Python; `mu` guards everything the loop and the Python methods share */
    pthread_mutex_t mu;
    pthread_t thread;
    int thread_running;
    volatile int thread_stop;
    int rt_priority; /* > 0: the thread asks for SCHED_FIFO at this priority */
    volatile int rt_status; /* 0 ok / not asked, else the errno of pthread_setschedparam */
    struct txbatch *bg_tx;
    uint8_t *bg_rx;
} Core;

static inline int64_t now_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int64_t local_clock(const Core *c, int64_t true_ns) {
    int64_t dt = true_ns - c->clk_base_true;
    return c->clk_base_local + dt + (int64_t)((__int128)dt * c->clk_rate_ppb / 1000000000LL);
}

static inline uint64_t rng_next(Core *c) {
    uint64_t x = c->rng;
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    c->rng = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static void build_ip_udp(uint8_t *pkt, const uint8_t src[4], const uint8_t dst[4], uint16_t sport, size_t payload) {
    pkt[0] = 0x45; pkt[1] = 0; put16(pkt + 2, (uint16_t)(28 + payload)); put16(pkt + 4, 0); put16(pkt + 6, 0x4000);
    pkt[8] = 64; pkt[9] = 17; put16(pkt + 10, 0); memcpy(pkt + 12, src, 4); memcpy(pkt + 16, dst, 4);
    put16(pkt + 20, sport); put16(pkt + 22, ROCE_PORT); put16(pkt + 24, (uint16_t)(8 + payload)); put16(pkt + 26, 0);
}

/* a batch of packets to send on one NIC's raw socket */
typedef struct txbatch {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in to[BATCH];
    uint8_t *buf; /* BATCH * MAX_PKT */
    int n;
    int what[BATCH]; /* path index for requests, -1 for replies */
    uint64_t seq[BATCH];
    int64_t t1[BATCH];
    uint8_t size_probe[BATCH];
} txbatch_t;

static ev_t *ev_push(Core *c) {
    c->notify = 1; /* ANSWERED is pushed only while a MISS/LATE or a take needs it: wake Python */
    if (c->ev_len == c->ring_cap) { c->drops[D_RING_FULL]++; return NULL; }
    ev_t *e = &c->evring[(c->ev_head + c->ev_len++) % c->ring_cap];
    memset(e, 0, sizeof *e);
    return e;
}

static void flush_answered(Core *c, path_t *pt) {
    if (!pt->agg.count) return;
    ev_t *e = ev_push(c);
    if (e) *e = pt->agg;
    pt->agg.count = 0;
    pt->agg.size = 0;
    pt->agg.worst_rtt = 0;
}

static void emit_miss(Core *c, path_t *pt, out_t *o) {
    flush_answered(c, pt);
    ev_t *e = ev_push(c);
    if (e) {
        e->kind = EV_MISS; e->path_id = pt->path_id; e->seq = o->seq; e->size = o->size;
        e->t1 = o->t_sent; e->t4 = o->deadline;
    }
    o->waiting = 0;
}

/* judge every request of the path, oldest first, whose deadline is before `until` */
static void expire(Core *c, path_t *pt, int64_t until) {
    for (; pt->exp_seq < pt->next_seq; pt->exp_seq++) {
        out_t *o = &pt->out[pt->exp_seq % OUT_SLOTS];
        if (!o->waiting || o->seq != pt->exp_seq) continue; /* answered (or never sent) */
        if (o->deadline >= until) break;
        emit_miss(c, pt, o);
    }
}

static void track_sent(Core *c, path_t *pt, uint64_t seq, int64_t t1, uint8_t size) {
    out_t *o = &pt->out[seq % OUT_SLOTS];
    if (o->waiting) emit_miss(c, pt, o); /* OUT_SLOTS requests later and still unanswered */
    o->seq = seq; o->t_sent = t1; o->deadline = t1 + pt->rto_ns; o->size = size; o->waiting = 1;
}

/* a reply in judging mode: fold it into ANSWERED if on time, else a LATE event */
static void track_reply(Core *c, path_t *pt, const probe_t *p, int64_t t_rx) {
    expire(c, pt, t_rx); /* requests whose deadline passed before this reply came are missed */
    out_t *o = &pt->out[p->seq % OUT_SLOTS];
    if (o->waiting && o->seq == p->seq && t_rx <= o->deadline) {
        o->waiting = 0;
        ev_t *a = &pt->agg;
        a->kind = EV_ANSWERED; a->path_id = pt->path_id; a->count++;
        int64_t rtt = t_rx - p->t1; /* the batch's worst round trip: the timeout must cover it */
        if (rtt > 0 && (uint64_t)rtt > a->worst_rtt) a->worst_rtt = rtt > UINT32_MAX ? UINT32_MAX : (uint32_t)rtt;
        if (p->seq >= a->seq || a->count == 1) {
            a->seq = p->seq; a->rx_count = p->rx_count;
            a->t1 = p->t1; a->t2 = p->t2; a->t3 = p->t3; a->t4 = t_rx;
        }
        a->size |= o->size;
        return;
    }
    if (o->waiting && o->seq == p->seq) emit_miss(c, pt, o); /* late: judged before it is heard */
    flush_answered(c, pt);
    ev_t *e = ev_push(c);
    if (e) {
        e->kind = EV_LATE; e->path_id = pt->path_id; e->seq = p->seq; e->rx_count = p->rx_count;
        e->t1 = p->t1; e->t2 = p->t2; e->t3 = p->t3; e->t4 = t_rx;
    }
}

static void tx_flush(Core *c, int nic, txbatch_t *b) {
    int off = 0;
    while (off < b->n) {
        int r = sendmmsg(c->nics[nic].tx_fd, b->msgs + off, b->n - off, MSG_DONTWAIT);
        if (r < 0) {
            c->drops[(errno == EAGAIN || errno == ENOBUFS) ? D_SEND_FULL : D_SEND_ERROR]++;
            off++; /* drop the packet at the head and go on: never wait on a peer */
            continue;
        }
        for (int i = off; i < off + r; i++) {
            if (b->what[i] < 0) { c->reflected++; continue; }
            c->paths[b->what[i]].sent++;
            c->sent++;
            if (c->tracking) track_sent(c, &c->paths[b->what[i]], b->seq[i], b->t1[i], b->size_probe[i]);
        }
        off += r;
    }
    b->n = 0;
}

static uint8_t *tx_slot(txbatch_t *b, const uint8_t dst[4], int what) {
    int i = b->n++;
    b->what[i] = what;
    memset(&b->to[i], 0, sizeof b->to[i]);
    b->to[i].sin_family = AF_INET;
    memcpy(&b->to[i].sin_addr, dst, 4);
    b->iov[i].iov_base = b->buf + (size_t)i * MAX_PKT;
    memset(&b->msgs[i], 0, sizeof b->msgs[i]);
    b->msgs[i].msg_hdr.msg_name = &b->to[i];
    b->msgs[i].msg_hdr.msg_namelen = sizeof b->to[i];
    b->msgs[i].msg_hdr.msg_iov = &b->iov[i];
    b->msgs[i].msg_hdr.msg_iovlen = 1;
    return b->buf + (size_t)i * MAX_PKT;
}

static reflect_t *reflect_lookup(Core *c, uint32_t sender, uint32_t path) {
    uint32_t h = (sender * 2654435761u) ^ (path * 40503u);
    for (uint32_t probe = 0; probe < REFLECT_SLOTS; probe++) {
        reflect_t *r = &c->reflect[(h + probe) & (REFLECT_SLOTS - 1)];
        if (r->sender == sender && r->path == path) return r;
        if (r->sender == 0) {
            if (c->reflect_used >= REFLECT_SLOTS * 3 / 4) return NULL; /* keep probing short */
            r->sender = sender; r->path = path; r->count = 0;
            memset(&r->replay, 0, sizeof r->replay);
            c->reflect_used++;
            return r;
        }
    }
    return NULL;
}

static int path_index(Core *c, uint32_t path_id) {
    for (int i = 0; i < c->npaths; i++) /* few hundred paths: a scan is cheaper than a hash here */
        if (c->paths[i].path_id == path_id) return i;
    return -1;
}

static void handle_packet(Core *c, int nic, const uint8_t *data, size_t n, const struct sockaddr_in *from,
                          int64_t t_rx_true, txbatch_t *tx) {
    probe_t p;
    const uint8_t *src = (const uint8_t *)&from->sin_addr;
    uint16_t sport = ntohs(from->sin_port);
    int why = decode(&c->keyed, data, n, src, c->nics[nic].addr, sport, ROCE_PORT, &p);
    if (why >= 0) { c->drops[why]++; return; }
    int64_t t_rx = local_clock(c, t_rx_true);
    if (p.kind == KIND_REQUEST) {
        if (p.reflector != c->agent_id || p.sender == 0) { c->drops[D_UNEXPECTED]++; return; }
        reflect_t *r = reflect_lookup(c, p.sender, p.path);
        if (!r) { c->drops[D_REFLECT_FULL]++; return; }
        if (!replay_accept(&r->replay, p.seq)) { c->drops[D_REPLAY]++; return; }
        r->count++;
        if (tx->n == BATCH) tx_flush(c, nic, tx);
        uint8_t *pkt = tx_slot(tx, src, -1);
        p.kind = KIND_REPLY; p.t2 = t_rx; p.rx_count = r->count;
        p.t3 = local_clock(c, now_ns(CLOCK_REALTIME));
        size_t len = encode(&c->keyed, &p, c->nics[nic].addr, src, sport, ROCE_PORT, pkt + 28);
        build_ip_udp(pkt, c->nics[nic].addr, src, sport, len);
        tx->iov[tx->n - 1].iov_len = 28 + len;
        return;
    }
    int pi = (p.sender == c->agent_id) ? path_index(c, p.path) : -1;
    if (pi < 0 || memcmp(c->paths[pi].peer, src, 4) != 0) { c->drops[D_UNEXPECTED]++; return; }
    if (!replay_accept(&c->paths[pi].replay, p.seq)) { c->drops[D_REPLAY]++; return; }
    c->replies++;
    if (c->tracking) { track_reply(c, &c->paths[pi], &p, t_rx); return; }
    if (c->ring_len == c->ring_cap) { c->drops[D_RING_FULL]++; return; }
    xrec_t *x = &c->ring[(c->ring_head + c->ring_len++) % c->ring_cap];
    x->path_id = p.path; x->rx_count = p.rx_count; x->seq = p.seq;
    x->t1 = p.t1; x->t2 = p.t2; x->t3 = p.t3; x->t4 = t_rx;
}

static void queue_probe(Core *c, int nic, int i, txbatch_t *tx) {
    path_t *pt = &c->paths[i];
    if (tx[nic].n == BATCH) tx_flush(c, nic, &tx[nic]);
    probe_t p = {0};
    int size_probe = pt->size_every && ++pt->size_count % pt->size_every == 0;
    p.kind = KIND_REQUEST; p.pad = size_probe ? pt->size_pad : pt->pad; p.flags = p.pad ? 1 : 0;
    p.sender = c->agent_id; p.reflector = pt->peer_id; p.path = pt->path_id; p.seq = pt->next_seq++;
    p.t1 = local_clock(c, now_ns(CLOCK_REALTIME));
    uint8_t *pkt = tx_slot(&tx[nic], pt->peer, i);
    tx[nic].seq[tx[nic].n - 1] = p.seq;
    tx[nic].t1[tx[nic].n - 1] = p.t1;
    tx[nic].size_probe[tx[nic].n - 1] = (uint8_t)size_probe;
    size_t len = encode(&c->keyed, &p, c->nics[nic].addr, pt->peer, pt->sport, ROCE_PORT, pkt + 28);
    build_ip_udp(pkt, c->nics[nic].addr, pt->peer, pt->sport, len);
    tx[nic].iov[tx[nic].n - 1].iov_len = 28 + len;
}

static void send_due(Core *c, int64_t now_mono, txbatch_t *tx) {
    for (int nic = 0; nic < c->nnics; nic++) {
        for (int i = 0; i < c->npaths; i++) {
            path_t *pt = &c->paths[i];
            if (pt->nic != nic) continue;
            if (pt->pair_due && pt->pair_due <= now_mono) { /* second probe of a coded pair */
                queue_probe(c, nic, i, tx);
                pt->pair_due = 0;
            }
            if (pt->next_due > now_mono + COALESCE_NS) continue;
            queue_probe(c, nic, i, tx);
            /* the pair's second probe goes out `gap` later, alone: on a software fabric a
             * back-to-back pair is spread by the first packet's own forwarding work */
            if (pt->pair_gap_ns) pt->pair_due = now_mono + pt->pair_gap_ns;
            /* next due: interval +- jitter, never in the past (a late loop does not burst) */
            int64_t j = 0;
            if (c->jitter_ppm) {
                int64_t span = pt->interval_ns * c->jitter_ppm / 1000000;
                if (span > 0) j = (int64_t)(rng_next(c) % (uint64_t)(2 * span + 1)) - span;
            }
            pt->next_due += pt->interval_ns + j;
            if (pt->next_due < now_mono) pt->next_due = now_mono + pt->interval_ns / 2;
        }
        if (tx[nic].n) tx_flush(c, nic, &tx[nic]);
    }
}

static void signal_python(Core *c) {
    if (!c->notify) return;
    c->notify = 0;
    uint64_t one = 1;
    if (c->efd >= 0 && write(c->efd, &one, sizeof one) < 0) { /* full counter: Python is awake anyway */ }
}

static void set_evidence(Core *c, int64_t t) {
    c->drained_local = t;
    c->evidence_updates++;
    if (c->tracking)
        for (int i = 0; i < c->npaths; i++) expire(c, &c->paths[i], t);
}

/* the loop: returns after duration_ns (CLOCK_MONOTONIC) */
static void core_run(Core *c, int64_t duration_ns, txbatch_t *tx, uint8_t *rxbuf) {
    struct pollfd pfd[MAX_NICS];
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in from[BATCH];
    char cbuf[BATCH][64];
    for (int i = 0; i < c->nnics; i++) { pfd[i].fd = c->nics[i].rx_fd; pfd[i].events = POLLIN; }
    int64_t end = now_ns(CLOCK_MONOTONIC) + duration_ns;
    for (;;) {
        int64_t now = now_ns(CLOCK_MONOTONIC);
        if (now >= end || c->thread_stop) break;
        pthread_mutex_lock(&c->mu);
        send_due(c, now, tx);
        int64_t next = end;
        int64_t mono_minus_local = c->tracking ? now - local_clock(c, now_ns(CLOCK_REALTIME)) : 0;
        for (int i = 0; i < c->npaths; i++) {
            path_t *pt = &c->paths[i];
            if (pt->next_due < next) next = pt->next_due;
            if (pt->pair_due && pt->pair_due < next) next = pt->pair_due;
            if (c->tracking && pt->exp_seq < pt->next_seq) { /* judge a miss the moment it is due */
                out_t *o = &pt->out[pt->exp_seq % OUT_SLOTS];
                if (o->waiting && o->seq == pt->exp_seq && o->deadline + mono_minus_local < next)
                    next = o->deadline + mono_minus_local + 1;
            }
        }
        pthread_mutex_unlock(&c->mu);
        int64_t wait = next - now_ns(CLOCK_MONOTONIC);
        if (wait > 2000000) wait = 2000000; /* wake at least every 2 ms: new paths, stop requests */
        struct timespec ts = {0, 0};
        if (wait > 0) { ts.tv_sec = wait / 1000000000LL; ts.tv_nsec = wait % 1000000000LL; }
        int ready = ppoll(pfd, c->nnics, &ts, NULL);
        if (ready < 0) continue;
        int64_t t_check = now_ns(CLOCK_REALTIME);
        c->wakeups++;
        if (ready == 0) { /* nothing arrived while we slept: everything before now is known */
            pthread_mutex_lock(&c->mu);
            set_evidence(c, local_clock(c, t_check));
            signal_python(c);
            pthread_mutex_unlock(&c->mu);
            continue;
        }
        /* every NIC is read until empty (a no-op recvmmsg on a quiet one) so that, if all come
         * back empty, everything that arrived before t_check is known: the evidence time */
        int drained = 1;
        pthread_mutex_lock(&c->mu);
        for (int nic = 0; nic < c->nnics; nic++) {
            int emptied = 0;
            for (int round = 0; round < 4; round++) { /* bounded work per wake-up */
                for (int i = 0; i < BATCH; i++) {
                    iov[i].iov_base = rxbuf + (size_t)i * MAX_PKT;
                    iov[i].iov_len = MAX_PKT;
                    memset(&msgs[i].msg_hdr, 0, sizeof msgs[i].msg_hdr);
                    msgs[i].msg_hdr.msg_name = &from[i];
                    msgs[i].msg_hdr.msg_namelen = sizeof from[i];
                    msgs[i].msg_hdr.msg_iov = &iov[i];
                    msgs[i].msg_hdr.msg_iovlen = 1;
                    msgs[i].msg_hdr.msg_control = cbuf[i];
                    msgs[i].msg_hdr.msg_controllen = sizeof cbuf[i];
                }
                int got = recvmmsg(c->nics[nic].rx_fd, msgs, BATCH, MSG_DONTWAIT, NULL);
                if (got <= 0) { emptied = got == 0 || errno == EAGAIN || errno == EWOULDBLOCK; break; }
                int64_t fallback = now_ns(CLOCK_REALTIME);
                for (int i = 0; i < got; i++) {
                    int64_t t_rx = fallback;
                    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msgs[i].msg_hdr); cm; cm = CMSG_NXTHDR(&msgs[i].msg_hdr, cm)) {
                        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SO_TIMESTAMPNS) {
                            struct timespec k;
                            memcpy(&k, CMSG_DATA(cm), sizeof k);
                            t_rx = (int64_t)k.tv_sec * 1000000000LL + k.tv_nsec;
                        }
                    }
                    c->received++;
                    handle_packet(c, nic, rxbuf + (size_t)i * MAX_PKT, msgs[i].msg_len, &from[i], t_rx, &tx[nic]);
                }
                if (tx[nic].n) tx_flush(c, nic, &tx[nic]);
                if (got < BATCH) { emptied = 1; break; }
            }
            drained &= emptied;
        }
        if (drained) set_evidence(c, local_clock(c, t_check));
        signal_python(c);
        pthread_mutex_unlock(&c->mu);
    }
}

static void *core_thread(void *arg) {
    Core *c = arg;
    /* real-time priority: on a busy host a normal thread waits for a CPU for milliseconds, and a
     * reflector that answers late looks like a lossy link to its peers. The loop sleeps in ppoll
     * between packets, so it takes little CPU; the kernel's RT throttling bounds it anyway. */
    if (c->rt_priority > 0) {
        struct sched_param sp = {.sched_priority = c->rt_priority};
        c->rt_status = pthread_setschedparam(pthread_self(), SCHED_FIFO, &sp);
    }

    while (!c->thread_stop) core_run(c, 100000000LL, c->bg_tx, c->bg_rx);
    return NULL;
}

/* ---- Python type ------------------------------------------------------------------------ */
static int Core_init(Core *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"key", "agent_id", "ring", "seed", "jitter_ppm", NULL};
    Py_buffer key;
    unsigned int agent_id, ring = XRING_DEFAULT, jitter = 100000;
    unsigned long long seed = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*I|IKI", kwlist, &key, &agent_id, &ring, &seed, &jitter)) return -1;
    if (key.len < 16 || key.len > 64) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "fleet key must be 16..64 bytes");
        return -1;
    }
    if (agent_id == 0 || ring < 16 || jitter >= 1000000) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "agent_id must be > 0, ring >= 16, jitter_ppm < 1000000");
        return -1;
    }
    b2_keyed_init(&self->keyed, key.buf, (size_t)key.len);
    PyBuffer_Release(&key);
    self->agent_id = agent_id;
    self->paths = PyMem_Calloc(MAX_PATHS, sizeof(path_t));
    self->reflect = PyMem_Calloc(REFLECT_SLOTS, sizeof(reflect_t));
    self->ring = PyMem_Calloc(ring, sizeof(xrec_t));
    self->evring = PyMem_Calloc(ring, sizeof(ev_t));
    self->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!self->paths || !self->reflect || !self->ring || !self->evring) { PyErr_NoMemory(); return -1; }
    self->ring_cap = ring;
    pthread_mutex_init(&self->mu, NULL);
    self->rng = seed ? seed : 1;
    self->jitter_ppm = jitter;
    return 0;
}

static void stop_thread(Core *self) {
    if (!self->thread_running) return;
    self->thread_stop = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->thread_running = 0;
    for (int i = 0; i < self->nnics; i++) free(self->bg_tx[i].buf);
    free(self->bg_tx);
    free(self->bg_rx);
    self->bg_tx = NULL;
    self->bg_rx = NULL;
}

static void Core_dealloc(Core *self) {
    stop_thread(self);
    for (int i = 0; self->paths && i < self->npaths; i++) PyMem_Free(self->paths[i].out);
    PyMem_Free(self->paths);
    PyMem_Free(self->reflect);
    PyMem_Free(self->ring);
    PyMem_Free(self->evring);
    if (self->efd >= 0) close(self->efd);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get_addr(PyObject *obj, uint8_t out[4]) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_SIMPLE) < 0) return -1;
    int ok = b.len == 4;
    if (ok) memcpy(out, b.buf, 4);
    PyBuffer_Release(&b);
    if (!ok) PyErr_SetString(PyExc_ValueError, "address must be 4 bytes (socket.inet_aton)");
    return ok ? 0 : -1;
}

static PyObject *Core_add_nic(Core *self, PyObject *args) {
    int rx, tx;
    PyObject *addr;
    if (!PyArg_ParseTuple(args, "iiO", &rx, &tx, &addr)) return NULL;
    if (self->nnics == MAX_NICS) return PyErr_Format(PyExc_ValueError, "at most %d NICs", MAX_NICS);
    nic_t *n = &self->nics[self->nnics];
    if (get_addr(addr, n->addr) < 0) return NULL;
    n->rx_fd = rx; n->tx_fd = tx;
    return PyLong_FromLong(self->nnics++);
}

static PyObject *Core_add_path(Core *self, PyObject *args) {
    unsigned int path_id, peer_id;
    int nic, sport, pad;
    long long interval, first_due, pair_gap = 0;
    PyObject *peer;
    if (!PyArg_ParseTuple(args, "IiIOiLiL|L", &path_id, &nic, &peer_id, &peer, &sport, &interval, &pad, &first_due,
                          &pair_gap))
        return NULL;
    if (nic < 0 || nic >= self->nnics) return PyErr_Format(PyExc_ValueError, "unknown NIC index %d", nic);
    if (sport < 1 || sport > 65535 || interval < 10000 || pad < 0 || pad > MAX_PAD || pair_gap < 0 ||
        pair_gap >= interval)
        return PyErr_Format(PyExc_ValueError, "sport 1..65535, interval >= 10 us, pad 0..%d, 0 <= pair gap < interval",
                            MAX_PAD);
    path_t np;
    memset(&np, 0, sizeof np);
    if (get_addr(peer, np.peer) < 0) return NULL;
    np.path_id = path_id; np.peer_id = peer_id; np.nic = nic; np.sport = (uint16_t)sport; np.pad = (uint16_t)pad;
    np.interval_ns = interval; np.next_due = first_due; np.pair_gap_ns = pair_gap;
    np.rto_ns = 5000000; /* until the detector pushes one: its initial timeout */
    np.out = PyMem_Calloc(OUT_SLOTS, sizeof(out_t));
    if (!np.out) return PyErr_NoMemory();
    pthread_mutex_lock(&self->mu);
    int exists = path_index(self, path_id) >= 0, full = self->npaths == MAX_PATHS;
    if (!exists && !full) self->paths[self->npaths++] = np;
    pthread_mutex_unlock(&self->mu);
    if (exists || full) PyMem_Free(np.out);
    if (exists) return PyErr_Format(PyExc_ValueError, "path %u exists", path_id);
    if (full) return PyErr_Format(PyExc_ValueError, "at most %d paths", MAX_PATHS);
    Py_RETURN_NONE;
}

static PyObject *Core_remove_path(Core *self, PyObject *args) {
    unsigned int path_id;
    if (!PyArg_ParseTuple(args, "I", &path_id)) return NULL;
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id);
    out_t *gone = NULL;
    if (i >= 0) {
        gone = self->paths[i].out;
        self->paths[i] = self->paths[--self->npaths];
    }
    pthread_mutex_unlock(&self->mu);
    PyMem_Free(gone);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    Py_RETURN_NONE;
}

static PyObject *Core_set_interval(Core *self, PyObject *args) {
    unsigned int path_id;
    long long interval;
    if (!PyArg_ParseTuple(args, "IL", &path_id, &interval)) return NULL;
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id), bad = 0;
    if (i >= 0) {
        path_t *p = &self->paths[i];
        if (interval < 10000 || p->pair_gap_ns >= interval) bad = 1;
        else {
            /* an active path must not wait out the rest of a long idle interval */
            if (interval < p->interval_ns) p->next_due -= p->interval_ns - interval;
            p->interval_ns = interval;
        }
    }
    pthread_mutex_unlock(&self->mu);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    if (bad) return PyErr_Format(PyExc_ValueError, "interval must be >= 10 us and longer than the pair gap");
    Py_RETURN_NONE;
}

static PyObject *Core_set_clock(Core *self, PyObject *args) {
    long long bt, bl, rate;
    if (!PyArg_ParseTuple(args, "LLL", &bt, &bl, &rate)) return NULL;
    pthread_mutex_lock(&self->mu);
    self->clk_base_true = bt; self->clk_base_local = bl; self->clk_rate_ppb = rate;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_run(Core *self, PyObject *args) {
    long long duration;
    if (!PyArg_ParseTuple(args, "L", &duration)) return NULL;
    if (self->thread_running) return PyErr_Format(PyExc_RuntimeError, "the loop runs in the background; stop() it first");
    txbatch_t *tx = PyMem_Calloc(self->nnics ? self->nnics : 1, sizeof(txbatch_t));
    uint8_t *rxbuf = PyMem_Malloc((size_t)BATCH * MAX_PKT);
    int ok = tx && rxbuf;
    for (int i = 0; ok && i < self->nnics; i++) {
        tx[i].buf = PyMem_Malloc((size_t)BATCH * MAX_PKT);
        ok = tx[i].buf != NULL;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        core_run(self, duration, tx, rxbuf);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; tx && i < self->nnics; i++) PyMem_Free(tx[i].buf);
    PyMem_Free(tx);
    PyMem_Free(rxbuf);
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Core_start(Core *self, PyObject *args) {
    int prio = 0;
    if (!PyArg_ParseTuple(args, "|i", &prio)) return NULL;
    if (prio < 0 || prio > 99) return PyErr_Format(PyExc_ValueError, "rt priority must be 0 (off) .. 99");
    if (self->thread_running) Py_RETURN_NONE;
    self->rt_priority = prio;
    self->rt_status = 0;
    self->bg_tx = calloc(self->nnics ? self->nnics : 1, sizeof(txbatch_t));
    self->bg_rx = malloc((size_t)BATCH * MAX_PKT);
    int ok = self->bg_tx && self->bg_rx;
    for (int i = 0; ok && i < self->nnics; i++) ok = (self->bg_tx[i].buf = malloc((size_t)BATCH * MAX_PKT)) != NULL;
    self->thread_stop = 0;
    if (!ok || pthread_create(&self->thread, NULL, core_thread, self) != 0) {
        for (int i = 0; self->bg_tx && i < self->nnics; i++) free(self->bg_tx[i].buf);
        free(self->bg_tx);
        free(self->bg_rx);
        self->bg_tx = NULL;
        self->bg_rx = NULL;
        return ok ? PyErr_Format(PyExc_OSError, "cannot start the probe thread") : PyErr_NoMemory();
    }
    self->thread_running = 1;
    Py_RETURN_NONE;
}

static PyObject *Core_rt_status(Core *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(self->rt_status);
}

static PyObject *Core_stop(Core *self, PyObject *Py_UNUSED(ignored)) {
    stop_thread(self);
    Py_RETURN_NONE;
}

static PyObject *Core_take(Core *self, PyObject *Py_UNUSED(ignored)) {
    /* completed exchanges since the last call, as packed little-endian records "<IIQqqqq" */
    pthread_mutex_lock(&self->mu);
    uint32_t n = self->ring_len;
    char *tmp = n ? malloc((size_t)n * sizeof(xrec_t)) : NULL;
    if (tmp) {
        for (uint32_t i = 0; i < n; i++)
            memcpy(tmp + (size_t)i * sizeof(xrec_t), &self->ring[(self->ring_head + i) % self->ring_cap], sizeof(xrec_t));
        self->ring_head = (self->ring_head + n) % self->ring_cap;
        self->ring_len = 0;
    }
    pthread_mutex_unlock(&self->mu);
    if (n && !tmp) return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize(tmp ? tmp : "", (Py_ssize_t)n * sizeof(xrec_t));
    free(tmp);
    return out;
}

static PyObject *Core_take_events(Core *self, PyObject *args) {
    /* (events as packed ev_t records, evidence time). all=True first flushes every path's pending
     * ANSWERED, so the caller sees every reply; all=False leaves them accumulating (cheap polls
     * that still see every MISS and LATE at once) */
    int all = 1;
    if (!PyArg_ParseTuple(args, "|p", &all)) return NULL;
    pthread_mutex_lock(&self->mu);
    if (all)
        for (int i = 0; i < self->npaths; i++) flush_answered(self, &self->paths[i]);
    uint32_t n = self->ev_len;
    self->notify = 0; /* whatever was pushed is being taken now */
    char *buf = malloc((size_t)n * sizeof(ev_t) + 1);
    int64_t evidence = self->drained_local;
    if (buf) {
        for (uint32_t i = 0; i < n; i++)
            memcpy(buf + (size_t)i * sizeof(ev_t), &self->evring[(self->ev_head + i) % self->ring_cap], sizeof(ev_t));
        self->ev_head = (self->ev_head + n) % self->ring_cap;
        self->ev_len = 0;
    }
    pthread_mutex_unlock(&self->mu);
    if (!buf) return PyErr_NoMemory();
    PyObject *out = Py_BuildValue("(y#L)", buf, (Py_ssize_t)n * sizeof(ev_t), (long long)evidence);
    free(buf);
    return out;
}

static PyObject *Core_fileno(Core *self, PyObject *Py_UNUSED(ignored)) {
    /* the eventfd: wait for it to be readable, then read 8 bytes and take_events() */
    return PyLong_FromLong(self->efd);
}

static PyObject *Core_track(Core *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    pthread_mutex_lock(&self->mu);
    self->tracking = (uint32_t)on;
    self->ev_len = 0;
    for (int i = 0; i < self->npaths; i++) {
        path_t *pt = &self->paths[i];
        memset(pt->out, 0, OUT_SLOTS * sizeof(out_t));
        pt->exp_seq = pt->next_seq;
        pt->agg.count = 0;
    }
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Core_set_rto(Core *self, PyObject *args) {
    unsigned int path_id;
    long long rto;
    if (!PyArg_ParseTuple(args, "IL", &path_id, &rto)) return NULL;
    if (rto < 1000 || rto > 60000000000LL) return PyErr_Format(PyExc_ValueError, "rto must be 1 us .. 60 s");
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id);
    if (i >= 0) self->paths[i].rto_ns = rto;
    pthread_mutex_unlock(&self->mu);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    Py_RETURN_NONE;
}

static PyObject *Core_set_size_probe(Core *self, PyObject *args) {
    unsigned int path_id, every;
    int pad;
    if (!PyArg_ParseTuple(args, "IIi", &path_id, &every, &pad)) return NULL;
    if (pad < 0 || pad > MAX_PAD) return PyErr_Format(PyExc_ValueError, "pad must be 0..%d", MAX_PAD);
    pthread_mutex_lock(&self->mu);
    int i = path_index(self, path_id);
    if (i >= 0) { self->paths[i].size_every = every; self->paths[i].size_pad = (uint16_t)pad; }
    pthread_mutex_unlock(&self->mu);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    Py_RETURN_NONE;
}

static PyObject *Core_counters(Core *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *drops = PyDict_New();
    if (!drops) return NULL;
    for (int i = 0; i < D_COUNT; i++) {
        if (!self->drops[i]) continue;
        PyObject *v = PyLong_FromUnsignedLongLong(self->drops[i]);
        if (!v || PyDict_SetItemString(drops, DROP_NAMES[i], v) < 0) { Py_XDECREF(v); Py_DECREF(drops); return NULL; }
        Py_DECREF(v);
    }
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:N}", "sent", self->sent, "reflected", self->reflected, "replies",
                         self->replies, "received", self->received, "wakeups", self->wakeups, "evidence_updates",
                         self->evidence_updates, "drops", drops);
}

static PyObject *Core_path_sent(Core *self, PyObject *args) {
    unsigned int path_id;
    if (!PyArg_ParseTuple(args, "I", &path_id)) return NULL;
    int i = path_index(self, path_id);
    if (i < 0) return PyErr_Format(PyExc_KeyError, "no path %u", path_id);
    return PyLong_FromUnsignedLongLong(self->paths[i].sent);
}

/* test entry points: the same encoder/decoder the loop uses */
static PyObject *Core_encode(Core *self, PyObject *args) {
    probe_t p = {0};
    unsigned int kind, flags, pad, sport, dport;
    PyObject *src, *dst;
    if (!PyArg_ParseTuple(args, "IIIIIIKLLLLIOOII", &kind, &flags, &pad, &p.sender, &p.reflector, &p.path, &p.seq,
                          &p.t1, &p.t2, &p.t3, &p.t4, &p.rx_count, &src, &dst, &sport, &dport))
        return NULL;
    if (pad > MAX_PAD) return PyErr_Format(PyExc_ValueError, "pad > %d", MAX_PAD);
    p.kind = (uint8_t)kind; p.flags = (uint8_t)flags; p.pad = (uint16_t)pad;
    uint8_t s[4], d[4];
    if (get_addr(src, s) < 0 || get_addr(dst, d) < 0) return NULL;
    uint8_t *buf = PyMem_Malloc(MIN_PAYLOAD + MAX_PAD);
    if (!buf) return PyErr_NoMemory();
    size_t n = encode(&self->keyed, &p, s, d, (uint16_t)sport, (uint16_t)dport, buf);
    PyObject *out = PyBytes_FromStringAndSize((char *)buf, (Py_ssize_t)n);
    PyMem_Free(buf);
    return out;
}

static PyObject *Core_decode(Core *self, PyObject *args) {
    Py_buffer data;
    PyObject *src, *dst;
    unsigned int sport, dport;
    if (!PyArg_ParseTuple(args, "y*OOII", &data, &src, &dst, &sport, &dport)) return NULL;
    uint8_t s[4], d[4];
    if (get_addr(src, s) < 0 || get_addr(dst, d) < 0) { PyBuffer_Release(&data); return NULL; }
    probe_t p;
    int why = decode(&self->keyed, data.buf, (size_t)data.len, s, d, (uint16_t)sport, (uint16_t)dport, &p);
    PyBuffer_Release(&data);
    if (why >= 0) return PyUnicode_FromString(DROP_NAMES[why]);
    /* same field order as wire.Probe */
    return Py_BuildValue("(IIIIKLLLLIII)", p.kind, p.sender, p.reflector, p.path, p.seq, p.t1, p.t2, p.t3, p.t4,
                         p.rx_count, p.flags, p.pad);
}

static PyObject *Core_replay_test(Core *self, PyObject *args) {
    /* feed a list of sequence numbers to a fresh replay window; returns the accept decisions */
    PyObject *seqs;
    if (!PyArg_ParseTuple(args, "O", &seqs)) return NULL;
    PyObject *it = PyObject_GetIter(seqs);
    if (!it) return NULL;
    replay_t w;
    memset(&w, 0, sizeof w);
    PyObject *out = PyList_New(0), *item;
    while (out && (item = PyIter_Next(it))) {
        unsigned long long s = PyLong_AsUnsignedLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred()) { Py_CLEAR(out); break; }
        PyObject *b = PyBool_FromLong(replay_accept(&w, s));
        PyList_Append(out, b);
        Py_DECREF(b);
    }
    Py_DECREF(it);
    return out;
}

static PyMethodDef Core_methods[] = {
    {"add_nic", (PyCFunction)Core_add_nic, METH_VARARGS, "add_nic(rx_fd, tx_fd, addr4) -> index"},
    {"add_path", (PyCFunction)Core_add_path, METH_VARARGS,
     "add_path(path_id, nic, peer_id, peer_addr4, sport, interval_ns, pad, first_due_monotonic_ns[, pair_gap_ns])"},
    {"remove_path", (PyCFunction)Core_remove_path, METH_VARARGS, "remove_path(path_id)"},
    {"set_interval", (PyCFunction)Core_set_interval, METH_VARARGS, "set_interval(path_id, interval_ns)"},
    {"set_clock", (PyCFunction)Core_set_clock, METH_VARARGS, "set_clock(base_true_ns, base_local_ns, rate_ppb)"},
    {"run", (PyCFunction)Core_run, METH_VARARGS, "run(duration_ns): probe, reflect, receive; GIL released"},
    {"start", (PyCFunction)Core_start, METH_VARARGS,
     "start([rt_priority]): run the loop in a native background thread (GIL-free), SCHED_FIFO if > 0"},
    {"rt_status", (PyCFunction)Core_rt_status, METH_NOARGS, "0, or the errno the thread got asking for SCHED_FIFO"},
    {"stop", (PyCFunction)Core_stop, METH_NOARGS, "stop the background thread and wait for it"},
    {"take", (PyCFunction)Core_take, METH_NOARGS, "completed exchanges as packed '<IIQqqqq' records"},
    {"take_events", (PyCFunction)Core_take_events, METH_VARARGS,
     "take_events(all=True) -> (events '<IIQIIIIqqqq' (kind, path, seq, count, rx_count, size, worst_rtt, t1..t4), evidence_ns)"},
    {"track", (PyCFunction)Core_track, METH_VARARGS, "track(on): judging mode (see the ev_t comment)"},
    {"fileno", (PyCFunction)Core_fileno, METH_NOARGS, "eventfd, readable when a MISS or LATE waits"},
    {"set_rto", (PyCFunction)Core_set_rto, METH_VARARGS, "set_rto(path_id, rto_ns): deadline of the next requests"},
    {"set_size_probe", (PyCFunction)Core_set_size_probe, METH_VARARGS,
     "set_size_probe(path_id, every, pad): every Nth probe carries `pad` bytes (0: off)"},
    {"counters", (PyCFunction)Core_counters, METH_NOARGS, "sent/reflected/replies/received and drops by reason"},
    {"path_sent", (PyCFunction)Core_path_sent, METH_VARARGS, "requests sent on a path"},
    {"encode", (PyCFunction)Core_encode, METH_VARARGS, "test hook: the loop's encoder"},
    {"decode", (PyCFunction)Core_decode, METH_VARARGS, "test hook: the loop's decoder; a str is a drop reason"},
    {"replay_test", (PyCFunction)Core_replay_test, METH_VARARGS, "test hook: replay window decisions"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "linkpass.probe._probecore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_doc = "The probe engine's data path for one agent (see module docstring).",
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "linkpass.probe._probecore",
                                    "Compiled per-packet data path of the LinkPass probe engine.", -1, NULL};

PyMODINIT_FUNC PyInit__probecore(void) {
    crc_init();
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    PyModule_AddObject(m, "Core", (PyObject *)&CoreType);
    PyModule_AddIntConstant(m, "RECORD_SIZE", sizeof(xrec_t));
    PyModule_AddIntConstant(m, "EVENT_SIZE", sizeof(ev_t));
    PyModule_AddIntConstant(m, "MAX_PAD", MAX_PAD);
    PyModule_AddIntConstant(m, "MAX_PATHS", MAX_PATHS);
    return m;
}
