/*
 * lp_steer.c: the steering shim, liblinkpass-steer.so (docs/steer.md). Preloaded into an
 * unmodified verbs application (LD_PRELOAD), it wraps ibv_modify_qp: when an RC queue pair on a
 * RoCE v2 GID goes INIT -> RTR towards a peer LinkPass probes, it sets the GRH flow label that
 * makes the QP's packets carry the next port of that peer's spread set in the entropy table, so
 * the process's QPs take distinct healthy fabric paths instead of where the hash of their
 * 5-tuple puts them. Everything else passes through untouched.
 *
 * The decisions are lp_steer_policy.c's (pure, tested case by case); this file gathers the facts
 * (the call, the GID's type from sysfs, a consistent copy of the table) and applies the answer.
 * Errors never reach the application: whatever goes wrong, the call goes through as it was made,
 * and if the steered call fails it is made again unsteered (a failed modify changes nothing).
 *
 * Environment: LINKPASS_ENTROPY_TABLE (the table, default /run/linkpass/entropy),
 * LINKPASS_STEER=0 (pass everything through), LINKPASS_STEER_OVERRIDE=1 (also replace a flow
 * label the application chose), LINKPASS_STEER_LOG=stderr|PATH (a line per RTR transition and a
 * summary at exit), LINKPASS_STEER_SYSFS (tests: another /sys/class/infiniband).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "../entropy_table.h"
#include "../nccl/lp_policy.h"
#include "lp_steer_policy.h"

#define LPS_EXPORT __attribute__((visibility("default")))
#define LPS_PEERS 256               /* peers whose turn is remembered exactly; more share slots */
#define LPS_REOPEN_NS 1000000000ull /* a missing or refused table is looked for again after this */

typedef int (*lps_modify_fn)(struct ibv_qp *, struct ibv_qp_attr *, int);

struct lps_peer { int family; uint8_t addr[16]; uint64_t turn; };

static struct {
    pthread_once_t once;
    pthread_mutex_t mu;
    lps_modify_fn real;
    int disabled, override;
    char table_path[256], sysfs[256];
    FILE *log;
    struct lpe_table t;
    int table_open;
    uint64_t next_open_ns;
    struct lps_peer peers[LPS_PEERS];
    unsigned long verdicts[LPS_NVERDICTS], retried_unsteered;
} S = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};

static void lps_say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void lps_say(const char *fmt, ...) {
    if (!S.log) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(S.log, "linkpass-steer[%d]: ", (int)getpid());
    vfprintf(S.log, fmt, ap);
    fputc('\n', S.log);
    fflush(S.log);
    va_end(ap);
}

