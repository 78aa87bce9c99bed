/*
 * The probe core's receive path (probe_rx.h: decoder, size and budget checks, reflector) fed
 * hostile input outside Python, to be built with AddressSanitizer and UBSan (linkpass/testbed/fuzz.py
 * builds and runs it; tests/unit/test_fuzz_harness.py and bench/reliability.py use that).
 *
 *   fuzz_harness fuzz COUNT SEED     COUNT packets: random, truncated, mutated, over-long (also
 *                                    signed ones), replays; time jumps past the reflector's idle
 *                                    timeout. Prints one JSON line of outcome counts. Any memory
 *                                    error is the sanitizer's report and exit; a broken invariant
 *                                    (a reply that does not decode, a reflector table whose probe
 *                                    runs are broken, a budget above its burst) aborts.
 *   fuzz_harness cost KIND COUNT     ns per packet of one kind of junk through the receive path
 *                                    (built without sanitizers): unexpected_size (9 KB, a size
 *                                    nobody expects), over_budget (9 KB forged, from a source
 *                                    whose budget is spent), bad_tag (9 KB forged, checked in full:
 *                                    the cost of every such packet without the two checks).
 *
 * Every input lives in a heap block of exactly its length and every reply is written into a block
 * of exactly MAX_PKT, so a read or write one byte outside is a sanitizer report.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "probe_rx.h"

#define AGENT 7
#define SENDERS 8 /* sender ids 1..SENDERS; paths up to PATHS: more keys than the table holds */
#define PATHS 20000
#define KEEP 64 /* valid requests kept for replays */

static uint64_t rng = 0x9E3779B97F4A7C15ULL;
static uint64_t rnd(void) {
    rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1DULL;
}
static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }

static const uint8_t KEY[32] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
static const uint8_t ME[4] = {198, 18, 64, 7};
static const uint16_t PADS[] = {0, 100, 1372, MAX_PAD}; /* the sizes the harness's core expects */

static void fail(const char *what) {
    fprintf(stderr, "fuzz_harness: invariant broken: %s\n", what);
    abort();
}

/* a probe signed with `keyed` whose header says `pad_field` and which carries `body_pad` bytes of
 * padding: equal and <= MAX_PAD is a probe a peer sends; otherwise what only a forger sends.
 * Returns a heap block of exactly the packet's length. */
static uint8_t *forge(const b2_t *keyed, const probe_t *p, uint32_t pad_field, size_t body_pad, const uint8_t src[4],
                      uint16_t sport, size_t *n_out) {
    size_t n = MIN_PAYLOAD + body_pad;
    uint8_t *d = malloc(n);
    if (!d) fail("out of memory");
    probe_t q = *p;
    q.pad = 0;
    uint8_t head[MIN_PAYLOAD];
    encode(keyed, &q, src, ME, sport, ROCE_PORT, head); /* BTH and header; tag and ICRC redone below */
    memcpy(d, head, BTH_LEN + HDR_LEN);
    put16(d + BTH_LEN + 6, (uint16_t)pad_field);
    memset(d + BTH_LEN + HDR_LEN, 0, body_pad);
    b2_t s = *keyed;
    b2_update(&s, d + BTH_LEN, HDR_LEN + body_pad);
    b2_final16(&s, d + BTH_LEN + HDR_LEN + body_pad);
    size_t roce_len = n - ICRC_LEN;
    uint32_t c = icrc(src, ME, sport, ROCE_PORT, d, roce_len);
    for (int i = 0; i < 4; i++) d[roce_len + i] = (uint8_t)(c >> (8 * i));
    *n_out = n;
    return d;
}

static void random_source(uint8_t src[4]) {
    static const uint8_t peers[4][4] = {{198, 18, 64, 1}, {198, 18, 64, 3}, {198, 18, 64, 5}, {198, 18, 65, 9}};
    if (below(4)) { memcpy(src, peers[below(4)], 4); return; } /* mostly the peers: they become trusted */
    uint32_t a = (uint32_t)rnd();
    memcpy(src, &a, 4);
}

