/* lp_lanes.c: see lp_lanes.h; the layout and the protocol are docs/lanes.md. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lp_lanes.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "lp_lanes.c: lane reports are little-endian; big-endian hosts need byte swaps"
#endif

#define H_SIZE 64
#define L_SIZE 64
/* header */
#define H_MAGIC 0
#define H_VERSION 8
#define H_HSIZE 10
#define H_LSIZE 12
#define H_CAPACITY 14
#define H_PID 16
#define H_USED 20
#define H_HEARTBEAT 24
/* lane record */
#define L_SEQ 0
#define L_STATE 4
#define L_FAMILY 5
#define L_PLANE 6
#define L_SPORT 8
#define L_KIND 10
#define L_PEER 16
#define L_SENT 32
#define L_ACKED 40
#define L_PROGRESS 48

#define FRESH_NS 1000000000ull /* a file whose heartbeat is this recent belongs to a live writer */

static struct {
    uint8_t *map;
    size_t size;
    pid_t pid;                 /* the opener: a forked child must not remove its parent's file */
    uint32_t used;
    uint8_t busy[LPL_CAPACITY]; /* our own copy of which slots are open: claims never read the map */
    int said_full, said_off;
    lpl_log_fn log;
    char path[PATH_MAX];
} R;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
    char buf[PATH_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (R.log) R.log(buf);
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint8_t *rec(int slot) { return R.map + H_SIZE + (size_t)slot * L_SIZE; }
static void put64(uint8_t *p, uint64_t v, int order) { __atomic_store_n((uint64_t *)(void *)p, v, order); }
static void put32(uint8_t *p, uint32_t v, int order) { __atomic_store_n((uint32_t *)(void *)p, v, order); }
static void put16(uint8_t *p, uint16_t v) { __atomic_store_n((uint16_t *)(void *)p, v, __ATOMIC_RELAXED); }
static void put8(uint8_t *p, uint8_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* An existing lanes.<pid> is ours to replace only if no live writer owns it: same pid, another
 * pid namespace is possible, so a fresh heartbeat means someone else's. */
static int stale(const char *path) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return errno == ENOENT;
    struct stat st;
    uint8_t h[H_SIZE];
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
    if (ok && pread(fd, h, sizeof h, 0) == (ssize_t)sizeof h && memcmp(h, "LPLANES1", 8) == 0) {
        uint64_t hb;
        memcpy(&hb, h + H_HEARTBEAT, sizeof hb);
        uint64_t now = mono_ns();
        if (hb <= now && now - hb < FRESH_NS) ok = 0;
    }
    close(fd);
    return ok;
}

static int fail(const char *what, int err) {
    if (!R.said_off++)
        say("lane reports: not written (%s %s: %s); the agent does not see this process's lanes, the job runs as "
            "before", what, R.path, strerror(err));
    return -1;
}

int lpl_open(lpl_log_fn log) {
    if (R.map) return 0;
    if (log) R.log = log;
    const char *dir = getenv("LINKPASS_LANES_DIR");
    if (!dir || !*dir) dir = LPL_DEFAULT_DIR;
    if (snprintf(R.path, sizeof R.path, "%s/lanes.%ld", dir, (long)getpid()) >= (int)sizeof R.path)
        return fail("path too long:", ENAMETOOLONG);
    int fd = -1;
    for (int attempt = 0; attempt < 2 && fd < 0; attempt++) {
        fd = open(R.path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd >= 0 || errno != EEXIST || attempt) break;
        if (!stale(R.path) || (unlink(R.path) < 0 && errno != ENOENT)) { errno = EEXIST; break; }
    }
    if (fd < 0) return fail("cannot create", errno);
    size_t size = H_SIZE + (size_t)L_SIZE * LPL_CAPACITY;
    void *m = MAP_FAILED;
    int err = 0;
    /* fchmod: the agent reads it whatever the job's umask */
    if (fchmod(fd, 0644) < 0 || ftruncate(fd, (off_t)size) < 0 ||
        (m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
        err = errno;
        close(fd);
        unlink(R.path);
        return fail("cannot size or map", err);
    }
    close(fd);
    R.map = m;
    R.size = size;
    R.pid = getpid();
    R.used = 0;
    R.said_full = 0;
    memset(R.busy, 0, sizeof R.busy);
    uint16_t v16[4] = {1, H_SIZE, L_SIZE, LPL_CAPACITY};
    memcpy(R.map + H_VERSION, v16, sizeof v16);
    put32(R.map + H_PID, (uint32_t)R.pid, __ATOMIC_RELAXED);
    put64(R.map + H_HEARTBEAT, mono_ns(), __ATOMIC_RELAXED);
    uint64_t magic;
    memcpy(&magic, "LPLANES1", 8);
    put64(R.map + H_MAGIC, magic, __ATOMIC_RELEASE); /* last: a header with its magic is whole */
    say("lane reports: %s (%d lanes)", R.path, LPL_CAPACITY);
    return 0;
}

int lpl_is_open(void) { return R.map != NULL; }

void lpl_close(void) {
    if (!R.map) return;
    if (getpid() == R.pid) unlink(R.path);
    munmap(R.map, R.size);
    R.map = NULL;
}

/* Identity changes inside an odd seq (docs/lanes.md, "The protocol"). */
static void ident_begin(uint8_t *r) {
    uint32_t seq = __atomic_load_n((uint32_t *)(void *)(r + L_SEQ), __ATOMIC_RELAXED);
    put32(r + L_SEQ, seq | 1, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* the odd seq before any identity store */
}

static void ident_end(uint8_t *r) {
    uint32_t seq = __atomic_load_n((uint32_t *)(void *)(r + L_SEQ), __ATOMIC_RELAXED);
    put32(r + L_SEQ, seq + 1, __ATOMIC_RELEASE);
}

static void ident_write(uint8_t *r, uint8_t state, uint8_t family, uint16_t plane, uint16_t sport, uint8_t kind,
                        const uint8_t peer[16]) {
    put8(r + L_STATE, state);
    put8(r + L_FAMILY, family);
    put16(r + L_PLANE, plane);
    put16(r + L_SPORT, sport);
    put8(r + L_KIND, kind);
    for (int i = 0; i < 16; i += 8) {
        uint64_t w;
        memcpy(&w, peer + i, sizeof w);
        put64(r + L_PEER + i, w, __ATOMIC_RELAXED);
    }
    put64(r + L_SENT, 0, __ATOMIC_RELAXED);
    put64(r + L_ACKED, 0, __ATOMIC_RELAXED);
    put64(r + L_PROGRESS, 0, __ATOMIC_RELAXED);
}

int lpl_claim(int family, const void *addr, uint16_t plane, uint16_t sport, uint8_t kind) {
    if (!R.map || (family != 4 && family != 6)) return -1;
    int slot = 0;
    while (slot < LPL_CAPACITY && R.busy[slot]) slot++;
    if (slot == LPL_CAPACITY) {
        if (!R.said_full++)
            say("lane reports: all %d slots of %s are taken; further lanes are not reported", LPL_CAPACITY, R.path);
        return -1;
    }
    uint8_t peer[16] = {0};
    memcpy(peer, addr, family == 4 ? 4 : 16);
    if ((uint32_t)slot >= R.used) { /* the reader looks only at [0, used) */
        R.used = (uint32_t)slot + 1;
        put32(R.map + H_USED, R.used, __ATOMIC_RELEASE);
    }
    uint8_t *r = rec(slot);
    ident_begin(r);
    ident_write(r, 1, (uint8_t)family, plane, sport, kind, peer);
    ident_end(r);
    R.busy[slot] = 1;
    return slot;
}

void lpl_release(int slot) {
    if (!R.map || slot < 0 || slot >= LPL_CAPACITY || !R.busy[slot]) return;
    static const uint8_t none[16];
    uint8_t *r = rec(slot);
    ident_begin(r);
    ident_write(r, 0, 0, 0, 0, 0, none);
    ident_end(r);
    R.busy[slot] = 0;
}

/* One writer: a load of our own last store and one 8-byte store, no seq. */
void lpl_sent(int slot, uint64_t bytes) {
    if (!R.map || (unsigned)slot >= LPL_CAPACITY) return;
    uint8_t *p = rec(slot) + L_SENT;
    put64(p, __atomic_load_n((uint64_t *)(void *)p, __ATOMIC_RELAXED) + bytes, __ATOMIC_RELEASE);
}

void lpl_acked(int slot, uint64_t bytes, uint64_t now_ns) {
    if (!R.map || (unsigned)slot >= LPL_CAPACITY || !bytes) return;
    uint8_t *r = rec(slot);
    /* the time first: a reader that sees the new count also sees when it moved */
    put64(r + L_PROGRESS, now_ns, __ATOMIC_RELEASE);
    put64(r + L_ACKED, __atomic_load_n((uint64_t *)(void *)(r + L_ACKED), __ATOMIC_RELAXED) + bytes, __ATOMIC_RELEASE);
}

void lpl_heartbeat(uint64_t now_ns) {
    if (R.map) put64(R.map + H_HEARTBEAT, now_ns, __ATOMIC_RELEASE);
}
