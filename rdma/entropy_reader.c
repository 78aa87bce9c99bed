/*
 * entropy_reader: read the LinkPass entropy table (docs/entropy-table.md) without Python.
 *
 * Proves the layout is C-readable and is the reference for C consumers (RDMA QP steering, the
 * NCCL net plugin): map the file read-only, take a consistent copy with the seqlock reader
 * protocol (acquire load of seq, relaxed word copies, acquire fence, re-load seq), and print it.
 *
 *   entropy_reader [-p PATH] [-r RETRIES] [-s STALE_MS] [-a MAX_AGE_MS] [-n COUNT]
 *       prints the table (COUNT consistent snapshots, one after another; default 1)
 *       -d NS (tests only) spins NS ns after copying the header and after each entry, to widen the
 *       race window a torn copy would need; never use it in production
 *   entropy_reader [options] lookup PEER PLANE [KEY]
 *       prints the port a transport with this KEY (e.g. its QP number) should use:
 *       ports[KEY % nports]
 *
 * Exit codes: 0 ok, 1 lookup found no entry (or an entry without ports), 2 usage, 3 missing
 * (no file), 4 bad (magic, version, sizes, truncated), 5 stale (writer died mid-update, or the
 * heartbeat is older than -a), 6 busy (no consistent copy within the retries, writer alive),
 * 7 other I/O error.
 *
 * Build: gcc -O2 -std=gnu11 -Wall -Wextra -o entropy_reader rdma/entropy_reader.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
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

#define DEFAULT_PATH "/run/linkpass/entropy"
#define MAGIC "LPENTRPY"
#define VERSION 1
#define HEADER_SIZE 128
#define ENTRY_SIZE 192
#define MAX_PORTS 16
#define MAX_CAPACITY 65536
#define TABLE_RETIRED 0x1u

enum { EX_OK = 0, EX_NOTFOUND = 1, EX_USAGE_ = 2, EX_MISSING = 3, EX_BAD = 4, EX_STALE = 5, EX_BUSY = 6, EX_IO = 7 };

/* header offsets */
#define OFF_MAGIC 0
#define OFF_VERSION 8
#define OFF_HEADER_SIZE 10
#define OFF_ENTRY_SIZE 12
#define OFF_MAX_PORTS 14
#define OFF_CAPACITY 16
#define OFF_TABLE_FLAGS 20
#define OFF_FILE_SIZE 24
#define OFF_WRITER_PID 32
#define OFF_WRITER_PIDNS 40
#define OFF_HEARTBEAT 48
#define OFF_WRITE_BEGIN 56
#define OFF_SEQ 64
#define OFF_GENERATION 72
#define OFF_COUNT 80
#define OFF_UPDATE_REALTIME 88
#define OFF_UPDATE_MONO 96
/* entry offsets */
#define E_FAMILY 0
#define E_NPORTS 1
#define E_PLANE 2
#define E_FLAGS 4
#define E_ADDR 8
#define E_GENERATION 24
#define E_PORTS 32
#define E_PATH_IDS 64
#define E_PORT_FLAGS 128

/* The file is little-endian; this reader assumes a little-endian host (x86-64, aarch64 LE). */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "entropy_reader: big-endian hosts need byte swaps in the getters below"
#endif

static uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Fields the writer changes while readers run are read with atomic loads (no data race in the
 * C11 sense; on x86-64 these are plain movs). */
static uint64_t load64(const uint8_t *base, size_t off, int order) {
    return __atomic_load_n((const uint64_t *)(base + off), order);
}
static uint32_t load32(const uint8_t *base, size_t off) {
    return __atomic_load_n((const uint32_t *)(base + off), __ATOMIC_RELAXED);
}

