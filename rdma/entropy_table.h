/*
 * entropy_table.h: the C reader of the LinkPass entropy table (docs/entropy-table.md), header-only.
 *
 * One reader for every C consumer: the `entropy_reader` command (rdma/entropy_reader.c), the
 * NCCL net plugin (rdma/nccl/) and the steering shim (rdma/steer/) include this file. Map the file read-only, take a consistent copy
 * with the seqlock reader protocol (acquire load of seq, relaxed word copies, acquire fence,
 * re-load seq), look entries up in the copy. Never writes to the file, never blocks the writer.
 * No global state: every result and diagnostic lives in the caller's struct lpe_table.
 *
 * Built with -DENTROPY_READER_NEGATIVE_CONTROL the reader skips the second seq load (tests prove
 * such a reader does see torn tables).
 */
#ifndef LINKPASS_ENTROPY_TABLE_H
#define LINKPASS_ENTROPY_TABLE_H

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define LPE_DEFAULT_PATH "/run/linkpass/entropy"
#define LPE_MAGIC "LPENTRPY"
#define LPE_VERSION 1
#define LPE_HEADER_SIZE 128
#define LPE_ENTRY_SIZE 192
#define LPE_MAX_PORTS 16
#define LPE_MAX_CAPACITY 65536
#define LPE_TABLE_RETIRED 0x1u
#define LPE_ENTRY_FAIL_STATIC 0x1u

/* results (the command's exit codes) */
enum { LPE_OK = 0, LPE_NOTFOUND = 1, LPE_USAGE = 2, LPE_MISSING = 3, LPE_BAD = 4, LPE_STALE = 5, LPE_BUSY = 6, LPE_IO = 7 };

/* header offsets */
#define LPE_OFF_MAGIC 0
#define LPE_OFF_VERSION 8
#define LPE_OFF_HEADER_SIZE 10
#define LPE_OFF_ENTRY_SIZE 12
#define LPE_OFF_MAX_PORTS 14
#define LPE_OFF_CAPACITY 16
#define LPE_OFF_TABLE_FLAGS 20
#define LPE_OFF_FILE_SIZE 24
#define LPE_OFF_WRITER_PID 32
#define LPE_OFF_WRITER_PIDNS 40
#define LPE_OFF_HEARTBEAT 48
#define LPE_OFF_WRITE_BEGIN 56
#define LPE_OFF_SEQ 64
#define LPE_OFF_GENERATION 72
#define LPE_OFF_COUNT 80
#define LPE_OFF_UPDATE_REALTIME 88
#define LPE_OFF_UPDATE_MONO 96
/* entry offsets */
#define LPE_E_FAMILY 0
#define LPE_E_NPORTS 1
#define LPE_E_PLANE 2
#define LPE_E_FLAGS 4
#define LPE_E_ADDR 8
#define LPE_E_GENERATION 24
#define LPE_E_PORTS 32
#define LPE_E_PATH_IDS 64
#define LPE_E_PORT_FLAGS 128

/* The file is little-endian; this reader assumes a little-endian host (x86-64, aarch64 LE). */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "entropy_table.h: big-endian hosts need byte swaps in the getters below"
#endif

static inline uint16_t lpe_get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t lpe_get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t lpe_get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Fields the writer changes while readers run are read with atomic loads (no data race in the
 * C11 sense; on x86-64 these are plain movs). */
static inline uint64_t lpe_load64(const uint8_t *base, size_t off, int order) {
    return __atomic_load_n((const uint64_t *)(base + off), order);
}
static inline uint32_t lpe_load32(const uint8_t *base, size_t off) {
    return __atomic_load_n((const uint32_t *)(base + off), __ATOMIC_RELAXED);
}

/* Copy n bytes (n and both pointers 8-aligned) with relaxed 8-byte atomic loads. */
static inline void lpe_copy_words(uint8_t *dst, const uint8_t *src, size_t n) {
    const uint64_t *s = (const uint64_t *)src;
    uint64_t *d = (uint64_t *)dst;
    for (size_t i = 0; i < n / 8; i++) d[i] = __atomic_load_n(&s[i], __ATOMIC_RELAXED);
}