static void random_probe(probe_t *p) {
    memset(p, 0, sizeof *p);
    p->kind = below(8) ? KIND_REQUEST : KIND_REPLY;
    p->sender = 1 + (uint32_t)below(SENDERS);
    p->reflector = below(16) ? AGENT : (uint32_t)rnd();
    p->path = (uint32_t)below(PATHS);
    p->seq = below(4) ? below(100000) : rnd(); /* now and then near the top of the space */
    p->t1 = (int64_t)rnd(); p->rx_count = (uint32_t)rnd();
    /* mostly small: edge cases are in the lengths, not in hashing many 9 KB blocks */
    uint64_t w = below(100);
    p->pad = w < 50 ? PADS[0] : w < 70 ? PADS[1] : w < 85 ? PADS[2] : w < 90 ? PADS[3] : (uint16_t)below(MAX_PAD + 1);
    p->flags = p->pad ? 1 : 0;
}

/* the linear-probing invariant: every entry is reachable from its home slot without crossing an
 * empty one, and the occupancy count is right */
static void check_table(const rx_t *r) {
    uint32_t used = 0;
    for (uint32_t i = 0; i < REFLECT_SLOTS; i++) {
        const reflect_t *e = &r->reflect[i];
        if (!e->sender) continue;
        used++;
        for (uint32_t j = refl_home(e->sender, e->path); j != i; j = (j + 1) & (REFLECT_SLOTS - 1))
            if (!r->reflect[j].sender) fail("a reflector entry is cut off from its home slot");
    }
    if (used != r->reflect_used) fail("reflector occupancy count");
    if (r->reflect_used > REFLECT_MAX) fail("reflector table over its limit");
    if (r->shared.tokens > r->shared_burst) fail("shared budget above its burst");
    for (int i = 0; i < SRC_SETS * SRC_WAYS; i++)
        if (r->src[i].used && r->src[i].tokens > r->src_burst) fail("source budget above its burst");
}

static int64_t stamp(void *ctx) { return *(const int64_t *)ctx; }

static rx_t *new_rx(void) {
    rx_t *r = malloc(sizeof *r);
    reflect_t *table = malloc(REFLECT_SLOTS * sizeof(reflect_t));
    if (!r || !table) fail("out of memory");
    rx_init(r, KEY, sizeof KEY, AGENT, table, 1);
    for (size_t i = 0; i < sizeof PADS / sizeof PADS[0]; i++) r->pad_ok[PADS[i]] = 1;
    return r;
}