/* Copy n bytes (n and both pointers 8-aligned) with relaxed 8-byte atomic loads. */
static void copy_words(uint8_t *dst, const uint8_t *src, size_t n) {
    const uint64_t *s = (const uint64_t *)src;
    uint64_t *d = (uint64_t *)dst;
    for (size_t i = 0; i < n / 8; i++) d[i] = __atomic_load_n(&s[i], __ATOMIC_RELAXED);
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t own_pidns(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static uint64_t debug_delay_ns; /* -d: see the usage above */

static void debug_spin(void) {
    if (!debug_delay_ns) return;
    uint64_t until = mono_ns() + debug_delay_ns;
    while (mono_ns() < until) __asm__ __volatile__("" ::: "memory");
}

struct table {
    const uint8_t *map; /* the read-only mapping */
    size_t map_size;
    uint32_t capacity;
    uint8_t header[HEADER_SIZE]; /* consistent copy */
    uint8_t *entries;            /* consistent copy, capacity * ENTRY_SIZE */
    uint32_t count;
};

static const char *why;  /* diagnostic for stderr */
static char why_buf[256];

/* Open, map and check the static part of the header. */
static int table_open(const char *path, struct table *t) {
    memset(t, 0, sizeof *t);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why_buf, sizeof why_buf, "%s: %s", path, strerror(errno));
        why = why_buf;
        return errno == ENOENT ? EX_MISSING : EX_IO;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) { close(fd); why = "fstat failed"; return EX_IO; }
    if (st.st_size < HEADER_SIZE) {
        close(fd);
        snprintf(why_buf, sizeof why_buf, "file: %lld bytes, shorter than the header (truncated)", (long long)st.st_size);
        why = why_buf;
        return EX_BAD;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) { why = "mmap failed"; return EX_IO; }
    const uint8_t *b = m;
    t->map = b;
    t->map_size = (size_t)st.st_size;
    why = why_buf;
    /* magic .. file_size never change after the file is created: plain reads are fine */
    if (memcmp(b + OFF_MAGIC, MAGIC, 8) != 0) { snprintf(why_buf, sizeof why_buf, "magic: not an entropy table"); return EX_BAD; }
    if (get16(b + OFF_VERSION) != VERSION) {
        snprintf(why_buf, sizeof why_buf, "version: %u, this reader knows %d", get16(b + OFF_VERSION), VERSION);
        return EX_BAD;
    }
    if (get16(b + OFF_HEADER_SIZE) != HEADER_SIZE || get16(b + OFF_ENTRY_SIZE) != ENTRY_SIZE ||
        get16(b + OFF_MAX_PORTS) != MAX_PORTS) {
        snprintf(why_buf, sizeof why_buf, "header_size/entry_size/max_ports: unexpected");
        return EX_BAD;
    }
    uint32_t cap = get32(b + OFF_CAPACITY);
    if (cap < 1 || cap > MAX_CAPACITY) { snprintf(why_buf, sizeof why_buf, "capacity: %u", cap); return EX_BAD; }
    uint64_t want = HEADER_SIZE + (uint64_t)cap * ENTRY_SIZE;
    if (get64(b + OFF_FILE_SIZE) != want) { snprintf(why_buf, sizeof why_buf, "file_size: does not match capacity"); return EX_BAD; }
    if ((uint64_t)st.st_size < want) {
        snprintf(why_buf, sizeof why_buf, "file: %lld bytes, header says %" PRIu64 " (truncated)", (long long)st.st_size, want);
        return EX_BAD;
    }
    t->capacity = cap;
    t->entries = malloc((size_t)cap * ENTRY_SIZE);
    if (!t->entries) { why = "out of memory"; return EX_IO; }
    why = NULL;
    return EX_OK;
}

static void table_close(struct table *t) {
    if (t->map) munmap((void *)t->map, t->map_size);
    free(t->entries);
    memset(t, 0, sizeof *t);
}

/* Is the writer of an open (odd) section gone? Dead pid (same pid namespace only), no writer,
 * or the section has been open longer than stale_ns. */
static int writer_gone(const struct table *t, uint64_t stale_ns) {
    uint32_t pid = load32(t->map, OFF_WRITER_PID);
    uint64_t ns = load64(t->map, OFF_WRITER_PIDNS, __ATOMIC_RELAXED);
    if (pid == 0) return 1;
    if (ns == 0 || ns == own_pidns()) {
        if (kill((pid_t)pid, 0) < 0 && errno == ESRCH) return 1;
    }
    uint64_t begin = load64(t->map, OFF_WRITE_BEGIN, __ATOMIC_RELAXED);
    uint64_t now = mono_ns();
    return stale_ns && now > begin && now - begin > stale_ns;
}