static inline uint64_t lpe_mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t lpe_own_pidns(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

struct lpe_table {
    const uint8_t *map; /* the read-only mapping */
    size_t map_size;
    uint32_t capacity;
    uint8_t header[LPE_HEADER_SIZE]; /* consistent copy */
    uint8_t *entries;                /* consistent copy, capacity * LPE_ENTRY_SIZE */
    uint32_t count;
    void (*between_copies)(void);    /* tests only: called after the header and each entry copy */
    char why[512];                   /* what went wrong, for a log line */
};

/* The system user the packaged agent runs as (deploy/systemd): a table it owns is trusted too. */
#ifndef LPE_AGENT_USER
#define LPE_AGENT_USER "linkpass"
#endif

/* Whether uid is LPE_AGENT_USER's. Looked up only for an owner that is neither root nor this
 * process, so the usual root- or self-owned table costs no user-database query. */
static inline int lpe_is_agent_user(uid_t uid) {
    struct passwd pw, *found = NULL;
    char buf[1024];
    return getpwnam_r(LPE_AGENT_USER, &pw, buf, sizeof buf, &found) == 0 && found != NULL && found->pw_uid == uid;
}

/* Whom a reader trusts (docs/entropy-table.md): the table's ports steer this host's traffic, so
 * the file and its directory must belong to root, to this process's uid or to the agent's system
 * user, and be writable by no group or other user. 0 trusted; -1 not, with t->why naming which
 * one and why. */
static inline int lpe_untrusted(const char *where, const struct stat *st, struct lpe_table *t) {
    if (st->st_uid != 0 && st->st_uid != geteuid() && !lpe_is_agent_user(st->st_uid)) {
        snprintf(t->why, sizeof t->why, "%.300s belongs to uid %u, not to root, this process's uid or the agent's user "
                 "(" LPE_AGENT_USER "): its ports would steer this host's traffic, so it is not read", where,
                 (unsigned)st->st_uid);
        return -1;
    }
    if (st->st_mode & (S_IWGRP | S_IWOTH)) {
        snprintf(t->why, sizeof t->why, "%.300s can be written by its group or others (mode %04o): its ports would steer "
                 "this host's traffic, so it is not read", where, (unsigned)(st->st_mode & 07777));
        return -1;
    }
    return 0;
}

static inline int lpe_trusted(const char *path, const struct stat *st, struct lpe_table *t) {
    if (lpe_untrusted(path, st, t) < 0) return -1;
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    struct stat ds;
    if (stat(dir, &ds) < 0) { snprintf(t->why, sizeof t->why, "%.300s: %s", dir, strerror(errno)); return -1; }
    return lpe_untrusted(dir, &ds, t);
}

/* Open, map and check who could have written the file and the static part of the header. On
 * failure t->why says why; the caller still calls lpe_close (it frees whatever was made). */
static inline int lpe_open(const char *path, struct lpe_table *t) {
    memset(t, 0, sizeof *t);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        snprintf(t->why, sizeof t->why, "%s: %s", path, strerror(e));
        return e == ENOENT ? LPE_MISSING : LPE_IO;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) { close(fd); snprintf(t->why, sizeof t->why, "fstat failed"); return LPE_IO; }
    if (lpe_trusted(path, &st, t) < 0) { close(fd); return LPE_BAD; }
    if (st.st_size < LPE_HEADER_SIZE) {
        close(fd);
        snprintf(t->why, sizeof t->why, "file: %lld bytes, shorter than the header (truncated)", (long long)st.st_size);
        return LPE_BAD;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) { snprintf(t->why, sizeof t->why, "mmap failed"); return LPE_IO; }
    const uint8_t *b = m;
    t->map = b;
    t->map_size = (size_t)st.st_size;
    /* magic .. file_size never change after the file is created: plain reads are fine */
    if (memcmp(b + LPE_OFF_MAGIC, LPE_MAGIC, 8) != 0) { snprintf(t->why, sizeof t->why, "magic: not an entropy table"); return LPE_BAD; }
    if (lpe_get16(b + LPE_OFF_VERSION) != LPE_VERSION) {
        snprintf(t->why, sizeof t->why, "version: %u, this reader knows %d", lpe_get16(b + LPE_OFF_VERSION), LPE_VERSION);
        return LPE_BAD;
    }
    if (lpe_get16(b + LPE_OFF_HEADER_SIZE) != LPE_HEADER_SIZE || lpe_get16(b + LPE_OFF_ENTRY_SIZE) != LPE_ENTRY_SIZE ||
        lpe_get16(b + LPE_OFF_MAX_PORTS) != LPE_MAX_PORTS) {
        snprintf(t->why, sizeof t->why, "header_size/entry_size/max_ports: unexpected");
        return LPE_BAD;
    }
    uint32_t cap = lpe_get32(b + LPE_OFF_CAPACITY);
    if (cap < 1 || cap > LPE_MAX_CAPACITY) { snprintf(t->why, sizeof t->why, "capacity: %u", cap); return LPE_BAD; }
    uint64_t want = LPE_HEADER_SIZE + (uint64_t)cap * LPE_ENTRY_SIZE;
    if (lpe_get64(b + LPE_OFF_FILE_SIZE) != want) { snprintf(t->why, sizeof t->why, "file_size: does not match capacity"); return LPE_BAD; }
    if ((uint64_t)st.st_size < want) {
        snprintf(t->why, sizeof t->why, "file: %lld bytes, header says %" PRIu64 " (truncated)", (long long)st.st_size, want);
        return LPE_BAD;
    }
    t->capacity = cap;
    t->entries = malloc((size_t)cap * LPE_ENTRY_SIZE);
    if (!t->entries) { snprintf(t->why, sizeof t->why, "out of memory"); return LPE_IO; }
    t->why[0] = 0;
    return LPE_OK;
}

