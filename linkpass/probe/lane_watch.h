/*
 * lane_watch.h: the probe thread's look at a lane report (docs/lanes.md), so that the agent's
 * Python loop need not wake every couple of milliseconds to see a job's lanes keep progressing.
 *
 * The rate rule stays in Python (linkpass/core/activity.py). This look only tells whether what
 * that rule reads may have changed: for one report's bytes at `now`, a digest of every open
 * lane's identity (slot, seq) and its two bits as the rule computes them (progressing: acked
 * bytes advanced within the window of the writer's last look; waiting without progress: bytes
 * unacknowledged and not progressing). A writer silent for longer than `silent` counts as neither,
 * as in the rule. The digest covers every open lane the rule could use (and a few it ignores:
 * those of unknown peers, families or kinds), so a change of the rule's view changes it; the
 * reverse is allowed (a wake-up that finds nothing new).
 *
 * Everything in the report is untrusted: lengths are checked against what was read, `used` is
 * clamped to the capacity the bytes hold, and a report that is not one digests to a constant.
 * Plain C over bytes (no I/O): the probe core reads the file with pread, which cannot fault on a
 * file a writer truncates, and the tests call the same function.
 */
#ifndef LINKPASS_LANE_WATCH_H
#define LINKPASS_LANE_WATCH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LW_HEADER 64
#define LW_LANE 64
#define LW_MAX_CAPACITY 1024
#define LW_MAX_BYTES (LW_HEADER + LW_LANE * LW_MAX_CAPACITY)
#define LW_FUTURE_SLACK_NS 1000000 /* activity.FUTURE_SLACK_NS: a write racing the look */
#define LW_NOT_A_REPORT 0x6c616e6573626164ULL
#define LW_GONE 0x6c616e6573676f6eULL /* the digest of a gone writer's report */
#define LW_STALE_NS 1000000000LL /* lanes_reader.STALE_NS: a writer silent this long is gone */
#define LW_LOOK_BYTES (256L << 10) /* lane bytes one look reads (lanes_reader.LOOK_BYTES) */

static inline uint64_t lw_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static inline uint32_t lw_u32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static inline uint16_t lw_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint64_t lw_mix(uint64_t h, uint64_t v) { /* splitmix64 step over the running hash */
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h ^= h >> 30; h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27; h *= 0x94d049bb133111ebULL;
    return h ^ (h >> 31);
}

/* The number of lane bytes worth reading after a header: what `used` asks for, within the
 * capacity; -1 when the header is not a report's. `len` is what was read of the header. */
static inline long lw_lanes_wanted(const uint8_t *buf, size_t len) {
    if (len < LW_HEADER || memcmp(buf, "LPLANES1", 8) != 0 || lw_u16(buf + 8) != 1 || lw_u16(buf + 10) != LW_HEADER ||
        lw_u16(buf + 12) != LW_LANE)
        return -1;
    uint32_t cap = lw_u16(buf + 14), used = lw_u32(buf + 20);
    if (cap < 1 || cap > LW_MAX_CAPACITY) return -1;
    if (used > cap) used = cap;
    return (long)used * LW_LANE;
}

/* Whether a report's writer is gone: its heartbeat (header of a report, already checked) is
 * over LW_STALE_NS old; a heartbeat of 0 (not yet beating) or in the future is not gone. */
static inline int lw_gone(const uint8_t *buf, int64_t now) {
    int64_t beat = (int64_t)lw_u64(buf + 24);
    return beat > 0 && now - beat > LW_STALE_NS;
}

/* The digest of one report (`len` bytes read from its start) at `now` (CLOCK_MONOTONIC ns). */
static inline uint64_t lw_digest(const uint8_t *buf, size_t len, int64_t now, int64_t window, int64_t silent_ns) {
    long want = lw_lanes_wanted(buf, len);
    if (want < 0) return LW_NOT_A_REPORT;
    uint64_t h = lw_mix(0, 0x6c70);
    int64_t beat = (int64_t)lw_u64(buf + 24);
    int64_t looked = (beat > 0 && beat <= now + LW_FUTURE_SLACK_NS) ? beat : now;
    int silent = now - looked > silent_ns;
    size_t have = len - LW_HEADER < (size_t)want ? len - LW_HEADER : (size_t)want;
    for (size_t off = 0; off + LW_LANE <= have; off += LW_LANE) {
        const uint8_t *l = buf + LW_HEADER + off;
        uint32_t seq = lw_u32(l);
        if (l[4] != 1 || (seq & 1)) continue; /* free, or its identity being written */
        uint64_t sent = lw_u64(l + 32), acked = lw_u64(l + 40);
        int64_t progress = (int64_t)lw_u64(l + 48);
        if (progress < 0 || progress > now + LW_FUTURE_SLACK_NS) progress = 0;
        if (progress > now) progress = now;
        int64_t judged = (looked < now ? looked : now);
        if (progress > judged) judged = progress;
        int progressing = !silent && progress > 0 && judged - progress <= window;
        int stuck = !silent && !progressing && acked < sent;
        h = lw_mix(h, (uint64_t)(off / LW_LANE) << 32 | seq);
        h = lw_mix(h, (uint64_t)(progressing | stuck << 1));
    }
    return h;
}

#endif
