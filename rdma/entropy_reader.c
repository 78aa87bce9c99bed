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
 * The reader itself (open, seqlock copy, lookup) is rdma/entropy_table.h, shared with the NCCL net
 * plugin.
 *
 * Build: gcc -O2 -std=gnu11 -Wall -Wextra -o entropy_reader rdma/entropy_reader.c
 */
#define _GNU_SOURCE
#include <arpa/inet.h>

#include "entropy_table.h"

#define DEFAULT_PATH "/run/linkpass/entropy"

static uint64_t debug_delay_ns; /* -d: see the usage above */

static void debug_spin(void) {
    uint64_t until = lpe_mono_ns() + debug_delay_ns;
    while (lpe_mono_ns() < until) __asm__ __volatile__("" ::: "memory");
}

static void format_addr(const uint8_t *e, char *out, size_t n) {
    if (!inet_ntop(e[LPE_E_FAMILY] == 4 ? AF_INET : AF_INET6, e + LPE_E_ADDR, out, (socklen_t)n)) snprintf(out, n, "?");
}

static void print_table(const struct lpe_table *t) {
    const uint8_t *h = t->header;
    printf("table version=%u capacity=%u count=%u generation=%" PRIu64 " seq=%" PRIu64 " writer_pid=%u flags=0x%x "
           "update_realtime_ns=%" PRIu64 " update_mono_ns=%" PRIu64 " heartbeat_mono_ns=%" PRIu64 "\n",
           lpe_get16(h + LPE_OFF_VERSION), t->capacity, t->count, lpe_get64(h + LPE_OFF_GENERATION),
           lpe_get64(h + LPE_OFF_SEQ), lpe_get32(h + LPE_OFF_WRITER_PID), lpe_get32(h + LPE_OFF_TABLE_FLAGS),
           lpe_get64(h + LPE_OFF_UPDATE_REALTIME), lpe_get64(h + LPE_OFF_UPDATE_MONO), lpe_get64(h + LPE_OFF_HEARTBEAT));
    for (uint32_t i = 0; i < t->count; i++) {
        const uint8_t *e = t->entries + (size_t)i * LPE_ENTRY_SIZE;
        char addr[INET6_ADDRSTRLEN];
        format_addr(e, addr, sizeof addr);
        unsigned n = e[LPE_E_NPORTS];
        printf("entry peer=%s plane=%u flags=0x%x generation=%" PRIu64 " ports=", addr, lpe_get16(e + LPE_E_PLANE),
               lpe_get32(e + LPE_E_FLAGS), lpe_get64(e + LPE_E_GENERATION));
        for (unsigned k = 0; k < n; k++) printf("%s%u", k ? "," : "", lpe_get16(e + LPE_E_PORTS + 2 * k));
        printf(" path_ids=");
        for (unsigned k = 0; k < n; k++) printf("%s%08x", k ? "," : "", lpe_get32(e + LPE_E_PATH_IDS + 4 * k));
        printf(" port_flags=");
        for (unsigned k = 0; k < n; k++) printf("%s%u", k ? "," : "", e[LPE_E_PORT_FLAGS + k]);
        printf("\n");
    }
}

static int usage(void) {
    fprintf(stderr, "usage: entropy_reader [-p PATH] [-r RETRIES] [-s STALE_MS] [-a MAX_AGE_MS] [-n COUNT] "
                    "[lookup PEER PLANE [KEY]]\n");
    return LPE_USAGE;
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
        else { fprintf(stderr, "entropy_reader: peer %s is not an IPv4 or IPv6 address\n", argv[optind + 1]); return LPE_USAGE; }
        char *end = NULL;
        plane = strtoul(argv[optind + 2], &end, 10);
        if (*end || plane > 0xFFFF) return usage();
        if (argc - optind == 4) {
            key = strtoul(argv[optind + 3], &end, 10);
            if (*end) return usage();
        }
    }

    struct lpe_table t;
    int rc = lpe_open(path, &t);
    if (debug_delay_ns) t.between_copies = debug_spin;
    for (long i = 0; rc == LPE_OK && i < count; i++) {
        rc = lpe_read(&t, retries, stale_ns);
        if (rc != LPE_OK) break;
        if (max_age_ns) {
            uint64_t hb = lpe_load64(t.map, LPE_OFF_HEARTBEAT, __ATOMIC_RELAXED), now = lpe_mono_ns();
            if (now > hb && now - hb > max_age_ns) {
                snprintf(t.why, sizeof t.why, "heartbeat %.0f ms old (writer gone?)", (double)(now - hb) / 1e6);
                rc = LPE_STALE;
                break;
            }
        }
        if (lookup) {
            const uint8_t *e = lpe_find(&t, family, addr, (unsigned)plane);
            if (!e || e[LPE_E_NPORTS] == 0) {
                snprintf(t.why, sizeof t.why, "%s", e ? "entry has no ports" : "no entry for this peer and plane");
                rc = LPE_NOTFOUND;
                break;
            }
            printf("%u\n", lpe_get16(e + LPE_E_PORTS + 2 * (key % e[LPE_E_NPORTS])));
        } else {
            print_table(&t);
        }
    }
    if (rc == LPE_OK && lpe_retired(&t))
        fprintf(stderr, "entropy_reader: note: this file was retired (a writer replaced it); re-open the path\n");
    if (rc != LPE_OK && t.why[0]) fprintf(stderr, "entropy_reader: %s\n", t.why);
    lpe_close(&t);
    return rc;
}