static inline void lpe_close(struct lpe_table *t) {
    if (t->map) munmap((void *)t->map, t->map_size);
    free(t->entries);
    t->map = NULL;
    t->entries = NULL;
    t->count = 0;
    t->capacity = 0;
}

/* Has a writer replaced this file with a new one at the same path (re-open the path)? */
static inline int lpe_retired(const struct lpe_table *t) {
    return (lpe_load32(t->map, LPE_OFF_TABLE_FLAGS) & LPE_TABLE_RETIRED) != 0;
}

/* Is the writer of an open (odd) section gone? Dead pid (same pid namespace only), no writer,
 * or the section has been open longer than stale_ns. */
static inline int lpe_writer_gone(const struct lpe_table *t, uint64_t stale_ns) {
    uint32_t pid = lpe_load32(t->map, LPE_OFF_WRITER_PID);
    uint64_t ns = lpe_load64(t->map, LPE_OFF_WRITER_PIDNS, __ATOMIC_RELAXED);
    if (pid == 0) return 1;
    if (ns == 0 || ns == lpe_own_pidns()) {
        if (kill((pid_t)pid, 0) < 0 && errno == ESRCH) return 1;
    }
    uint64_t begin = lpe_load64(t->map, LPE_OFF_WRITE_BEGIN, __ATOMIC_RELAXED);
    uint64_t now = lpe_mono_ns();
    return stale_ns && now > begin && now - begin > stale_ns;
}

