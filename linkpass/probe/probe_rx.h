/*
 * The probe core's receive path, in C, without Python or sockets: what every packet that reaches
 * a NIC's socket goes through before the loop sees an authenticated reply, and the reflector.
 * The extension (_probecore.c) and the sanitizer harness (fuzz_harness.c) both include it.
 *
 * Order of the checks, cheapest first, so junk costs as little as it can:
 *   1. the header (decode_header): length, BTH, magic, version, kind, padding bounded and equal
 *      to the length: a few compares;
 *   2. the size: only the probe sizes this core is configured for (the small probe, its paths'
 *      paddings and full-size paddings, and the sizes the agent declared) go further. A 9 KB
 *      packet costs ~30 us to check (CRC-32 and BLAKE2b over all of it): a size nobody here
 *      sends or expects is dropped before that;
 *   3. the source's budget (below): a source whose packets kept failing the ICRC or the tag is
 *      dropped before hashing until its budget refills;
 *   4. ICRC and tag (decode_verify), then the reflector or the caller (a reply to our probe).
 *
 * Budgets. Checking bytes that turn out to be forged is charged, in bytes, to a token bucket of
 * the packet's source address (4096 seats, 4-way set-associative by a salted hash of the
 * address). A source that has authenticated within TRUST_NS keeps its seat and draws only on its
 * own bucket: one source's junk never delays another's probes. Other sources also draw on one
 * shared bucket, so addresses made up by the thousand cost no more than one source; they evict
 * each other from the seats, never a trusted source. What a budget cannot do: junk sent with a
 * trusted peer's own (spoofed) address empties that peer's bucket, and its probes are dropped
 * here until it refills (counted as source_over_budget).
 *
 * Reflector. One entry per (sender, path): the requests seen (the reply's rx_count) and a replay
 * window. Open addressing with linear probing, at most 3/4 full; an entry not heard from for
 * `idle_ns` is removed (backward-shift deletion, no tombstones) by a sweep the loop runs a few
 * slots at a time, or all at once when the table is full.
 */
#ifndef LINKPASS_PROBE_RX_H
#define LINKPASS_PROBE_RX_H

#include "probe_wire.h"

#define REFLECT_SLOTS 16384 /* power of two */
#define REFLECT_MAX (REFLECT_SLOTS * 3 / 4) /* keeps probing short */
#define REFLECT_IDLE_NS 10000000000LL /* an entry unheard for this long is freed */
#define FULL_SWEEP_EVERY_NS 100000000LL /* at most this often a full table is swept all at once */
#define SRC_SETS 1024 /* power of two */
#define SRC_WAYS 4
#define TRUST_NS 60000000000LL /* a source that authenticated within this long is trusted */
/* defaults, in bytes checked and found forged: ~3.5 ns a byte here, so a source costs at most
 * ~1 % of a core and all untrusted sources together ~3 % */
#define SRC_RATE 2000000LL /* per source, bytes/s */
#define SRC_BURST 262144LL
#define SHARED_RATE 8000000LL /* all untrusted sources together */
#define SHARED_BURST 1048576LL

typedef struct {
    uint32_t sender, path; /* key; sender 0 = empty slot */
    uint32_t count;
    int64_t last_ns;
    replay_t replay;
} reflect_t;

typedef struct {
    uint32_t addr; /* as the 4 bytes of the packet */
    uint32_t used;
    int64_t tokens, last_ns; /* bytes; refilled lazily up to the burst */
    int64_t ok_ns; /* last authenticated packet from it; 0: never */
} bucket_t;

typedef struct {
    b2_t keyed;         /* the fleet key: every packet sent is signed with it */
    b2_t keyed_other;   /* during a key rotation, the other key accepted too (has_other) */
    int has_other;
    uint64_t other_key_ok; /* packets the other key authenticated */
    uint32_t agent_id;
    uint32_t salt;
    uint8_t pad_ok[MAX_PAD + 1]; /* 1: a packet with this padding is one we expect */
    bucket_t src[SRC_SETS * SRC_WAYS];
    bucket_t shared;
    int64_t src_rate, src_burst, shared_rate, shared_burst;
    reflect_t *reflect; /* REFLECT_SLOTS, owned by whoever owns this */
    uint32_t reflect_used, sweep_at;
    int64_t idle_ns, last_full_sweep;
    uint64_t expired;
    uint64_t drops[D_COUNT];
} rx_t;