static int fuzz(uint64_t count, uint64_t seed) {
    rng ^= seed * 0xD1B54A32D192ED03ULL;
    rnd();
    rx_t *r = new_rx();
    b2_t wrong;
    uint8_t other[32];
    for (int i = 0; i < 32; i++) other[i] = (uint8_t)(0xA5 ^ i);
    b2_keyed_init(&wrong, other, sizeof other);
    uint8_t *reply = malloc(MAX_PKT);
    uint8_t *kept[KEEP] = {0};
    size_t kept_n[KEEP] = {0};
    uint8_t kept_src[KEEP][4];
    uint64_t reflected = 0, replies = 0;
    int64_t now = 1000000000LL;
    if (!reply) fail("out of memory");
    for (uint64_t i = 0; i < count; i++) {
        now += (int64_t)below(2000000); /* up to 2 ms between packets, and now and then a long silence */
        if (below(50000) == 0) now += 11000000000LL;
        if (i % 20000 == 0) { /* budgets alternate between generous (everything hashed) and tight */
            int tight = (i / 20000) % 2;
            r->src_rate = tight ? 20000 : 1000000000; r->src_burst = tight ? 40000 : (1LL << 40);
            r->shared_rate = tight ? 50000 : 1000000000; r->shared_burst = tight ? 100000 : (1LL << 40);
            if (r->shared.tokens > r->shared_burst) r->shared.tokens = r->shared_burst;
            for (int k = 0; k < SRC_SETS * SRC_WAYS; k++)
                if (r->src[k].tokens > r->src_burst) r->src[k].tokens = r->src_burst;
        }
        uint8_t src[4];
        random_source(src);
        uint16_t sport = (uint16_t)(49152 + below(64));
        size_t n = 0;
        uint8_t *d = NULL;
        int keep = 0;
        probe_t p;
        switch (below(8)) {
        case 0: { /* random bytes, mostly short, sometimes longer than any receive buffer */
            n = below(3) ? below(200) : below(MAX_PKT + 2000);
            d = malloc(n ? n : 1);
            if (!d) fail("out of memory");
            for (size_t k = 0; k < n; k++) d[k] = (uint8_t)rnd();
            if (n > BTH_LEN + 4 && below(2)) { d[0] = OPCODE_RC_SEND_ONLY; put32(d + 4, LINKPASS_QPN); }
            if (n > BTH_LEN + 8 && below(2)) { d[BTH_LEN] = 'L'; d[BTH_LEN + 1] = 'P'; d[BTH_LEN + 2] = VERSION; d[BTH_LEN + 3] = KIND_REQUEST; }
            break;
        }
        case 1: case 2: { /* a valid probe, then maybe truncated, flipped or extended */
            random_probe(&p);
            d = forge(below(6) ? &r->keyed : &wrong, &p, p.pad, p.pad, src, sport, &n);
            int how = (int)below(5);
            if (how == 1 && n) { size_t cut = below(n); uint8_t *t = malloc(cut ? cut : 1); if (!t) fail("oom"); memcpy(t, d, cut); free(d); d = t; n = cut; }
            if (how == 2) for (int k = 0, m = 1 + (int)below(4); k < m; k++) d[below(n)] ^= (uint8_t)(1 + below(255));
            if (how == 3) {
                size_t extra = 1 + below(600);
                uint8_t *t = malloc(n + extra);
                if (!t) fail("out of memory");
                memcpy(t, d, n);
                for (size_t k = 0; k < extra; k++) t[n + k] = (uint8_t)rnd();
                free(d); d = t; n += extra;
            }
            keep = how == 0 && p.kind == KIND_REQUEST;
            break;
        }
        case 3: { /* signed, and longer than a send slot, or lying about its padding */
            random_probe(&p);
            p.kind = KIND_REQUEST; p.reflector = AGENT;
            uint32_t pad_field = below(2) ? MAX_PAD + 1 + (uint32_t)below(64) : (uint32_t)below(65536 - 200);
            size_t body = below(2) ? pad_field : below(MAX_PAD + 100);
            if (body > MAX_PAD + 100) body = MAX_PAD + 100;
            d = forge(&r->keyed, &p, pad_field, body, src, sport, &n);
            break;
        }
        case 4: { /* a replay of a request that was valid */
            int k = (int)below(KEEP);
            if (!kept[k]) { d = malloc(1); n = 0; break; }
            n = kept_n[k];
            d = malloc(n);
            if (!d) fail("out of memory");
            memcpy(d, kept[k], n);
            memcpy(src, kept_src[k], 4);
            break;
        }
        default: { /* a valid request to us from a peer: the reflector's entries fill and expire */
            random_probe(&p);
            p.kind = KIND_REQUEST; p.reflector = AGENT; p.seq = i;
            d = forge(&r->keyed, &p, p.pad, p.pad, src, sport, &n);
            keep = 1;
        }
        }
        probe_t out;
        size_t len = 0;
        int64_t t2 = now;
        int what = rx_handle(r, d, n, src, ME, sport, now, t2, stamp, &t2, &out, reply, &len);
        if (what == RX_REFLECTED) {
            probe_t back;
            if (len > MAX_PKT || len < IP_UDP_LEN) fail("reply length");
            if (get16(reply + 2) != len || get16(reply + 24) != len - 20) fail("reply's IP or UDP length");
            if ((reflected & 7) == 0) { /* the whole reply checked now and then: hashing is what costs */
                if (decode(&r->keyed, reply + IP_UDP_LEN, len - IP_UDP_LEN, ME, src, sport, ROCE_PORT, &back) >= 0)
                    fail("a reflected reply does not decode");
                if (back.kind != KIND_REPLY || back.rx_count == 0) fail("reply fields");
            }
            reflected++;
        } else if (what == RX_REPLY) {
            replies++;
        } else if (what < 0 || what >= D_COUNT) {
            fail("unknown outcome");
        }
        if (keep && what == RX_REFLECTED) {
            int k = (int)below(KEEP);
            free(kept[k]);
            kept[k] = d; kept_n[k] = n; memcpy(kept_src[k], src, 4);
            d = NULL;
        }
        free(d);
        rx_sweep(r, now, 64);
        if ((i & 4095) == 0) check_table(r);
    }
    check_table(r);
    printf("{\"inputs\": %llu, \"reflected\": %llu, \"replies\": %llu, \"reflector_expired\": %llu, \"drops\": {",
           (unsigned long long)count, (unsigned long long)reflected, (unsigned long long)replies,
           (unsigned long long)r->expired);
    for (int k = 0, first = 1; k < D_COUNT; k++) {
        if (!r->drops[k]) continue;
        printf("%s\"%s\": %llu", first ? "" : ", ", DROP_NAMES[k], (unsigned long long)r->drops[k]);
        first = 0;
    }
    printf("}}\n");
    for (int k = 0; k < KEEP; k++) free(kept[k]);
    free(reply);
    free(r->reflect);
    free(r);
    return 0;
}

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int cost(const char *kind, uint64_t count) {
    rx_t *r = new_rx();
    uint8_t other[32], src[4] = {198, 18, 64, 66};
    for (int i = 0; i < 32; i++) other[i] = (uint8_t)(0xA5 ^ i);
    b2_t wrong;
    b2_keyed_init(&wrong, other, sizeof other);
    probe_t p = {.kind = KIND_REQUEST, .sender = 3, .reflector = AGENT, .path = 1, .seq = 1, .pad = MAX_PAD, .flags = 1};
    size_t n;
    uint8_t *d = forge(&wrong, &p, MAX_PAD, MAX_PAD, src, 50000, &n);
    uint8_t *reply = malloc(MAX_PKT);
    int expect;
    if (!strcmp(kind, "unexpected_size")) { r->pad_ok[MAX_PAD] = 0; expect = D_UNEXPECTED_SIZE; }
    else if (!strcmp(kind, "over_budget")) expect = D_OVER_BUDGET;
    else if (!strcmp(kind, "bad_tag")) {
        r->src_rate = r->shared_rate = 1000000000; r->src_burst = r->shared_burst = r->shared.tokens = 1LL << 50;
        expect = D_BAD_TAG;
    } else {
        fprintf(stderr, "cost: KIND is unexpected_size, over_budget or bad_tag\n");
        return 2;
    }
    int64_t now = 1000000000LL;
    probe_t out;
    size_t len;
    for (int i = 0; i < 64; i++) rx_handle(r, d, n, src, ME, 50000, now, now, stamp, &now, &out, reply, &len); /* spend the budget */
    uint64_t before = r->drops[expect];
    int64_t t0 = mono_ns();
    for (uint64_t i = 0; i < count; i++) rx_handle(r, d, n, src, ME, 50000, now, now, stamp, &now, &out, reply, &len);
    int64_t t1 = mono_ns();
    if (r->drops[expect] - before != count) fail("cost: packets were not all dropped for the reason measured");
    printf("{\"kind\": \"%s\", \"count\": %llu, \"ns_per_packet\": %.1f}\n", kind, (unsigned long long)count,
           (double)(t1 - t0) / (double)count);
    free(d); free(reply); free(r->reflect); free(r);
    return 0;
}

int main(int argc, char **argv) {
    crc_init();
    if (argc == 4 && !strcmp(argv[1], "fuzz")) return fuzz(strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10));
    if (argc == 4 && !strcmp(argv[1], "cost")) return cost(argv[2], strtoull(argv[3], NULL, 10));
    fprintf(stderr, "usage: %s fuzz COUNT SEED | cost unexpected_size|over_budget|bad_tag COUNT\n", argv[0]);
    return 2;
}