/* The seqlock read: returns LPE_OK with t->header / t->entries / t->count consistent. */
static inline int lpe_read(struct lpe_table *t, long retries, uint64_t stale_ns) {
    const uint8_t *b = t->map;
    uint64_t odd_seq = 0;
    long odd_spins = 0;
    for (long attempt = 0; attempt < retries; attempt++) {
        uint64_t s0 = lpe_load64(b, LPE_OFF_SEQ, __ATOMIC_ACQUIRE); /* the copy below cannot move above this */
        if (s0 & 1) {                                               /* writer inside its section */
            odd_spins = (s0 == odd_seq) ? odd_spins + 1 : 1;
            odd_seq = s0;
            if (odd_spins % 64 == 0) {
                if (lpe_writer_gone(t, stale_ns)) {
                    snprintf(t->why, sizeof t->why, "seq %" PRIu64 " odd and the writer is gone (died mid-update)", s0);
                    return LPE_STALE;
                }
                sched_yield();
            }
            continue;
        }
        lpe_copy_words(t->header, b, LPE_HEADER_SIZE);
        uint32_t count = lpe_get32(t->header + LPE_OFF_COUNT);
        if (count > t->capacity) count = t->capacity; /* garbage from a torn read; checked below */
        if (t->between_copies) t->between_copies();
        for (uint32_t i = 0; i < count; i++) {
            lpe_copy_words(t->entries + (size_t)i * LPE_ENTRY_SIZE, b + LPE_HEADER_SIZE + (size_t)i * LPE_ENTRY_SIZE,
                           LPE_ENTRY_SIZE);
            if (t->between_copies) t->between_copies();
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* every load of the copy completes before the re-load */
        uint64_t s1 = lpe_load64(b, LPE_OFF_SEQ, __ATOMIC_RELAXED);
#ifdef ENTROPY_READER_NEGATIVE_CONTROL
        s1 = s0; /* deliberately wrong: accept the first copy (tests prove they can see a torn one) */
#endif
        if (s1 != s0) {
            if (attempt % 16 == 15) sched_yield();
            continue;
        }
        t->count = lpe_get32(t->header + LPE_OFF_COUNT);
        if (t->count > t->capacity) {
            snprintf(t->why, sizeof t->why, "count: %u > capacity %u", t->count, t->capacity);
            t->count = 0;
            return LPE_BAD;
        }
        for (uint32_t i = 0; i < t->count; i++) {
            const uint8_t *e = t->entries + (size_t)i * LPE_ENTRY_SIZE;
            if ((e[LPE_E_FAMILY] != 4 && e[LPE_E_FAMILY] != 6) || e[LPE_E_NPORTS] > LPE_MAX_PORTS) {
                snprintf(t->why, sizeof t->why, "entries[%u]: family %u nports %u", i, e[LPE_E_FAMILY], e[LPE_E_NPORTS]);
                t->count = 0;
                return LPE_BAD;
            }
        }
        return LPE_OK;
    }
    if (lpe_load64(b, LPE_OFF_SEQ, __ATOMIC_ACQUIRE) & 1) {
        if (lpe_writer_gone(t, stale_ns)) {
            snprintf(t->why, sizeof t->why, "seq odd and the writer is gone (died mid-update)");
            return LPE_STALE;
        }
    }
    snprintf(t->why, sizeof t->why, "no consistent copy within the retries (writer busy)");
    return LPE_BUSY;
}

/* The entry for (peer, plane) in a consistent copy, or NULL. family is 4 or 6, addr 16 bytes in
 * network order (IPv4 in bytes 0..3, the rest zero). */
static inline const uint8_t *lpe_find(const struct lpe_table *t, int family, const uint8_t addr[16], unsigned plane) {
    for (uint32_t i = 0; i < t->count; i++) {
        const uint8_t *e = t->entries + (size_t)i * LPE_ENTRY_SIZE;
        if (e[LPE_E_FAMILY] == family && lpe_get16(e + LPE_E_PLANE) == plane && memcmp(e + LPE_E_ADDR, addr, 16) == 0)
            return e;
    }
    return NULL;
}

/* The entry for a peer address on whichever plane has it, or NULL: a NIC address belongs to one
 * plane, so a caller that knows only the peer's address (a QP's destination GID) finds its plane. */
static inline const uint8_t *lpe_find_peer(const struct lpe_table *t, int family, const uint8_t addr[16]) {
    for (uint32_t i = 0; i < t->count; i++) {
        const uint8_t *e = t->entries + (size_t)i * LPE_ENTRY_SIZE;
        if (e[LPE_E_FAMILY] == family && memcmp(e + LPE_E_ADDR, addr, 16) == 0) return e;
    }
    return NULL;
}

#endif