/* what rx_handle() did with a packet that was not dropped (drop reasons are >= 0) */
enum { RX_REPLY = -1, RX_REFLECTED = -2 };

static void rx_init(rx_t *r, const uint8_t *key, size_t keylen, uint32_t agent_id, reflect_t *table, uint64_t seed) {
    memset(r, 0, sizeof *r);
    b2_keyed_init(&r->keyed, key, keylen);
    r->agent_id = agent_id;
    r->salt = (uint32_t)(seed * 0x9E3779B97F4A7C15ULL >> 32) | 1;
    r->pad_ok[0] = 1; /* the small probe */
    r->src_rate = SRC_RATE; r->src_burst = SRC_BURST; r->shared_rate = SHARED_RATE; r->shared_burst = SHARED_BURST;
    r->shared.used = 1; r->shared.tokens = SHARED_BURST;
    r->reflect = table;
    memset(table, 0, REFLECT_SLOTS * sizeof(reflect_t));
    r->idle_ns = REFLECT_IDLE_NS;
}

/* The keys: `key` signs and verifies; `other` (NULL: none) verifies too, while a fleet rotates
 * from one key to the next (docs/security.md). */
static void rx_set_keys(rx_t *r, const uint8_t *key, size_t keylen, const uint8_t *other, size_t otherlen) {
    b2_keyed_init(&r->keyed, key, keylen);
    r->has_other = other != NULL;
    if (other) b2_keyed_init(&r->keyed_other, other, otherlen);
    else memset(&r->keyed_other, 0, sizeof r->keyed_other);
}

/* ---- budgets ----------------------------------------------------------------------------- */
static void bucket_refill(bucket_t *b, int64_t rate, int64_t burst, int64_t now) {
    int64_t dt = now - b->last_ns;
    if (dt <= 0) return;
    b->last_ns = now;
    if (dt >= 1000000000LL) { b->tokens = burst; return; } /* rate <= 1e9: dt * rate fits */
    b->tokens += dt * rate / 1000000000LL;
    if (b->tokens > burst) b->tokens = burst;
}

static inline int trusted(const bucket_t *b, int64_t now) { return b && b->ok_ns && now - b->ok_ns < TRUST_NS; }

/* the seat of `addr`, taken if need be from the least recently heard untrusted source of its
 * set; NULL when all of its set are trusted (it then draws on the shared bucket alone) */
static bucket_t *src_seat(rx_t *r, uint32_t addr, int64_t now) {
    bucket_t *set = &r->src[(((addr ^ r->salt) * 2654435761u) >> 7 & (SRC_SETS - 1)) * SRC_WAYS];
    bucket_t *empty = NULL, *oldest = NULL;
    for (int i = 0; i < SRC_WAYS; i++) {
        bucket_t *b = &set[i];
        if (!b->used) { if (!empty) empty = b; continue; }
        if (b->addr == addr) return b;
        if (!trusted(b, now) && (!oldest || b->last_ns < oldest->last_ns)) oldest = b;
    }
    bucket_t *v = empty ? empty : oldest;
    if (!v) return NULL;
    v->addr = addr; v->used = 1; v->tokens = r->src_burst; v->last_ns = now; v->ok_ns = 0;
    return v;
}

/* ---- reflector table ---------------------------------------------------------------------- */
static inline uint32_t refl_home(uint32_t sender, uint32_t path) {
    return ((sender * 2654435761u) ^ (path * 40503u)) & (REFLECT_SLOTS - 1);
}

static void refl_delete(rx_t *r, uint32_t i) {
    const uint32_t mask = REFLECT_SLOTS - 1;
    for (uint32_t j = i;;) { /* move later entries of the probe run into the hole, as long as they may go there */
        j = (j + 1) & mask;
        reflect_t *e = &r->reflect[j];
        if (e->sender == 0) break;
        uint32_t k = refl_home(e->sender, e->path);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        r->reflect[i] = *e;
        i = j;
    }
    memset(&r->reflect[i], 0, sizeof r->reflect[i]);
    r->reflect_used--;
    r->expired++;
}

/* looks at `slots` slots from where the last sweep stopped, freeing the entries idle too long */
static void rx_sweep(rx_t *r, int64_t now, uint32_t slots) {
    for (uint32_t n = 0; n < slots && r->reflect_used; n++) {
        uint32_t i = r->sweep_at;
        reflect_t *e = &r->reflect[i];
        if (e->sender && now - e->last_ns > r->idle_ns) {
            refl_delete(r, i); /* slot i may hold a moved entry now: look at it again */
            continue;
        }
        r->sweep_at = (i + 1) & (REFLECT_SLOTS - 1);
    }
}