/* The seqlock read: returns EX_OK with t->header / t->entries / t->count consistent. */
static int table_read(struct table *t, long retries, uint64_t stale_ns) {
    const uint8_t *b = t->map;
    uint64_t odd_seq = 0;
    long odd_spins = 0;
    for (long attempt = 0; attempt < retries; attempt++) {
        uint64_t s0 = load64(b, OFF_SEQ, __ATOMIC_ACQUIRE); /* the copy below cannot move above this */
        if (s0 & 1) {                                       /* writer inside its section */
            odd_spins = (s0 == odd_seq) ? odd_spins + 1 : 1;
            odd_seq = s0;
            if (odd_spins % 64 == 0) {
                if (writer_gone(t, stale_ns)) {
                    snprintf(why_buf, sizeof why_buf, "seq %" PRIu64 " odd and the writer is gone (died mid-update)", s0);
                    why = why_buf;
                    return EX_STALE;
                }
                sched_yield();
            }
            continue;
        }
        copy_words(t->header, b, HEADER_SIZE);
        uint32_t count = get32(t->header + OFF_COUNT);
        if (count > t->capacity) count = t->capacity; /* garbage from a torn read; checked below */
        debug_spin();
        for (uint32_t i = 0; i < count; i++) {
            copy_words(t->entries + (size_t)i * ENTRY_SIZE, b + HEADER_SIZE + (size_t)i * ENTRY_SIZE, ENTRY_SIZE);
            debug_spin();
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* every load of the copy completes before the re-load */
        uint64_t s1 = load64(b, OFF_SEQ, __ATOMIC_RELAXED);
#ifdef ENTROPY_READER_NEGATIVE_CONTROL
        s1 = s0; /* deliberately wrong: accept the first copy (tests prove they can see a torn one) */
#endif
        if (s1 != s0) {
            if (attempt % 16 == 15) sched_yield();
            continue;
        }
        t->count = get32(t->header + OFF_COUNT);
        if (t->count > t->capacity) {
            snprintf(why_buf, sizeof why_buf, "count: %u > capacity %u", t->count, t->capacity);
            why = why_buf;
            return EX_BAD;
        }
        for (uint32_t i = 0; i < t->count; i++) {
            const uint8_t *e = t->entries + (size_t)i * ENTRY_SIZE;
            if ((e[E_FAMILY] != 4 && e[E_FAMILY] != 6) || e[E_NPORTS] > MAX_PORTS) {
                snprintf(why_buf, sizeof why_buf, "entries[%u]: family %u nports %u", i, e[E_FAMILY], e[E_NPORTS]);
                why = why_buf;
                return EX_BAD;
            }
        }
        return EX_OK;
    }
    if (load64(b, OFF_SEQ, __ATOMIC_ACQUIRE) & 1) {
        if (writer_gone(t, stale_ns)) {
            why = "seq odd and the writer is gone (died mid-update)";
            return EX_STALE;
        }
    }
    why = "no consistent copy within the retries (writer busy)";
    return EX_BUSY;
}

static void format_addr(const uint8_t *e, char *out, size_t n) {
    if (!inet_ntop(e[E_FAMILY] == 4 ? AF_INET : AF_INET6, e + E_ADDR, out, (socklen_t)n)) snprintf(out, n, "?");
}

static void print_table(const struct table *t) {
    const uint8_t *h = t->header;
    printf("table version=%u capacity=%u count=%u generation=%" PRIu64 " seq=%" PRIu64 " writer_pid=%u flags=0x%x "
           "update_realtime_ns=%" PRIu64 " update_mono_ns=%" PRIu64 " heartbeat_mono_ns=%" PRIu64 "\n",
           get16(h + OFF_VERSION), t->capacity, t->count, get64(h + OFF_GENERATION), get64(h + OFF_SEQ),
           get32(h + OFF_WRITER_PID), get32(h + OFF_TABLE_FLAGS), get64(h + OFF_UPDATE_REALTIME),
           get64(h + OFF_UPDATE_MONO), get64(h + OFF_HEARTBEAT));
    for (uint32_t i = 0; i < t->count; i++) {
        const uint8_t *e = t->entries + (size_t)i * ENTRY_SIZE;
        char addr[INET6_ADDRSTRLEN];
        format_addr(e, addr, sizeof addr);
        unsigned n = e[E_NPORTS];
        printf("entry peer=%s plane=%u flags=0x%x generation=%" PRIu64 " ports=", addr, get16(e + E_PLANE),
               get32(e + E_FLAGS), get64(e + E_GENERATION));
        for (unsigned k = 0; k < n; k++) printf("%s%u", k ? "," : "", get16(e + E_PORTS + 2 * k));
        printf(" path_ids=");
        for (unsigned k = 0; k < n; k++) printf("%s%08x", k ? "," : "", get32(e + E_PATH_IDS + 4 * k));
        printf(" port_flags=");
        for (unsigned k = 0; k < n; k++) printf("%s%u", k ? "," : "", e[E_PORT_FLAGS + k]);
        printf("\n");
    }
}

/* The entry for (peer, plane) in a consistent copy, or NULL. */
static const uint8_t *find_entry(const struct table *t, int family, const uint8_t addr[16], unsigned plane) {
    for (uint32_t i = 0; i < t->count; i++) {
        const uint8_t *e = t->entries + (size_t)i * ENTRY_SIZE;
        if (e[E_FAMILY] == family && get16(e + E_PLANE) == plane && memcmp(e + E_ADDR, addr, 16) == 0) return e;
    }
    return NULL;
}

static int usage(void) {
    fprintf(stderr, "usage: entropy_reader [-p PATH] [-r RETRIES] [-s STALE_MS] [-a MAX_AGE_MS] [-n COUNT] "
                    "[lookup PEER PLANE [KEY]]\n");
    return EX_USAGE_;
}

int main(int argc, char **argv) {
    const char *path = DEFAULT_PATH;
    long retries = 20000, count = 1;
    uint64_t stale_ns = 1000000000ull, max_age_ns = 0;
    int opt;
    while ((opt = getopt(argc, argv, "p:r:s:a:n:d:h")) != -1) {
        char *end = NULL;
        long v = 0;
        if (opt != 'p' && opt != 'h') {
            v = strtol(optarg, &end, 10);
            if (*end || v < 0) return usage();
        }
        switch (opt) {
        case 'p': path = optarg; break;
        case 'r': retries = v > 0 ? v : 1; break;
        case 's': stale_ns = (uint64_t)v * 1000000ull; break;
        case 'a': max_age_ns = (uint64_t)v * 1000000ull; break;
        case 'n': count = v > 0 ? v : 1; break;
        case 'd': debug_delay_ns = (uint64_t)v; break;
        default: return usage();
        }
    }
    int lookup = 0, family = 0;
    uint8_t addr[16] = {0};
    unsigned long plane = 0, key = 0;
    if (optind < argc) {
        if (strcmp(argv[optind], "lookup") != 0 || argc - optind < 3 || argc - optind > 4) return usage();
        lookup = 1;
        if (inet_pton(AF_INET, argv[optind + 1], addr) == 1) family = 4;
        else if (inet_pton(AF_INET6, argv[optind + 1], addr) == 1) family = 6;
        else { fprintf(stderr, "entropy_reader: peer %s is not an IPv4 or IPv6 address\n", argv[optind + 1]); return EX_USAGE_; }
        char *end = NULL;
        plane = strtoul(argv[optind + 2], &end, 10);
        if (*end || plane > 0xFFFF) return usage();
        if (argc - optind == 4) {
            key = strtoul(argv[optind + 3], &end, 10);
            if (*end) return usage();
        }
    }

    struct table t;
    int rc = table_open(path, &t);
    for (long i = 0; rc == EX_OK && i < count; i++) {
        rc = table_read(&t, retries, stale_ns);
        if (rc != EX_OK) break;
        if (max_age_ns) {
            uint64_t hb = load64(t.map, OFF_HEARTBEAT, __ATOMIC_RELAXED), now = mono_ns();
            if (now > hb && now - hb > max_age_ns) {
                snprintf(why_buf, sizeof why_buf, "heartbeat %.0f ms old (writer gone?)", (double)(now - hb) / 1e6);
                why = why_buf;
                rc = EX_STALE;
                break;
            }
        }
        if (lookup) {
            const uint8_t *e = find_entry(&t, family, addr, (unsigned)plane);
            if (!e || e[E_NPORTS] == 0) {
                why = e ? "entry has no ports" : "no entry for this peer and plane";
                rc = EX_NOTFOUND;
                break;
            }
            printf("%u\n", get16(e + E_PORTS + 2 * (key % e[E_NPORTS])));
        } else {
            print_table(&t);
        }
    }
    if (rc == EX_OK && load32(t.map, OFF_TABLE_FLAGS) & TABLE_RETIRED)
        fprintf(stderr, "entropy_reader: note: this file was retired (a writer replaced it); re-open the path\n");
    if (rc != EX_OK && why) fprintf(stderr, "entropy_reader: %s\n", why);
    table_close(&t);
    return rc;
}
