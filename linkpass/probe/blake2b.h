/*
 * BLAKE2b (RFC 7693), keyed, with a 16-byte output: the tag of every probe (probe_wire.h) and of
 * the NCCL plugin's lane hellos (rdma/nccl/lp_plugin.c). Python's hashlib.blake2b(key=...,
 * digest_size=16) computes the same. Plain C, no I/O, no library.
 */
#ifndef LINKPASS_BLAKE2B_H
#define LINKPASS_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define B2_TAG_LEN 16

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

static inline void b2_compress(b2_t *s, const uint8_t *block, int last) {
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

static inline void b2_update(b2_t *s, const uint8_t *p, size_t n) {
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
static inline void b2_keyed_init(b2_t *s, const uint8_t *key, size_t keylen) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 8; i++) s->h[i] = B2_IV[i];
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ B2_TAG_LEN;
    uint8_t block[128] = {0};
    memcpy(block, key, keylen);
    b2_update(s, block, 128);
}

static inline void b2_final16(b2_t *s, uint8_t out[B2_TAG_LEN]) {
    s->t += s->n;
    memset(s->buf + s->n, 0, 128 - s->n);
    b2_compress(s, s->buf, 1);
    memcpy(out, s->h, B2_TAG_LEN);
}

/* the 16-byte tag of `n` bytes at `p` under `key` (1..64 bytes) */
static inline void b2_tag16(const uint8_t *key, size_t keylen, const uint8_t *p, size_t n, uint8_t out[B2_TAG_LEN]) {
    b2_t s;
    b2_keyed_init(&s, key, keylen);
    b2_update(&s, p, n);
    b2_final16(&s, out);
}

#endif