static reflect_t *reflect_lookup(rx_t *r, uint32_t sender, uint32_t path, int64_t now) {
    for (int attempt = 0; attempt < 2; attempt++) {
        uint32_t h = refl_home(sender, path);
        for (uint32_t probe = 0; probe < REFLECT_SLOTS; probe++) {
            reflect_t *e = &r->reflect[(h + probe) & (REFLECT_SLOTS - 1)];
            if (e->sender == sender && e->path == path) return e;
            if (e->sender != 0) continue;
            if (r->reflect_used < REFLECT_MAX) {
                memset(e, 0, sizeof *e);
                e->sender = sender; e->path = path; e->last_ns = now;
                r->reflect_used++;
                return e;
            }
            break;
        }
        if (attempt || now - r->last_full_sweep < FULL_SWEEP_EVERY_NS) break;
        r->last_full_sweep = now; /* full: free every idle entry at once, then look again */
        r->sweep_at = 0;
        rx_sweep(r, now, 2 * REFLECT_SLOTS);
    }
    return NULL;
}

/* ---- the receive path ------------------------------------------------------------------- */
typedef int64_t (*stamp_fn)(void *ctx);

static inline int rx_drop(rx_t *r, int why) { r->drops[why]++; return why; }

/*
 * One received UDP payload `d` of `n` bytes from src:sport to dst (this NIC), at `now` (a
 * monotonic clock, for budgets and the reflector's idle timeout), received at `t2` (the local
 * clock). Returns a drop reason (counted), RX_REPLY (an authenticated reply, in *p, for the
 * caller to match), or RX_REFLECTED: the reply to a request, a whole IP packet of *out_len bytes
 * in `out` (room: MAX_PKT), stamped t3 = t3_now(ctx) just before it is encoded.
 */
static int rx_handle(rx_t *r, const uint8_t *d, size_t n, const uint8_t src[4], const uint8_t dst[4], uint16_t sport,
                     int64_t now, int64_t t2, stamp_fn t3_now, void *ctx, probe_t *p, uint8_t *out, size_t *out_len) {
    uint16_t pad;
    int why = decode_header(d, n, &pad);
    if (why >= 0) return rx_drop(r, why);
    if (!r->pad_ok[pad]) return rx_drop(r, D_UNEXPECTED_SIZE);
    uint32_t addr;
    memcpy(&addr, src, 4);
    bucket_t *b = src_seat(r, addr, now);
    int trust = trusted(b, now);
    if (b) bucket_refill(b, r->src_rate, r->src_burst, now);
    if (!trust) bucket_refill(&r->shared, r->shared_rate, r->shared_burst, now);
    if ((b && b->tokens <= 0) || (!trust && r->shared.tokens <= 0)) return rx_drop(r, D_OVER_BUDGET);
    why = decode_verify(&r->keyed, d, n, pad, src, dst, sport, ROCE_PORT, p);
    int64_t cost = (int64_t)n;
    if (why == D_BAD_TAG && r->has_other) { /* mid-rotation: a peer may still (or already) sign with the other key */
        why = decode_verify(&r->keyed_other, d, n, pad, src, dst, sport, ROCE_PORT, p);
        if (why < 0) r->other_key_ok++;
        cost *= 2; /* a forged packet cost two checks */
    }
    if (why >= 0) {
        if (b) b->tokens -= cost;
        if (!trust) r->shared.tokens -= cost;
        return rx_drop(r, why);
    }
    if (b) b->ok_ns = now ? now : 1;
    if (p->kind == KIND_REPLY) return RX_REPLY;
    if (p->reflector != r->agent_id || p->sender == 0) return rx_drop(r, D_UNEXPECTED);
    reflect_t *e = reflect_lookup(r, p->sender, p->path, now);
    if (!e) return rx_drop(r, D_REFLECT_FULL);
    if (!replay_accept(&e->replay, p->seq)) return rx_drop(r, D_REPLAY);
    e->count++;
    e->last_ns = now;
    p->kind = KIND_REPLY; p->t2 = t2; p->rx_count = e->count;
    p->t3 = t3_now(ctx);
    size_t len = encode(&r->keyed, p, dst, src, sport, ROCE_PORT, out + IP_UDP_LEN);
    build_ip_udp(out, dst, src, sport, len);
    *out_len = IP_UDP_LEN + len;
    return RX_REFLECTED;
}

#endif
