/*
 * The LinkPass probe on the wire, in C: exactly linkpass/core/wire.py's format (tests compare
 * the two byte for byte and reason for reason).
 *
 *   BTH(12) | header(64) | padding | BLAKE2b-128 tag over header+padding | ICRC(4, little-endian)
 *
 * CRC-32 is implemented here and BLAKE2b in blake2b.h, so the core needs no libraries. No Python
 * and no I/O: the extension (_probecore.c) and the sanitizer harness (fuzz_harness.c) both
 * include it, so the harness exercises the very code the loop runs.
 */
#ifndef LINKPASS_PROBE_WIRE_H
#define LINKPASS_PROBE_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blake2b.h"

#define ROCE_PORT 4791
#define LINKPASS_QPN 0x4C5001u
#define OPCODE_RC_SEND_ONLY 0x04
#define VERSION 1
#define KIND_REQUEST 1
#define KIND_REPLY 2
#define BTH_LEN 12
#define HDR_LEN 64
#define TAG_LEN B2_TAG_LEN
#define FLEET_KEY_MIN 32 /* core/wire.py FLEET_KEY_MIN, FLEET_KEY_MAX */
#define FLEET_KEY_MAX 64
#define ICRC_LEN 4
#define IP_UDP_LEN 28
#define MIN_PAYLOAD (BTH_LEN + HDR_LEN + TAG_LEN + ICRC_LEN)
#define MAX_PAD 9000
#define MAX_PKT (IP_UDP_LEN + MIN_PAYLOAD + MAX_PAD) /* a send slot, and a receive buffer */
#define REPLAY_WORDS 64 /* 4096-sequence window */

/* drop reasons: the first ones are wire.DROP_REASONS, in the same order */
enum { D_SHORT, D_NOT_ROCE, D_BAD_MAGIC, D_BAD_VERSION, D_BAD_KIND, D_BAD_LENGTH, D_BAD_ICRC, D_BAD_TAG,
       D_REPLAY, D_UNKNOWN_PEER, D_UNEXPECTED, D_SEND_FULL, D_SEND_ERROR, D_REFLECT_FULL, D_RING_FULL,
       D_UNEXPECTED_SIZE, D_OVER_BUDGET, D_COUNT };
static const char *DROP_NAMES[D_COUNT] = {"short", "not_roce", "bad_magic", "bad_version", "bad_kind", "bad_length",
                                          "bad_icrc", "bad_tag", "replay", "unknown_peer", "unexpected",
                                          "send_buffer_full", "send_error", "reflector_table_full", "ring_full",
                                          "unexpected_size", "source_over_budget"};

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

/* ---- wire helpers ----------------------------------------------------------------------- */
static inline void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static inline void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static inline void put64(uint8_t *p, uint64_t v) { put32(p, (uint32_t)(v >> 32)); put32(p + 4, (uint32_t)v); }
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

/* writes the UDP payload of `p` into out, which has room for MIN_PAYLOAD + p->pad (the caller
 * keeps p->pad <= MAX_PAD: a send slot is MAX_PKT); returns its length */
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
    out[roce_len] = (uint8_t)c; out[roce_len + 1] = (uint8_t)(c >> 8);
    out[roce_len + 2] = (uint8_t)(c >> 16); out[roce_len + 3] = (uint8_t)(c >> 24);
    return roce_len + ICRC_LEN;
}

/* The checks that cost no hashing, in wire.py's order: returns -1 and the padding, or a drop
 * reason. The padding is bounded before the length is trusted: a reply is as long as its request
 * and must fit a send slot. */
static int decode_header(const uint8_t *d, size_t n, uint16_t *pad_out) {
    if (n < MIN_PAYLOAD) return D_SHORT;
    if (d[0] != OPCODE_RC_SEND_ONLY || (get32(d + 4) & 0xFFFFFF) != LINKPASS_QPN) return D_NOT_ROCE;
    const uint8_t *h = d + BTH_LEN;
    if (h[0] != 'L' || h[1] != 'P') return D_BAD_MAGIC;
    if (h[2] != VERSION) return D_BAD_VERSION;
    if (h[3] != KIND_REQUEST && h[3] != KIND_REPLY) return D_BAD_KIND;
    uint16_t pad = get16(h + 6);
    if (pad > MAX_PAD || n != (size_t)MIN_PAYLOAD + pad) return D_BAD_LENGTH;
    *pad_out = pad;
    return -1;
}

/* ICRC and tag of a packet decode_header() accepted with `pad`: the expensive half (CRC-32 and
 * BLAKE2b over the whole packet). Returns -1 and fills `p`, or a drop reason. */
static int decode_verify(const b2_t *keyed, const uint8_t *d, size_t n, uint16_t pad, const uint8_t src[4],
                         const uint8_t dst[4], uint16_t sport, uint16_t dport, probe_t *p) {
    const uint8_t *h = d + BTH_LEN;
    size_t roce_len = n - ICRC_LEN;
    uint32_t c = icrc(src, dst, sport, dport, d, roce_len);
    const uint8_t *ic = d + roce_len;
    if (((uint32_t)ic[0] | (uint32_t)ic[1] << 8 | (uint32_t)ic[2] << 16 | (uint32_t)ic[3] << 24) != c) return D_BAD_ICRC;
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

/* returns -1 on success, else a drop reason */
static int decode(const b2_t *keyed, const uint8_t *d, size_t n, const uint8_t src[4], const uint8_t dst[4],
                  uint16_t sport, uint16_t dport, probe_t *p) {
    uint16_t pad;
    int why = decode_header(d, n, &pad);
    return why >= 0 ? why : decode_verify(keyed, d, n, pad, src, dst, sport, dport, p);
}

/* the IPv4 (DF, id 0) and UDP headers of a packet sent from the raw socket */
static void build_ip_udp(uint8_t *pkt, const uint8_t src[4], const uint8_t dst[4], uint16_t sport, size_t payload) {
    pkt[0] = 0x45; pkt[1] = 0; put16(pkt + 2, (uint16_t)(IP_UDP_LEN + payload)); put16(pkt + 4, 0); put16(pkt + 6, 0x4000);
    pkt[8] = 64; pkt[9] = 17; put16(pkt + 10, 0); memcpy(pkt + 12, src, 4); memcpy(pkt + 16, dst, 4);
    put16(pkt + 20, sport); put16(pkt + 22, ROCE_PORT); put16(pkt + 24, (uint16_t)(8 + payload)); put16(pkt + 26, 0);
}

/* ---- replay window ---------------------------------------------------------------------- */
/* wire.ReplayWindow's semantics over the whole 64-bit sequence space: `top` is the highest
 * accepted sequence itself (not top + 1, which wraps at 2^64 - 1) */
typedef struct {
    uint64_t top;
    uint64_t any; /* 0: nothing accepted yet */
    uint64_t bits[REPLAY_WORDS]; /* bit i: seq (top - i) seen */
} replay_t;

static int replay_accept(replay_t *w, uint64_t seq) {
    const uint64_t size = REPLAY_WORDS * 64;
    if (!w->any || seq > w->top) {
        uint64_t shift = w->any ? seq - w->top : size;
        if (shift >= size) {
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
        w->top = seq;
        w->any = 1;
        w->bits[0] |= 1;
        return 1;
    }
    uint64_t back = w->top - seq;
    if (back >= size) return 0;
    uint64_t m = 1ULL << (back % 64);
    if (w->bits[back / 64] & m) return 0;
    w->bits[back / 64] |= m;
    return 1;
}

#endif