static void lps_init(void) {
    S.real = (lps_modify_fn)dlvsym(RTLD_NEXT, "ibv_modify_qp", "IBVERBS_1.1");
    if (!S.real) S.real = (lps_modify_fn)dlsym(RTLD_NEXT, "ibv_modify_qp");
    const char *v = getenv("LINKPASS_STEER");
    S.disabled = v && strcmp(v, "0") == 0;
    v = getenv("LINKPASS_STEER_OVERRIDE");
    S.override = v && strcmp(v, "1") == 0;
    v = getenv("LINKPASS_ENTROPY_TABLE");
    snprintf(S.table_path, sizeof S.table_path, "%s", v && v[0] == '/' && strlen(v) < sizeof S.table_path ? v : LPE_DEFAULT_PATH);
    v = getenv("LINKPASS_STEER_SYSFS");
    snprintf(S.sysfs, sizeof S.sysfs, "%s", v && v[0] == '/' && strlen(v) < sizeof S.sysfs ? v : "/sys/class/infiniband");
    v = getenv("LINKPASS_STEER_LOG");
    if (v && strcmp(v, "stderr") == 0) {
        S.log = stderr;
    } else if (v && v[0] == '/') {
        int fd = open(v, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        S.log = fd >= 0 ? fdopen(fd, "a") : NULL;
        if (!S.log && fd >= 0) close(fd);
    }
    if (!S.real) lps_say("ibv_modify_qp not found in the libraries loaded after the shim: passing nothing through");
}

__attribute__((destructor)) static void lps_summary(void) {
    unsigned long rtr = 0;
    for (int v = 0; v < LPS_NVERDICTS; v++) rtr += v == LPS_NOT_RTR ? 0 : S.verdicts[v];
    if (!S.log || rtr == 0) return;
    char line[512];
    int n = snprintf(line, sizeof line, "%lu QP transition(s) to RTR: steered %lu", rtr, S.verdicts[LPS_STEERED]);
    for (int v = LPS_NOT_RC; v < LPS_NVERDICTS && n > 0 && (size_t)n < sizeof line; v++)
        if (S.verdicts[v]) n += snprintf(line + n, sizeof line - (size_t)n, ", %s %lu", lps_verdict_name[v], S.verdicts[v]);
    lps_say("%s; retried unsteered %lu", line, S.retried_unsteered);
}

/* "RoCE v2" in sysfs' gid_attrs/types/<index> of the QP's device and port. */
static int lps_gid_is_roce_v2(const char *dev, unsigned port, unsigned index) {
    char path[384], buf[32] = {0};
    snprintf(path, sizeof path, "%s/%s/ports/%u/gid_attrs/types/%u", S.sysfs, dev, port, index);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    return got > 0 && strncmp(buf, "RoCE v2", 7) == 0;
}

/* A consistent copy of a trusted table in S.t, or 0 (why not logged at each attempt; a missing or refused
 * table is opened again at most once per LPS_REOPEN_NS). */
static int lps_table(void) {
    if (S.table_open && lpe_retired(&S.t)) {
        lpe_close(&S.t);
        S.table_open = 0;
        S.next_open_ns = 0;
    }
    if (!S.table_open) {
        uint64_t now = lpe_mono_ns();
        if (now < S.next_open_ns) return 0;
        int rc = lpe_open(S.table_path, &S.t);
        if (rc != LPE_OK) {
            lps_say("entropy table not used: %s", S.t.why);
            lpe_close(&S.t);
            S.next_open_ns = now + LPS_REOPEN_NS;
            return 0;
        }
        S.table_open = 1;
    }
    int rc = lpe_read(&S.t, 20000, 1000000000ull);
    if (rc != LPE_OK) {
        lps_say("entropy table not read: %s", S.t.why);
        if (rc == LPE_BAD) {
            lpe_close(&S.t);
            S.table_open = 0;
            S.next_open_ns = lpe_mono_ns() + LPS_REOPEN_NS;
        }
        return 0;
    }
    return 1;
}

static uint64_t lps_next_turn(int family, const uint8_t addr[16]) {
    unsigned h = 2166136261u;
    for (int i = 0; i < 16; i++) h = (h ^ addr[i]) * 16777619u;
    for (unsigned k = 0; k < LPS_PEERS; k++) {
        struct lps_peer *p = &S.peers[(h + k) % LPS_PEERS];
        if (p->family == 0) {
            p->family = family;
            memcpy(p->addr, addr, 16);
        }
        if (p->family == family && memcmp(p->addr, addr, 16) == 0) return p->turn++;
    }
    return S.peers[h % LPS_PEERS].turn++; /* every slot taken: peers share a turn counter */
}

LPS_EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask) {
    pthread_once(&S.once, lps_init);
    if (!S.real) return ENOSYS;
    struct lps_call c = {0};
    c.to_rtr = attr && (attr_mask & IBV_QP_STATE) && attr->qp_state == IBV_QPS_RTR;
    if (!c.to_rtr || S.disabled || !qp) {
        if (!c.to_rtr) __atomic_fetch_add(&S.verdicts[LPS_NOT_RTR], 1, __ATOMIC_RELAXED);
        return S.real(qp, attr, attr_mask);
    }
    c.rc = qp->qp_type == IBV_QPT_RC;
    c.grh = (attr_mask & IBV_QP_AV) && attr->ah_attr.is_global;
    c.flow_label = attr->ah_attr.grh.flow_label;
    c.override = S.override;
    const char *dev = qp->context && qp->context->device ? qp->context->device->name : "";
    unsigned port = attr->ah_attr.port_num ? attr->ah_attr.port_num : 1;
    unsigned gid_index = attr->ah_attr.grh.sgid_index;
    uint8_t addr[16];
    int family = lps_gid_address(attr->ah_attr.grh.dgid.raw, addr);
    char peer[INET6_ADDRSTRLEN] = "?";
    inet_ntop(family == 4 ? AF_INET : AF_INET6, addr, peer, sizeof peer);

    pthread_mutex_lock(&S.mu);
    uint16_t sport = 0, plane = 0;
    uint32_t path = 0;
    int pick = -1;
    /* the costlier facts (sysfs, the table) only for a call the cheap guards have not refused */
    const uint8_t *e = NULL;
    if (c.rc && c.grh && (c.flow_label == 0 || c.override)) {
        c.roce_v2 = lps_gid_is_roce_v2(dev, port, gid_index);
        c.table_ok = c.roce_v2 && lps_table();
        e = c.table_ok ? lpe_find_peer(&S.t, family, addr) : NULL;
        c.have_entry = e != NULL;
        c.nports = e ? e[LPE_E_NPORTS] : 0;
    }
    enum lps_verdict v = lps_judge(&c);
    if (v == LPS_STEERED) {
        pick = lps_pick(c.nports, lps_next_turn(family, addr));
        plane = lpe_get16(e + LPE_E_PLANE);
        sport = lpe_get16(e + LPE_E_PORTS + 2 * pick);
        path = lpe_get32(e + LPE_E_PATH_IDS + 4 * pick);
    }
    uint32_t label = v == LPS_STEERED ? lp_flow_label_for_sport(sport) : 0;
    if (v == LPS_STEERED && label == 0) v = LPS_NO_PORT; /* below 0xC000: no flow label reaches it */
    S.verdicts[v]++;
    if (v == LPS_STEERED)
        lps_say("qp %u on %s port %u gid %u to %s (plane %u): steered to source port %u (flow label 0x%x, path %08x, "
                "%d of %d in the spread set)", qp->qp_num, dev, port, gid_index, peer, plane, sport, label, path,
                pick + 1, c.nports);
    else
        lps_say("qp %u on %s port %u gid %u to %s: untouched (%s)", qp->qp_num, dev, port, gid_index, peer,
                lps_verdict_name[v]);
    pthread_mutex_unlock(&S.mu);

    if (v != LPS_STEERED) return S.real(qp, attr, attr_mask);
    struct ibv_qp_attr steered = *attr;
    steered.ah_attr.grh.flow_label = label;
    int rc = S.real(qp, &steered, attr_mask);
    if (rc != 0) {
        __atomic_fetch_add(&S.retried_unsteered, 1, __ATOMIC_RELAXED);
        lps_say("qp %u: the steered transition failed (%s); made again as the application asked", qp->qp_num,
                strerror(rc > 0 ? rc : errno));
        rc = S.real(qp, attr, attr_mask);
    }
    return rc;
}
